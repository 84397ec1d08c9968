"""Checks for statement 8 (08_rereferenced_accumulator.md): the kernels' re-referenced accumulator
acc* = acc - l1 (m1 - m2) is updated, merged and finalised correctly; empty states stay NaN-free;
and in float32 at large logits its KL is far more accurate than the plain form's."""
import math

import numpy as np
import pytest
import sympy as sp
from hypothesis import example, given
from hypothesis import strategies as st

from proofs._mpkit import (
    U32, close, cuts_for, dense_np, dense_row, finite, from_rr, identity, online_np, online_rr_np,
    rows, rr_finalize, rr_finalize_np, sharded, rr_merge, rr_merge_np, rr_start_np, rr_update,
    rr_update_np, sym_nonzero_at, sym_zero, tiles_from_cuts, to_rr, update,
)

TRAP = dict(invalid="raise", divide="raise", over="raise")  # as in test_06
C_FLOOR = 4.0  # statement 7c's floor: C_FLOOR * u * (1 + |LSE1| + |LSE2|)
C_SPREAD = 2.0  # the scale-free figure of section "Why": C_SPREAD * u * (1 + ln n + |KL| + W)

# ---- symbolic --------------------------------------------------------------------------------
# A 3-key tile; the old state is FREE symbols (any state, not only one that represents keys);
# old and new shifts are arbitrary symbols: nothing below uses that they are maxima.
x = sp.symbols("s1_0:5", real=True)
y = sp.symbols("s2_0:5", real=True)
m1, m2, n1, n2 = sp.symbols("m1 m2 m1new m2new", real=True)
l1, l2, acc = sp.symbols("l1 l2 acc", real=True)
TILE = (0, 1, 2)


def psi(acc_, l1_, m1_, m2_):
    """The bijection: statement 2's acc -> acc* = acc - l1 (m1 - m2)."""
    return acc_ - l1_ * (m1_ - m2_)


def moved_of(d1, d2, variant=None):
    return {None: d1 - d2, "no_move": 0, "plus": d1 + d2}[variant]


def plain_update():
    """Statement 2's update of (l1, acc) with the tile (any new shift n1)."""
    a1 = sp.exp(m1 - n1)
    p = [sp.exp(x[j] - n1) for j in TILE]
    return a1 * l1 + sum(p), a1 * acc + sum(pj * (x[j] - y[j]) for pj, j in zip(p, TILE))


def rr_update_sym(acc_star, variant=None):
    """The kernels' update of acc* with the same tile."""
    a1 = sp.exp(m1 - n1)
    moved = moved_of(n1 - m1, n2 - m2, variant)
    return (acc_star - l1 * moved) * a1 + sum(
        sp.exp(x[j] - n1) * ((x[j] - n1) - (y[j] - n2)) for j in TILE)


def test_statement_8_update_commutes_with_the_bijection_symbolically():
    l1_new, acc_new = plain_update()
    got = rr_update_sym(psi(acc, l1, m1, m2))
    assert sym_zero(got - psi(acc_new, l1_new, n1, n2))  # acc*' == acc' - l1' (m1' - m2')


def test_statement_8_update_preserves_the_rereferenced_invariant_symbolically():
    # J = {3, 4} seen with shifts (m1, m2), the tile {0, 1, 2} added with shifts (n1, n2).
    def inv(keys, s1, s2):
        w = [sp.exp(x[j] - s1) for j in keys]
        return sum(w), sum(wj * ((x[j] - s1) - (y[j] - s2)) for wj, j in zip(w, keys))

    l1_J, accs_J = inv((3, 4), m1, m2)
    moved = (n1 - m1) - (n2 - m2)
    got = (accs_J - l1_J * moved) * sp.exp(m1 - n1) + inv(TILE, n1, n2)[1]
    assert sym_zero(got - inv((0, 1, 2, 3, 4), n1, n2)[1])


