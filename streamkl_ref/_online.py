"""The streaming (online) attention KL, run exactly as a kernel runs it.

Five running scalars per query row, ``(m1, l1, m2, l2, acc)``, start ``(−inf, 0, −inf, 0, 0)``
(:func:`initial_state`). For each key tile ``T`` (:func:`update_state`, the one home of the
recurrence)::

    m1' = max(m1, max_T S1)        a1 = exp(m1 − m1')
    l1' = a1·l1 + Σ_T exp(S1 − m1')
    acc' = a1·acc + Σ_T exp(S1 − m1')·(S1 − S2)
    m2' = max(m2, max_T S2)        l2' = exp(m2 − m2')·l2 + Σ_T exp(S2 − m2')

and at the end (:func:`finalize_state`) ``KL = acc/l1 + (m2 − m1) + log(l2/l1)``,
``LSE_t = m_t + log l_t``. (That is ``acc/l1 + LSE2 − LSE1`` with the two large ``m``'s
subtracted first and the two ``l``'s divided before the log, so no ``m + log l`` sum is rounded
before the cancellation.)

Guards: masked entries are selected away before any arithmetic, so they add exactly 0 to
``l1, l2, acc``; a row with no visible entry in a tile keeps its state bit-for-bit (its rescale
factor is ``exp(0) = 1``, or ``0 · 0`` while the row is still empty); ``exp(−inf − (−inf))`` and
``0 · inf`` are never evaluated. A row that never saw a key finalises to ``KL = 0``,
``LSE = −inf``; emptiness is read from ``m1 == −inf``, so a NaN row stays NaN.

Base 2 (``base2=True``): the scores arrive already multiplied by ``log2(e)`` (folded into the
scale), ``exp2``/``log2`` replace ``exp``/``log``, and the state holds base-2 quantities (``m``
and ``acc`` in bits). :func:`finalize_state` converts to nats with ``ln 2``.

Two partial states over disjoint key sets combine with :func:`merge_states` (split-K): it is
commutative, associative up to rounding, and has the start state as its identity.

Every function computes in the dtype of the state it is given: with float32 state and scores,
every arithmetic step is float32, as in a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import numpy as np

from ._checks import check_block, check_inputs
from ._scores import (
    LN2,
    LOG2E,
    as_float_array,
    check_float_dtype,
    expand_key_heads,
    scaled_scores,
    tile_past_frontier,
    visible,
)

__all__ = [
    "OnlineState",
    "OnlineResult",
    "TileEvent",
    "initial_state",
    "update_state",
    "merge_states",
    "finalize_state",
    "attention_kl_online",
]


class OnlineState(NamedTuple):
    """The five running scalars of every query row (arrays of one shape and dtype).

    ``m1, m2``: running maxima of ``S1, S2``; ``l1, l2``: ``Σ exp(S_t − m_t)``;
    ``acc``: ``Σ exp(S1 − m1)·(S1 − S2)``. In base-2 mode all are in base-2 units.
    """

    m1: np.ndarray
    l1: np.ndarray
    m2: np.ndarray
    l2: np.ndarray
    acc: np.ndarray

    def copy(self) -> "OnlineState":
        return OnlineState(*(np.array(x, copy=True) for x in self))


class OnlineResult(NamedTuple):
    """What :func:`attention_kl_online` returns; unpacks as ``kl, lse1, lse2, visited, skipped``.

    ``kl, lse1, lse2``: ``[B, H, N_Q]`` in nats, in the arithmetic dtype. ``tiles_visited`` and
    ``tiles_skipped`` count (query block, key tile) pairs of one (batch, head) slice (every slice
    runs the same grid); ``visited + skipped = ceil(N_Q/block_q) · ceil(N_K/block_k)``.
    """

    kl: np.ndarray
    lse1: np.ndarray
    lse2: np.ndarray
    tiles_visited: int
    tiles_skipped: int


@dataclass(frozen=True)
class TileEvent:
    """One step of the streaming loop, handed to the ``on_tile`` hook of :func:`attention_kl_online`.

    ``rows``: query rows ``[row_start, row_stop)`` of the block (real rows only, no padding);
    ``keys``: key columns ``[key_start, key_stop)`` of the tile (real columns only).
    ``skipped``: the tile lies past the causal frontier and was not computed.
    ``masked``: the tile was computed with a mask (diagonal or partial tile).
    ``state``: copy of the block's state *after* the tile, arrays ``[B, H, row_stop - row_start]``,
    in base-2 units when ``base2``.
    """

    q_block: int
    k_tile: int
    row_start: int
    row_stop: int
    key_start: int
    key_stop: int
    skipped: bool
    masked: bool
    base2: bool
    state: OnlineState


def initial_state(shape, dtype=np.float64) -> OnlineState:
    """The start state ``(−inf, 0, −inf, 0, 0)`` for rows of ``shape``; the identity of
    :func:`merge_states`."""
    dtype = check_float_dtype(dtype)
    return OnlineState(
        m1=np.full(shape, -np.inf, dtype=dtype),
        l1=np.zeros(shape, dtype=dtype),
        m2=np.full(shape, -np.inf, dtype=dtype),
        l2=np.zeros(shape, dtype=dtype),
        acc=np.zeros(shape, dtype=dtype),
    )


def _finite_reference(m: np.ndarray) -> np.ndarray:
    """``m`` where a row has seen a key, 0 where it has not (``m = −inf``): the value every
    exponent is taken relative to, so that ``−inf − (−inf)`` never occurs."""
    return np.where(m == -np.inf, m.dtype.type(0), m)


def update_state(state: OnlineState, s1_tile, s2_tile, mask=None, *, base2: bool = False) -> OnlineState:
    """One key tile of the recurrence.

    Args:
        state: the rows' state, arrays of shape ``[..., R]``.
        s1_tile, s2_tile: scores ``[..., R, C]`` of the tile (base-2 scaled when ``base2``);
            cast to the state's dtype. Values at masked entries are ignored (may be ``-inf``).
        mask: boolean, broadcastable to ``[..., R, C]``, ``True`` = visible; ``None`` = all visible.
        base2: use ``exp2`` (state in base-2 units).

    Returns:
        The new state. Rows with no visible entry in the tile keep their state exactly.
    """
    dtype = state.m1.dtype.type
    exp = np.exp2 if base2 else np.exp
    s1 = np.asarray(s1_tile, dtype=dtype)
    s2 = np.asarray(s2_tile, dtype=dtype)
    mask = np.ones(s1.shape, dtype=bool) if mask is None else np.broadcast_to(np.asarray(mask, dtype=bool), s1.shape)
    neg_inf = dtype(-np.inf)
    active = mask.any(axis=-1)

    def running_max(m_old, s):
        tile_max = np.max(np.where(mask, s, neg_inf), axis=-1, initial=neg_inf)
        return np.where(active, np.maximum(m_old, tile_max), m_old)

    def rescale_and_weights(m_old, m_new, s):
        ref = _finite_reference(m_new)
        alpha = exp(m_old - ref)  # m_old = −inf gives 0; an inactive, non-empty row gives exp(0) = 1
        refc = ref[..., None]
        weights = np.where(mask, exp(np.where(mask, s, refc) - refc), dtype(0))
        return alpha, weights

    m1 = running_max(state.m1, s1)
    m2 = running_max(state.m2, s2)
    a1, p1 = rescale_and_weights(state.m1, m1, s1)
    a2, p2 = rescale_and_weights(state.m2, m2, s2)
    zero = dtype(0)
    diff = np.where(mask, s1, zero) - np.where(mask, s2, zero)  # exactly 0 where masked
    return OnlineState(
        m1=m1,
        l1=a1 * state.l1 + np.sum(p1, axis=-1),
        m2=m2,
        l2=a2 * state.l2 + np.sum(p2, axis=-1),
        acc=a1 * state.acc + np.sum(p1 * diff, axis=-1),
    )


def merge_states(a: OnlineState, b: OnlineState, *, base2: bool = False) -> OnlineState:
    """Combine the states of two disjoint key sets (split-K).

    ``m = max(mA, mB)``, ``l = lA·e^{mA−m} + lB·e^{mB−m}``, ``acc`` with the side-1 factors.
    Commutative exactly, associative up to rounding, ``initial_state`` is the identity; two empty
    states merge to an empty state without NaN.
    """
    exp = np.exp2 if base2 else np.exp

    def factors(ma, mb):
        m = np.maximum(ma, mb)
        ref = _finite_reference(m)
        return m, exp(ma - ref), exp(mb - ref)

    m1, fa1, fb1 = factors(a.m1, b.m1)
    m2, fa2, fb2 = factors(a.m2, b.m2)
    return OnlineState(
        m1=m1,
        l1=a.l1 * fa1 + b.l1 * fb1,
        m2=m2,
        l2=a.l2 * fa2 + b.l2 * fb2,
        acc=a.acc * fa1 + b.acc * fb1,
    )


def finalize_state(state: OnlineState, base2: bool = False):
    """``(kl, lse1, lse2)`` in nats, in the state's dtype.

    ``KL = acc/l1 + (m2 − m1) + log(l2/l1)``, ``LSE_t = m_t + log l_t`` (times ``ln 2`` in base-2
    mode). Rows that never saw a key (``m1 = −inf``): ``KL = 0``, ``LSE = −inf``.
    """
    dtype = state.m1.dtype.type
    log = np.log2 if base2 else np.log
    empty = state.m1 == -np.inf
    one, zero = dtype(1), dtype(0)
    l1 = np.where(empty, one, state.l1)
    l2 = np.where(empty, one, state.l2)
    m1 = np.where(empty, zero, state.m1)
    m2 = np.where(empty, zero, state.m2)
    kl = state.acc / l1 + (m2 - m1) + log(l2 / l1)
    lse1 = m1 + log(l1)
    lse2 = m2 + log(l2)
    if base2:
        ln2 = dtype(LN2)
        kl, lse1, lse2 = kl * ln2, lse1 * ln2, lse2 * ln2
    neg_inf = dtype(-np.inf)
    return (
        np.where(empty, zero, kl),
        np.where(empty, neg_inf, lse1),
        np.where(empty, neg_inf, lse2),
    )


def _pad_rows(x: np.ndarray, n: int) -> np.ndarray:
    """Zero-pad axis 2 (rows) to length ``n``, as a kernel's out-of-range loads would."""
    extra = n - x.shape[2]
    if extra == 0:
        return x
    return np.concatenate([x, np.zeros(x.shape[:2] + (extra,) + x.shape[3:], dtype=x.dtype)], axis=2)


