"""Gradients: closed form against mpmath finite differences; the tiled backward against the
closed form."""
import warnings

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from _ref_gradcheck import (
    GRADS,
    NAMES,
    directional_fd,
    directional_tolerance,
    fd_gradient,
    fd_noise,
    grad_tolerance,
)
from streamkl_ref.strategies import EPS32, make_problem, problems
from streamkl_ref import attention_kl, attention_kl_grad, attention_kl_grad_tiled

pytestmark = pytest.mark.filterwarnings("error")

CASES = {
    "gqa_causal_nq_gt_nk": dict(seed=21, B=1, H=2, HK1=1, HK2=2, NQ=4, NK=3, D1=3, D2=2, causal=True),
    "mqa_both_d1_ne_d2": dict(seed=22, B=1, H=2, HK1=1, HK2=1, NQ=2, NK=4, D1=2, D2=3),
    "scaled_causal_nk_gt_nq": dict(seed=23, B=2, H=1, HK1=1, HK2=1, NQ=2, NK=3, D1=2, D2=1, causal=True,
                                   scale1=0.7, scale2=1.9),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_closed_form_matches_mpmath_finite_differences(case):
    p = make_problem(**CASES[case])
    d = p.dims
    g = np.random.default_rng(99).standard_normal((d.B, d.H, d.NQ))
    grads = attention_kl_grad(*p.inputs, g, **p.kw)
    for which, (name, gname) in enumerate(zip(NAMES, GRADS)):
        fd = fd_gradient(p, g, which)
        assert grads[gname].shape == p.inputs[which].shape and grads[gname].dtype == np.float64
        err = np.abs(grads[gname] - fd).max()
        assert err <= grad_tolerance(p, g, gname) + fd_noise(p, g), (name, err)
        assert np.abs(fd).max() > 0  # the check is not vacuous


@given(problems(max_n=4, max_d=3, max_b=1), st.integers(0, 2**32 - 1))
@example(make_problem(seed=24, H=4, HK1=2, HK2=1, NQ=3, NK=2, causal=True), 0)
# a single key (KL = 0 identically) and tiny logits: the gradient is 0 and only the mpmath
# rounding floor of the finite difference remains
@example(make_problem(seed=0, H=1, HK2=1, NQ=1, NK=1, D1=1, D2=1, amplitude=5e-173), 0)
def test_directional_derivatives_match_mpmath(problem, seed):
    """Along a random direction per input: ``⟨grad, v⟩`` against a central difference in mpmath."""
    d = problem.dims
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((d.B, d.H, d.NQ))
    grads = attention_kl_grad(*problem.inputs, g, **problem.kw)
    for which, gname in enumerate(GRADS):
        v = rng.standard_normal(problem.inputs[which].shape)
        fd = directional_fd(problem, g, which, v)
        ours = float(np.sum(grads[gname] * v))
        tol = directional_tolerance(problem, g, gname, grads[gname], v)
        assert abs(ours - fd) <= tol, (gname, ours, fd, tol)


blocks = st.integers(1, 6)
setting_choices = st.sampled_from([("1",), ("2",), ("1", "2")])


@given(problems(), blocks, blocks, setting_choices, st.integers(0, 2**32 - 1))
@example(make_problem(seed=25, NQ=7, NK=2, causal=True), 3, 1, ("1", "2"), 1)  # empty rows
def test_tiled_backward_equals_closed_form(problem, block_q, block_k, settings, seed):
    d = problem.dims
    g = np.random.default_rng(seed).standard_normal((d.B, d.H, d.NQ))
    kl, lse1, lse2 = attention_kl(*problem.inputs, **problem.kw, return_lse=True)
    closed = attention_kl_grad(*problem.inputs, g, **problem.kw)
    tiled = attention_kl_grad_tiled(*problem.inputs, g, lse1, lse2, kl, **problem.kw,
                                    block_q=block_q, block_k=block_k, settings=settings)
    expected = {"1": ("dq2", "dk2"), "2": ("dq1", "dk1")}
    assert set(tiled) == {k for s in settings for k in expected[s]}
    for key, value in tiled.items():
        assert value.shape == closed[key].shape and value.dtype == np.float64
        err = np.abs(value - closed[key]).max(initial=0.0)
        assert err <= grad_tolerance(problem, g, key), (key, err)


# OpenBLAS's float32 kernels can raise the FE_INVALID flag on finite inputs (numpy/numpy#24067,
# #13173, OpenMathLib/OpenBLAS#1924), so NumPy's "invalid value encountered in matmul" can appear
# or not for the same example (Hypothesis FlakyFailures under -n 2, on inputs with subnormal
# entries). That one warning is ignored around the float32 tiled runs, inside the test: a
# function-level filterwarnings mark does not override this module's "error" mark in pytest 9
# (the module's mark is applied last). A real NaN or inf in the result fails the finiteness
# assert below.
@given(problems(max_n=10, max_d=6), blocks, blocks, st.integers(0, 2**32 - 1))
def test_tiled_backward_float32_within_float32_rounding(problem, block_q, block_k, seed):
    """FlashAttention-style: the float32 tiled backward run as one single tile is the dense
    float32 computation; smaller tiles may be at most twice as far from the float64 closed form,
    plus a floor of a few float32 roundings at the logit scale times the gradient's size."""
    d = problem.dims
    g = np.random.default_rng(seed).standard_normal((d.B, d.H, d.NQ))
    kl, lse1, lse2 = attention_kl(*problem.inputs, **problem.kw, return_lse=True)
    closed = attention_kl_grad(*problem.inputs, g, **problem.kw)
    args = (*problem.inputs, g, lse1, lse2, kl)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="invalid value encountered in matmul", category=RuntimeWarning)
        one_tile = attention_kl_grad_tiled(*args, **problem.kw, block_q=d.NQ, block_k=d.NK, dtype=np.float32)
        tiled = attention_kl_grad_tiled(*args, **problem.kw, block_q=block_q, block_k=block_k, dtype=np.float32)
    for key in GRADS:
        assert tiled[key].dtype == np.float32
        assert np.isfinite(tiled[key]).all() and np.isfinite(one_tile[key]).all(), key
        ref = closed[key]
        floor = grad_tolerance(problem, g, key, ulps=4, eps=EPS32)
        err_dense = np.abs(one_tile[key] - ref).max(initial=0.0)
        err_tiled = np.abs(tiled[key] - ref).max(initial=0.0)
        assert err_tiled <= 2 * err_dense + floor, (key, err_tiled, err_dense, floor)


