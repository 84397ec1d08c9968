"""Packed variable-length sequences (``cu_seqlens``), as FlashAttention's varlen API takes them.

Conventions (docs/math.md, "Packed sequences"): ``q_t [total_q, H, D_t]``, ``k_t [total_k, H_Kt, D_t]``,
``cu_seqlens_q`` / ``cu_seqlens_k`` integer ``[batch + 1]``: 0, non-decreasing, ending at the
totals. Sequence ``i`` is query rows ``cu_seqlens_q[i] : cu_seqlens_q[i+1]`` and keys
``cu_seqlens_k[i] : cu_seqlens_k[i+1]``; it attends only within itself, and everything of the
padded case holds per sequence (bottom-right causal within it, GQA, ``D1 != D2``). Zero-length
sequences are allowed; a sequence with queries but no keys gives KL 0, LSE −inf, zero gradients.

Defined sequence by sequence through the dense functions (:mod:`._dense`, :mod:`._grad`): no
formula lives here, only the packing. :func:`check_varlen` holds the packing's input rules and
is shared with ``streamkl_gpu.attention_kl_varlen``.
"""
from __future__ import annotations

from numbers import Integral

import numpy as np

from ._checks import Dims, check_flag, check_inputs
from ._dense import attention_kl
from ._grad import attention_kl_grad
from ._scores import as_float_array

__all__ = [
    "attention_kl_varlen",
    "attention_kl_varlen_grad",
    "check_varlen",
    "check_max_seqlen",
    "check_seqlens_shape",
    "check_seqlens_values",
    "padded_view",
]


def padded_view(x):
    """``[total, H, D] -> [1, H, total, D]``: a view in the padded layout (B = 1), for the shape
    rules of :func:`check_inputs` and for kernels that take ``[B, H, N, D]`` strides."""
    return x.transpose(1, 0, 2)[None] if isinstance(x, np.ndarray) else x.transpose(0, 1).unsqueeze(0)


def _check_3d(x, name: str):
    ndim = getattr(x, "ndim", None)
    if ndim is None:
        raise ValueError(f"{name} must be an array or tensor, got {type(x).__name__}")
    if ndim != 3:
        raise ValueError(f"{name} must have 3 dimensions [total, H, D] (packed sequences), got {ndim} "
                         f"(shape {tuple(x.shape)})")


def check_max_seqlen(value, name: str) -> int:
    """``max_seqlen_q`` / ``max_seqlen_k``: a non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def check_seqlens_shape(cu_seqlens_q, cu_seqlens_k) -> int:
    """The checks that need no values: 1-D, at least one entry, equal lengths. Returns ``batch``."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        ndim = getattr(cu, "ndim", None)
        if ndim is None:
            raise ValueError(f"{name} must be an array or tensor, got {type(cu).__name__}")
        if ndim != 1:
            raise ValueError(f"{name} must be 1-D [batch + 1], got shape {tuple(cu.shape)}")
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must have at least one entry (batch + 1 >= 1), got shape {tuple(cu.shape)}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries but cu_seqlens_k has {cu_seqlens_k.shape[0]}: "
            "both are [batch + 1] for the same sequences")
    return int(cu_seqlens_q.shape[0]) - 1


