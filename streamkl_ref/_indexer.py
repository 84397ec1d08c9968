"""The sparse-attention indexer loss: KL from the head-averaged teacher attention to a
weighted-ReLU student (DeepSeek-V3.2's lightning indexer, dense warm-up form).

Conventions (docs/math.md, "The indexer loss"; statement 9 of ``proofs/``):

- Teacher (a constant): ``q [B, H, N_Q, D]``, ``k [B, H_K, N_K, D]`` (GQA/MQA: head ``h`` reads
  key head ``h // (H // H_K)``), scale σ (``None`` -> ``1/sqrt(D)``):
  ``P_h = softmax(σ · q_h k_{h//g}ᵀ)`` over the visible keys; target ``p = (1/H) Σ_h P_h``.
- Student: ``q_idx [B, H_I, N_Q, D_I]``, ``k_idx [B, H_KI, N_K, D_I]``, ``weights [B, H_I, N_Q]``:
  ``a[j,t,s] = q_idx[j,t] · k_idx[j // (H_I / H_KI), s]`` (no scale: fold it into ``weights``),
  ``I[t,s] = Σ_j weights[j,t] · relu(a[j,t,s])`` (``relu=False``: ``a`` itself).
- ``KL[b,t] = KL(p[t,:] || softmax(I[t,:])) = Σ_s p log p − Σ_s p·I + LSE_I[t]``, per query row
  (not per head: the target mixes all heads), in nats, ``[B, N_Q]``.
- Bottom-right causal; a row with no visible key has ``KL = 0``, ``LSE_I = −inf``, zero gradient.
- NaN isolation: masks are applied by selection (``np.where``) before any arithmetic, so an
  invisible entry never reaches a row (never ``0 · NaN``); a NaN in an input gives NaN in the rows
  it reaches. Because ``p`` mixes heads, a NaN in teacher key head ``g`` at key ``s`` reaches every
  row that sees ``s``.

:func:`indexer_kl` materialises (float64, ``log p`` as a log-sum-exp over heads, the KL as
``Σ p·(log p − log softmax I)``); :func:`indexer_kl_mp` is the mpmath ground truth;
:func:`indexer_kl_online` is the tiled recurrence a kernel runs; :func:`indexer_kl_grad` the
closed-form gradient in ``q_idx, k_idx, weights``.
"""
from __future__ import annotations

from typing import NamedTuple

import mpmath
import numpy as np

from ._checks import IndexerDims, check_block, check_flag, check_indexer_inputs, check_shape
from ._dense import kl_from_log_probs, masked_log_softmax, masked_probs
from ._grad import _tile_probs
from ._mp import _as_mp_input, _to_mpf
from ._online import (
    MAX_REFERENCED,
    PLAIN,
    _finite_reference,
    finalize_state,
    initial_state,
    update_state,
)
from ._scores import (
    as_float_array,
    check_float_dtype,
    expand_key_heads,
    reduce_key_heads,
    scaled_scores,
    tile_past_frontier,
    visible,
)

__all__ = [
    "indexer_kl",
    "indexer_kl_mp",
    "indexer_kl_online",
    "indexer_kl_grad",
    "IndexerOnlineResult",
    "IndexerTileStats",
    "indexer_logits",
    "teacher_log_target",
    "check_indexer_call",
]

_NAMES = ("q", "k", "q_idx", "k_idx", "weights")


def _check_relu(relu) -> bool:
    return check_flag(relu, "relu")


def check_indexer_call(q, k, q_idx, k_idx, weights, *, scale=None, relu=True, dtype=np.float64):
    """``(arrays, dims, relu)``: the five inputs as float arrays of ``dtype``, validated."""
    arrays = tuple(as_float_array(x, n, dtype) for x, n in zip((q, k, q_idx, k_idx, weights), _NAMES))
    dims = check_indexer_inputs(*arrays, scale=scale)
    return arrays, dims, _check_relu(relu)


