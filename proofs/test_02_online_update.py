"""Checks for statement 2 (02_online_update.md): rescaling by the new running max keeps the
state exact, i.e. the invariant survives every update."""
import math

import mpmath
import sympy as sp
from hypothesis import example, given
from hypothesis import strategies as st

from proofs._mpkit import (
    close, cuts_for, dense_row, hp, identity, online_row, rows, sym_nonzero_at, sym_zero,
    tiles_from_cuts, update,
)

# Seen keys J = {0, 1}, new tile T = {2, 3}; old maxima m, mu; new maxima m', mu' are arbitrary
# symbols: the invariant survives for ANY new shift (the max is chosen for statement 7).
x = sp.symbols("s1_0:4", real=True)
y = sp.symbols("s2_0:4", real=True)
m, mn, mu, mun = sp.symbols("m1 m1new m2 m2new", real=True)
J, T = (0, 1), (2, 3)


def invariant(keys, shift1, shift2):
    l1 = sum(sp.exp(x[j] - shift1) for j in keys)
    l2 = sum(sp.exp(y[j] - shift2) for j in keys)
    acc = sum(sp.exp(x[j] - shift1) * (x[j] - y[j]) for j in keys)
    return l1, l2, acc


def updated(a1, a2):
    l1, l2, acc = invariant(J, m, mu)
    p1 = {j: sp.exp(x[j] - mn) for j in T}
    p2 = {j: sp.exp(y[j] - mun) for j in T}
    return (
        a1 * l1 + sum(p1.values()),
        a2 * l2 + sum(p2.values()),
        a1 * acc + sum(p1[j] * (x[j] - y[j]) for j in T),
    )


def test_statement_2_update_preserves_the_invariant_symbolically():
    new = updated(sp.exp(m - mn), sp.exp(mu - mun))
    want = invariant(J + T, mn, mun)
    for got, exp_ in zip(new, want):
        assert sym_zero(got - exp_)


def test_statement_2_check_rejects_a_forgotten_rescale_symbolically():
    new = updated(1, 1)  # deliberate mistake: a = 1
    want = invariant(J + T, mn, mun)
    point = {**dict(zip(x, [0.1, 0.5, 1.7, -0.2])), **dict(zip(y, [0.3, -0.4, 0.9, 0.0])),
             m: 0.5, mn: 1.7, mu: 0.3, mun: 0.9}
    for got, exp_ in zip(new, want):
        assert sym_nonzero_at(got - exp_, point)
        assert not sym_zero(got - exp_)


@hp
def _check_invariant(state, seen1, seen2):
    vis = [j for j, v in enumerate(seen1) if v != -math.inf]
    if not vis:
        assert state == identity()
        return
    s1 = [mpmath.mpf(seen1[j]) for j in vis]
    s2 = [mpmath.mpf(seen2[j]) for j in vis]
    assert state.m1 == max(s1) and state.m2 == max(s2)
    assert close(state.l1, mpmath.fsum(mpmath.exp(v - state.m1) for v in s1))
    assert close(state.l2, mpmath.fsum(mpmath.exp(v - state.m2) for v in s2))
    assert close(state.acc, mpmath.fsum(mpmath.exp(a - state.m1) * (a - b) for a, b in zip(s1, s2)))
    assert state.l1 >= 1 and state.l2 >= 1  # the max key contributes exp(0) = 1


@given(rows(max_n=10, masked=True), st.data())
@example(([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]), None)  # the max rises in every tile
@example(([-math.inf, -math.inf, 5.0], [-math.inf, -math.inf, -5.0]), None)  # masked first tiles
def test_statement_2_invariant_holds_after_every_tile(pair, data):
    s1, s2 = pair
    n = len(s1)
    cuts = data.draw(cuts_for(n)) if data is not None else list(range(1, n))
    state = identity()
    for a, b in tiles_from_cuts(n, cuts):
        state = update(state, s1[a:b], s2[a:b])
        _check_invariant(state, s1[:b], s2[:b])


@given(rows(max_n=10, masked=True), st.data())
def test_statement_2_online_result_equals_the_definition(pair, data):
    s1, s2 = pair
    cuts = data.draw(cuts_for(len(s1)))
    for got, want in zip(online_row(s1, s2, cuts), dense_row(s1, s2)):
        assert close(got, want)


def test_statement_2_numeric_check_rejects_a_forgotten_rescale():
    s1, s2 = [1.0, 2.0, 3.0], [0.5, 0.0, 2.0]
    cuts = [1, 2]  # one key per tile: the running max rises at every step
    exact = dense_row(s1, s2)
    assert all(close(g, w) for g, w in zip(online_row(s1, s2, cuts), exact))
    wrong = online_row(s1, s2, cuts, rescale=False)
    assert not close(wrong[0], exact[0])
    assert not close(wrong[1], exact[1])
