"""Dense float64 reference against the mpmath ground truth (and the conventions both share)."""
import mpmath
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from streamkl_ref.strategies import EPS64, assert_close_rows, logit_scale, make_problem, problems
from streamkl_ref import attention_kl, attention_kl_mp

pytestmark = pytest.mark.filterwarnings("error")  # no invalid-value / overflow warnings anywhere


@given(problems(max_n=6, max_d=4))
@example(make_problem(seed=1, NQ=5, NK=3, causal=True))  # N_Q > N_K: two empty rows
@example(make_problem(seed=2, H=4, HK1=2, HK2=1, NQ=1, NK=1, D1=1, D2=4))
def test_dense_matches_mpmath(problem):
    kl, lse1, lse2 = attention_kl(*problem.inputs, **problem.kw, return_lse=True)
    kl_mp, lse1_mp, lse2_mp = attention_kl_mp(*problem.inputs, **problem.kw, return_lse=True, dps=50)
    scale = logit_scale(problem)
    assert kl.dtype == np.float64 and kl.shape == (problem.dims.B, problem.dims.H, problem.dims.NQ)
    assert_close_rows(kl, kl_mp, scale, what="kl")
    assert_close_rows(lse1, lse1_mp, scale, what="lse1")
    assert_close_rows(lse2, lse2_mp, scale, what="lse2")


def test_mpmath_agrees_with_itself_at_higher_precision():
    p = make_problem(seed=3, NQ=4, NK=5, causal=True)
    lo = attention_kl_mp(*p.inputs, **p.kw, dps=50, return_mpf=True)
    hi = attention_kl_mp(*p.inputs, **p.kw, dps=80, return_mpf=True)
    with mpmath.workdps(80):
        worst = max(abs(a - b) for a, b in zip(lo.ravel(), hi.ravel()))
    assert worst < mpmath.mpf(10) ** -45
    assert isinstance(lo.ravel()[0], mpmath.mpf)


def test_kl_nonnegative_and_zero_for_identical_sides():
    p = make_problem(seed=4, NQ=6, NK=6, D1=5, D2=5, causal=True)
    kl = attention_kl(*p.inputs, **p.kw)
    assert np.all(kl >= -16 * EPS64)  # KL >= 0 up to rounding
    same = attention_kl(p.q1, p.k1, p.q1, p.k1, causal=True)
    assert np.array_equal(same, np.zeros_like(same))  # bitwise-identical logits: exactly 0


def test_bottom_right_causal_convention():
    """Key j visible to query i iff j <= i + N_K - N_Q: the last query row sees every key, and
    with N_Q > N_K the first N_Q - N_K rows see none."""
    p = make_problem(seed=5, H=1, HK1=1, HK2=1, NQ=5, NK=3, causal=True)
    kl, lse1, _ = attention_kl(*p.inputs, **p.kw, return_lse=True)
    assert np.all(np.isneginf(lse1[..., :2])) and np.all(kl[..., :2] == 0)
    full = attention_kl(*p.inputs, causal=False, return_lse=True)
    assert kl[0, 0, -1] == full[0][0, 0, -1]  # the last row sees all N_K keys
    # row 2 sees exactly key 0: both distributions are one-hot there -> KL 0, LSE = S[2, 0]
    s1_20 = p.q1[0, 0, 2] @ p.k1[0, 0, 0] / np.sqrt(p.q1.shape[-1])
    assert kl[0, 0, 2] == 0.0 and lse1[0, 0, 2] == pytest.approx(s1_20, rel=1e-15)


def test_low_precision_inputs_are_upcast():
    p = make_problem(seed=6, NQ=4, NK=5)
    half = [x.astype(np.float16) for x in p.inputs]
    kl_half = attention_kl(*half, **p.kw)
    kl_exact = attention_kl(*[x.astype(np.float64) for x in half], **p.kw)
    assert kl_half.dtype == np.float64
    assert np.array_equal(kl_half, kl_exact)  # float16 -> float64 is exact: same computation


@given(st.floats(0.01, 100.0), st.floats(0.01, 100.0))
def test_scale_none_means_inverse_sqrt_d_and_scales_are_per_side(t1, t2):
    p = make_problem(seed=7, NQ=3, NK=4, D1=3, D2=2)
    explicit = attention_kl(*p.inputs, scale1=1 / np.sqrt(3), scale2=1 / np.sqrt(2))
    assert np.array_equal(attention_kl(*p.inputs), explicit)
    # a temperature is scale_t / tau: scaling q_t by c is the same as scaling scale_t by c
    a = attention_kl(p.q1 * t1, p.k1, p.q2 * t2, p.k2, scale1=1.0, scale2=1.0)
    b = attention_kl(*p.inputs, scale1=t1, scale2=t2)
    p.scale1, p.scale2 = t1, t2
    assert_close_rows(a, b, logit_scale(p))