def check_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int,
                         max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The checks on the values (NumPy integer arrays): start at 0, non-decreasing, end at the
    totals, no sequence longer than its ``max_seqlen``."""
    for name, cu, total, max_name, max_len in (
        ("cu_seqlens_q", cu_seqlens_q, total_q, "max_seqlen_q", max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, total_k, "max_seqlen_k", max_seqlen_k),
    ):
        cu = np.asarray(cu).astype(np.int64)
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0]}")
        lengths = np.diff(cu)
        if (lengths < 0).any():
            i = int(np.argmax(lengths < 0))
            raise ValueError(f"{name} must be non-decreasing, but {name}[{i + 1}] = {cu[i + 1]} < "
                             f"{name}[{i}] = {cu[i]}")
        if cu[-1] != total:
            raise ValueError(f"{name} must end at the number of packed rows ({total}), got {cu[-1]}")
        if lengths.size and lengths.max() > max_len:
            i = int(np.argmax(lengths))
            raise ValueError(f"{name}: sequence {i} has length {lengths[i]} > {max_name} = {max_len}")


def check_varlen(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 *, scale1=None, scale2=None) -> tuple[Dims, int, int, int]:
    """Shape rules of a packed problem (no values read). Returns ``(dims, batch, max_seqlen_q,
    max_seqlen_k)``; ``dims`` is that of the ``[1, H, total, D]`` views (``NQ``/``NK`` are the
    totals)."""
    for name, x in (("q1", q1), ("k1", k1), ("q2", q2), ("k2", k2)):
        _check_3d(x, name)
    dims = check_inputs(*(padded_view(x) for x in (q1, k1, q2, k2)), scale1=scale1, scale2=scale2)
    batch = check_seqlens_shape(cu_seqlens_q, cu_seqlens_k)
    max_q = check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_k = check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    return dims, batch, max_q, max_k


def _as_cu(cu, name):
    arr = np.asarray(cu)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _prepare(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale1, scale2):
    q1, k1, q2, k2 = (as_float_array(x, n) for x, n in ((q1, "q1"), (k1, "k1"), (q2, "q2"), (k2, "k2")))
    cu_q, cu_k = _as_cu(cu_seqlens_q, "cu_seqlens_q"), _as_cu(cu_seqlens_k, "cu_seqlens_k")
    dims, batch, max_q, max_k = check_varlen(q1, k1, q2, k2, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                             scale1=scale1, scale2=scale2)
    check_seqlens_values(cu_q, cu_k, dims.NQ, dims.NK, max_q, max_k)
    return (q1, k1, q2, k2), cu_q, cu_k, dims, batch


def _sequences(xs, cu_q, cu_k, batch):
    """Per sequence: its row slice and its four inputs as ``[1, H, n, D]`` arrays."""
    q1, k1, q2, k2 = xs
    for i in range(batch):
        rows = slice(cu_q[i], cu_q[i + 1])
        keys = slice(cu_k[i], cu_k[i + 1])
        yield rows, keys, tuple(padded_view(x) for x in (q1[rows], k1[keys], q2[rows], k2[keys]))


def attention_kl_varlen(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        *, causal=False, scale1=None, scale2=None, return_lse=False):
    """Per-row ``KL(P1 || P2)`` of packed sequences, float64, each sequence by the dense reference.

    Args:
        q1: ``[total_q, H, D1]``, k1: ``[total_k, H_K1, D1]``, q2: ``[total_q, H, D2]``,
            k2: ``[total_k, H_K2, D2]``.
        cu_seqlens_q, cu_seqlens_k: integer ``[batch + 1]``, 0, non-decreasing, ending at
            ``total_q`` / ``total_k``.
        max_seqlen_q, max_seqlen_k: upper bounds of the sequence lengths (checked).
        causal, scale1, scale2: as :func:`streamkl_ref.attention_kl`, per sequence.
        return_lse: also return the natural-log LSEs ``[total_q, H]``.

    Returns:
        ``kl`` ``[total_q, H]`` float64 nats (or ``(kl, lse1, lse2)``).

    Raises:
        ValueError: naming the argument, for inconsistent shapes or a bad ``cu_seqlens``.
    """
    causal = check_flag(causal, "causal")
    xs, cu_q, cu_k, dims, batch = _prepare(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q, max_seqlen_k, scale1, scale2)
    out = [np.zeros((dims.NQ, dims.H)) for _ in range(3)]
    for rows, _, seq in _sequences(xs, cu_q, cu_k, batch):
        kl, lse1, lse2 = attention_kl(*seq, causal=causal, scale1=dims.scale1, scale2=dims.scale2,
                                      return_lse=True)
        for o, v in zip(out, (kl, lse1, lse2)):
            o[rows] = v[0].T
    return tuple(out) if return_lse else out[0]


def attention_kl_varlen_grad(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             grad_kl, *, causal=False, scale1=None, scale2=None):
    """Gradient of ``Σ grad_kl · KL`` for packed sequences, each sequence by
    :func:`streamkl_ref.attention_kl_grad`.

    Args:
        as :func:`attention_kl_varlen`; ``grad_kl``: ``[total_q, H]``.

    Returns:
        ``{"dq1", "dk1", "dq2", "dk2"}``: float64 arrays shaped like the packed inputs.
        Keys of a sequence with no query rows, and rows of a sequence with no keys, get 0.
    """
    causal = check_flag(causal, "causal")
    xs, cu_q, cu_k, dims, batch = _prepare(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q, max_seqlen_k, scale1, scale2)
    g = as_float_array(grad_kl, "grad_kl")
    if g.shape != (dims.NQ, dims.H):
        raise ValueError(f"grad_kl must have shape [total_q, H] = {[dims.NQ, dims.H]}, got {list(g.shape)}")
    grads = {name: np.zeros(x.shape) for name, x in zip(("dq1", "dk1", "dq2", "dk2"), xs)}
    for rows, keys, seq in _sequences(xs, cu_q, cu_k, batch):
        part = attention_kl_grad(*seq, g[rows].T[None], causal=causal, scale1=dims.scale1, scale2=dims.scale2)
        for name in grads:
            grads[name][rows if name.startswith("dq") else keys] = part[name][0].transpose(1, 0, 2)
    return grads
