"""Checks for statement 7 (07_floating_point.md): exponent arguments are <= 0 (no overflow),
the first-order rounding-error bound of the float32 online recurrence, and the error model of
the test tolerances (c * dense low-precision error + floor)."""
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from proofs._mpkit import (
    U32, coarse_bound, dense_np, dense_row, finite, first_order_bound, online_np,
)

# First order in u: the neglected terms are products of two relative perturbations, each below
# 1e-3 over the drawn inputs (|S| <= 4096), so they are < 0.1 % of the bound; allow 1 %.
SECOND_ORDER_SLACK = 1.01
C_DENSE, C_FLOOR = 2.0, 4.0  # the tolerance model: C_DENSE * dense error + C_FLOOR * u * scale


@st.composite
def f32_rows(draw, max_n=64, scales=(1.0, 16.0, 256.0, 4096.0)):
    n = draw(st.integers(1, max_n))
    B = draw(st.integers(1, 16))
    M = draw(st.sampled_from(scales))
    s1 = np.array(draw(st.lists(finite(-1, 1), min_size=n, max_size=n))) * M
    noise = np.array(draw(st.lists(finite(-1, 1), min_size=n, max_size=n)))
    kind = draw(st.sampled_from(["close+offset", "independent", "scaled"]))
    if kind == "close+offset":  # small KL, large |LSE|: the cancellation case
        s2 = s1 + 1e-3 * M * noise + draw(finite(-1, 1)) * M
    elif kind == "independent":
        s2 = noise * M
    else:
        s2 = s1 * draw(finite(0.5, 1.5)) + noise
    return s1.astype(np.float32), s2.astype(np.float32), B


def _exact(s1, s2):
    kl, l1, l2 = dense_row([float(x) for x in s1], [float(x) for x in s2])
    return float(kl), float(l1), float(l2)


def _errors(got, exact):
    return [abs(float(g) - e) for g, e in zip(got, exact)]


RISING = (np.arange(16, dtype=np.float32) * np.float32(0.7), np.arange(16, dtype=np.float32) *
          np.float32(0.21), 1)  # the running max rises at every one of 16 tiles


def _shifted(seed):
    """Large logits (~3000), small KL: LSE2 - LSE1 cancels ~3 significant digits of float32."""
    rng = np.random.default_rng(seed)
    s1 = (rng.uniform(-1, 1, 32) * 8).astype(np.float32) + np.float32(3000)
    s2 = (s1 + rng.normal(0, 0.05, 32) - 1000).astype(np.float32)
    return s1, s2, 8


@given(f32_rows(scales=(1.0, 1e3, 1e10, 1e30)))
@example((np.array([0.0, 1e30], np.float32), np.array([-1e30, 0.0], np.float32), 1))
def test_statement_7_every_exponent_argument_is_nonpositive_and_nothing_overflows(case):
    s1, s2, B = case
    args, trace = [], []
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        kl, lse1, lse2 = online_np(s1, s2, B, record=args, trace=trace)
    assert max(float(a.max()) for a in args) <= 0.0
    assert np.isfinite([kl, lse1, lse2]).all()
    for _, l1, _, l2, _ in trace:  # the max key contributes exp(0) = 1; each term is <= 1
        assert 1 <= l1 <= len(s1) and 1 <= l2 <= len(s1)


def test_statement_7_check_rejects_the_unshifted_sum():
    s1 = np.array([0.0, 100.0, 200.0], np.float32)
    args = []
    with np.errstate(over="ignore", invalid="ignore"):
        kl = online_np(s1, s1, 1, shift=False, record=args)[0]
    assert max(float(a.max()) for a in args) > 0 and not np.isfinite(kl)
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        online_np(s1, s1, 1, shift=False)


@given(f32_rows())
@example(RISING)
@example(_shifted(3))
@example((np.array([1.0], np.float32), np.array([-2.0], np.float32), 16))  # one key
def test_statement_7_online_error_is_within_the_first_order_bound(case):
    s1, s2, B = case
    exact = _exact(s1, s2)
    errs = _errors(online_np(s1, s2, B), exact)
    bounds = first_order_bound(s1, s2, B)
    for e, b in zip(errs, bounds):
        assert e <= SECOND_ORDER_SLACK * b
    M = float(max(np.abs(s1).max(), np.abs(s2).max()))
    assert bounds[0] <= coarse_bound(len(s1), B, M)  # the data-free corollary is weaker


def test_statement_7_bound_check_rejects_a_sloppy_rescale():
    s1, s2, B = RISING
    exact = _exact(s1, s2)
    bound = first_order_bound(s1, s2, B)[0]
    assert _errors(online_np(s1, s2, B), exact)[0] <= bound
    assert _errors(online_np(s1, s2, B, sloppy_rescale=True), exact)[0] > 10 * bound


def tolerance(dense_err, lse1, lse2):
    return C_DENSE * dense_err + C_FLOOR * U32 * (1 + abs(lse1) + abs(lse2))


@given(f32_rows())
@example(RISING)
@example(_shifted(3))
def test_statement_7_online_error_fits_the_dense_low_precision_tolerance_model(case):
    s1, s2, B = case
    exact = _exact(s1, s2)
    err = _errors(online_np(s1, s2, B), exact)[0]
    dense_err = _errors(dense_np(s1, s2), exact)[0]
    assert err <= tolerance(dense_err, exact[1], exact[2])


def test_statement_7_tolerance_model_rejects_sloppy_code_and_naive_rtol_rejects_correct_code():
    s1, s2, B = RISING
    exact = _exact(s1, s2)
    dense_err = _errors(dense_np(s1, s2), exact)[0]
    sloppy = _errors(online_np(s1, s2, B, sloppy_rescale=True), exact)[0]
    assert sloppy > tolerance(dense_err, exact[1], exact[2])
    # The wrong scale: a tolerance relative to |KL| fails the *correct* float32 code on large
    # logits, because the unavoidable error is ~ u |LSE|, not ~ u |KL|.
    s1, s2, B = _shifted(3)
    exact = _exact(s1, s2)
    err = _errors(online_np(s1, s2, B), exact)[0]
    assert err <= tolerance(_errors(dense_np(s1, s2), exact)[0], exact[1], exact[2])
    assert err > 1e-2 * abs(exact[0])  # even a 1 % relative tolerance rejects it