# merge: free states A, B and ANY common shifts (M1, M2) (in the kernel, the larger maxima)
mA1, mA2, mB1, mB2, M1, M2 = sp.symbols("mA1 mA2 mB1 mB2 M1 M2", real=True)
lA, lB, cA, cB = sp.symbols("l1A l1B accA accB", real=True)


def rr_merge_sym(variant=None):
    a, b = sp.exp(mA1 - M1), sp.exp(mB1 - M1)
    movA = moved_of(M1 - mA1, M2 - mA2, variant)
    movB = moved_of(M1 - mB1, M2 - mB2, variant)
    return (psi(cA, lA, mA1, mA2) - lA * movA) * a + (psi(cB, lB, mB1, mB2) - lB * movB) * b


def test_statement_8_merge_commutes_with_the_bijection_symbolically():
    a, b = sp.exp(mA1 - M1), sp.exp(mB1 - M1)
    l1_m, acc_m = a * lA + b * lB, a * cA + b * cB  # statement 3's merge
    assert sym_zero(rr_merge_sym() - psi(acc_m, l1_m, M1, M2))


def kl_definition():
    N = 3
    Z1, Z2 = sum(sp.exp(x[j]) for j in range(N)), sum(sp.exp(y[j]) for j in range(N))
    return sum(sp.exp(x[j]) / Z1 * (sp.log(sp.exp(x[j]) / Z1) - sp.log(sp.exp(y[j]) / Z2))
               for j in range(N))


def test_statement_8_finalization_equals_kl_symbolically():
    # free state: acc*/l1 + log(l2/l1) == acc/l1 + LSE2 - LSE1 with acc = acc* + l1 (m1 - m2)
    accs = sp.Symbol("accstar", real=True)
    plain = (accs + l1 * (m1 - m2)) / l1 + (m2 + sp.log(l2)) - (m1 + sp.log(l1))
    assert sym_zero(accs / l1 + sp.log(l2 / l1) - plain)
    # the invariant sums over 3 keys with ANY shifts give the definition of KL
    w1 = [sp.exp(x[j] - m1) for j in range(3)]
    L1, L2 = sum(w1), sum(sp.exp(y[j] - m2) for j in range(3))
    A = sum(w1[j] * ((x[j] - m1) - (y[j] - m2)) for j in range(3))
    assert sym_zero(A / L1 + sp.log(L2 / L1) - kl_definition())
    # base 2 (statement 4): scores / ln 2, any shifts in bits, 2^x and log2; times ln 2
    LN2 = sp.log(2)
    a2, b2 = [x[j] / LN2 for j in range(3)], [y[j] / LN2 for j in range(3)]
    w = [2 ** (a2[j] - m1) for j in range(3)]
    L1b, L2b = sum(w), sum(2 ** (b2[j] - m2) for j in range(3))
    Ab = sum(w[j] * ((a2[j] - m1) - (b2[j] - m2)) for j in range(3))
    kl_bits = Ab / L1b + sp.log(L2b / L1b, 2)
    assert sym_zero((LN2 * kl_bits - kl_definition()).rewrite(sp.exp))


def test_statement_8_symbolic_check_rejects_a_forgotten_move_and_a_wrong_sign():
    point = {**dict(zip(x, [0.1, 0.5, 1.7, -0.2, 0.3])), **dict(zip(y, [0.3, -0.4, 0.9, 0.0, 1.0])),
             m1: 0.5, n1: 1.7, m2: 0.3, n2: 1.2, l1: 2.0, acc: 0.7,
             mA1: 0.2, mA2: -1.0, mB1: 1.5, mB2: 0.4, M1: 1.5, M2: 0.4,
             lA: 1.3, lB: 2.1, cA: 0.3, cB: -0.6}
    l1_new, acc_new = plain_update()
    a, b = sp.exp(mA1 - M1), sp.exp(mB1 - M1)
    for variant in ("no_move", "plus"):
        bad = rr_update_sym(psi(acc, l1, m1, m2), variant) - psi(acc_new, l1_new, n1, n2)
        assert sym_nonzero_at(bad, point) and not sym_zero(bad)
        bad = rr_merge_sym(variant) - psi(a * cA + b * cB, a * lA + b * lB, M1, M2)
        assert sym_nonzero_at(bad, point) and not sym_zero(bad)


