"""Checks for statement 4 (04_base2.md): folding sigma*log2(e) into Q and using exp2/log2 gives
KL in bits; KL_nats = ln 2 * KL_bits and LSE_nats = ln 2 * LSE_bits."""
import mpmath
import sympy as sp
from hypothesis import example, given
from hypothesis import strategies as st

from proofs._mpkit import (
    DPS, close, cuts_for, dense_row, finite, hp, scores, sym_nonzero_at, sym_zero, tiles_from_cuts,
)

N = 3
a = sp.symbols(f"s1_0:{N}", real=True)  # natural-log scores sigma * q.k
b = sp.symbols(f"s2_0:{N}", real=True)
mb1, mb2 = sp.symbols("mbits1 mbits2", real=True)  # ANY base-2 shifts
LN2 = sp.log(2)


def kl_definition():
    Z1, Z2 = sum(sp.exp(x) for x in a), sum(sp.exp(x) for x in b)
    return sum(sp.exp(a[j]) / Z1 * (sp.log(sp.exp(a[j]) / Z1) - sp.log(sp.exp(b[j]) / Z2))
               for j in range(N))


def bits_pipeline(log=lambda v: sp.log(v, 2)):
    a2 = [x / LN2 for x in a]  # S' = (sigma log2(e) Q) K^T = S log2(e)
    b2 = [x / LN2 for x in b]
    l1 = sum(2 ** (x - mb1) for x in a2)
    l2 = sum(2 ** (x - mb2) for x in b2)
    acc = sum(2 ** (a2[j] - mb1) * (a2[j] - b2[j]) for j in range(N))
    lse1, lse2 = mb1 + log(l1), mb2 + log(l2)
    return acc / l1 + lse2 - lse1, lse1, lse2


def zero(expr):
    return sym_zero(expr.rewrite(sp.exp))


def test_statement_4_kl_nats_is_ln2_times_kl_bits_symbolically():
    kl_bits, lse1, lse2 = bits_pipeline()
    assert zero(LN2 * kl_bits - kl_definition())
    assert zero(sp.exp(LN2 * lse1) - sum(sp.exp(x) for x in a))  # LSE_nats = ln2 * LSE_bits


def test_statement_4_setting_2_gradient_in_bits_symbolically():
    # dKL_nats/dS1 (natural logits) from base-2 quantities: P1 = 2^(S1' - LSE1'), and every
    # term of the bracket is in bits, so one factor ln 2 converts it.
    kl_bits, lse1, lse2 = bits_pipeline()
    kl = kl_definition()
    for k in range(N):
        p1 = 2 ** (a[k] / LN2 - lse1)
        claim = LN2 * p1 * ((a[k] - b[k]) / LN2 - (lse1 - lse2) - kl_bits)
        assert zero(sp.diff(kl, a[k]) - claim)


def test_statement_4_symbolic_check_rejects_ln_for_log2_and_a_missing_ln2():
    point = {**dict(zip(a, [0.2, 1.5, -0.8])), **dict(zip(b, [0.0, -1.0, 2.5])), mb1: 1.0, mb2: 2.0}
    kl_bits, _, _ = bits_pipeline()
    kl_ln, _, _ = bits_pipeline(log=sp.log)  # deliberate mistake: ln instead of log2
    for wrong in (kl_bits - kl_definition(), LN2 * kl_ln - kl_definition()):
        assert sym_nonzero_at(wrong, point)
        assert not zero(wrong)


@hp
def online_bits(s1b, s2b, cuts, *, log2=lambda v: mpmath.log(v, 2)):
    """The base-2 recurrence (exp2/log2) over a tiling, on base-2 scores.

    Returns ``(KL_bits, LSE1_bits, LSE2_bits)``."""
    m1 = m2 = mpmath.ninf
    l1 = l2 = acc = mpmath.mpf(0)
    for lo, hi in tiles_from_cuts(len(s1b), cuts):
        t1, t2 = s1b[lo:hi], s2b[lo:hi]
        n1, n2 = max([m1] + t1), max([m2] + t2)
        a1 = 2 ** (m1 - n1) if m1 != mpmath.ninf else 0
        a2 = 2 ** (m2 - n2) if m2 != mpmath.ninf else 0
        p1 = [2 ** (x - n1) for x in t1]
        l1 = a1 * l1 + mpmath.fsum(p1)
        l2 = a2 * l2 + mpmath.fsum(2 ** (x - n2) for x in t2)
        acc = a1 * acc + mpmath.fsum(p * (x - y) for p, x, y in zip(p1, t1, t2))
        m1, m2 = n1, n2
    lse1, lse2 = m1 + log2(l1), m2 + log2(l2)
    return acc / l1 + lse2 - lse1, lse1, lse2


@st.composite
def heads(draw):
    nk = draw(st.integers(1, 6))
    d1, d2 = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    mat = lambda r, c: draw(st.lists(st.lists(finite(-3, 3), min_size=c, max_size=c),
                                     min_size=r, max_size=r))
    q1, k1, q2, k2 = mat(1, d1), mat(nk, d1), mat(1, d2), mat(nk, d2)
    sig1, sig2 = draw(finite(0.05, 4)), draw(finite(0.05, 4))
    cuts = draw(cuts_for(nk))
    return q1, k1, q2, k2, sig1, sig2, cuts


@hp
def _fold(q, sigma):
    """Q' = sigma * log2(e) * Q: the kernel's fold."""
    c = mpmath.mpf(sigma) / mpmath.log(2)
    return [[c * mpmath.mpf(v) for v in row] for row in q]


@given(heads())
@example(([[1.0]], [[30.0], [-30.0]], [[1.0]], [[-30.0], [30.0]], 4.0, 4.0, [1]))  # huge logits
# found by Hypothesis: a product of two Python floats must be formed in mpmath, not in double
@example(([[0.0]], [[0.0]], [[0.0, 3.0]], [[0.0, 1e-12]], 1.0, 1.0, []))
def test_statement_4_base2_recurrence_with_folded_q_matches_natural_kl(case):
    q1, k1, q2, k2, sig1, sig2, cuts = case
    s1 = scores([q1], [k1], sig1)[0][0]  # natural scores, as the definition has them
    s2 = scores([q2], [k2], sig2)[0][0]
    s1b = scores([_fold(q1, sig1)], [k1], 1)[0][0]  # base-2 scores from the folded Q
    s2b = scores([_fold(q2, sig2)], [k2], 1)[0][0]
    kl, lse1, lse2 = dense_row(s1, s2)
    kl_bits, lb1, lb2 = online_bits(s1b, s2b, cuts)
    with mpmath.workdps(DPS):
        ln2 = mpmath.log(2)
        assert close(ln2 * kl_bits, kl)
        assert close(ln2 * lb1, lse1) and close(ln2 * lb2, lse2)


def test_statement_4_numeric_check_rejects_ln_for_log2_and_a_missing_ln2():
    s1, s2 = [0.0, 2.0, -1.0], [1.0, 0.0, 0.5]
    with mpmath.workdps(DPS):
        s1b = [mpmath.mpf(x) / mpmath.log(2) for x in s1]
        s2b = [mpmath.mpf(x) / mpmath.log(2) for x in s2]
        kl = dense_row(s1, s2)[0]
        good = online_bits(s1b, s2b, [1])[0]
        assert close(mpmath.log(2) * good, kl)
        assert not close(good, kl)  # missing ln 2
        assert not close(mpmath.log(2) * online_bits(s1b, s2b, [1], log2=mpmath.log)[0], kl)
