"""Tiny, self-contained kit for the machine checks in ``proofs/``.

Deliberately independent of ``streamkl_ref``: the proofs check the *mathematics*, so they carry
their own minimal implementations:

- exact (mpmath, ``DPS`` digits) row KL from the definition, the online recurrence, the merge;
- exact attention-level KL over small ``[H, N, D]`` nested lists (for the gradient checks);
- a NumPy emulation of the online recurrence in a chosen float dtype (``online_np``), with the
  guards of statement 6, optional deliberate mistakes, and a recorder for ``exp`` arguments;
- the first-order rounding-error bound of statement 7 (``first_order_bound``).
- the re-referenced state the kernels keep (statement 8): the bijection ``to_rr``/``from_rr``,
  exact ``rr_update``/``rr_merge``/``rr_finalize`` and their NumPy emulations (``*_np``).
- the indexer loss (statement 9): the head-averaged target ``mixture_target``, the definition
  ``indexer_row``, the student's state ``ix_update``/``ix_merge``/``ix_finalize``, the kernel's
  row in NumPy ``ix_row_np``, and the indexer-level loss and claimed gradients.

Rows are sequences of scores; a masked entry is ``-inf`` on *both* sides.
Every mpmath routine runs under ``mp.workdps(DPS)`` so the global precision is left alone.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import mpmath
import numpy as np
from hypothesis import strategies as st
from mpmath import mp, mpf

DPS = 60
NINF = mpmath.ninf


def hp(fn):
    """Run ``fn`` at ``DPS`` decimal digits, or more if the caller already works at more (as
    ``mpmath.diff`` does when it evaluates ``fn`` at nearby points)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with mp.workdps(max(DPS, mp.dps)):
            return fn(*args, **kwargs)

    return wrapper


def _is_masked(x) -> bool:
    return x == NINF


def _check_one_mask(s1, s2):
    for a, b in zip(s1, s2):
        assert _is_masked(a) == _is_masked(b), "one mask for both sides (statement 6)"


# --------------------------------------------------------------------------------------------
# Exact row quantities
# --------------------------------------------------------------------------------------------
@hp
def dense_row(s1: Sequence, s2: Sequence):
    """``(KL, LSE1, LSE2)`` of one row *by the definition*: ``P = softmax``,
    ``KL = sum_j P1 (log P1 - log P2)`` with ``0 log 0 = 0``. Empty row: ``(0, -inf, -inf)``."""
    s1 = [mpf(x) for x in s1]
    s2 = [mpf(x) for x in s2]
    _check_one_mask(s1, s2)
    vis = [j for j, x in enumerate(s1) if not _is_masked(x)]
    if not vis:
        return mpf(0), NINF, NINF
    z1 = mpmath.fsum(mpmath.exp(s1[j]) for j in vis)
    z2 = mpmath.fsum(mpmath.exp(s2[j]) for j in vis)
    p1 = {j: mpmath.exp(s1[j]) / z1 for j in vis}
    p2 = {j: mpmath.exp(s2[j]) / z2 for j in vis}
    kl = mpmath.fsum(p1[j] * (mpmath.log(p1[j]) - mpmath.log(p2[j])) for j in vis)
    return kl, mpmath.log(z1), mpmath.log(z2)


@hp
def decomposition(s1: Sequence, s2: Sequence, m1):
    """Statement 1's right-hand side ``acc/l1 + LSE2 - LSE1`` for the shift ``m1``."""
    s1 = [mpf(x) for x in s1]
    s2 = [mpf(x) for x in s2]
    vis = [j for j, x in enumerate(s1) if not _is_masked(x)]
    m1 = mpf(m1)
    w = {j: mpmath.exp(s1[j] - m1) for j in vis}
    l1 = mpmath.fsum(w.values())
    acc = mpmath.fsum(w[j] * (s1[j] - s2[j]) for j in vis)
    lse1 = mpmath.log(mpmath.fsum(mpmath.exp(s1[j]) for j in vis))
    lse2 = mpmath.log(mpmath.fsum(mpmath.exp(s2[j]) for j in vis))
    return acc / l1 + lse2 - lse1


# --------------------------------------------------------------------------------------------
# The online state, update, merge (exact arithmetic, guarded as in statement 6)
# --------------------------------------------------------------------------------------------
class State(NamedTuple):
    m1: object
    l1: object
    m2: object
    l2: object
    acc: object


def identity() -> State:
    """The start state ``(-inf, 0, -inf, 0, 0)``."""
    return State(NINF, mpf(0), NINF, mpf(0), mpf(0))


@hp
def update(state: State, t1: Sequence, t2: Sequence, *, rescale: bool = True) -> State:
    """One step of the online recurrence on a key tile ``(t1, t2)``.

    ``rescale=False`` is the deliberate mistake "forget the factor ``a = exp(m - m')``"."""
    t1 = [mpf(x) for x in t1]
    t2 = [mpf(x) for x in t2]
    _check_one_mask(t1, t2)
    vis = [j for j, x in enumerate(t1) if not _is_masked(x)]
    m1n = max([state.m1] + [t1[j] for j in vis])
    m2n = max([state.m2] + [t2[j] for j in vis])
    if m1n == NINF:  # nothing visible so far: the state is unchanged (guard, statement 6)
        return state
    a1 = mpmath.exp(state.m1 - m1n) if state.m1 != NINF else mpf(0)
    a2 = mpmath.exp(state.m2 - m2n) if state.m2 != NINF else mpf(0)
    if not rescale:
        a1 = a2 = mpf(1)
    p1 = {j: mpmath.exp(t1[j] - m1n) for j in vis}
    p2 = {j: mpmath.exp(t2[j] - m2n) for j in vis}
    return State(
        m1n,
        a1 * state.l1 + mpmath.fsum(p1.values()),
        m2n,
        a2 * state.l2 + mpmath.fsum(p2.values()),
        a1 * state.acc + mpmath.fsum(p1[j] * (t1[j] - t2[j]) for j in vis),
    )


