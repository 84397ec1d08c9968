"""Scores, masks and array plumbing shared by every algorithm in streamkl_ref (one home each).

Conventions (the contract is docs/math.md):

- Layout ``[B, H, N, D]``. Side ``t`` has queries ``q_t [B, H, N_Q, D_t]`` and keys
  ``k_t [B, H_Kt, N_K, D_t]``; query head ``h`` reads key head ``h // (H // H_Kt)`` (GQA/MQA),
  which :func:`expand_key_heads` realises by repeating every key head ``H // H_Kt`` times.
- Scores ``S_t = scale_t * (q_t @ k_tᵀ)``: :func:`scaled_scores`, the only place they are formed.
- Causal masking is **bottom-right aligned** (as in FlashAttention, unlike SDPA's top-left
  ``is_causal``): key ``j`` is visible to query ``i`` iff ``j <= i + (N_K - N_Q)``. With
  ``N_Q > N_K`` the first ``N_Q - N_K`` rows see no key at all. :func:`visible` is the only place
  this rule is written; it also hides the padding rows/columns of partial tiles.
- Masks are kept *beside* the scores as boolean arrays (``True`` = visible) instead of being
  written into the scores as ``-inf``; every consumer selects with ``np.where`` before doing
  arithmetic, so no ``-inf - -inf`` or ``0 * inf`` is ever evaluated.
- Invisible values never reach a row (docs/math.md): a NaN or ±inf in a key a row cannot see, or in a
  query row, is selected away before it meets that row's arithmetic. A matmul cannot select, so
  the operands of the gradient matmuls go through :func:`finite_or_zero` (see there).
"""
from __future__ import annotations

import math

import numpy as np

__all__ = [
    "LN2",
    "LOG2E",
    "as_float_array",
    "expand_key_heads",
    "reduce_key_heads",
    "scaled_scores",
    "visible",
    "tile_past_frontier",
    "check_float_dtype",
    "finite_or_zero",
]

LN2 = math.log(2.0)  # ln 2: converts base-2 quantities (bits) to nats
LOG2E = 1.0 / LN2  # log2(e): folded into the score scale in base-2 mode


def as_float_array(x, name: str, dtype=np.float64) -> np.ndarray:
    """``x`` as a C-contiguous NumPy array of ``dtype``; a ``ValueError`` naming ``name`` if it is not real.

    A torch tensor (any device, any float dtype, requiring grad or not) is detached and copied to
    a float64 CPU array first, without this package importing torch. C order always (a copy of a
    strided view): NumPy's matmul takes a different summation path (BLAS, FMA) for other layouts,
    so a strided view and its contiguous copy could differ in the last bit (float32, found by the
    NaN-isolation property test of ``attention_kl_grad_tiled``); the references' results depend on
    the values only."""
    if _is_torch_tensor(x):
        if x.is_complex():
            raise ValueError(f"{name} is a complex torch tensor; the references take real inputs")
        x = x.detach().cpu().double().numpy()
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as exc:  # ragged lists and the like
        raise ValueError(f"{name} must be a real array, could not convert it: {exc}") from exc
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)


def _is_torch_tensor(x) -> bool:
    # duck-typed: streamkl_ref never imports torch
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach") and hasattr(x, "is_complex")


def check_float_dtype(dtype, name: str = "dtype") -> type:
    """The arithmetic dtype of the emulated kernels: ``np.float32`` or ``np.float64``."""
    try:
        resolved = np.dtype(dtype).type
    except TypeError as exc:
        raise ValueError(f"{name} must be np.float32 or np.float64, got {dtype!r}") from exc
    if resolved not in (np.float32, np.float64):
        raise ValueError(f"{name} must be np.float32 or np.float64, got {dtype!r}")
    return resolved


def expand_key_heads(k: np.ndarray, group: int) -> np.ndarray:
    """``[B, H_K, N_K, D] -> [B, H_K * group, N_K, D]``: query head ``h`` reads ``k[:, h // group]``."""
    return k if group == 1 else np.repeat(k, group, axis=1)


def reduce_key_heads(dk_per_query_head: np.ndarray, group: int) -> np.ndarray:
    """Adjoint of :func:`expand_key_heads`: sum the ``group`` query heads that read each key head."""
    if group == 1:
        return dk_per_query_head
    B, H, N, D = dk_per_query_head.shape
    return dk_per_query_head.reshape(B, H // group, group, N, D).sum(axis=2)


def scaled_scores(q: np.ndarray, k: np.ndarray, scale) -> np.ndarray:
    """``scale * (q @ kᵀ)`` over the last two axes, in the (common) dtype of ``q`` and ``k``.

    ``scale`` is rounded once to that dtype, as a kernel holding it in a register would.
    """
    qk = q @ np.swapaxes(k, -1, -2)
    return qk * qk.dtype.type(scale)


def visible(rows: np.ndarray, cols: np.ndarray, n_q: int, n_k: int, causal: bool) -> np.ndarray:
    """Boolean ``[len(rows), len(cols)]``: may query ``rows[a]`` see key ``cols[b]``?

    Indices at or past ``n_q`` / ``n_k`` (the padding of a partial tile) are never visible.
    Causal: bottom-right aligned, ``j <= i + (n_k - n_q)``.
    """
    rows = np.asarray(rows)[:, None]
    cols = np.asarray(cols)[None, :]
    mask = (rows < n_q) & (cols < n_k)
    if causal:
        mask &= cols <= rows + (n_k - n_q)
    return mask


def finite_or_zero(x: np.ndarray) -> np.ndarray:
    """``x`` with NaN and ±inf replaced by 0: a matmul operand beside a masked ``dS``.

    In ``dQ = dS · K`` a key ``j`` that row ``i`` cannot see has ``dS[i, j] = 0``, but
    ``0 · NaN = NaN`` would still carry a NaN key into row ``i`` (and a NaN query row into the
    ``dK`` of keys it cannot see, through ``dSᵀ · Q``). Zeroing the non-finite operand entries
    loses nothing a row sees: a NaN key or query that a row *does* see has already made that row's
    ``dS`` NaN (its scores and log-sum-exp are NaN), so the NaN still arrives, through ``dS``.
    """
    return np.where(np.isfinite(x), x, x.dtype.type(0))


def tile_past_frontier(row_start: int, row_stop: int, col_start: int, n_q: int, n_k: int) -> bool:
    """Causal only: does the tile ``rows [row_start, row_stop) x cols [col_start, ...)`` lie
    entirely past the frontier (no row of it sees any of its keys), so a kernel skips it?"""
    last_row = min(row_stop, n_q) - 1
    return col_start > last_row + (n_k - n_q)
