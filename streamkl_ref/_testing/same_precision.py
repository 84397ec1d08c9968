"""The same-precision dense results that set each tolerance scale, as a function of NumPy inputs.

The tolerance rule compares a kernel's error with that of the same math done densely in PyTorch
at the inputs' precision (:func:`attention_kl_torch`, :func:`indexer_kl_torch`: forward and
autograd backward). In bfloat16 on a CPU that is seconds per large case, so these functions take
what the reference cache can key (:func:`streamkl_ref._testing.reference_cache.call`): the inputs
as float64 arrays (which hold the low-precision inputs' values exactly), the dtype's name, the
upstream gradient as float64 and the options, and return float64 arrays (the low-precision
results' values exactly): ``"kl"`` (or the loss) and the gradient of each input asked for, by
name. Each rebuilds the tensors the checks built before (same dtype, shapes, strides, the same
inputs requiring grad), so the numbers are those of calling the dense functions directly.

The results also depend on torch's CPU kernels: each function takes ``torch_version`` (it must
be the running torch's) so that it is part of the key; :func:`call` adds it.
"""
from __future__ import annotations

from . import reference_cache
from .dense import attention_kl_torch, indexer_kl_torch

ATTENTION_INPUTS = ("q1", "k1", "q2", "k2")
ATTENTION_GRADS = {"q1": "dq1", "k1": "dk1", "q2": "dq2", "k2": "dk2"}
INDEXER_INPUTS = ("q", "k", "q_idx", "k_idx", "weights")
INDEXER_GRADS = {"q_idx": "dq_idx", "k_idx": "dk_idx", "weights": "dweights"}


def call(fn, *args, **kwargs):
    """``fn(*args, **kwargs, torch_version=torch.__version__)`` through the reference cache."""
    import torch

    return reference_cache.call(fn, *args, torch_version=torch.__version__, **kwargs)


def _leaves(arrays, names, dtype, grad_inputs):
    import torch

    cd = getattr(torch, dtype)
    return [torch.from_numpy(a).to(cd).clone().requires_grad_(n in grad_inputs) for a, n in zip(arrays, names)]


def _check_version(torch_version) -> None:
    import torch

    if torch_version != torch.__version__:
        raise ValueError(f"torch_version {torch_version!r} is not the running torch's {torch.__version__!r}")


def _numpy(t):
    return None if t is None else t.detach().to("cpu").double().numpy()


def attention_kl_same(q1, k1, q2, k2, g, *, dtype, causal, scale1, scale2, grad_inputs=ATTENTION_INPUTS,
                      torch_version):
    """:func:`attention_kl_torch` at ``dtype`` (a name) on ``[B, H, N, D]`` float64 arrays: ``{"kl":
    [B, H, N_Q]}`` plus, with ``g`` (``[B, H, N_Q]``, cast to ``dtype``) given, ``dq1``... of each
    input named in ``grad_inputs`` after one ``backward(g)``."""
    import torch

    _check_version(torch_version)
    same = _leaves((q1, k1, q2, k2), ATTENTION_INPUTS, dtype, grad_inputs if g is not None else ())
    kl = attention_kl_torch(*same, compute_dtype=getattr(torch, dtype), causal=causal, scale1=scale1,
                            scale2=scale2)
    out = {"kl": _numpy(kl)}
    if g is not None and grad_inputs:
        kl.backward(torch.from_numpy(g).to(kl.dtype))
        for x, n in zip(same, ATTENTION_INPUTS):
            if n in grad_inputs:
                out[ATTENTION_GRADS[n]] = _numpy(x.grad)
    return out


def attention_kl_varlen_same(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, g, *, dtype, causal, torch_version):
    """The packed (varlen) layout ``[T, H, D]``: :func:`attention_kl_torch` at ``dtype`` sequence by
    sequence (``cu_seqlens_*`` as in ``streamkl_ref.attention_kl_varlen``; sequences without rows
    or keys are skipped, their rows 0), each with its own ``backward`` of ``g[rows]`` (``g``:
    ``[T_Q, H]``) accumulating into the packed inputs. ``{"kl": [T_Q, H], "dq1", "dk1", "dq2",
    "dk2"}``."""
    import torch

    _check_version(torch_version)
    cd = getattr(torch, dtype)
    same = _leaves((q1, k1, q2, k2), ATTENTION_INPUTS, dtype, ATTENTION_INPUTS)
    gt = torch.from_numpy(g)
    cu_q, cu_k = [int(v) for v in cu_seqlens_q], [int(v) for v in cu_seqlens_k]
    same_kl = torch.zeros(q1.shape[0], q1.shape[1], dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        rows_i, keys_i = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if rows_i.start == rows_i.stop or keys_i.start == keys_i.stop:
            continue
        seq = [x[sl].transpose(0, 1)[None] for x, sl in zip(same, (rows_i, keys_i, rows_i, keys_i))]
        out = attention_kl_torch(*seq, causal=causal, compute_dtype=cd)
        out.backward(gt[rows_i].T[None].to(out.dtype))
        same_kl[rows_i] = out[0].T.detach().double()
    res = {"kl": same_kl.numpy()}
    for x, n in zip(same, ATTENTION_INPUTS):
        res[ATTENTION_GRADS[n]] = _numpy(x.grad)
    return res


def indexer_kl_same(q, k, q_idx, k_idx, weights, g, *, dtype, causal, scale, relu, grad_inputs=tuple(INDEXER_GRADS),
                    torch_version):
    """:func:`indexer_kl_torch` at ``dtype`` on float64 arrays: ``{"kl": [B, N_Q]}`` plus, with ``g``
    (``[B, N_Q]``) given, ``dq_idx``, ``dk_idx``, ``dweights`` of each input named in
    ``grad_inputs`` (the teacher ``q``, ``k`` is a constant)."""
    import torch

    _check_version(torch_version)
    same = _leaves((q, k, q_idx, k_idx, weights), INDEXER_INPUTS, dtype, grad_inputs if g is not None else ())
    kl = indexer_kl_torch(*same, compute_dtype=getattr(torch, dtype), causal=causal, scale=scale, relu=relu)
    out = {"kl": _numpy(kl)}
    if g is not None and grad_inputs:
        kl.backward(torch.from_numpy(g).to(kl.dtype))
        for x, n in zip(same, INDEXER_INPUTS):
            if n in grad_inputs:
                out[INDEXER_GRADS[n]] = _numpy(x.grad)
    return out