# ---- mpmath, 60 digits -----------------------------------------------------------------------
def _same_state(A, B):
    return (A.m1 == B.m1 and A.m2 == B.m2
            and all(close(u, v) for u, v in zip((A.l1, A.l2, A.acc), (B.l1, B.l2, B.acc))))


@given(rows(max_n=10, masked=True), st.data())
@example(([1.0, 2.0, 3.0], [0.0, 5.0, -1.0]), None)  # both maxima move, in opposite tiles
@example(([-math.inf, -math.inf, 5.0], [-math.inf, -math.inf, -5.0]), None)  # masked first tiles
def test_statement_8_rereferenced_state_is_the_image_of_statement_2s_after_every_tile(pair, data):
    s1, s2 = pair
    n = len(s1)
    cuts = data.draw(cuts_for(n)) if data is not None else list(range(1, n))
    plain, star = identity(), identity()
    for a, b in tiles_from_cuts(n, cuts):
        plain = update(plain, s1[a:b], s2[a:b])
        star = rr_update(star, s1[a:b], s2[a:b])
        assert _same_state(star, to_rr(plain))  # acc* = acc - l1 (m1 - m2), every tile
        assert _same_state(from_rr(star), plain)
    for got, want in zip(rr_finalize(star), dense_row(s1, s2)):
        assert close(got, want)




def _shard_states(s1, s2, shards, tilings, step, start):
    out = []
    for keys, cuts in zip(shards, tilings):
        a1, a2 = [s1[j] for j in keys], [s2[j] for j in keys]
        state = start
        for a, b in tiles_from_cuts(len(keys), cuts):
            state = step(state, a1[a:b], a2[a:b])
        out.append(state)
    return out


def _merge_all(states, picks, merge):
    states = list(states)
    it = iter(picks)
    while len(states) > 1:  # a random merge tree, random argument order
        A = states.pop(next(it) % len(states))
        B = states.pop(next(it) % len(states))
        states.append(merge(A, B))
    return states[0]


@given(sharded())
@example(([1.0, -math.inf, 3.0, 0.0], [2.0, -math.inf, -1.0, 0.5], [[0], [1], [2, 3]],
          [[], [], [1]], [0, 1, 0, 0, 1, 0]))  # a shard that sees only masked keys
def test_statement_8_every_sharding_tiling_and_merge_order_agrees(case):
    s1, s2, shards, tilings, picks = case
    states = _shard_states(s1, s2, shards, tilings, rr_update, identity())
    got = rr_finalize(_merge_all(states, picks, rr_merge))
    for g, w in zip(got, dense_row(s1, s2)):
        assert close(g, w)


def test_statement_8_numeric_check_rejects_a_forgotten_move_and_a_wrong_sign():
    s1, s2 = [1.0, 2.0, 3.0], [0.5, 4.0, 2.0]  # both maxima move, by different amounts
    exact = dense_row(s1, s2)[0]

    def run(variant):
        state = identity()
        for j in range(3):  # one key per tile
            state = rr_update(state, s1[j:j + 1], s2[j:j + 1], variant=variant)
        A, B = rr_update(identity(), s1[:1], s2[:1]), rr_update(identity(), s1[1:], s2[1:])
        return rr_finalize(state)[0], rr_finalize(rr_merge(A, B, variant=variant))[0]

    assert all(close(v, exact) for v in run(None))
    for variant in ("no_move", "plus"):
        online, merged = run(variant)
        assert not close(online, exact) and not close(merged, exact)


# ---- the empty-state convention, in float64 with every invalid operation trapped ---------------
@given(sharded())
@example(([-math.inf] * 3, [-math.inf] * 3, [[0, 1, 2]], [[1]], [0, 0]))  # an empty row
@example(([-math.inf, 2.0, -math.inf], [-math.inf, -1.0, -math.inf], [[0], [1], [2]],
          [[], [], []], [2, 0, 1, 0, 0, 0]))  # empty shards merged first and last
