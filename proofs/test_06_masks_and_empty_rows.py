"""Checks for statement 6 (06_masks_and_empty_rows.md): the mask conventions, empty rows
(KL 0, LSE -inf, gradient 0), and the guards that keep -inf - (-inf) and 0 * inf out."""
import math

import mpmath
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from proofs._mpkit import (
    NINF, close, dense_row, finite, identity, merge, online_np, row_grads, rows, tile_state,
)

TRAP = dict(invalid="raise", divide="raise", over="raise")  # -inf - -inf, 0*inf, log 0, overflow


def causal(nq, nk):
    """Bottom-right aligned causal mask: key j visible to query i iff j <= i + (N_K - N_Q)."""
    return [[j <= i + (nk - nq) for j in range(nk)] for i in range(nq)]


@given(st.integers(1, 16), st.integers(1, 16))
def test_statement_6_causal_mask_is_bottom_right_aligned(nq, nk):
    mask = causal(nq, nk)
    counts = [sum(row) for row in mask]
    assert counts == [min(nk, max(0, i + nk - nq + 1)) for i in range(nq)]
    assert sum(c == 0 for c in counts) == max(0, nq - nk)  # the first N_Q - N_K rows are empty
    assert counts[-1] == nk  # the last query sees every key
    top_left = [[j <= i for j in range(nk)] for i in range(nq)]  # SDPA's is_causal
    assert (mask == top_left) == (nq == nk)


def grads_np(s1, s2, lse1, lse2, kl, g):
    """Guarded backward of one row in float64: P recomputed as exp(S - LSE) from the saved LSEs,
    the log-ratio from logits and LSEs; only visible entries of non-empty rows are touched."""
    s1, s2 = np.asarray(s1, np.float64), np.asarray(s2, np.float64)
    d1, d2 = np.zeros_like(s1), np.zeros_like(s1)
    if lse1 == -np.inf:  # empty row: gradient 0, and exp(-inf - (-inf)) is never formed
        return d1, d2
    vis = s1 > -np.inf
    p1, p2 = np.exp(s1[vis] - lse1), np.exp(s2[vis] - lse2)
    d2[vis] = g * (p2 - p1)
    d1[vis] = g * p1 * ((s1[vis] - s2[vis]) - (lse1 - lse2) - kl)
    return d1, d2


@st.composite
def masked_rows(draw):
    s1, s2 = draw(rows(max_n=12, masked=True))
    B = draw(st.integers(1, 5))
    g = draw(finite(-3, 3))
    return s1, s2, B, g


@given(masked_rows())
@example(([-math.inf] * 3, [-math.inf] * 3, 2, 1.0))  # an empty row
@example(([-math.inf, -math.inf, 2.0, -math.inf], [-math.inf, -math.inf, -1.0, -math.inf], 2, -1.0))
def test_statement_6_guarded_recurrence_and_backward_never_form_nan(case):
    s1, s2, B, g = case
    with np.errstate(**TRAP):  # any -inf - (-inf), 0 * inf or log(0) would raise here
        kl, lse1, lse2 = online_np(s1, s2, B, np.float64)
        d1, d2 = grads_np(s1, s2, lse1, lse2, kl, g)
    want = dense_row(s1, s2)
    if all(x == -math.inf for x in s1):
        assert kl == 0 and lse1 == -np.inf and lse2 == -np.inf
        assert not d1.any() and not d2.any()
        return
    for got, w in zip((kl, lse1, lse2), want):
        assert close(float(got), w, rel=1e-12)
    e1, e2 = row_grads(s1, s2)
    for j, x in enumerate(s1):
        if x == -math.inf:
            assert d1[j] == 0 and d2[j] == 0
        assert close(float(d1[j]), g * e1[j], rel=1e-12)
        assert close(float(d2[j]), g * e2[j], rel=1e-12)


@pytest.mark.parametrize(
    "s1, s2",
    [([-math.inf] * 4, [-math.inf] * 4),  # empty row
     ([-math.inf, -math.inf, 1.0, 0.0], [-math.inf, -math.inf, 0.5, 2.0])],  # masked first tile
)
def test_statement_6_check_rejects_the_unguarded_recurrence(s1, s2):
    with np.errstate(**TRAP):
        online_np(s1, s2, 2, np.float64)  # guarded: fine
        with pytest.raises(FloatingPointError):
            online_np(s1, s2, 2, np.float64, guarded=False)
    with np.errstate(all="ignore"):
        assert math.isnan(online_np(s1, s2, 2, np.float64, guarded=False)[0])


def test_statement_6_merge_of_empty_states_is_guarded():
    E = identity()
    assert merge(E, E) == E  # no exp(-inf - (-inf))
    A = tile_state([1.0, -math.inf], [0.0, -math.inf])
    assert merge(A, E) == A and merge(E, A) == A
    with mpmath.workdps(30):  # the unguarded weight would be NaN
        assert mpmath.isnan(mpmath.exp(NINF - NINF))


def test_statement_6_one_mask_for_both_sides_is_needed():
    # Masking side 2 alone where side 1 is visible puts P1 > 0 against P2 = 0: KL = +inf.
    with mpmath.workdps(30):
        p1 = [mpmath.mpf(1) / 2, mpmath.mpf(1) / 2]
        p2 = [mpmath.mpf(1), mpmath.mpf(0)]
        kl = mpmath.fsum(a * (mpmath.log(a) - mpmath.log(b)) for a, b in zip(p1, p2))
        assert kl == mpmath.inf
    with pytest.raises(AssertionError, match="one mask"):
        dense_row([1.0, 2.0], [1.0, -math.inf])