def tile_state(t1: Sequence, t2: Sequence) -> State:
    """The state of one key tile on its own (its own maxima)."""
    return update(identity(), t1, t2)


@hp
def _side_merge(mA, lA, mB, lB, variant):
    m = max(mA, mB)
    if m == NINF:  # both empty (guard, statement 6): never form -inf - (-inf)
        return m, mpf(0), mpf(0), mpf(0)
    aA = mpmath.exp(mA - m) if mA != NINF else mpf(0)
    aB = mpmath.exp(mB - m) if mB != NINF else mpf(0)
    if variant == "no_rescale":
        aA = aB = mpf(1)
    elif variant == "rescale_only_b":
        aA = mpf(1)
    return m, aA * lA + aB * lB, aA, aB


@hp
def merge(A: State, B: State, *, variant: str | None = None) -> State:
    """Merge two partial states over disjoint key sets.

    ``variant`` selects a deliberate mistake: ``"no_rescale"`` (add the sums as they are) or
    ``"rescale_only_b"`` (rescale only the second argument)."""
    m1, l1, aA, aB = _side_merge(A.m1, A.l1, B.m1, B.l1, variant)
    m2, l2, _, _ = _side_merge(A.m2, A.l2, B.m2, B.l2, variant)
    return State(m1, l1, m2, l2, aA * A.acc + aB * B.acc)


@hp
def finalize(state: State):
    """``(KL, LSE1, LSE2)`` from a state; an empty state gives ``(0, -inf, -inf)``."""
    if state.l1 == 0:
        return mpf(0), NINF, NINF
    lse1 = state.m1 + mpmath.log(state.l1)
    lse2 = state.m2 + mpmath.log(state.l2)
    return state.acc / state.l1 + lse2 - lse1, lse1, lse2


def tiles_from_cuts(n: int, cuts: Sequence[int]):
    """Split ``range(n)`` at the sorted cut points into contiguous (possibly empty-free) tiles."""
    edges = [0] + sorted(set(c for c in cuts if 0 < c < n)) + [n]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:])]


def online_row(s1: Sequence, s2: Sequence, cuts: Sequence[int] = (), *, rescale=True):
    """Exact online recurrence over the tiling given by ``cuts``; returns ``(KL, LSE1, LSE2)``."""
    st_ = identity()
    for a, b in tiles_from_cuts(len(s1), cuts):
        st_ = update(st_, s1[a:b], s2[a:b], rescale=rescale)
    return finalize(st_)


def close(a, b, rel=mpf(10) ** -40) -> bool:
    """Equality up to ``rel`` (relative to ``1 + |b|``); infinities must match exactly."""
    with mp.workdps(DPS):
        a, b = mpf(a), mpf(b)
        if mpmath.isinf(a) or mpmath.isinf(b):
            return a == b
        return abs(a - b) <= rel * (1 + abs(b))


