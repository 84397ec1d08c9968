"""``indexer_kl``: the public entry point of the indexer loss, the plain design's custom ops
(``streamkl::indexer_fwd`` / ``streamkl::indexer_bwd``) and the materialised PyTorch form."""
from __future__ import annotations

from typing import Optional

import torch

from streamkl_gpu._core import custom_ops as _custom_ops
from streamkl_gpu._core.launcher import compile_first_call
from streamkl_gpu.indexer.training import accumulate as _accumulate
from streamkl_gpu.indexer.training import choice as _choice
from streamkl_gpu.indexer.training import chunk as _chunk
from streamkl_gpu.indexer import host as _host
from streamkl_gpu.indexer import plan as _plan_mod
from streamkl_gpu.indexer import teacher_lse as _teacher_lse  # the teacher's LSEs when the caller gives none
from streamkl_gpu.indexer.training import row_weights as _row_weights
from streamkl_gpu.indexer.training import store as _store

__all__ = ["indexer_kl", "indexer_kl_naive"]


# ----------------------------------------------------------------------------------------------
# torch.library custom ops + autograd (traceable by torch.compile)
# ----------------------------------------------------------------------------------------------

@_custom_ops.custom_op("streamkl::indexer_fwd", mutates_args=())
def _indexer_fwd_op(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                    weights: torch.Tensor, lse: Optional[torch.Tensor], causal: bool, scale: float,
                    relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _host._forward(q, k, q_idx, k_idx, weights, lse, causal, scale, relu)


@_indexer_fwd_op.register_fake
def _indexer_fwd_fake(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    B, H, NQ = q.shape[0], q.shape[1], q.shape[2]
    return (q.new_empty((B, NQ), dtype=torch.float32), q.new_empty((B, NQ), dtype=torch.float32),
            q.new_empty((B, H, NQ), dtype=torch.float32))


@_custom_ops.custom_op("streamkl::indexer_bwd", mutates_args=())
def _indexer_bwd_op(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor,
                    k_idx: torch.Tensor, weights: torch.Tensor, lse_bits: torch.Tensor,
                    lse_idx: torch.Tensor, causal: bool, scale: float,
                    relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _host._backward(g, q, k, q_idx, k_idx, weights, lse_bits, lse_idx, causal, scale, relu)


@_indexer_bwd_op.register_fake
def _indexer_bwd_fake(g, q, k, q_idx, k_idx, weights, lse_bits, lse_idx, causal, scale, relu):
    return torch.empty_like(q_idx), torch.empty_like(k_idx), torch.empty_like(weights)


def _setup_context(ctx, inputs, output):
    q, k, q_idx, k_idx, weights, lse, causal, scale, relu = inputs
    kl, lse_idx, lse_bits = output
    ctx.save_for_backward(q, k, q_idx, k_idx, weights, lse_bits, lse_idx)
    ctx.args = (causal, scale, relu)


def _indexer_backward(ctx, g_kl, g_lse_idx, g_lse_bits):
    q, k, q_idx, k_idx, weights, lse_bits, lse_idx = ctx.saved_tensors
    causal, scale, relu = ctx.args
    return _plan_mod._student_grads(ctx.needs_input_grad, lambda: _custom_ops.call(_indexer_bwd_op,
        g_kl, q, k, q_idx, k_idx, weights, lse_bits, lse_idx, causal, scale, relu))


_custom_ops.register_autograd(_indexer_fwd_op, _indexer_backward, _setup_context)


def indexer_kl(q, k, q_idx, k_idx, weights, *, causal=False, scale=None, relu=True, lse=None,
               reduction="none", row_weights=None):
    """The sparse-attention indexer loss ``KL(p || softmax(I))`` per query row, streamed.

    Args:
        q: ``[B, H, N_Q, D]`` teacher queries, ``D <= 576``. k: ``[B, H_K, N_K, D]`` teacher keys
            (``H % H_K == 0``; MQA: ``H_K = 1``). The teacher is a constant: ``q`` and ``k`` get
            no gradient even if they require one.
        q_idx: ``[B, H_I, N_Q, D_I]`` indexer queries, ``D_I <= 256``. k_idx: ``[B, H_KI, N_K, D_I]``
            (``H_I % H_KI == 0``). weights: ``[B, H_I, N_Q]`` (any scale folded in).
            Any strides (Megatron's ``[S, B, H, D]`` tensors as ``.permute(1, 2, 0, 3)`` views);
            fp16, bf16 or fp32 (q and k share a dtype, q_idx and k_idx share one).
        causal: bottom-right aligned (key ``s`` visible to row ``t`` iff ``s <= t + N_K - N_Q``).
        scale: the teacher's score scale; ``None`` means ``1/sqrt(D)``. An absorbed-MLA teacher
            (``D = 576``) needs the MLA scale, e.g. ``192 ** -0.5``.
        relu: ``I = sum_j weights_j relu(q_idx_j . k_idx)``; ``False`` drops the ReLU.
        lse: optional teacher LSEs, float32 ``[B, H, N_Q]``, natural log, ``-inf`` for rows with
            no visible key (FlashAttention's ``softmax_lse``): the teacher is then read once in
            the forward. Shape, dtype and device are checked, values are not (a wrong ``lse``
            gives wrong rows). Without it a training step (scalar reduction, a gradient wanted)
            computes them in a first streaming pass (the teacher read twice) and then takes the
            same path.
        reduction: ``"none"`` (``[B, N_Q]``), ``"sum"``, or ``"mean"`` over the rows with at
            least one visible key (Megatron's reduction).
        row_weights: optional ``[B, N_Q]`` per-row weights known at forward time (per-token loss
            weights, masked rows): rows ``row_weights * KL``, summed by ``"sum"``, divided by the
            rows with a visible key by ``"mean"`` (all ones: the unweighted loss). A constant (no
            gradient); a training step with them keeps the forward-formed gradient
            (``indexer/training/row_weights.py``).

    Returns:
        float32 KL in nats, ``[B, N_Q]`` or a scalar; rows with no visible key give 0 and zero
        gradient. Differentiable in ``q_idx``, ``k_idx``, ``weights``.
    """
    args = (q, k, q_idx, k_idx, weights, causal, scale, relu, lse, reduction, row_weights)
    # a new signature: every kernel of the call (the LSE pass, the forward, the backward's)
    # compiles at once before it runs (_core/launcher.compile_first_call)
    compile_first_call("indexer_kl", args, lambda: _indexer_kl(*args), getattr(q, "device", None))
    return _indexer_kl(*args)


def _indexer_kl(q, k, q_idx, k_idx, weights, causal, scale, relu, lse, reduction, row_weights):
    dims = _plan_mod._check(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=relu, lse=lse,
                  reduction=reduction)
    row_weights = _row_weights.check_row_weights(row_weights, dims, q.device)
    if lse is None and _choice._use_pacc(dims, True, reduction, q_idx, k_idx, weights):  # (True: lse will be there)
        # a training step without lse: the teacher's LSEs by one streaming pass, then the fast path
        lse = _teacher_lse.teacher_lse(q, k, q_idx, k_idx, weights, causal=causal, scale=dims.scale)
    use_pacc = _choice._use_pacc(dims, lse, reduction, q_idx, k_idx, weights)
    if use_pacc and _choice.pstore_mode(dims) == "chunk":  # the gradient formed in the forward (row weights as its g)
        total = _custom_ops.call(_chunk._indexer_loss_full_fwd_op, q, k, q_idx, k_idx, weights, lse, causal,
                                 dims.scale, relu, row_weights)[0]
        return total if reduction == "sum" else total / _plan_mod._rows_with_keys(dims, causal)
    if use_pacc and row_weights is None:  # store p whole, or accumulate the target's share (uniform g only)
        op = _store._indexer_loss_pstore_fwd_op if _choice.pstore_enabled(dims) else _accumulate._indexer_loss_fwd_op
        total = _custom_ops.call(op, q, k, q_idx, k_idx, weights, lse, causal, dims.scale, relu)[0]
        return total if reduction == "sum" else total / _plan_mod._rows_with_keys(dims, causal)
    kl = _custom_ops.call(_indexer_fwd_op, q, k, q_idx, k_idx, weights, lse, causal, dims.scale, relu)[0]
    if row_weights is not None:  # the recomputing backward then gets g * row_weights per row
        kl = kl * row_weights
    if reduction == "none":
        return kl
    total = kl.sum()
    if reduction == "sum":
        return total
    return total / _plan_mod._rows_with_keys(dims, causal)


# ----------------------------------------------------------------------------------------------
# The materialised PyTorch form (what users run today): the benchmark's baseline and the tests'
# same-precision computation (FlashAttention's tolerance rule). Differentiable through autograd.
# ----------------------------------------------------------------------------------------------

def indexer_kl_naive(q, k, q_idx, k_idx, weights, *, causal=False, scale=None, relu=True,
                     compute_dtype=torch.float32):
    """``[B, N_Q]`` KL in ``compute_dtype``, every score matrix materialised: teacher scores per
    head, softmax, head mean; indexer scores, ReLU, weights, log-softmax; KL. Products are formed
    from the inputs cast to ``compute_dtype`` (the anchors' baseline: bf16 inputs,
    ``compute_dtype=torch.float32``). Rows with no visible key give 0. The formula has one home,
    :func:`streamkl_ref.testing.indexer_kl_torch` (the conformance suite's baseline)."""
    from streamkl_ref.testing import indexer_kl_torch

    return indexer_kl_torch(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=relu,
                            compute_dtype=compute_dtype)
