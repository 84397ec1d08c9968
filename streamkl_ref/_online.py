"""The streaming (online) attention KL, run exactly as a kernel runs it.

(``accumulator="max_referenced"``, ``base2=True``, ``dtype=np.float32`` is the arithmetic of the
``streamkl_gpu`` forward kernels, operation for operation; the default ``"plain"`` accumulator is
docs/math.md's, described first.)

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

Two accumulator forms (``accumulator=`` of :func:`initial_state` and :func:`attention_kl_online`;
the state's class records which one it holds, so :func:`update_state`, :func:`merge_states` and
:func:`finalize_state` need no flag and refuse to mix them):

- ``"plain"`` (:class:`OnlineState`, the default): docs/math.md's ``acc = Σ e^{s1−m1}·(s1 − s2)``,
  as above.
- ``"max_referenced"`` (:class:`MaxReferencedState`): what the Triton kernels of
  ``streamkl_gpu`` keep, the same sum with each log-ratio measured from the two running maxima,
  ``acc* = Σ e^{s1−m1}·((s1 − m1) − (s2 − m2)) = acc − l1·(m1 − m2)``. With ``safe(m)`` = ``m``,
  or 0 while ``m = −inf``, and ``m'`` the new running maxima, a tile does::

      moved = (safe(m1') − safe(m1)) − (safe(m2') − safe(m2))
      acc*' = (acc* − l1·moved)·e^{m1 − m1'} + Σ_T e^{s1 − m1'}·((s1 − m1') − (s2 − m2'))

  (masked entries add 0), a merge re-references both parts to the merged maxima first,
  ``acc* = (accA* − l1A·movedA)·a + (accB* − l1B·movedB)·b`` with
  ``movedX = (safe(m1) − safe(m1X)) − (safe(m2) − safe(m2X))``, and the finalisation is
  ``KL = acc*/l1 + log(l2/l1)``: the large maxima never enter a rounded sum, so at large logits
  (``|S| ≫ 1``) the float32 KL keeps its accuracy where the plain form loses about
  ``eps32·|m|``. The per-entry log-ratio is formed as ``(s1 − m1') − (s2 − m2')``, in that order,
  as the kernels do. :func:`convert_state` maps a state between the two forms.

Split-K (``split_k`` of :func:`attention_kl_online`) runs the kernels' key split: every split's
tiles from the start state, then the partial states merged in split order from the start state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import numpy as np

from ._checks import check_block, check_flag, check_inputs
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
    "ACCUMULATORS",
    "OnlineState",
    "MaxReferencedState",
    "OnlineResult",
    "TileEvent",
    "initial_state",
    "update_state",
    "merge_states",
    "finalize_state",
    "convert_state",
    "attention_kl_online",
]

PLAIN = "plain"
MAX_REFERENCED = "max_referenced"
ACCUMULATORS = (PLAIN, MAX_REFERENCED)  # the values ``accumulator=`` accepts


class OnlineState(NamedTuple):
    """The five running scalars of every query row (arrays of one shape and dtype).

    ``m1, m2``: running maxima of ``S1, S2``; ``l1, l2``: ``Σ exp(S_t − m_t)``;
    ``acc``: ``Σ exp(S1 − m1)·(S1 − S2)`` (the ``"plain"`` accumulator of docs/math.md; the subclass
    :class:`MaxReferencedState` holds the kernels' form). In base-2 mode all are in base-2 units.
    ``accumulator`` (a class attribute, not a field) names the form.
    """

    m1: np.ndarray
    l1: np.ndarray
    m2: np.ndarray
    l2: np.ndarray
    acc: np.ndarray

    accumulator = PLAIN

    def copy(self) -> "OnlineState":
        return type(self)(*(np.array(x, copy=True) for x in self))


class MaxReferencedState(OnlineState):
    """The five scalars with the accumulator the kernels keep (``accumulator="max_referenced"``).

    Same fields as :class:`OnlineState`; only ``acc`` differs:
    ``acc = Σ exp(S1 − m1)·((S1 − m1) − (S2 − m2))``, i.e. the plain ``acc − l1·(m1 − m2)``.
    """

    __slots__ = ()
    accumulator = MAX_REFERENCED


_STATE_CLASS = {PLAIN: OnlineState, MAX_REFERENCED: MaxReferencedState}


def check_accumulator(accumulator) -> type:
    """The state class of ``accumulator`` (``"plain"`` or ``"max_referenced"``)."""
    try:
        return _STATE_CLASS[accumulator]
    except (KeyError, TypeError):
        raise ValueError(f"accumulator must be one of {ACCUMULATORS}, got {accumulator!r}") from None


def _form(state) -> str:
    """The accumulator form a state holds (any other five-field state counts as plain)."""
    return getattr(state, "accumulator", PLAIN)


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
    in base-2 units when ``base2``, of the class of the run's accumulator form. With
    ``split_k > 1`` it is the running state of the tile's key split (``split``), before the merge.
    ``split``: index of the key split the tile belongs to (0 without split-K).
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
    split: int = 0


def initial_state(shape, dtype=np.float64, accumulator: str = PLAIN) -> OnlineState:
    """The start state ``(−inf, 0, −inf, 0, 0)`` for rows of ``shape``; the identity of
    :func:`merge_states`. ``accumulator``: ``"plain"`` (an :class:`OnlineState`) or
    ``"max_referenced"`` (a :class:`MaxReferencedState`); the start state is the same numbers."""
    cls = check_accumulator(accumulator)
    dtype = check_float_dtype(dtype)
    return cls(
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
    """One key tile of the recurrence, in the accumulator form of ``state``.

    Args:
        state: the rows' state, arrays of shape ``[..., R]`` (:class:`OnlineState` or
            :class:`MaxReferencedState`; the result has the same class).
        s1_tile, s2_tile: scores ``[..., R, C]`` of the tile (base-2 scaled when ``base2``);
            cast to the state's dtype. Values at masked entries are ignored (may be ``-inf``).
        mask: boolean, broadcastable to ``[..., R, C]``, ``True`` = visible; ``None`` = all visible.
        base2: use ``exp2`` (state in base-2 units).

    Returns:
        The new state. Rows with no visible entry in the tile keep their state exactly.
    """
    form = _form(state)
    dtype = state.m1.dtype.type
    exp = np.exp2 if base2 else np.exp
    s1 = np.asarray(s1_tile, dtype=dtype)
    s2 = np.asarray(s2_tile, dtype=dtype)
    mask = np.ones(s1.shape, dtype=bool) if mask is None else np.broadcast_to(np.asarray(mask, dtype=bool), s1.shape)
    neg_inf = dtype(-np.inf)
    zero = dtype(0)
    active = mask.any(axis=-1)

    def running_max(m_old, s):
        tile_max = np.max(np.where(mask, s, neg_inf), axis=-1, initial=neg_inf)
        return np.where(active, np.maximum(m_old, tile_max), m_old)

    def shifted(m_old, m_new, s):
        """``(reference, alpha, x)``: the new shift ``safe(m')``, the rescale factor of the old
        sums, and the exponents ``x = s − safe(m')`` (0 where masked, so always finite)."""
        ref = _finite_reference(m_new)
        alpha = exp(m_old - ref)  # m_old = −inf gives 0; an inactive, non-empty row gives exp(0) = 1
        refc = ref[..., None]
        return ref, alpha, np.where(mask, s, refc) - refc

    m1 = running_max(state.m1, s1)
    m2 = running_max(state.m2, s2)
    ref1, a1, x1 = shifted(state.m1, m1, s1)
    ref2, a2, x2 = shifted(state.m2, m2, s2)
    p1 = np.where(mask, exp(x1), zero)
    p2 = np.where(mask, exp(x2), zero)
    if form == PLAIN:
        diff = np.where(mask, s1, zero) - np.where(mask, s2, zero)  # exactly 0 where masked
        acc = a1 * state.acc + np.sum(p1 * diff, axis=-1)
    else:  # MAX_REFERENCED, as the kernels run it
        # re-reference the old sum to the new maxima (each old term moves by −moved), then add
        # the tile's terms p1·((s1 − m1') − (s2 − m2')); x1 − x2 is 0 where masked
        moved = (ref1 - _finite_reference(state.m1)) - (ref2 - _finite_reference(state.m2))
        acc = (state.acc - state.l1 * moved) * a1 + np.sum(p1 * (x1 - x2), axis=-1)
    return _STATE_CLASS[form](
        m1=m1,
        l1=a1 * state.l1 + np.sum(p1, axis=-1),
        m2=m2,
        l2=a2 * state.l2 + np.sum(p2, axis=-1),
        acc=acc,
    )


def merge_states(a: OnlineState, b: OnlineState, *, base2: bool = False) -> OnlineState:
    """Combine the states of two disjoint key sets (split-K); both must hold the same form.

    ``m = max(mA, mB)``, ``l = lA·e^{mA−m} + lB·e^{mB−m}``, ``acc`` with the side-1 factors
    (``"max_referenced"``: after re-referencing each part to the merged maxima,
    ``accX − lX1·movedX``, see the module docstring). Commutative exactly, associative up to
    rounding, ``initial_state`` is the identity; two empty states merge to an empty state
    without NaN.
    """
    form = _form(a)
    if _form(b) != form:
        raise ValueError(f"cannot merge a {form!r} state with a {_form(b)!r} state (see convert_state)")
    exp = np.exp2 if base2 else np.exp

    def factors(ma, mb):
        m = np.maximum(ma, mb)
        ref = _finite_reference(m)
        return m, ref, exp(ma - ref), exp(mb - ref)

    m1, ref1, fa1, fb1 = factors(a.m1, b.m1)
    m2, ref2, fa2, fb2 = factors(a.m2, b.m2)
    if form == PLAIN:
        acc = a.acc * fa1 + b.acc * fb1
    else:  # MAX_REFERENCED, as the kernels' combine step runs it
        def rereferenced(x):
            moved = (ref1 - _finite_reference(x.m1)) - (ref2 - _finite_reference(x.m2))
            return x.acc - x.l1 * moved

        acc = rereferenced(a) * fa1 + rereferenced(b) * fb1
    return _STATE_CLASS[form](
        m1=m1,
        l1=a.l1 * fa1 + b.l1 * fb1,
        m2=m2,
        l2=a.l2 * fa2 + b.l2 * fb2,
        acc=acc,
    )


def finalize_state(state: OnlineState, base2: bool = False):
    """``(kl, lse1, lse2)`` in nats, in the state's dtype.

    ``KL = acc/l1 + (m2 − m1) + log(l2/l1)`` for the plain form, ``KL = acc/l1 + log(l2/l1)`` for
    the max-referenced form (whose ``acc`` already holds ``−l1·(m1 − m2)``); ``LSE_t = m_t + log l_t``
    (times ``ln 2`` in base-2 mode). Rows that never saw a key (``m1 = −inf``): ``KL = 0``,
    ``LSE = −inf``.
    """
    form = _form(state)
    dtype = state.m1.dtype.type
    log = np.log2 if base2 else np.log
    empty = state.m1 == -np.inf
    one, zero = dtype(1), dtype(0)
    l1 = np.where(empty, one, state.l1)
    l2 = np.where(empty, one, state.l2)
    m1 = np.where(empty, zero, state.m1)
    m2 = np.where(empty, zero, state.m2)
    if form == PLAIN:
        kl = state.acc / l1 + (m2 - m1) + log(l2 / l1)
    else:
        kl = state.acc / l1 + log(l2 / l1)
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


def convert_state(state: OnlineState, accumulator: str) -> OnlineState:
    """The same state in the form ``accumulator``: ``acc* = acc − l1·(safe(m1) − safe(m2))`` one way,
    ``acc = acc* + l1·(safe(m1) − safe(m2))`` the other (one rounding each; ``m, l`` unchanged;
    a state already in that form is returned as is). Finalises to the same KL up to rounding."""
    cls = check_accumulator(accumulator)
    form = _form(state)
    if form == accumulator:
        return state
    offset = state.l1 * (_finite_reference(state.m1) - _finite_reference(state.m2))
    acc = state.acc - offset if accumulator == MAX_REFERENCED else state.acc + offset
    return cls(state.m1, state.l1, state.m2, state.l2, acc)


def _pad_rows(x: np.ndarray, n: int) -> np.ndarray:
    """Zero-pad axis 2 (rows) to length ``n``, as a kernel's out-of-range loads would."""
    extra = n - x.shape[2]
    if extra == 0:
        return x
    return np.concatenate([x, np.zeros(x.shape[:2] + (extra,) + x.shape[3:], dtype=x.dtype)], axis=2)


def _key_splits(n_k_tiles: int, split_k: int) -> int:
    """Tiles per key split, as ``streamkl_gpu`` sizes them: at most ``split_k`` splits of equal
    whole-tile length (the last may be shorter); every split holds at least one tile."""
    splits = min(split_k, n_k_tiles)
    return -(-n_k_tiles // splits) if splits else 1


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
    accumulator: str = PLAIN,
    split_k: int = 1,
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
        accumulator: ``"plain"`` (default; docs/math.md's ``acc = Σ e^{S1−m1}(S1 − S2)``) or
            ``"max_referenced"`` (the ``streamkl_gpu`` kernels' ``acc − l1·(m1 − m2)``; see the
            module docstring). ``base2=True, dtype=np.float32, accumulator="max_referenced"``
            is the arithmetic of the kernels on fp32 inputs.
        split_k: key splits (positive integer, default 1), sized as ``streamkl_gpu`` sizes them
            (``min(split_k, tiles)`` splits of ``ceil(tiles / splits)`` key tiles): each split
            streams its tiles from the start state; the partial states are then merged in split
            order by :func:`merge_states`, starting from the start state, and finalised.
        on_tile: called with a :class:`TileEvent` after every tile (also for skipped ones).

    Returns:
        :class:`OnlineResult` ``(kl, lse1, lse2, tiles_visited, tiles_skipped)``; ``kl, lse1,
        lse2`` are ``[B, H, N_Q]`` arrays of ``dtype``, in nats. A NaN input gives NaN in the
        rows it reaches, as in the dense reference.
    """
    causal = check_flag(causal, "causal")
    arrays = [as_float_array(x, n) for x, n in ((q1, "q1"), (k1, "k1"), (q2, "q2"), (k2, "k2"))]
    dims = check_inputs(*arrays, scale1=scale1, scale2=scale2)
    block_q = check_block(block_q, "block_q")
    block_k = check_block(block_k, "block_k")
    split_k = check_block(split_k, "split_k")
    dtype = check_float_dtype(dtype)
    check_accumulator(accumulator)
    q1, k1, q2, k2 = (x.astype(dtype) for x in arrays)
    B, H, NQ, NK = dims.B, dims.H, dims.NQ, dims.NK
    n_q_blocks = -(-NQ // block_q)
    n_k_tiles = -(-NK // block_k)
    tiles_per_split = _key_splits(n_k_tiles, split_k)
    n_splits = -(-n_k_tiles // tiles_per_split)

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
        q1_blk, q2_blk = q1p[:, :, r0:r1], q2p[:, :, r0:r1]
        partials = []
        for split in range(max(n_splits, 1)):
            state = initial_state((B, H, block_q), dtype, accumulator)
            for kt in range(split * tiles_per_split, min((split + 1) * tiles_per_split, n_k_tiles)):
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
                            state=type(state)(*(x[:, :, : real_r1 - r0].copy() for x in state)),
                            split=split,
                        )
                    )
            partials.append(state)
        if len(partials) == 1:
            state = partials[0]
        else:  # the kernels' combine step: merge in split order, from the start state
            state = initial_state((B, H, block_q), dtype, accumulator)
            for part in partials:
                state = merge_states(state, part, base2=base2)
        kl_b, lse1_b, lse2_b = finalize_state(state, base2=base2)
        n_real = real_r1 - r0
        kl[:, :, r0:real_r1] = kl_b[:, :, :n_real]
        lse1[:, :, r0:real_r1] = lse1_b[:, :, :n_real]
        lse2[:, :, r0:real_r1] = lse2_b[:, :, :n_real]
    return OnlineResult(kl, lse1, lse2, visited, skipped)
