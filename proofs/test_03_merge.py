"""Checks for statement 3 (03_merge.md): the merge of partial states is exact, associative and
commutative with the start state as identity; so every tiling, split and sharding agrees."""
import itertools
import math

import sympy as sp
from hypothesis import example, given
from hypothesis import strategies as st

from proofs._mpkit import (
    close, dense_row, finalize, identity, merge, rows, sharded, sym_nonzero_at, sym_zero, tile_state,
    tiles_from_cuts, update,
)

# ---- symbolic: one side's (m, l, acc); side 2's (m2, l2) is the same formula without acc ----
t = sp.Symbol("t", real=True)
p, q = sp.symbols("p q", nonnegative=True)  # nonnegative gaps: ties are included


def smerge(A, B, variant=None):
    (mA, lA, cA), (mB, lB, cB) = A, B
    m = sp.Max(mA, mB)
    aA, aB = sp.exp(mA - m), sp.exp(mB - m)
    if variant == "rescale_only_b":
        aA = 1
    return (m, aA * lA + aB * lB, aA * cA + aB * cB)


def sym_state(name, m):
    l, c = sp.symbols(f"l_{name} acc_{name}", real=True)
    return (m, l, c)


def same(X, Y):
    return X[0] == Y[0] and all(sym_zero(u - v) for u, v in zip(X[1:], Y[1:]))


def test_statement_3_merge_is_exact_for_any_shift_symbolically():
    # A over keys {0,1}, B over {2}: merging with ANY common shift m gives the union's sums.
    s1 = sp.symbols("s1_0:3", real=True)
    s2 = sp.symbols("s2_0:3", real=True)
    mA, mB, m = sp.symbols("mA mB m", real=True)

    def sums(keys, shift):
        l = sum(sp.exp(s1[j] - shift) for j in keys)
        acc = sum(sp.exp(s1[j] - shift) * (s1[j] - s2[j]) for j in keys)
        return l, acc

    (lA, cA), (lB, cB), (l, c) = sums((0, 1), mA), sums((2,), mB), sums((0, 1, 2), m)
    aA, aB = sp.exp(mA - m), sp.exp(mB - m)
    assert sym_zero(aA * lA + aB * lB - l)
    assert sym_zero(aA * cA + aB * cB - c)


def test_statement_3_merge_is_associative():
    # Every order of the three maxima (ties included): sympy resolves Max in each case.
    for ms in set(itertools.permutations((t, t + p, t + p + q))):
        A, B, C = (sym_state(n, mm) for n, mm in zip("ABC", ms))
        assert same(smerge(smerge(A, B), C), smerge(A, smerge(B, C)))


def test_statement_3_merge_is_commutative():
    for ms in ((t, t + p), (t + p, t)):
        A, B = (sym_state(n, mm) for n, mm in zip("AB", ms))
        assert same(smerge(A, B), smerge(B, A))


def test_statement_3_start_state_is_the_identity():
    E = (-sp.oo, 0, 0)
    A = sym_state("A", t)
    assert same(smerge(A, E), A) and same(smerge(E, A), A)


def test_statement_3_symbolic_check_rejects_a_half_rescaled_merge():
    A, B = sym_state("A", t), sym_state("B", t + p)
    bad1, bad2 = smerge(A, B, "rescale_only_b"), smerge(B, A, "rescale_only_b")
    point = {t: 0.0, p: 1.0, sp.Symbol("l_A", real=True): 1.0, sp.Symbol("l_B", real=True): 2.0}
    assert sym_nonzero_at(bad1[1] - bad2[1], point)
    assert not same(bad1, bad2)


# ---- numeric: random shardings, tilings, merge trees and orders at 60 digits ----


def _shard_state(s1, s2, keys, cuts):
    a1, a2 = [s1[j] for j in keys], [s2[j] for j in keys]
    state = identity()
    for a, b in tiles_from_cuts(len(keys), cuts):
        state = update(state, a1[a:b], a2[a:b])
    return state


def _merge_all(states, picks, variant=None):
    states = list(states)
    it = iter(picks)
    while len(states) > 1:  # a random merge tree, random argument order
        i = next(it) % len(states)
        A = states.pop(i)
        j = next(it) % len(states)
        B = states.pop(j)
        states.append(merge(A, B, variant=variant))
    return states[0]


@given(sharded())
# a shard that sees only masked keys
@example(([1.0, -math.inf, 3.0, 0.0], [2.0, -math.inf, -1.0, 0.5], [[0], [1], [2, 3]],
          [[], [], [1]], [0, 1, 0, 0, 1, 0]))
def test_statement_3_every_sharding_tiling_and_merge_order_agrees(case):
    s1, s2, shards, tilings, picks = case
    states = [_shard_state(s1, s2, keys, cuts) for keys, cuts in zip(shards, tilings)]
    got = finalize(_merge_all(states, picks))
    for g, w in zip(got, dense_row(s1, s2)):
        assert close(g, w)


@given(rows(max_n=8, masked=True), st.data())
def test_statement_3_online_update_is_a_merge_with_the_tile_state(pair, data):
    s1, s2 = pair
    cut = data.draw(st.integers(0, len(s1)))
    state = update(identity(), s1[:cut], s2[:cut])
    A = update(state, s1[cut:], s2[cut:])
    B = merge(state, tile_state(s1[cut:], s2[cut:]))
    assert A.m1 == B.m1 and A.m2 == B.m2
    assert all(close(u, v) for u, v in zip(A[1::2] + (A.acc,), B[1::2] + (B.acc,)))


def test_statement_3_numeric_check_rejects_a_merge_without_rescaling():
    s1, s2 = [0.0, 4.0], [1.0, -2.0]
    A, B = tile_state(s1[:1], s2[:1]), tile_state(s1[1:], s2[1:])
    exact = dense_row(s1, s2)
    assert close(finalize(merge(A, B))[0], exact[0])
    assert not close(finalize(merge(A, B, variant="no_rescale"))[0], exact[0])
    assert not close(finalize(merge(A, B, variant="rescale_only_b"))[0], exact[0])