def _row_array(x, name: str, want: tuple, label: str, dtype) -> np.ndarray:
    arr = as_float_array(x, name, dtype)
    check_shape(arr, name, want, label)
    return arr


# --------------------------------------------------------------------------------------------
# The two formulas every algorithm here shares (one home each)
# --------------------------------------------------------------------------------------------
def indexer_logits(q_idx_rows, k_idx_cols, weights_rows, relu: bool):
    """``(I, a)``: the student's logits ``I [B, R, C]`` and the per-head products
    ``a [B, H_I, R, C]`` for query rows ``q_idx_rows [B, H_I, R, D_I]``, key-head-expanded keys
    ``k_idx_cols [B, H_I, C, D_I]`` and ``weights_rows [B, H_I, R]``:
    ``I = Σ_j weights[j] · relu(a[j])``. ``np.maximum`` keeps a NaN a NaN (``a > 0`` would not)."""
    a = q_idx_rows @ np.swapaxes(k_idx_cols, -1, -2)
    act = np.maximum(a, a.dtype.type(0)) if relu else a
    return np.sum(weights_rows[..., None] * act, axis=1), a


def teacher_log_target(log_probs_per_head, mask):
    """``log p = log((1/H) Σ_h P_h)`` at visible entries (0 elsewhere), from the per-head
    log-probabilities ``[B, H, R, C]``: a log-sum-exp over the head axis, max-subtracted, so a
    ``p`` below the float range still has an accurate (finite) logarithm."""
    H = log_probs_per_head.shape[1]
    per_entry = np.moveaxis(log_probs_per_head, 1, -1)  # [B, R, C, H]
    head_mask = np.broadcast_to(mask[..., None], per_entry.shape)
    _, lse_heads = masked_log_softmax(per_entry, head_mask)  # −inf at invisible entries
    return np.where(mask, lse_heads - per_entry.dtype.type(np.log(H)), 0)


# --------------------------------------------------------------------------------------------
# Dense
# --------------------------------------------------------------------------------------------
def _dense_parts(arrays, dims: IndexerDims, causal: bool, relu: bool):
    """Everything the dense loss and gradient need, in the dtype of ``arrays``."""
    q, k, q_idx, k_idx, weights = arrays
    mask = visible(np.arange(dims.NQ), np.arange(dims.NK), dims.NQ, dims.NK, causal)
    s = scaled_scores(q, expand_key_heads(k, dims.group), dims.scale)
    log_p_heads, lse_teacher = masked_log_softmax(s, mask)
    log_p = teacher_log_target(log_p_heads, mask)
    k_idx_e = expand_key_heads(k_idx, dims.group_idx)
    logits, a = indexer_logits(q_idx, k_idx_e, weights, relu)
    log_q, lse_idx = masked_log_softmax(logits, mask)
    return dict(mask=mask, log_p=log_p, log_q=log_q, lse_idx=lse_idx, lse_teacher=lse_teacher,
                a=a, k_idx_e=k_idx_e, logits=logits)


def dense_indexer_kl(arrays, dims: IndexerDims, causal: bool, relu: bool):
    """``(kl [B, N_Q], lse_idx [B, N_Q], lse_teacher [B, H, N_Q])``, every step in the dtype of
    ``arrays`` (tests use float32 to measure a same-precision computation's error)."""
    parts = _dense_parts(arrays, dims, causal, relu)
    kl = kl_from_log_probs(parts["log_p"], parts["log_q"], parts["mask"])
    return kl, parts["lse_idx"], parts["lse_teacher"]