def test_gqa_key_gradient_sums_over_its_query_heads():
    p = make_problem(seed=26, B=1, H=4, HK1=2, HK2=1, NQ=3, NK=4)
    g = np.random.default_rng(1).standard_normal((1, 4, 3))
    grads = attention_kl_grad(*p.inputs, g, **p.kw)
    expanded = make_problem(seed=26, B=1, H=4, HK1=2, HK2=1, NQ=3, NK=4)
    expanded.k1 = np.repeat(p.k1, 2, axis=1)
    expanded.k2 = np.repeat(p.k2, 4, axis=1)
    full = attention_kl_grad(*expanded.inputs, g, **expanded.kw)
    np.testing.assert_array_equal(grads["dq1"], full["dq1"])
    np.testing.assert_allclose(grads["dk1"], full["dk1"].reshape(1, 2, 2, 4, 3).sum(2), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(grads["dk2"], full["dk2"].sum(1, keepdims=True), rtol=1e-14, atol=1e-15)


def test_zero_upstream_gradient_gives_zero():
    p = make_problem(seed=27, NQ=3, NK=3, causal=True)
    grads = attention_kl_grad(*p.inputs, np.zeros((1, 2, 3)), **p.kw)
    assert all(np.array_equal(v, np.zeros_like(v)) for v in grads.values())
