"""NaN/inf isolation cases shared by the kernel and reference tests (NumPy only, no torch).

docs/math.md, "Invisible keys never reach a row": a row's KL, LSEs and gradient rows depend only on
the keys it sees, a key's dK only on the query rows that see it; NaN or ±inf in a key a row
cannot see never reaches that row; NaN in a query row never reaches the dK of keys it cannot
see; the dK of a key no row sees is 0; NaN in a visible input still gives NaN.

A :class:`NanCase` is a small problem plus a list of *poisons*: NaN/±inf planted in single
elements of keys (``key_poison``), query rows (``query_poison``) and upstream-gradient rows
(``grad_poison``), and the storage around each input (``pad``: the inputs become strided views
into a larger NaN-filled buffer, so a load that forgets its mask reads NaN). :func:`taint` says
which outputs a poison may reach; everything else must be bitwise equal to the clean run
(:func:`assert_same_bits`). Where a NaN (not ±inf) reaches a row or key, the output there must
be NaN (:func:`assert_all_nan`): never a silent 0. What ±inf in a *visible* entry gives is outside
the contract (only its isolation is checked).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from streamkl_ref._scores import visible

POISON_VALUES = (float("nan"), float("inf"), float("-inf"))


@dataclass(frozen=True)
class NanCase:
    B: int = 1
    H: int = 1
    HK1: int = 1
    HK2: int = 1
    NQ: int = 8
    NK: int = 8
    D1: int = 16
    D2: int = 16
    causal: bool = True
    seed: int = 0
    key_poison: tuple = ()  # (side 1|2, b, key head, key j, dim d, value)
    query_poison: tuple = ()  # (side 1|2, b, query head, row i, dim d, value)
    grad_poison: tuple = ()  # (b, query head, row i, value)
    pad: tuple = (0, 0, 0, 0)  # NaN storage past B, heads, N, D of every input
    layout: str = "bhnd"  # "bnhd": the inputs are [B, N, H, D] buffers seen through transpose(1, 2)
    extra: dict = field(default_factory=dict, compare=False)  # per-test knobs (split_k, tiles, ...)

    @property
    def group1(self):
        return self.H // self.HK1

    @property
    def group2(self):
        return self.H // self.HK2

    def shapes(self):
        B, H, NQ, NK = self.B, self.H, self.NQ, self.NK
        return [(B, H, NQ, self.D1), (B, self.HK1, NK, self.D1), (B, H, NQ, self.D2), (B, self.HK2, NK, self.D2)]

    def clean(self, dtype=np.float32):
        """``(q1, k1, q2, k2, g)`` as float64 arrays holding values exactly representable in ``dtype``."""
        rng = np.random.default_rng(self.seed)
        xs = [rng.standard_normal(s).astype(dtype).astype(np.float64) for s in self.shapes()]
        g = rng.standard_normal((self.B, self.H, self.NQ)).astype(dtype).astype(np.float64)
        return xs + [g]

    def poisoned(self, arrays):
        """Copies of ``(q1, k1, q2, k2, g)`` with the poisons planted."""
        q1, k1, q2, k2, g = (np.array(a, copy=True) for a in arrays)
        keys, queries = {1: k1, 2: k2}, {1: q1, 2: q2}
        for side, b, kh, j, d, value in self.key_poison:
            keys[side][b, kh, j, d] = value
        for side, b, h, i, d, value in self.query_poison:
            queries[side][b, h, i, d] = value
        for b, h, i, value in self.grad_poison:
            g[b, h, i] = value
        return [q1, k1, q2, k2, g]

    def __repr__(self):  # short, for Hypothesis reports
        return (f"NanCase(B={self.B}, H={self.H}, HK1={self.HK1}, HK2={self.HK2}, NQ={self.NQ}, NK={self.NK}, "
                f"D1={self.D1}, D2={self.D2}, causal={self.causal}, seed={self.seed}, "
                f"key_poison={self.key_poison}, query_poison={self.query_poison}, "
                f"grad_poison={self.grad_poison}, pad={self.pad}, layout={self.layout!r}, extra={self.extra})")


def padded_view(x: np.ndarray, pad, layout: str, xp_full, xp_transpose):
    """``x [B, H, N, D]`` copied into a NaN-filled buffer ``pad`` larger on each axis, returned as
    a strided view of that buffer. ``xp_full(shape)`` makes the NaN buffer (NumPy or torch);
    ``xp_transpose(v)`` swaps axes 1 and 2 (the ``"bnhd"`` layout)."""
    B, H, N, D = x.shape
    pb, ph, pn, pd = pad
    if layout == "bhnd":
        buf = xp_full((B + pb, H + ph, N + pn, D + pd))
        view = buf[:B, :H, :N, :D]
    elif layout == "bnhd":
        buf = xp_full((B + pb, N + pn, H + ph, D + pd))
        view = xp_transpose(buf[:B, :N, :H, :D])
    else:
        raise ValueError(f"layout must be 'bhnd' or 'bnhd', got {layout!r}")
    view[...] = x
    return view


@dataclass
class Taint:
    """Which outputs a case's poisons may reach (``True`` = may differ from the clean run)."""

    rows_fwd: np.ndarray  # [B, H, NQ]: KL, LSE1, LSE2
    rows_fwd_nan: np.ndarray  # [B, H, NQ]: a NaN reaches the row: KL must be NaN
    rows_bwd: np.ndarray  # [B, H, NQ]: dq1, dq2 (also poisoned upstream gradients)
    rows_bwd_nan: np.ndarray
    keys1: np.ndarray  # [B, HK1, NK]: dk1
    keys1_nan: np.ndarray
    keys2: np.ndarray  # [B, HK2, NK]: dk2
    keys2_nan: np.ndarray
    unseen_keys: np.ndarray  # [NK]: no row sees the key: dk exactly 0