def attention_kl_online(
    q1,
    k1,
    q2,
    k2,
    *,
    causal: bool = False,
    scale1=None,
    scale2=None,
    block_q: int = 16,
    block_k: int = 16,
    dtype=np.float64,
    base2: bool = False,
    on_tile: Optional[Callable[[TileEvent], None]] = None,
) -> OnlineResult:
    """Attention KL by the streaming algorithm, tile by tile, as a kernel computes it.

    For each block of ``block_q`` query rows: start from :func:`initial_state`, walk the key
    tiles of ``block_k`` columns in order, form that one ``block_q x block_k`` tile of ``S1`` and
    ``S2`` (zero-padded past ``N_Q``/``N_K``, padding masked), and apply :func:`update_state`;
    then :func:`finalize_state`. With ``causal``, tiles entirely past the (bottom-right) frontier
    are skipped and counted; tiles that are partly visible (the diagonal, the ragged edge) are
    masked; fully visible tiles run unmasked. No more than one tile of scores is alive.

    Args:
        q1, k1, q2, k2, causal, scale1, scale2: as :func:`streamkl_ref.attention_kl`.
        block_q, block_k: tile sizes (positive integers; need not divide ``N_Q``/``N_K``).
        dtype: ``np.float64`` or ``np.float32``; every arithmetic step (the ``q·k`` products,
            the scaling, the recurrence, the finalisation) is done in it.
        base2: fold ``scale_t · log2(e)`` into the scores and use ``exp2``/``log2``.
        on_tile: called with a :class:`TileEvent` after every tile (also for skipped ones).

    Returns:
        :class:`OnlineResult` ``(kl, lse1, lse2, tiles_visited, tiles_skipped)``; ``kl, lse1,
        lse2`` are ``[B, H, N_Q]`` arrays of ``dtype``, in nats. A NaN input gives NaN in the
        rows it reaches, as in the dense reference.
    """
    arrays = [as_float_array(x, n) for x, n in ((q1, "q1"), (k1, "k1"), (q2, "q2"), (k2, "k2"))]
    dims = check_inputs(*arrays, scale1=scale1, scale2=scale2)
    block_q = check_block(block_q, "block_q")
    block_k = check_block(block_k, "block_k")
    dtype = check_float_dtype(dtype)
    q1, k1, q2, k2 = (x.astype(dtype) for x in arrays)
    B, H, NQ, NK = dims.B, dims.H, dims.NQ, dims.NK
    n_q_blocks = -(-NQ // block_q)
    n_k_tiles = -(-NK // block_k)

    fold = LOG2E if base2 else 1.0
    scale1_tile, scale2_tile = dims.scale1 * fold, dims.scale2 * fold  # rounded once, to dtype, in scaled_scores
    q1p, q2p = _pad_rows(q1, n_q_blocks * block_q), _pad_rows(q2, n_q_blocks * block_q)
    k1p = _pad_rows(expand_key_heads(k1, dims.group1), n_k_tiles * block_k)
    k2p = _pad_rows(expand_key_heads(k2, dims.group2), n_k_tiles * block_k)

    kl = np.zeros((B, H, NQ), dtype=dtype)
    lse1 = np.full((B, H, NQ), -np.inf, dtype=dtype)
    lse2 = np.full((B, H, NQ), -np.inf, dtype=dtype)
    visited = skipped = 0
    for qb in range(n_q_blocks):
        r0, r1 = qb * block_q, (qb + 1) * block_q
        real_r1 = min(r1, NQ)
        rows = np.arange(r0, r1)
        state = initial_state((B, H, block_q), dtype)
        q1_blk, q2_blk = q1p[:, :, r0:r1], q2p[:, :, r0:r1]
        for kt in range(n_k_tiles):
            c0, c1 = kt * block_k, (kt + 1) * block_k
            is_skipped = causal and tile_past_frontier(r0, r1, c0, NQ, NK)
            mask = None
            if is_skipped:
                skipped += 1
            else:
                visited += 1
                tile_mask = visible(rows, np.arange(c0, c1), NQ, NK, causal)
                mask = None if tile_mask.all() else tile_mask
                s1 = scaled_scores(q1_blk, k1p[:, :, c0:c1], scale1_tile)
                s2 = scaled_scores(q2_blk, k2p[:, :, c0:c1], scale2_tile)
                state = update_state(state, s1, s2, mask, base2=base2)
            if on_tile is not None:
                on_tile(
                    TileEvent(
                        q_block=qb, k_tile=kt, row_start=r0, row_stop=real_r1,
                        key_start=c0, key_stop=min(c1, NK), skipped=is_skipped,
                        masked=mask is not None, base2=base2,
                        state=OnlineState(*(x[:, :, : real_r1 - r0].copy() for x in state)),
                    )
                )
        kl_b, lse1_b, lse2_b = finalize_state(state, base2=base2)
        n_real = real_r1 - r0
        kl[:, :, r0:real_r1] = kl_b[:, :, :n_real]
        lse1[:, :, r0:real_r1] = lse1_b[:, :, :n_real]
        lse2[:, :, r0:real_r1] = lse2_b[:, :, :n_real]
    return OnlineResult(kl, lse1, lse2, visited, skipped)