# --------------------------------------------------------------------------------------------
# Attention level (small nested lists), for the gradient checks of statement 5
# --------------------------------------------------------------------------------------------
@hp
def scores(Q, K, sigma):
    """``S[h][i][j] = sigma * <Q[h][i], K[h // (H/H_K)][j]>`` (GQA)."""
    H, HK = len(Q), len(K)
    g = H // HK
    return [
        [[mpf(sigma) * mpmath.fsum(mpf(a) * mpf(b) for a, b in zip(q, k)) for k in K[h // g]]
         for q in Q[h]]
        for h in range(H)
    ]


@hp
def attention_loss(Q1, K1, Q2, K2, s1, s2, G, mask=None):
    """``L = sum_{h,i} G[h][i] * KL[h][i]`` (mask ``[N_Q][N_K]`` of bools, True = visible)."""
    S1, S2 = scores(Q1, K1, s1), scores(Q2, K2, s2)
    total = mpf(0)
    for h in range(len(S1)):
        for i in range(len(S1[h])):
            r1, r2 = S1[h][i], S2[h][i]
            if mask is not None:
                r1 = [x if mask[i][j] else NINF for j, x in enumerate(r1)]
                r2 = [x if mask[i][j] else NINF for j, x in enumerate(r2)]
            total += G[h][i] * dense_row(r1, r2)[0]
    return total


@hp
def row_grads(r1, r2, *, drop_kl_term=False):
    """The claimed ``dKL/dS1`` (setting 2) and ``dKL/dS2`` (setting 1) of one row, from the
    logits and the LSEs, with masked entries (and empty rows) giving exactly 0."""
    r1 = [mpf(x) for x in r1]  # never subtract two Python floats: that would round to double
    r2 = [mpf(x) for x in r2]
    kl, lse1, lse2 = dense_row(r1, r2)
    n = len(r1)
    d1, d2 = [mpf(0)] * n, [mpf(0)] * n
    if lse1 == NINF:
        return d1, d2
    for j in range(n):
        if _is_masked(mpf(r1[j])):
            continue
        p1 = mpmath.exp(r1[j] - lse1)
        p2 = mpmath.exp(r2[j] - lse2)
        d2[j] = p2 - p1
        d1[j] = p1 * ((r1[j] - r2[j]) - (lse1 - lse2) - (0 if drop_kl_term else kl))
    return d1, d2


@hp
def attention_grads(Q1, K1, Q2, K2, s1, s2, G, mask=None, *, drop_kl_term=False, gqa_sum=True):
    """Claimed ``dQ1, dK1, dQ2, dK2`` of ``attention_loss``: ``dS1 = G * row_grads``,
    ``dQ = sigma dS K``, ``dK = sigma dS^T Q`` summed over the query heads of a key head.
    ``gqa_sum=False`` is the deliberate mistake "take dK from the first query head only"."""
    S1, S2 = scores(Q1, K1, s1), scores(Q2, K2, s2)
    H = len(Q1)
    out = []
    for Q, K, sig, side in ((Q1, K1, s1, 0), (Q2, K2, s2, 1)):
        g = H // len(K)
        dQ = [[[mpf(0)] * len(Q[0][0]) for _ in Q[0]] for _ in Q]
        dK = [[[mpf(0)] * len(K[0][0]) for _ in K[0]] for _ in K]
        for h in range(H):
            kh = h // g
            for i in range(len(Q[h])):
                r1, r2 = S1[h][i], S2[h][i]
                if mask is not None:
                    r1 = [x if mask[i][j] else NINF for j, x in enumerate(r1)]
                    r2 = [x if mask[i][j] else NINF for j, x in enumerate(r2)]
                dS = row_grads(r1, r2, drop_kl_term=drop_kl_term)[side]
                for j, ds in enumerate(dS):
                    ds = G[h][i] * ds
                    for d in range(len(Q[h][i])):
                        dQ[h][i][d] += sig * ds * K[kh][j][d]
                        if gqa_sum or h % g == 0:
                            dK[kh][j][d] += sig * ds * Q[h][i][d]
        out += [dQ, dK]
    return out


# --------------------------------------------------------------------------------------------
# Float emulation of the recurrence (statements 6 and 7)
# --------------------------------------------------------------------------------------------
def _fexp(x, dtype):
    """``exp`` with at most ~1 ulp error in ``dtype``: float64 exp, rounded once to ``dtype``."""
    return np.exp(np.asarray(x, np.float64)).astype(dtype)


def _flog(x, dtype):
    return np.log(np.asarray(x, np.float64)).astype(dtype)


def _seqsum(v, dtype):
    """Left-to-right sum in ``dtype`` (the order the bound of statement 7 assumes)."""
    acc = dtype(0)
    for x in v:
        acc = dtype(acc + x)
    return acc


def truncate_bf16(x):
    """Round a float32 toward zero to bfloat16 (8 significant bits): a deliberately sloppy step."""
    a = np.asarray(x, np.float32).copy()
    return (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).reshape(a.shape)[()]


def online_np(s1, s2, B, dtype=np.float32, *, guarded=True, shift=True, record=None,
              trace=None, sloppy_rescale=False):
    """The online recurrence in ``dtype`` over tiles of width ``B``; returns ``(KL, LSE1, LSE2)``.

    - ``guarded=False``: the naive recurrence (no empty-tile / empty-row guards): it forms
      ``-inf - (-inf)`` on masked data; run it under ``np.errstate(invalid='raise')`` to see.
    - ``shift=False``: no running max (``m`` stays 0): the naive ``sum exp(S)``.
    - ``record``: a list that receives every ``exp`` argument (as float64 arrays).
    - ``trace``: a list that receives the state ``(m1, l1, m2, l2, acc)`` after every tile.
    - ``sloppy_rescale``: truncate the rescale factor to bfloat16 (a deliberate mistake).
    """
    s1 = np.asarray(s1, dtype)
    s2 = np.asarray(s2, dtype)
    zero, ninf = dtype(0), dtype(-np.inf)

    def ex(x):
        if record is not None:
            record.append(np.array(x, np.float64, ndmin=1))
        return _fexp(x, dtype)

    m1, l1, m2, l2, acc = ninf, zero, ninf, zero, zero
    if not shift:
        m1 = m2 = zero
    for t0 in range(0, len(s1), B):
        x1, x2 = s1[t0:t0 + B], s2[t0:t0 + B]
        if guarded:
            vis = x1 > ninf
            if not vis.any():
                continue  # an all-masked tile leaves the state unchanged
            x1, x2 = x1[vis], x2[vis]
        n1 = np.maximum(m1, x1.max()) if shift else m1
        n2 = np.maximum(m2, x2.max()) if shift else m2
        if guarded:
            a1 = ex(dtype(m1 - n1)) if m1 > ninf else zero
            a2 = ex(dtype(m2 - n2)) if m2 > ninf else zero
        else:
            a1, a2 = ex(dtype(m1 - n1)), ex(dtype(m2 - n2))
        if sloppy_rescale:
            a1, a2 = truncate_bf16(a1), truncate_bf16(a2)
        p1 = ex((x1 - n1).astype(dtype))
        p2 = ex((x2 - n2).astype(dtype))
        d = (x1 - x2).astype(dtype)
        l1 = dtype(dtype(a1 * l1) + _seqsum(p1, dtype))
        l2 = dtype(dtype(a2 * l2) + _seqsum(p2, dtype))
        acc = dtype(dtype(a1 * acc) + _seqsum((p1 * d).astype(dtype), dtype))
        m1, m2 = n1, n2
        if trace is not None:
            trace.append((m1, l1, m2, l2, acc))
    if guarded and l1 == 0:
        return zero, ninf, ninf
    lse1 = dtype(m1 + _flog(l1, dtype))
    lse2 = dtype(m2 + _flog(l2, dtype))
    return dtype(dtype(acc / l1) + dtype(lse2 - lse1)), lse1, lse2


def dense_np(s1, s2, dtype=np.float32):
    """The same math done densely (one tile holding the whole row) in ``dtype``."""
    return online_np(s1, s2, max(len(s1), 1), dtype)


# --------------------------------------------------------------------------------------------
# Statement 7: the first-order rounding-error bound
# --------------------------------------------------------------------------------------------
U32 = 2.0 ** -24  # unit roundoff of float32 (round to nearest)
ETA32 = 2.0 ** -149  # spacing of float32 subnormals: bound on any absolute underflow error


@hp
def first_order_bound(s1, s2, B, *, u=U32, u_e=2 * U32, u_l=2 * U32, eta=ETA32):
    """Bounds on ``|KL^ - KL|, |LSE1^ - LSE1|, |LSE2^ - LSE2|`` for ``online_np`` (no mask),
    to first order in ``u``. See ``07_floating_point.md`` for the derivation."""
    s1 = [mpf(float(x)) for x in s1]
    s2 = [mpf(float(x)) for x in s2]
    n = len(s1)
    T = -(-n // B)
    Bw = min(B, n)
    c = T * u_e + (Bw + 2 * T) * u
    m1, m2 = max(s1), max(s2)
    w1 = [mpmath.exp(x - m1) for x in s1]
    w2 = [mpmath.exp(x - m2) for x in s2]
    l1, l2 = mpmath.fsum(w1), mpmath.fsum(w2)
    P1 = [w / l1 for w in w1]
    P2 = [w / l2 for w in w2]
    d = [a - b for a, b in zip(s1, s2)]
    acc = mpmath.fsum(w * x for w, x in zip(w1, d))
    R = acc / l1
    lse1, lse2 = m1 + mpmath.log(l1), m2 + mpmath.log(l2)
    kl = R + lse2 - lse1
    rho1 = u * mpmath.fsum(p * (m1 - x) for p, x in zip(P1, s1)) + c + n * eta
    rho2 = u * mpmath.fsum(p * (m2 - x) for p, x in zip(P2, s2)) + c + n * eta
    e_acc = mpmath.fsum(p * abs(x) * (u * (m1 - s) + c + 2 * u) for p, x, s in zip(P1, d, s1))
    e_acc += n * eta * (max(abs(x) for x in d) + 1)
    e_R = e_acc + abs(R) * rho1 + u * abs(R)
    e_L1 = rho1 + u_l * mpmath.log(l1) + u * abs(lse1)
    e_L2 = rho2 + u_l * mpmath.log(l2) + u * abs(lse2)
    e_kl = e_R + e_L1 + e_L2 + u * abs(lse2 - lse1) + u * abs(kl)
    return float(e_kl), float(e_L1), float(e_L2)


@hp
def coarse_bound(n, B, M, *, u=U32, u_e=2 * U32, u_l=2 * U32, eta=ETA32):
    """The data-free corollary: the bound in terms of ``n, B, T`` and ``M = max |S|`` only:
    ``M (4 rho + 14 u) + 2 rho + (2 u_l + 4 u) ln n + n eta (2 M + 1)``,
    ``rho = u ln n + c + n eta``."""
    T = -(-n // B)
    Bw = min(B, n)
    c = T * u_e + (Bw + 2 * T) * u
    ln_n = mpmath.log(n)
    rho = u * ln_n + c + n * eta
    return float(M * (4 * rho + 14 * u) + 2 * rho + (2 * u_l + 4 * u) * ln_n
                 + n * eta * (2 * M + 1))


# --------------------------------------------------------------------------------------------
# Hypothesis strategies (bounded floats only)
# --------------------------------------------------------------------------------------------
def finite(lo=-30.0, hi=30.0):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


@st.composite
def rows(draw, min_n=1, max_n=8, lo=-30.0, hi=30.0, masked=False):
    """A pair of score rows of the same length; with ``masked``, some entries ``-inf`` on both."""
    n = draw(st.integers(min_n, max_n))
    s1 = draw(st.lists(finite(lo, hi), min_size=n, max_size=n))
    s2 = draw(st.lists(finite(lo, hi), min_size=n, max_size=n))
    if masked:
        m = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        s1 = [-math.inf if k else x for k, x in zip(m, s1)]
        s2 = [-math.inf if k else x for k, x in zip(m, s2)]
    return s1, s2


def cuts_for(n):
    return st.lists(st.integers(1, max(n - 1, 1)), max_size=max(n - 1, 0))


@st.composite
def sharded(draw):
    """A masked row pair, a key sharding (any, not only contiguous), a tiling per shard and
    random picks that fix the merge tree and order (statements 3 and 8)."""
    s1, s2 = draw(rows(max_n=10, masked=True))
    n = len(s1)
    k = draw(st.integers(1, n))
    owner = draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n))  # any key sharding
    shards = [[j for j in range(n) if owner[j] == s] for s in range(k)]
    tilings = [draw(st.lists(st.integers(1, max(len(sh) - 1, 1)), max_size=3)) for sh in shards]
    picks = draw(st.lists(st.integers(0, 10 ** 6), min_size=2 * k, max_size=2 * k))
    return s1, s2, shards, tilings, picks


# --------------------------------------------------------------------------------------------
# SymPy helpers
# --------------------------------------------------------------------------------------------
def sym_zero(expr) -> bool:
    """True when SymPy proves ``expr == 0`` (real symbols; logs of products split, exps of sums
    split, then ``simplify``)."""
    import sympy as sp

    e = sp.expand(sp.expand_log(expr, force=True), power_exp=True)
    # exp(x) of a real x is a positive number: name each one, and the rest is rational algebra
    # in those names and the remaining logs (a fast, complete test for these expressions).
    exps = sorted(e.atoms(sp.exp), key=sp.default_sort_key)
    names = sp.symbols(f"_E0:{len(exps)}", positive=True)
    r = sp.expand_log(e.subs(dict(zip(exps, names))), force=True)
    if sp.cancel(sp.together(r)) == 0:
        return True
    return sp.simplify(e) == 0


def sym_nonzero_at(expr, point: dict) -> bool:
    """True when ``expr`` evaluates to a nonzero number at ``point`` (disproves an identity)."""
    val = complex(expr.subs(point).evalf(30))
    return abs(val) > 1e-12


# --------------------------------------------------------------------------------------------
# Statement 8: the re-referenced accumulator the kernels keep
#   acc* = sum_j exp(s_j - m1) ((s_j - m1) - (t_j - m2))  =  acc - l1 (m1 - m2)
# A -inf maximum is replaced by 0 wherever it is used as a shift (the kernels' ``_safe``), and
# exp(-inf) = 0 is evaluated: no branch on empty states, and -inf - (-inf) is never formed.
# --------------------------------------------------------------------------------------------
def _safe(m):
    """The shift of a running max: 0 while nothing was seen (``m == -inf``)."""
    return type(m)(0) if m == -math.inf else m  # a 0 of the same type (mpf or NumPy scalar)


@hp
def to_rr(state: State) -> State:
    """Statement 2's state -> the re-referenced one: ``acc* = acc - l1 (m1 - m2)``."""
    return state._replace(acc=state.acc - state.l1 * (_safe(state.m1) - _safe(state.m2)))


@hp
def from_rr(state: State) -> State:
    """The inverse: ``acc = acc* + l1 (m1 - m2)``."""
    return state._replace(acc=state.acc + state.l1 * (_safe(state.m1) - _safe(state.m2)))


def _moved(m1n, m1, m2n, m2, variant):
    d1, d2 = _safe(m1n) - _safe(m1), _safe(m2n) - _safe(m2)
    if variant == "no_move":  # deliberate mistake: forget the -l1*moved term
        return d1 * 0
    if variant == "plus":  # deliberate mistake: moved = dm1 + dm2
        return d1 + d2
    return d1 - d2


@hp
def rr_update(state: State, t1: Sequence, t2: Sequence, *, variant: str | None = None) -> State:
    """One step of the re-referenced recurrence (the kernels' ``_fwd_key_range``), exact.

    ``variant``: ``"no_move"`` or ``"plus"``, deliberate mistakes in the re-reference term."""
    t1 = [mpf(x) for x in t1]
    t2 = [mpf(x) for x in t2]
    _check_one_mask(t1, t2)
    vis = [j for j, x in enumerate(t1) if not _is_masked(x)]
    m1n = max([state.m1] + [t1[j] for j in vis])
    m2n = max([state.m2] + [t2[j] for j in vis])
    sh1, sh2 = _safe(m1n), _safe(m2n)
    a1, a2 = mpmath.exp(state.m1 - sh1), mpmath.exp(state.m2 - sh2)  # exp(-inf) = 0
    moved = _moved(m1n, state.m1, m2n, state.m2, variant)
    p1 = {j: mpmath.exp(t1[j] - sh1) for j in vis}
    p2 = {j: mpmath.exp(t2[j] - sh2) for j in vis}
    return State(
        m1n,
        a1 * state.l1 + mpmath.fsum(p1.values()),
        m2n,
        a2 * state.l2 + mpmath.fsum(p2.values()),
        (state.acc - state.l1 * moved) * a1
        + mpmath.fsum(p1[j] * ((t1[j] - sh1) - (t2[j] - sh2)) for j in vis),
    )


@hp
def rr_merge(A: State, B: State, *, variant: str | None = None) -> State:
    """Merge of two re-referenced states (the kernels' ``_kl_combine_kernel``), exact."""
    m1, m2 = max(A.m1, B.m1), max(A.m2, B.m2)
    sh1, sh2 = _safe(m1), _safe(m2)
    a1, b1 = mpmath.exp(A.m1 - sh1), mpmath.exp(B.m1 - sh1)
    a2, b2 = mpmath.exp(A.m2 - sh2), mpmath.exp(B.m2 - sh2)
    mA = _moved(m1, A.m1, m2, A.m2, variant)
    mB = _moved(m1, B.m1, m2, B.m2, variant)
    return State(m1, a1 * A.l1 + b1 * B.l1, m2, a2 * A.l2 + b2 * B.l2,
                 (A.acc - A.l1 * mA) * a1 + (B.acc - B.l1 * mB) * b1)


@hp
def rr_finalize(state: State):
    """``(KL, LSE1, LSE2)`` with ``KL = acc*/l1 + log(l2/l1)``; empty state: ``(0, -inf, -inf)``."""
    if state.l1 == 0:
        return mpf(0), NINF, NINF
    return (state.acc / state.l1 + mpmath.log(state.l2 / state.l1),
            state.m1 + mpmath.log(state.l1), state.m2 + mpmath.log(state.l2))


def rr_update_np(state, x1, x2, dtype=np.float32):
    """The kernels' tile step in ``dtype`` (base e): masked entries are ``-inf`` in ``x1, x2``;
    like the kernel, the log-ratio is formed from finite stand-in scores and the exponent
    argument is set to ``-inf`` where masked. ``state`` is ``(m1, l1, m2, l2, acc*)``."""
    m1, l1, m2, l2, acc = state
    x1, x2 = np.asarray(x1, dtype), np.asarray(x2, dtype)
    ninf = dtype(-np.inf)
    vis = x1 > ninf
    r1, r2 = np.where(vis, x1, dtype(0)), np.where(vis, x2, dtype(0))  # finite stand-ins
    m1n = dtype(max(m1, np.where(vis, x1, ninf).max(initial=ninf)))
    m2n = dtype(max(m2, np.where(vis, x2, ninf).max(initial=ninf)))
    sh1, sh2 = _safe(m1n), _safe(m2n)
    y1, y2 = (r1 - sh1).astype(dtype), (r2 - sh2).astype(dtype)
    ratio = (y1 - y2).astype(dtype)  # (s1 - m1') - (s2 - m2'): small where P1 matters
    p1 = _fexp(np.where(vis, y1, ninf), dtype)  # exp(-inf) = 0: masked entries add nothing
    p2 = _fexp(np.where(vis, y2, ninf), dtype)
    a1, a2 = _fexp(dtype(m1 - sh1), dtype)[()], _fexp(dtype(m2 - sh2), dtype)[()]
    moved = dtype(dtype(sh1 - _safe(m1)) - dtype(sh2 - _safe(m2)))
    acc = dtype(dtype(dtype(acc - dtype(l1 * moved)) * a1)
                + _seqsum((p1 * ratio).astype(dtype), dtype))
    l1 = dtype(dtype(a1 * l1) + _seqsum(p1, dtype))
    l2 = dtype(dtype(a2 * l2) + _seqsum(p2, dtype))
    return (m1n, l1, m2n, l2, acc)


def rr_merge_np(A, B, dtype=np.float32):
    """The kernels' split-K merge of two re-referenced states in ``dtype``."""
    m1, m2 = dtype(max(A[0], B[0])), dtype(max(A[2], B[2]))
    sh1, sh2 = _safe(m1), _safe(m2)
    out_l1, out_l2, out_acc = dtype(0), dtype(0), dtype(0)
    for m1x, l1x, m2x, l2x, accx in (A, B):
        a1, a2 = _fexp(dtype(m1x - sh1), dtype)[()], _fexp(dtype(m2x - sh2), dtype)[()]
        moved = dtype(dtype(sh1 - _safe(m1x)) - dtype(sh2 - _safe(m2x)))
        out_acc = dtype(out_acc + dtype(dtype(accx - dtype(l1x * moved)) * a1))
        out_l1 = dtype(out_l1 + dtype(a1 * l1x))
        out_l2 = dtype(out_l2 + dtype(a2 * l2x))
    return (m1, out_l1, m2, out_l2, out_acc)


def rr_finalize_np(state, dtype=np.float32):
    """``KL = fl(fl(acc*/l1) + fl(log fl(l2/l1)))`` (the kernels' ``_finalize``, base e)."""
    m1, l1, m2, l2, acc = state
    if l1 == 0:
        return dtype(0), dtype(-np.inf), dtype(-np.inf)
    kl = dtype(dtype(acc / l1) + _flog(dtype(l2 / l1), dtype))
    return kl, dtype(m1 + _flog(l1, dtype)), dtype(m2 + _flog(l2, dtype))


def rr_start_np(dtype=np.float32):
    return (dtype(-np.inf), dtype(0), dtype(-np.inf), dtype(0), dtype(0))


def online_rr_np(s1, s2, B, dtype=np.float32, *, trace=None):
    """The re-referenced recurrence in ``dtype`` over tiles of width ``B``: ``(KL, LSE1, LSE2)``."""
    s1, s2 = np.asarray(s1, dtype), np.asarray(s2, dtype)
    state = rr_start_np(dtype)
    for t0 in range(0, len(s1), B):
        state = rr_update_np(state, s1[t0:t0 + B], s2[t0:t0 + B], dtype)
        if trace is not None:
            trace.append(state)
    return rr_finalize_np(state, dtype)


# --------------------------------------------------------------------------------------------
# Statement 9: the indexer loss (head-averaged teacher target, student logits I)
#   A row: ``heads`` = H lists of teacher scores, ``logits`` = the student's I; a masked key is
#   -inf in every head and in I (one mask). p = (1/H) sum_h softmax(heads[h]).
#   State (m, l, mass, c, plogp): m, l of I as in statement 2; mass = sum p;
#   c = sum p (I - m) (re-referenced to the student's running max); plogp = sum p log p.
# --------------------------------------------------------------------------------------------
class IxState(NamedTuple):
    m: object
    l: object
    mass: object
    c: object
    plogp: object


def ix_identity() -> IxState:
    return IxState(NINF, mpf(0), mpf(0), mpf(0), mpf(0))


def _check_ix_mask(heads, logits):
    for h in heads:
        assert len(h) == len(logits)
        for a, b in zip(h, logits):
            assert _is_masked(mpf(a)) == _is_masked(mpf(b)), "one mask for teacher and student"


@hp
def teacher_lses(heads):
    """Every head's LSE (``-inf`` for an empty row), by its definition."""
    out = []
    for h in heads:
        vis = [mpf(x) for x in h if not _is_masked(mpf(x))]
        out.append(mpmath.log(mpmath.fsum(mpmath.exp(x) for x in vis)) if vis else NINF)
    return out


@hp
def mixture_target(heads, lses=None):
    """``p[s] = (1/H) sum_h exp(S_h[s] - LSE_h)`` (0 at masked keys), from the given LSEs or
    the exact ones."""
    lses = teacher_lses(heads) if lses is None else [mpf(x) for x in lses]
    H, n = len(heads), len(heads[0])
    return [mpf(0) if _is_masked(mpf(heads[0][s])) else
            mpmath.fsum(mpmath.exp(mpf(heads[h][s]) - lses[h]) for h in range(H)) / H
            for s in range(n)]


@hp
def indexer_row(heads, logits):
    """``(KL, LSE_I)`` by the definition ``KL(p || softmax I) = sum_{p>0} p (log p - log q)``;
    empty row ``(0, -inf)``."""
    _check_ix_mask(heads, logits)
    I = [mpf(x) for x in logits]
    vis = [s for s, x in enumerate(I) if not _is_masked(x)]
    if not vis:
        return mpf(0), NINF
    p = mixture_target(heads)
    lse_i = mpmath.log(mpmath.fsum(mpmath.exp(I[s]) for s in vis))
    kl = mpmath.fsum(p[s] * (mpmath.log(p[s]) - (I[s] - lse_i)) for s in vis if p[s] != 0)
    return kl, lse_i


@hp
def ix_update(state: IxState, p_tile, i_tile, *, variant: str | None = None) -> IxState:
    """One key tile of the student's recurrence, exact: ``p_tile`` the target's values (from the
    teacher LSEs), ``i_tile`` the logits (``-inf`` = masked).

    ``variant``: ``"no_move"`` (forget ``-mass * moved``), ``"rescale"`` (multiply ``c`` by the
    rescale factor, as statement 8's weights need but absolute weights ``p`` do not)."""
    I = [mpf(x) for x in i_tile]
    p = [mpf(x) for x in p_tile]
    vis = [j for j, x in enumerate(I) if not _is_masked(x)]
    if not vis:
        return state
    m_new = max([state.m] + [I[j] for j in vis])
    a = mpmath.exp(state.m - m_new)  # exp(-inf) = 0 for the first visible tile
    moved = m_new - _safe(state.m)
    c = state.c - (0 if variant == "no_move" else state.mass * moved)
    if variant == "rescale":
        c = c * a
    return IxState(
        m_new,
        a * state.l + mpmath.fsum(mpmath.exp(I[j] - m_new) for j in vis),
        state.mass + mpmath.fsum(p[j] for j in vis),
        c + mpmath.fsum(p[j] * (I[j] - m_new) for j in vis),
        state.plogp + mpmath.fsum(p[j] * mpmath.log(p[j]) for j in vis if p[j] != 0),
    )


@hp
def ix_merge(A: IxState, B: IxState) -> IxState:
    """Two states over disjoint key sets: ``l`` as in statement 3; each ``c`` re-referenced to
    the merged max (``c_X - mass_X * (m - m_X)``); ``mass``, ``plogp`` add (no factors)."""
    m = max(A.m, B.m)
    ref = _safe(m)
    c = mpf(0)
    for X in (A, B):
        c += X.c - X.mass * (ref - _safe(X.m))
    return IxState(m, mpmath.exp(A.m - ref) * A.l + mpmath.exp(B.m - ref) * B.l,
                   A.mass + B.mass, c, A.plogp + B.plogp)


@hp
def ix_finalize(state: IxState, *, use_mass: bool = False):
    """``(KL, LSE_I)``: ``KL = plogp - c + log l`` (uses sum p = 1); ``use_mass`` keeps the exact
    ``+ (1 - mass) m`` term (for a target that does not sum to 1). Empty: ``(0, -inf)``."""
    if state.m == NINF:
        return mpf(0), NINF
    kl = state.plogp - state.c + mpmath.log(state.l)
    if use_mass:
        kl += (1 - state.mass) * state.m
    return kl, state.m + mpmath.log(state.l)


def ix_row_np(heads, logits, B, dtype=np.float64, *, lses=None, plain=False, p=None):
    """The kernel's row in ``dtype``, no branches on empty states (``_safe`` shifts, exp(-inf) = 0),
    masked entries selected away before any arithmetic: pass 1 (teacher LSEs by statement 2's
    guarded recurrence, unless ``lses`` or ``p`` is given), pass 2 (``p`` per entry, the
    student's state), ``(KL, LSE_I)``. ``plain``: ``c = sum p I`` and
    ``KL = plogp - c + (m + log l)`` (no re-reference)."""
    I = np.asarray(logits, dtype)
    n = len(I)
    ninf, zero = dtype(-np.inf), dtype(0)
    vis_all = I > ninf
    if p is None:
        S = np.asarray(heads, dtype)
        if lses is None:
            lses = [online_np(h, h, B, dtype)[1] for h in S]
        safe_lse = np.array([zero if x == ninf else x for x in lses], dtype)[:, None]
        e = _fexp(np.where(vis_all[None], S, safe_lse) - safe_lse, dtype)  # exp(0) at masked
        p = np.where(vis_all, (e.sum(axis=0) / dtype(len(S))).astype(dtype), zero)
    p = np.asarray(p, dtype)
    m, l, mass, c, plogp = ninf, zero, zero, zero, zero
    for t0 in range(0, n, B):
        x, q, vis = I[t0:t0 + B], p[t0:t0 + B], vis_all[t0:t0 + B]
        m_new = dtype(max(m, np.where(vis, x, ninf).max(initial=ninf)))
        ref = _safe(m_new)
        a = _fexp(dtype(m - ref), dtype)[()]
        y = (np.where(vis, x, ref) - ref).astype(dtype)  # I - m', 0 where masked
        l = dtype(dtype(a * l) + _seqsum(np.where(vis, _fexp(y, dtype), zero), dtype))
        logq = _flog(np.where(vis & (q > 0), q, dtype(1)), dtype)
        plogp = dtype(plogp + _seqsum(np.where(vis, q * logq, zero).astype(dtype), dtype))
        if plain:
            c = dtype(c + _seqsum(np.where(vis, q * np.where(vis, x, zero), zero).astype(dtype), dtype))
        else:
            moved = dtype(ref - _safe(m))
            c = dtype(dtype(c - dtype(mass * moved)) + _seqsum(np.where(vis, q * y, zero).astype(dtype), dtype))
        mass = dtype(mass + _seqsum(np.where(vis, q, zero), dtype))
        m = m_new
    if m == ninf:
        return zero, ninf
    log_l = _flog(l, dtype)[()]
    if plain:
        return dtype(dtype(plogp - c) + dtype(m + log_l)), dtype(m + log_l)
    return dtype(dtype(plogp - c) + log_l), dtype(m + log_l)


@hp
def indexer_student_logits(Qi, Ki, W, relu=True):
    """``I[t][s] = sum_j W[j][t] * phi(<Qi[j][t], Ki[j // (H_I/H_KI)][s]>)``, ``phi`` = relu or id;
    also ``a[j][t][s]``."""
    HI, g = len(Qi), len(Qi) // len(Ki)
    a = [[[mpmath.fsum(mpf(u) * mpf(v) for u, v in zip(q, k)) for k in Ki[j // g]] for q in Qi[j]]
         for j in range(HI)]
    NQ, NK = len(Qi[0]), len(Ki[0])
    I = [[mpmath.fsum(mpf(W[j][t]) * (max(a[j][t][s], mpf(0)) if relu else a[j][t][s]) for j in range(HI))
          for s in range(NK)] for t in range(NQ)]
    return I, a


def _masked(rows_, mask):
    if mask is None:
        return rows_
    return [[x if mask[t][s] else NINF for s, x in enumerate(r)] for t, r in enumerate(rows_)]


@hp
def indexer_loss(S, Qi, Ki, W, G, mask=None, relu=True):
    """``L = sum_t G[t] * KL_t`` for teacher scores ``S[h][t][s]`` (a constant) and the student."""
    I, _ = indexer_student_logits(Qi, Ki, W, relu)
    I = _masked(I, mask)
    heads = [_masked(S[h], mask) for h in range(len(S))]
    return mpmath.fsum(mpf(G[t]) * indexer_row([h[t] for h in heads], I[t])[0] for t in range(len(I)))


@hp
def indexer_grads(S, Qi, Ki, W, G, mask=None, relu=True, *, variant=None):
    """The claimed ``dQi, dKi, dW`` of ``indexer_loss``: ``Gs = G (softmax(I) - p)`` per entry,
    ``dW = sum_s Gs phi(a)``, ``A = Gs W phi'(a)``, ``dQi = sum_s A Ki``, ``dKi = sum_{j, t} A Qi``.
    ``variant``: ``"no_indicator"`` (phi' = 1 even with relu), ``"no_gqa_sum"`` (dKi from the
    first query head of each group only), ``"flipped"`` (``p - softmax(I)``)."""
    I, a = indexer_student_logits(Qi, Ki, W, relu)
    I = _masked(I, mask)
    heads = [_masked(S[h], mask) for h in range(len(S))]
    HI, g = len(Qi), len(Qi) // len(Ki)
    NQ, NK, DI = len(Qi[0]), len(Ki[0]), len(Qi[0][0])
    dQ = [[[mpf(0)] * DI for _ in range(NQ)] for _ in range(HI)]
    dK = [[[mpf(0)] * DI for _ in range(NK)] for _ in Ki]
    dW = [[mpf(0)] * NQ for _ in range(HI)]
    for t in range(NQ):
        vis = [s for s in range(NK) if not _is_masked(I[t][s])]
        if not vis:
            continue
        p = mixture_target([h[t] for h in heads])
        lse_i = mpmath.log(mpmath.fsum(mpmath.exp(I[t][s]) for s in vis))
        for s in vis:
            Gs = mpf(G[t]) * (mpmath.exp(I[t][s] - lse_i) - p[s])
            if variant == "flipped":
                Gs = -Gs
            for j in range(HI):
                x = a[j][t][s]
                dW[j][t] += Gs * (max(x, mpf(0)) if relu else x)
                slope = 1 if (not relu or variant == "no_indicator" or x > 0) else 0
                A = Gs * mpf(W[j][t]) * slope
                for d in range(DI):
                    dQ[j][t][d] += A * mpf(Ki[j // g][s][d])
                    if variant != "no_gqa_sum" or j % g == 0:
                        dK[j // g][s][d] += A * mpf(Qi[j][t][d])
    return dQ, dK, dW