def indexer_kl(q, k, q_idx, k_idx, weights, *, causal=False, scale=None, relu=True, return_lse=False):
    """Per-row indexer loss ``KL(p || softmax(I))``, materialised, in float64.

    Args:
        q: ``[B, H, N_Q, D]`` teacher queries. k: ``[B, H_K, N_K, D]`` teacher keys (``H % H_K == 0``).
        q_idx: ``[B, H_I, N_Q, D_I]`` indexer queries. k_idx: ``[B, H_KI, N_K, D_I]`` indexer keys
            (``H_I % H_KI == 0``). weights: ``[B, H_I, N_Q]`` per-head, per-row weights.
        causal: bottom-right aligned causal mask (key ``s`` visible to row ``t`` iff
            ``s <= t + N_K − N_Q``).
        scale: the teacher's score scale; ``None`` means ``1/sqrt(D)`` (an absorbed-MLA teacher
            with ``D = 576`` needs its own, e.g. ``192 ** -0.5``).
        relu: ``I = Σ_j weights·relu(a)``; ``False`` drops the ReLU.
        return_lse: also return the student's and the teacher's natural-log row log-sum-exps.

    Returns:
        ``kl`` ``[B, N_Q]`` float64 (nats), or ``(kl, lse_idx [B, N_Q], lse_teacher [B, H, N_Q])``
        with ``return_lse`` (``lse_teacher`` is what ``lse=`` of the streaming forms takes).
        Rows with no visible key: ``kl = 0``, LSEs ``−inf``.

    Raises:
        ValueError: naming the argument, for inconsistent shapes, head counts that do not
        divide, a ``weights`` shape other than ``[B, H_I, N_Q]``, a bad ``scale`` or ``relu``.
    """
    causal = check_flag(causal, "causal")
    arrays, dims, relu = check_indexer_call(q, k, q_idx, k_idx, weights, scale=scale, relu=relu)
    kl, lse_idx, lse_teacher = dense_indexer_kl(arrays, dims, causal, relu)
    return (kl, lse_idx, lse_teacher) if return_lse else kl