def taint(case: NanCase, vis=None) -> Taint:
    """``vis [NQ, NK]``: who sees whom (default: the case's causal or full mask; packed
    sequences pass their block-diagonal one, :func:`packed_visible`)."""
    B, H, NQ, NK = case.B, case.H, case.NQ, case.NK
    if vis is None:
        vis = visible(np.arange(NQ), np.arange(NK), NQ, NK, case.causal)  # [NQ, NK]
    sees_any = vis.any(axis=1)  # a row with no visible key is empty whatever its query holds

    def key_marks(nan_only):
        marks = np.zeros((B, H, NK), dtype=bool)  # per query head: the keys it reads are poisoned
        for side, b, kh, j, _, value in case.key_poison:
            if nan_only and not np.isnan(value):
                continue
            group = case.group1 if side == 1 else case.group2
            marks[b, kh * group:(kh + 1) * group, j] = True
        return marks

    def query_marks(nan_only):
        marks = np.zeros((B, H, NQ), dtype=bool)
        for _, b, h, i, _, value in case.query_poison:
            if nan_only and not np.isnan(value):
                continue
            marks[b, h, i] = True
        return marks

    def grad_marks(nan_only):
        marks = np.zeros((B, H, NQ), dtype=bool)
        for b, h, i, value in case.grad_poison:
            if nan_only and not np.isnan(value):
                continue
            marks[b, h, i] = True
        return marks

    def rows_reached(nan_only):
        sees_bad = (key_marks(nan_only)[:, :, None, :] & vis).any(axis=-1)
        return sees_any & (query_marks(nan_only) | sees_bad)

    rows_fwd, rows_fwd_nan = rows_reached(False), rows_reached(True)
    rows_bwd = rows_fwd | (sees_any & grad_marks(False))
    rows_bwd_nan = rows_fwd_nan | (sees_any & grad_marks(True))

    def keys_reached(rows, hk):
        per_head = (rows[:, :, :, None] & vis).any(axis=2)  # [B, H, NK]: a reached row sees the key
        return per_head.reshape(B, hk, H // hk, NK).any(axis=2)

    return Taint(
        rows_fwd=rows_fwd, rows_fwd_nan=rows_fwd_nan, rows_bwd=rows_bwd, rows_bwd_nan=rows_bwd_nan,
        keys1=keys_reached(rows_bwd, case.HK1), keys1_nan=keys_reached(rows_bwd_nan, case.HK1),
        keys2=keys_reached(rows_bwd, case.HK2), keys2_nan=keys_reached(rows_bwd_nan, case.HK2),
        unseen_keys=~vis.any(axis=0),
    )


def packed_visible(cu_q, cu_k, causal: bool) -> np.ndarray:
    """``[total_q, total_k]`` visibility of packed sequences: each sequence sees only its own keys
    (bottom-right causal within it)."""
    vis = np.zeros((cu_q[-1], cu_k[-1]), dtype=bool)
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        vis[q0:q1, k0:k1] = visible(np.arange(q1 - q0), np.arange(k1 - k0), q1 - q0, k1 - k0, causal)
    return vis


def _canonical_bits(x: np.ndarray) -> np.ndarray:
    """The bit patterns of ``x`` with -0 folded into +0 (a masked product may give either sign)."""
    x = np.asarray(x)
    x = x + x.dtype.type(0)  # -0 + 0 = +0; every other value unchanged
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def assert_same_bits(name, out, clean, reached):
    """``out`` equals ``clean`` bit for bit wherever ``reached`` (broadcast over trailing axes) is
    False; the clean run is finite there (else the check would say nothing)."""
    out, clean = np.asarray(out), np.asarray(clean)
    assert out.shape == clean.shape and out.dtype == clean.dtype, (name, out.shape, clean.shape)
    keep = ~np.broadcast_to(reached.reshape(reached.shape + (1,) * (out.ndim - reached.ndim)), out.shape)
    finite_or_empty = np.isfinite(clean) | np.isneginf(clean)  # an empty row's LSE is -inf
    assert finite_or_empty[keep].all(), f"{name}: the clean run is not finite"
    same = _canonical_bits(out) == _canonical_bits(clean)
    bad = keep & ~same
    if bad.any():
        where = tuple(int(a[0]) for a in np.nonzero(bad))
        raise AssertionError(
            f"{name}: {int(bad.sum())} unreached entries differ from the clean run, first at {where}: "
            f"{out[where]!r} vs clean {clean[where]!r}")


def assert_all_nan(name, out, reached_by_nan):
    """Every entry of a row/key that a NaN reaches is NaN (never a silent 0 or a finite value)."""
    out = np.asarray(out)
    mask = np.broadcast_to(reached_by_nan.reshape(reached_by_nan.shape + (1,) * (out.ndim - reached_by_nan.ndim)),
                           out.shape)
    assert np.isnan(out[mask]).all(), f"{name}: a NaN reached these entries but they are not all NaN"


def assert_unseen_keys_zero(name, dk, unseen_keys):
    """dK of keys no row sees is exactly 0 (``dk [B, HK, NK, D]``)."""
    dk = np.asarray(dk)
    assert (dk[:, :, unseen_keys] == 0).all(), f"{name}: a key no row sees has nonzero dK"


# ------------------------------------------------------------------------------------------------
# Hypothesis strategy
# ------------------------------------------------------------------------------------------------
@st.composite
def nan_cases(draw, max_n=40, max_d=24, max_b=2, max_bh=8, max_poisons=3, pad=True, layouts=("bhnd", "bnhd"),
              keys_need_causal=True):
    """Small problems with NaN/±inf planted in keys (biased towards the last keys: past the causal
    frontier of the most rows), query rows and upstream-gradient rows (biased towards the first
    rows: the empty rows of ``N_Q > N_K``), and NaN storage around every input. At most
    ``max_bh`` (batch, query head) slices (the interpreter's cost grows with them).
    ``keys_need_causal=False``: poison keys without causal too (packed sequences hide them)."""
    B = draw(st.integers(1, max_b))
    H = draw(st.sampled_from([h for h in (1, 2, 4) if B * h <= max_bh]))
    HK1 = draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0]))
    HK2 = draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0]))
    NQ = draw(st.integers(1, max_n))
    NK = draw(st.integers(1, max_n))
    D1 = draw(st.integers(1, max_d))
    D2 = draw(st.integers(1, max_d))
    causal = draw(st.booleans())
    value = st.sampled_from(POISON_VALUES)
    side = st.sampled_from([1, 2])

    def key_entry():
        s = draw(side)
        d = D1 if s == 1 else D2
        hk = HK1 if s == 1 else HK2
        return (s, draw(st.integers(0, B - 1)), draw(st.integers(0, hk - 1)),
                NK - 1 - draw(st.integers(0, NK - 1)), draw(st.integers(0, d - 1)), draw(value))

    def query_entry():
        s = draw(side)
        d = D1 if s == 1 else D2
        return (s, draw(st.integers(0, B - 1)), draw(st.integers(0, H - 1)), draw(st.integers(0, NQ - 1)),
                draw(st.integers(0, d - 1)), draw(value))

    def grad_entry():
        return (draw(st.integers(0, B - 1)), draw(st.integers(0, H - 1)), draw(st.integers(0, NQ - 1)), draw(value))

    # A poisoned key taints every row that sees it, and causal rows that see the last keys see
    # every key, so one poisoned key usually leaves no dK to compare; without causal it taints
    # every row. Hence three kinds: keys only (causal), rows only (the dK isolation), or both.
    kind = draw(st.sampled_from(["rows", "keys", "both"]))
    n_keys = draw(st.integers(1, max_poisons)) if (causal or not keys_need_causal) and kind != "rows" else 0
    n_queries = draw(st.integers(0, max_poisons)) if kind != "keys" else 0
    n_grads = draw(st.integers(0 if n_queries else 1, max_poisons)) if kind != "keys" else 0
    pads = (draw(st.integers(0, 1)), draw(st.integers(0, 1)), draw(st.integers(0, 17)), draw(st.integers(0, 9))) \
        if pad else (0, 0, 0, 0)
    return NanCase(
        B=B, H=H, HK1=HK1, HK2=HK2, NQ=NQ, NK=NK, D1=D1, D2=D2, causal=causal,
        seed=draw(st.integers(0, 2 ** 16)),
        key_poison=tuple(key_entry() for _ in range(n_keys)),
        query_poison=tuple(query_entry() for _ in range(n_queries)),
        # one poison per entry: a second one at the same (b, h, i) would overwrite the first, which
        # the expected taint (grad_marks) does not model
        grad_poison=tuple({e[:3]: e for e in (grad_entry() for _ in range(n_grads))}.values()),
        pad=pads, layout=draw(st.sampled_from(layouts)),
    )


@st.composite
def packed_nan_cases(draw, max_sequences=3, **kw):
    """``(case, cu_seqlens_q, cu_seqlens_k)``: a B = 1 case whose rows and keys are cut into up to
    ``max_sequences`` packed sequences (zero-length ones allowed)."""
    case = draw(nan_cases(max_b=1, keys_need_causal=False, **kw))
    n = draw(st.integers(1, max_sequences))

    def cuts(total):
        inner = sorted(draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
        return [0] + inner + [total]

    return case, cuts(case.NQ), cuts(case.NK)


def reported_case_key7(side=1):
    """The first reported case: causal, N = 8, NaN in key 7 (only row 7 sees it)."""
    return NanCase(NQ=8, NK=8, D1=16, D2=16, causal=True, seed=7, key_poison=((side, 0, 0, 7, 3, float("nan")),))


def reported_case_key40(side=2):
    """The second reported case: causal, N = 64, NaN in key 40 (only rows 40..63 see it)."""
    return NanCase(NQ=64, NK=64, D1=16, D2=16, causal=True, seed=40, key_poison=((side, 0, 0, 40, 5, float("nan")),))
