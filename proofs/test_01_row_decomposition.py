"""Checks for statement 1 (01_row_decomposition.md): KL = acc/l1 + LSE2 - LSE1 for ANY shift m1."""
import math

import mpmath
import sympy as sp
from hypothesis import example, given

from proofs._mpkit import (
    DPS, close, decomposition, dense_row, finite, rows, sym_nonzero_at, sym_zero,
)

N = 3  # symbolic row length (the identity is term-by-term, so 3 keys exercise every step)
a = sp.symbols(f"s1_0:{N}", real=True)
b = sp.symbols(f"s2_0:{N}", real=True)
m1 = sp.Symbol("m1", real=True)
Z1 = sum(sp.exp(x) for x in a)
Z2 = sum(sp.exp(x) for x in b)
LSE1, LSE2 = sp.log(Z1), sp.log(Z2)


def kl_definition():
    P1 = [sp.exp(x) / Z1 for x in a]
    P2 = [sp.exp(x) / Z2 for x in b]
    return sum(P1[j] * (sp.log(P1[j]) - sp.log(P2[j])) for j in range(N))


def l1_acc():
    l1 = sum(sp.exp(x - m1) for x in a)
    acc = sum(sp.exp(a[j] - m1) * (a[j] - b[j]) for j in range(N))
    return l1, acc


def test_statement_1_decomposition_holds_symbolically_for_any_shift():
    l1, acc = l1_acc()
    assert sym_zero(kl_definition() - (acc / l1 + LSE2 - LSE1))


def test_statement_1_lse_is_shift_plus_log_l():
    # exp is injective on the reals, so exp(m1) * l1 == Z1 is LSE1 == m1 + log l1.
    l1, _ = l1_acc()
    assert sym_zero(sp.exp(m1) * l1 - Z1)


def test_statement_1_ratio_does_not_depend_on_the_shift():
    l1, acc = l1_acc()
    assert sym_zero(sp.diff(acc / l1, m1))


def test_statement_1_check_rejects_a_wrong_decomposition():
    """The symbolic check can fail: swapping the LSE signs, or normalising by l2, is rejected."""
    l1, acc = l1_acc()
    l2 = sum(sp.exp(x - m1) for x in b)
    point = {**dict(zip(a, [0.3, -1.2, 2.0])), **dict(zip(b, [1.1, 0.4, -0.7])), m1: 0.5}
    for wrong in (acc / l1 + LSE1 - LSE2, acc / l2 + LSE2 - LSE1):
        diff = kl_definition() - wrong
        assert sym_nonzero_at(diff, point)
        assert not sym_zero(diff)


@given(rows(max_n=10, masked=True), finite(-1e3, 1e3))
@example(([0.0, 700.0], [5.0, -700.0]), -1e3)  # exp(S - m1) far beyond float range
@example(([-math.inf, 1.0, -math.inf], [-math.inf, -1.0, -math.inf]), 0.0)
def test_statement_1_decomposition_numerically_at_60_digits(pair, shift):
    s1, s2 = pair
    if all(x == -math.inf for x in s1):
        s1, s2 = s1 + [0.0], s2 + [0.0]  # statement 1 is about rows with a visible key
    kl = dense_row(s1, s2)[0]
    assert close(decomposition(s1, s2, shift), kl)
    assert kl >= -1e-50  # Gibbs: KL is nonnegative


@given(rows(max_n=6))
@example(([0.0, 1.0], [1.0, 0.0]))  # LSE1 == LSE2 exactly: the two variants coincide
@example(([0.0, 22.0], [22.0, 7.279611331953486e-30]))  # LSE1 - LSE2 ~ 1e-39: found by Hypothesis
def test_statement_1_numeric_check_rejects_swapped_lse(pair):
    s1, s2 = pair
    kl, lse1, lse2 = dense_row(s1, s2)
    with mpmath.workdps(DPS):
        m1 = max(mpmath.mpf(x) for x in s1)
        w = [mpmath.exp(mpmath.mpf(x) - m1) for x in s1]
        ratio = mpmath.fsum(wj * (mpmath.mpf(a) - mpmath.mpf(b)) for wj, a, b in zip(w, s1, s2))
        ratio /= mpmath.fsum(w)
        assert close(ratio + lse2 - lse1, kl)  # the statement
        wrong = ratio + lse1 - lse2  # deliberate mistake: LSE signs swapped
        if abs(lse1 - lse2) > mpmath.mpf(10) ** -30:
            assert not close(wrong, kl)  # rejected whenever it makes a difference
        else:
            assert close(wrong, kl, rel=mpmath.mpf(10) ** -29)