# --------------------------------------------------------------------------------------------
# mpmath ground truth
# --------------------------------------------------------------------------------------------
def indexer_kl_mp(q, k, q_idx, k_idx, weights, *, causal=False, scale=None, relu=True, dps=50,
                  return_lse=False, return_mpf=False):
    """The indexer loss by its definition, in mpmath at ``dps`` digits (small shapes only).

    Same arguments and conventions as :func:`indexer_kl`; inputs may be object arrays of
    ``mpf``. Per row: ``P_h = exp(S_h − LSE_h)``, ``p = (1/H) Σ_h P_h``,
    ``KL = Σ_s p·(log p − (I − LSE_I))`` over the visible keys (``0 log 0 = 0``). The scale is the
    float64 value the other implementations use, taken as exact.

    Returns:
        ``kl`` ``[B, N_Q]``, or ``(kl, lse_idx, lse_teacher)`` with ``return_lse``; float64, or
        object arrays of ``mpf`` with ``return_mpf``.
    """
    causal = check_flag(causal, "causal")
    arrays = [_as_mp_input(x, n) for x, n in zip((q, k, q_idx, k_idx, weights), _NAMES)]
    dims = check_indexer_inputs(*arrays, scale=scale)
    relu = _check_relu(relu)
    if isinstance(dps, bool) or not isinstance(dps, int) or dps < 15:
        raise ValueError(f"dps must be an integer >= 15, got {dps!r}")
    q, k, q_idx, k_idx, weights = arrays
    mask = visible(np.arange(dims.NQ), np.arange(dims.NK), dims.NQ, dims.NK, causal)
    kl_out = np.empty((dims.B, dims.NQ), dtype=object)
    lse_idx_out = np.empty((dims.B, dims.NQ), dtype=object)
    lse_t_out = np.empty((dims.B, dims.H, dims.NQ), dtype=object)
    with mpmath.workdps(dps):
        sigma = mpmath.mpf(dims.scale)
        zero, neg_inf = mpmath.mpf(0), mpmath.mpf("-inf")

        def vec(x, *idx):
            return [_to_mpf(v) for v in x[idx]]

        for b in range(dims.B):
            for t in range(dims.NQ):
                keys = [s for s in range(dims.NK) if mask[t, s]]
                if not keys:
                    kl_out[b, t], lse_idx_out[b, t] = zero, neg_inf
                    lse_t_out[b, :, t] = neg_inf
                    continue
                p = [zero] * len(keys)
                for h in range(dims.H):
                    qh = vec(q, b, h, t)
                    sc = [sigma * mpmath.fdot(qh, vec(k, b, h // dims.group, s)) for s in keys]
                    lse_h = mpmath.log(mpmath.fsum(mpmath.exp(x) for x in sc))
                    lse_t_out[b, h, t] = lse_h
                    p = [pi + mpmath.exp(x - lse_h) for pi, x in zip(p, sc)]
                p = [pi / dims.H for pi in p]
                logits = [zero] * len(keys)
                for j in range(dims.HI):
                    qj = vec(q_idx, b, j, t)
                    w = _to_mpf(weights[b, j, t])
                    for n, s in enumerate(keys):
                        a = mpmath.fdot(qj, vec(k_idx, b, j // dims.group_idx, s))
                        logits[n] += w * (max(a, zero) if relu else a)
                lse_i = mpmath.log(mpmath.fsum(mpmath.exp(x) for x in logits))
                kl_out[b, t] = mpmath.fsum(pi * (mpmath.log(pi) - (x - lse_i))
                                           for pi, x in zip(p, logits) if pi != 0)
                lse_idx_out[b, t] = lse_i
    outs = (kl_out, lse_idx_out, lse_t_out)
    if not return_mpf:
        outs = tuple(np.array([float(v) for v in o.ravel()], dtype=np.float64).reshape(o.shape) for o in outs)
    return outs if return_lse else outs[0]


# --------------------------------------------------------------------------------------------
# Streaming, as a kernel runs it
# --------------------------------------------------------------------------------------------
class IndexerTileStats(NamedTuple):
    """(query block, key tile) pairs of one batch element (all heads share a tile: the kernel
    reads each teacher key tile once for every query head). ``lse_*``: the first pass that
    computes the teacher LSEs (0 when ``lse=`` is given). ``visited + skipped`` is
    ``ceil(N_Q/block_q) · ceil(N_K/block_k)`` for each pass that runs."""

    tiles_visited: int
    tiles_skipped: int
    lse_tiles_visited: int
    lse_tiles_skipped: int


class IndexerOnlineResult(NamedTuple):
    """What :func:`indexer_kl_online` returns; unpacks as ``kl, lse_idx, stats``."""

    kl: np.ndarray
    lse_idx: np.ndarray
    stats: IndexerTileStats


class IndexerState(NamedTuple):
    """The five running scalars of every query row, arrays ``[B, R]``.

    ``m``: running max of the student's logits ``I``; ``l = Σ exp(I − m)``; ``mass = Σ p``;
    ``acc = Σ p·(I − m)`` (``"max_referenced"``) or ``Σ p·I`` (``"plain"``);
    ``plogp = Σ p log p`` (``p`` is exact per entry once the teacher LSEs are known: no rescale).
    """

    m: np.ndarray
    l: np.ndarray
    mass: np.ndarray
    acc: np.ndarray
    plogp: np.ndarray


def _start(shape, dtype) -> IndexerState:
    zeros = lambda: np.zeros(shape, dtype=dtype)  # noqa: E731
    return IndexerState(np.full(shape, -np.inf, dtype=dtype), zeros(), zeros(), zeros(), zeros())


def _update(state: IndexerState, p, logits, mask, accumulator: str) -> IndexerState:
    """One key tile: target ``p [B, R, C]`` (0 where masked), logits ``I [B, R, C]``, ``mask [R, C]``."""
    dtype = state.m.dtype.type
    zero, neg_inf = dtype(0), dtype(-np.inf)
    active = mask.any(axis=-1)
    tile_max = np.max(np.where(mask, logits, neg_inf), axis=-1, initial=neg_inf)
    m = np.where(active, np.maximum(state.m, tile_max), state.m)
    ref, ref_old = _finite_reference(m), _finite_reference(state.m)
    alpha = np.exp(state.m - ref)  # 0 while the row was empty, 1 if the max did not move
    x = np.where(mask, logits, ref[..., None]) - ref[..., None]  # I − m', 0 where masked
    l = alpha * state.l + np.sum(np.where(mask, np.exp(x), zero), axis=-1)
    # p log p with 0 log 0 = 0; a NaN p stays NaN (NaN > 0 is False, NaN · 0 is NaN)
    log_p = np.log(np.where(mask & (p > 0), p, dtype(1)))
    plogp = state.plogp + np.sum(np.where(mask, p * log_p, zero), axis=-1)
    if accumulator == MAX_REFERENCED:
        # every old term p·(I − m) moves by −(m' − m) when the max moves: −mass·moved in all
        acc = state.acc - state.mass * (ref - ref_old) + np.sum(np.where(mask, p * x, zero), axis=-1)
    else:
        acc = state.acc + np.sum(np.where(mask, p * logits, zero), axis=-1)
    mass = state.mass + np.sum(np.where(mask, p, zero), axis=-1)
    return IndexerState(m, l, mass, acc, plogp)


def _finalize(state: IndexerState, accumulator: str):
    """``(kl, lse_idx)``. Re-referenced: ``KL = Σ p log p − acc + log l`` (uses ``Σ p = 1``, so the
    student's max never enters); plain: ``KL = Σ p log p − Σ p·I + (m + log l)``. Empty rows
    (``m = −inf``): ``(0, −inf)``."""
    dtype = state.m.dtype.type
    empty = state.m == -np.inf
    log_l = np.log(np.where(empty, dtype(1), state.l))
    m = np.where(empty, dtype(0), state.m)
    if accumulator == MAX_REFERENCED:
        kl = state.plogp - state.acc + log_l
    else:
        kl = state.plogp - state.acc + (m + log_l)
    return np.where(empty, dtype(0), kl), np.where(empty, dtype(-np.inf), m + log_l)


def indexer_kl_online(q, k, q_idx, k_idx, weights, *, causal=False, scale=None, relu=True, lse=None,
                      block_q=16, block_k=16, dtype=np.float64, accumulator=MAX_REFERENCED):
    """The indexer loss by the streaming algorithm, tile by tile, as a kernel computes it.

    For each block of ``block_q`` query rows:

    1. teacher LSEs: taken from ``lse`` (``[B, H, N_Q]``, natural log, ``−inf`` for empty rows;
       its values are not checked), or computed by a first pass over the key tiles (the online
       max/sum recurrence of :func:`streamkl_ref.update_state`, per head);
    2. one pass over the key tiles: form the ``H`` teacher score tiles, ``p = (1/H) Σ_h
       exp(S_h − LSE_h)``, the student's logits ``I`` for all ``H_I`` heads, and update five
       scalars per row (``m, l`` of ``I``; ``Σ p``; ``Σ p·(I − m)``, re-referenced to the running
       max when it moves; ``Σ p log p``, which needs no rescaling);
    3. ``KL = Σ p log p − Σ p·(I − m) + log l``.

    Causal tiles entirely past the frontier are skipped and counted, in both passes.

    Args:
        q, k, q_idx, k_idx, weights, causal, scale, relu: as :func:`indexer_kl`.
        lse: optional teacher LSEs ``[B, H, N_Q]`` (what FlashAttention's forward returns).
        block_q, block_k: tile sizes (positive integers; need not divide ``N_Q``/``N_K``).
        dtype: ``np.float64`` or ``np.float32``: the arithmetic of every step.
        accumulator: ``"max_referenced"`` (default, the kernel's) or ``"plain"`` (``Σ p·I`` and
            ``LSE_I`` cancelled at the end: loses ``eps·|I|`` at large logits).

    Returns:
        :class:`IndexerOnlineResult` ``(kl [B, N_Q], lse_idx [B, N_Q], stats)`` with
        :class:`IndexerTileStats`; arrays of ``dtype``.
    """
    causal = check_flag(causal, "causal")
    arrays, dims, relu = check_indexer_call(q, k, q_idx, k_idx, weights, scale=scale, relu=relu)
    block_q = check_block(block_q, "block_q")
    block_k = check_block(block_k, "block_k")
    dtype = check_float_dtype(dtype)
    if accumulator not in (MAX_REFERENCED, PLAIN):
        raise ValueError(f"accumulator must be one of {(MAX_REFERENCED, PLAIN)}, got {accumulator!r}")
    if lse is not None:
        lse = _row_array(lse, "lse", (dims.B, dims.H, dims.NQ), "[B, H, N_Q]", dtype)
    q, k, q_idx, k_idx, weights = (x.astype(dtype) for x in arrays)
    NQ, NK = dims.NQ, dims.NK
    k_e = expand_key_heads(k, dims.group)
    k_idx_e = expand_key_heads(k_idx, dims.group_idx)
    inv_heads = dtype(1.0 / dims.H)
    kl = np.zeros((dims.B, NQ), dtype=dtype)
    lse_idx = np.full((dims.B, NQ), -np.inf, dtype=dtype)
    counts = dict(visited=0, skipped=0, lse_visited=0, lse_skipped=0)

    def key_tiles(r0, r1, prefix):
        """The visible key tiles of a query block, counting the skipped ones."""
        for c0 in range(0, NK, block_k):
            if causal and tile_past_frontier(r0, r1, c0, NQ, NK):
                counts[prefix + "skipped"] += 1
                continue
            counts[prefix + "visited"] += 1
            c1 = min(c0 + block_k, NK)
            yield c0, c1, visible(np.arange(r0, r1), np.arange(c0, c1), NQ, NK, causal)

    for r0 in range(0, NQ, block_q):
        r1 = min(r0 + block_q, NQ)
        q_blk = q[:, :, r0:r1]
        teacher_scores = lambda c0, c1: scaled_scores(q_blk, k_e[:, :, c0:c1], dims.scale)  # noqa: E731
        if lse is None:  # first pass: the teacher's per-head LSEs (side 1 of the shared recurrence)
            teacher = initial_state((dims.B, dims.H, r1 - r0), dtype)
            for c0, c1, mask in key_tiles(r0, r1, "lse_"):
                s = teacher_scores(c0, c1)
                teacher = update_state(teacher, s, s, mask)
            lse_blk = finalize_state(teacher)[1]
        else:
            lse_blk = lse[:, :, r0:r1]
        state = _start((dims.B, r1 - r0), dtype)
        for c0, c1, mask in key_tiles(r0, r1, ""):
            p = np.sum(_tile_probs(teacher_scores(c0, c1), lse_blk, mask), axis=1) * inv_heads
            logits, _ = indexer_logits(q_idx[:, :, r0:r1], k_idx_e[:, :, c0:c1], weights[:, :, r0:r1], relu)
            state = _update(state, p, logits, mask, accumulator)
        kl[:, r0:r1], lse_idx[:, r0:r1] = _finalize(state, accumulator)
    stats = IndexerTileStats(counts["visited"], counts["skipped"], counts["lse_visited"], counts["lse_skipped"])
    return IndexerOnlineResult(kl, lse_idx, stats)


# --------------------------------------------------------------------------------------------
# Gradient (closed form)
# --------------------------------------------------------------------------------------------
def masked_contract(coef, mask, values):
    """``out[..., t, :] = Σ_{s visible to t} coef[..., t, s] · values[..., s, :]``.

    ``coef`` is 0 where masked; ``mask`` broadcasts to its shape. A plain matmul would still form
    ``0 · NaN`` for a non-finite ``values[s]`` at a key that row ``t`` does not see. Keys with a
    non-finite entry are therefore contracted by selection, so they reach only the rows that see
    them."""
    dtype = values.dtype.type
    finite = np.isfinite(values).all(axis=-1)  # [..., S]
    bad = ~finite.reshape(-1, finite.shape[-1]).all(axis=0)  # keys non-finite in any batch/head
    out = coef @ np.where(bad[:, None], dtype(0), values)
    if bad.any():
        cols = np.nonzero(bad)[0]
        terms = coef[..., :, cols, None] * values[..., None, cols, :]  # [..., T, n_bad, D]
        seen = np.broadcast_to(mask, coef.shape)[..., :, cols, None]
        out = out + np.sum(np.where(seen, terms, dtype(0)), axis=-2)
    return out


def indexer_kl_grad(q, k, q_idx, k_idx, weights, grad_kl, *, causal=False, scale=None, relu=True):
    """Closed-form gradient of ``Σ_{b,t} grad_kl[b,t] · KL[b,t]`` in ``q_idx, k_idx, weights``.

    With ``G = g·(softmax(I) − p)`` (``∂KL/∂I``, masked entries 0), ``a = q_idx · k_idxᵀ`` and
    ``A[j] = G · weights[j] · 1[a[j] > 0]`` (no indicator when ``relu=False``)::

        dweights[j,t] = Σ_s G[t,s]·relu(a[j,t,s])      dq_idx[j,t] = Σ_s A[j,t,s]·k_idx[j//g_I, s]
        dk_idx[j',s] = Σ_{j: j//g_I = j'} Σ_t A[j,t,s]·q_idx[j,t]

    The teacher is a constant (no gradient to ``q``, ``k``). At ``a = 0`` the ReLU's derivative
    is taken as 0.

    Args:
        q, k, q_idx, k_idx, weights, causal, scale, relu: as :func:`indexer_kl`.
        grad_kl: ``[B, N_Q]`` upstream gradient.

    Returns:
        ``{"dq_idx", "dk_idx", "dweights"}``, float64, shaped like ``q_idx, k_idx, weights``.
        Rows with no visible key contribute exactly 0; a NaN reaches the gradients of the rows
        (and the keys those rows see) it reaches, and nothing else.
    """
    causal = check_flag(causal, "causal")
    arrays, dims, relu = check_indexer_call(q, k, q_idx, k_idx, weights, scale=scale, relu=relu)
    g = _row_array(grad_kl, "grad_kl", (dims.B, dims.NQ), "[B, N_Q]", np.float64)
    parts = _dense_parts(arrays, dims, causal, relu)
    return _grad_from_parts(parts, parts["mask"], parts["log_p"], parts["log_q"], arrays, dims, g, relu)


def _grad_from_parts(parts, mask, log_p, log_q, arrays, dims: IndexerDims, g, relu: bool):
    """The closed forms from the target and student log-probabilities over ``mask`` (``[N_Q, N_K]``
    or per batch ``[B, N_Q, N_K]``): one home for the full-row and the top-k gradient."""
    a = parts["a"]
    q_idx, weights = arrays[2], arrays[4]
    head_mask = mask if mask.ndim == 2 else mask[:, None]  # broadcasts against [B, H_I, N_Q, N_K]
    p = masked_probs(log_p, mask)
    soft = masked_probs(log_q, mask)
    G = np.where(mask, g[..., None] * (soft - p), 0.0)[:, None]  # [B, 1, N_Q, N_K]
    act = np.maximum(a, 0.0) if relu else a
    dweights = np.sum(np.where(head_mask, G * act, 0.0), axis=-1)
    slope = (a > 0) if relu else 1.0
    A = np.where(head_mask, G * weights[..., None] * slope, 0.0)  # [B, H_I, N_Q, N_K]
    dq_idx = masked_contract(A, head_mask, parts["k_idx_e"])
    dk_idx = masked_contract(np.swapaxes(A, -1, -2), np.swapaxes(head_mask, -1, -2), q_idx)
    return {
        "dq_idx": dq_idx,
        "dk_idx": reduce_key_heads(dk_idx, dims.group_idx),
        "dweights": dweights,
    }