def test_statement_8_empty_states_contribute_nothing_and_never_form_nan(case):
    s1, s2, shards, tilings, picks = case
    f64 = np.float64
    with np.errstate(**TRAP):  # any -inf - (-inf), 0 * inf, 0/0 or log 0 would raise
        states = _shard_states(s1, s2, shards, tilings,
                               lambda s, a, b: rr_update_np(s, a, b, f64), rr_start_np(f64))
        for state, keys in zip(states, shards):
            if all(s1[j] == -math.inf for j in keys):  # an empty shard stays the start state
                assert state == rr_start_np(f64)
        merged = _merge_all(states, picks, lambda A, B: rr_merge_np(A, B, f64))
        kl, lse1, lse2 = rr_finalize_np(merged, f64)
    if all(v == -math.inf for v in s1):
        assert (kl, lse1, lse2) == (0, -np.inf, -np.inf)
        return
    for got, want in zip((kl, lse1, lse2), dense_row(s1, s2)):
        assert close(float(got), want, rel=1e-12)


# ---- float32 at large logits ------------------------------------------------------------------
def _exact(s1, s2):
    return tuple(float(v) for v in dense_row([float(a) for a in s1], [float(b) for b in s2]))


def _offset_case(seed, n, spread, offset1, offset2, noise, B):
    """Scores ~ offset1 + spread * U(-1, 1); side 2 = side 1 + N(0, noise) shifted to offset2."""
    rng = np.random.default_rng(seed)
    s1 = (rng.uniform(-1, 1, n) * spread + offset1).astype(np.float32)
    s2 = (s1.astype(np.float64) + rng.normal(0, noise, n) + (offset2 - offset1)).astype(np.float32)
    return s1, s2, B


PINNED = [
    _offset_case(3, 32, 8.0, 3000.0, 2000.0, 0.05, 8),  # statement 7c's example: KL ~ 7e-4
    _offset_case(1, 64, 20.0, 1e4, 1.3e4, 0.5, 4),  # scores ~ 1e4, KL ~ 2e-2
    _offset_case(5, 48, 2.0, -7000.0, -7000.0, 0.1, 1),  # one key per tile, equal offsets
]


@pytest.mark.parametrize("case", PINNED)
def test_statement_8_float32_kl_error_at_large_logits_is_far_below_the_plain_forms(case):
    s1, s2, B = case
    exact = _exact(s1, s2)
    plain = abs(float(online_np(s1, s2, B)[0]) - exact[0])
    star = abs(float(online_rr_np(s1, s2, B)[0]) - exact[0])
    assert plain >= 10 * star  # a real gap: measured 100x to 6000x on these rows
    assert plain >= 100 * U32 * (1 + abs(exact[0]))  # and the plain error is not a fluke of 0


@st.composite
def large_rows(draw, max_n=48):
    n = draw(st.integers(1, max_n))
    B = draw(st.integers(1, 16))
    spread = draw(st.sampled_from([1.0, 8.0, 64.0, 1024.0]))
    o1 = draw(st.sampled_from([0.0, 1e3, -3e3, 1e4])) + draw(finite(-1e3, 1e3))
    o2 = o1 + draw(finite(-1e3, 1e3))
    u1 = np.array(draw(st.lists(finite(-1, 1), min_size=n, max_size=n)))
    u2 = np.array(draw(st.lists(finite(-1, 1), min_size=n, max_size=n)))
    kind = draw(st.sampled_from(["close+offset", "independent", "scaled"]))
    s1 = o1 + spread * u1
    if kind == "close+offset":  # small KL, large |LSE|: the cancellation case
        s2 = s1 + 1e-3 * spread * u2 + (o2 - o1)
    elif kind == "independent":
        s2 = o2 + spread * u2
    else:
        s2 = s1 * draw(finite(0.5, 1.5)) + u2
    return s1.astype(np.float32), s2.astype(np.float32), B


@given(large_rows())
@example(PINNED[0])
@example((np.array([0.0, 1e4], np.float32), np.array([1e4, 0.0], np.float32), 1))  # W ~ M
def test_statement_8_float32_error_is_never_worse_than_the_plain_form_beyond_rounding(case):
    s1, s2, B = case
    exact = _exact(s1, s2)
    kl, lse1, lse2 = exact
    star_out = online_rr_np(s1, s2, B)
    star = abs(float(star_out[0]) - kl)
    plain = abs(float(online_np(s1, s2, B)[0]) - kl)
    floor = C_FLOOR * U32 * (1 + abs(lse1) + abs(lse2))
    assert star <= plain + floor  # never worse than the plain form beyond 7c's floor
    assert star <= 2 * abs(float(dense_np(s1, s2)[0]) - kl) + floor  # 7c's model accepts it
    # the error scales with the spread W of the scores, not their magnitude (argued, observed)
    W = float(s1.max() - s1.min()) + float(s2.max() - s2.min())
    assert star <= C_SPREAD * U32 * (1 + math.log(len(s1)) + abs(kl) + W)
    # the LSEs are the plain ones (m + log l): same values, same rounding
    assert abs(float(star_out[1]) - lse1) <= floor and abs(float(star_out[2]) - lse2) <= floor


@st.composite
def grid_rows_and_offsets(draw, max_n=32):
    """Scores on the grid 2^-10 with |s| < 8, offsets integers with |c| <= 16000: every s + c is
    a float32 exactly (|s + c| < 2^14 on the grid 2^-10 needs 24 significant bits)."""
    n = draw(st.integers(1, max_n))
    B = draw(st.integers(1, 16))
    k = st.lists(st.integers(-8 * 1024 + 1, 8 * 1024 - 1), min_size=n, max_size=n)
    s1 = np.array(draw(k), np.float32) / np.float32(1024)
    s2 = np.array(draw(k), np.float32) / np.float32(1024)
    c1, c2 = draw(st.integers(-16000, 16000)), draw(st.integers(-16000, 16000))
    cut = draw(st.integers(0, n))
    return s1, s2, B, np.float32(c1), np.float32(c2), cut


def _rr_split(s1, s2, B, cut):
    """Two split-K parts (keys [0, cut) and [cut, n)), each tiled by B, merged: (KL, LSE1, LSE2)."""
    parts = []
    for a, b in ((0, cut), (cut, len(s1))):
        state = rr_start_np()
        for t0 in range(a, b, B):
            state = rr_update_np(state, s1[t0:min(t0 + B, b)], s2[t0:min(t0 + B, b)])
        parts.append(state)
    return rr_finalize_np(rr_merge_np(*parts))


@given(grid_rows_and_offsets())
@example((np.array([0.5, -3.25, 7.0], np.float32), np.array([1.0, 0.0, -2.5], np.float32), 1,
          np.float32(3000), np.float32(2000), 1))
def test_statement_8_float32_kl_is_bitwise_invariant_under_exact_offsets(case):
    s1, s2, B, c1, c2, cut = case
    o1, o2 = s1 + c1, s2 + c2
    assert (o1.astype(np.float64) == s1.astype(np.float64) + float(c1)).all()  # exact offsets
    assert (o2.astype(np.float64) == s2.astype(np.float64) + float(c2)).all()
    assert online_rr_np(o1, o2, B)[0] == online_rr_np(s1, s2, B)[0]
    assert _rr_split(o1, o2, B, cut)[0] == _rr_split(s1, s2, B, cut)[0]


def test_statement_8_offset_check_rejects_the_plain_form():
    s1 = np.array([0.5, -3.25, 7.0, 1.125], np.float32)
    s2 = np.array([1.0, 0.0, -2.5, 6.75], np.float32)
    base = online_np(s1, s2, 1)[0]
    o1, o2 = s1 + np.float32(3000), s2 + np.float32(2000)
    assert online_rr_np(o1, o2, 1)[0] == online_rr_np(s1, s2, 1)[0]
    assert online_np(o1, o2, 1)[0] != base  # the plain form rounds LSE_t at the offset's size
