"""Extreme inputs: huge scales and logits, empty rows, identical and shifted sides, one-hot P1.
Everything must stay finite wherever the mathematics is finite."""
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from _ref_gradcheck import GRADS, directional_fd, directional_tolerance, grad_tolerance
from streamkl_ref.strategies import EPS32, EPS64, Problem, assert_close_rows, logit_scale, make_problem
from streamkl_ref import (
    attention_kl,
    attention_kl_grad,
    attention_kl_grad_tiled,
    attention_kl_mp,
    attention_kl_online,
)

pytestmark = pytest.mark.filterwarnings("error")  # no overflow / invalid-value warnings either


def all_forward(problem, block_q=2, block_k=3):
    """``{name: (kl, lse1, lse2)}`` from every forward implementation (float64 ones)."""
    out = {"dense": attention_kl(*problem.inputs, **problem.kw, return_lse=True),
           "mp": attention_kl_mp(*problem.inputs, **problem.kw, return_lse=True)}
    for base2 in (False, True):
        out[f"online_base2={base2}"] = attention_kl_online(
            *problem.inputs, **problem.kw, block_q=block_q, block_k=block_k, base2=base2)[:3]
    return out


def check_all_against_mp(problem, **blocks):
    results = all_forward(problem, **blocks)
    scale = logit_scale(problem)
    for name, (kl, lse1, lse2) in results.items():
        assert_close_rows(kl, results["mp"][0], scale, what=f"{name} kl")
        assert_close_rows(lse1, results["mp"][1], scale, what=f"{name} lse1")
        assert_close_rows(lse2, results["mp"][2], scale, what=f"{name} lse2")
    return results


def check_grads(problem, seed=0):
    """Closed form finite, tiled == closed form, and directional derivatives match mpmath."""
    d = problem.dims
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((d.B, d.H, d.NQ))
    kl, lse1, lse2 = attention_kl(*problem.inputs, **problem.kw, return_lse=True)
    closed = attention_kl_grad(*problem.inputs, g, **problem.kw)
    tiled = attention_kl_grad_tiled(*problem.inputs, g, lse1, lse2, kl, **problem.kw, block_q=2, block_k=2)
    for which, key in enumerate(GRADS):
        assert np.all(np.isfinite(closed[key])), key
        assert np.abs(tiled[key] - closed[key]).max() <= grad_tolerance(problem, g, key), key
        v = rng.standard_normal(problem.inputs[which].shape)
        fd = directional_fd(problem, g, which, v)
        ours = float(np.sum(closed[key] * v))
        assert abs(ours - fd) <= directional_tolerance(problem, g, key, closed[key], v), (key, ours, fd)
    return closed


@given(st.sampled_from([1.0, 10.0, 1e2, 1e3, 1e4]), st.sampled_from([1.0, 10.0, 1e2, 1e3, 1e4]),
       st.booleans(), st.integers(0, 1000))
@example(1e4, 1e4, True, 0)
@example(1e4, 1.0, False, 1)
def test_large_scales(scale1, scale2, causal, seed):
    p = make_problem(seed=seed, NQ=4, NK=5, D1=3, D2=2, causal=causal, scale1=scale1, scale2=scale2)
    results = check_all_against_mp(p)
    assert all(np.all(np.isfinite(r[0])) for r in results.values())
    check_grads(p, seed)


def test_logits_of_plus_minus_1e4():
    # D = 1, scale 1: S = q·k takes the values ±1e4 and ±5e3 exactly
    q = np.array([100.0, -100.0, 50.0])[None, None, :, None]
    k = np.array([100.0, -100.0, 100.0, 0.0])[None, None, :, None]
    p = Problem(q1=q, k1=k, q2=-q, k2=k[:, :, ::-1].copy(), scale1=1.0, scale2=1.0)
    results = check_all_against_mp(p, block_q=2, block_k=3)
    kl = results["dense"][0]
    assert np.all(np.isfinite(kl)) and kl.max() > 1e3  # nearly disjoint supports: huge but finite KL
    check_grads(p)
    r32 = attention_kl_online(*p.inputs, **p.kw, block_q=2, block_k=3, dtype=np.float32)
    assert np.all(np.isfinite(r32.kl))
    np.testing.assert_allclose(r32.kl, kl, rtol=16 * EPS32, atol=4 * EPS32 * 1e4)


def test_empty_rows_give_zero_kl_neginf_lse_and_zero_gradient():
    p = make_problem(seed=31, H=2, HK1=1, HK2=2, NQ=6, NK=2, causal=True)  # rows 0..3 see nothing
    empty = slice(0, 4)
    for name, (kl, lse1, lse2) in all_forward(p).items():
        assert np.all(kl[..., empty] == 0), name
        assert np.all(np.isneginf(lse1[..., empty])) and np.all(np.isneginf(lse2[..., empty])), name
        assert np.all(np.isfinite(kl[..., 4:])) and np.all(np.isfinite(lse1[..., 4:])), name
    r32 = attention_kl_online(*p.inputs, **p.kw, block_q=4, block_k=1, dtype=np.float32, base2=True)
    assert np.all(r32.kl[..., empty] == 0) and np.all(np.isneginf(r32.lse2[..., empty]))
    g = np.random.default_rng(0).standard_normal((1, 2, 6))
    kl, lse1, lse2 = attention_kl(*p.inputs, **p.kw, return_lse=True)
    for grads in (attention_kl_grad(*p.inputs, g, **p.kw),
                  attention_kl_grad_tiled(*p.inputs, g, lse1, lse2, kl, **p.kw, block_q=4, block_k=1),
                  attention_kl_grad_tiled(*p.inputs, g, lse1, lse2, kl, **p.kw, dtype=np.float32)):
        assert all(np.all(np.isfinite(v)) for v in grads.values())
        assert np.all(grads["dq1"][..., empty, :] == 0) and np.all(grads["dq2"][..., empty, :] == 0)
        assert np.any(grads["dq1"][..., 4:, :] != 0)  # the rows that see keys do get gradient
    # changing what an empty row's query holds changes nothing at all
    p2 = make_problem(seed=31, H=2, HK1=1, HK2=2, NQ=6, NK=2, causal=True)
    p2.q1[..., empty, :] *= 1e3
    assert np.array_equal(attention_kl(*p2.inputs, **p2.kw), attention_kl(*p.inputs, **p.kw))


def test_no_keys_at_all():
    p = make_problem(seed=32, NQ=3, NK=0)
    for name, (kl, lse1, lse2) in all_forward(p).items():
        assert kl.shape == (1, 2, 3) and np.all(kl == 0) and np.all(np.isneginf(lse1)), name
    grads = attention_kl_grad(*p.inputs, np.ones((1, 2, 3)), **p.kw)
    assert grads["dk1"].shape == (1, 1, 0, 3) and np.all(grads["dq1"] == 0)


@given(st.sampled_from([1.0, 1e2, 1e4]), st.booleans())
def test_identical_sides_give_exactly_zero(scale, causal):
    p = make_problem(seed=33, NQ=5, NK=7, D1=4, D2=4, causal=causal, scale1=scale, scale2=scale)
    p.q2, p.k2 = p.q1.copy(), np.repeat(p.k1, 2, axis=1)  # the same key head, read through GQA
    for name, (kl, lse1, lse2) in all_forward(p).items():
        assert np.all(kl == 0), name  # bitwise-identical logits: exactly 0, not just small
        assert np.array_equal(lse1, lse2), name
    r32 = attention_kl_online(*p.inputs, **p.kw, dtype=np.float32, block_q=2, block_k=3, base2=True)
    assert np.all(r32.kl == 0)
    grads = attention_kl_grad(*p.inputs, np.ones((1, 2, 5)), **p.kw)
    assert all(np.all(v == 0) for v in grads.values())  # KL = 0 is a minimum in both settings


@given(st.sampled_from([1.0, 1e2, 1e4, -1e4]), st.booleans())
@example(1e4, False)
def test_sides_shifted_by_a_constant_give_zero_to_rounding(shift, causal):
    """``S2 = S1 + c`` row-wise (an extra head-dim column): ``KL = 0`` in exact arithmetic, while
    the streaming form cancels ``acc/l1 ≈ −c`` against ``m2 − m1 ≈ c``."""
    p = make_problem(seed=34, NQ=4, NK=6, D1=3, D2=3, causal=causal, scale1=0.5, scale2=0.5)
    p.q2 = np.concatenate([p.q1, np.ones(p.q1.shape[:-1] + (1,))], axis=-1)
    p.k2 = np.concatenate([np.repeat(p.k1, 2, axis=1), np.full((1, 2, 6, 1), shift / 0.5)], axis=-1)
    mp_kl = attention_kl_mp(*p.inputs, **p.kw)
    assert np.all(np.abs(mp_kl) < 1e-40)
    results = check_all_against_mp(p)
    assert all(np.all(np.isfinite(r[0])) for r in results.values())
    assert np.abs(results["dense"][0]).max() <= 64 * EPS64 * (1 + abs(shift))


def test_one_hot_p1():
    """Side 1 puts all its mass on one key (``exp(−1e4)`` underflows to 0 in float64): the KL is
    ``LSE2 − S2[j*]``, finite; the gradients are finite."""
    p = make_problem(seed=35, H=1, HK1=1, HK2=1, NQ=3, NK=5, D1=1, D2=3, scale1=1.0)
    p.k1 = np.array([0.0, 0.0, 1.0, 0.0, -1.0])[None, None, :, None]
    p.q1 = np.full((1, 1, 3, 1), 1e4)
    results = check_all_against_mp(p)
    kl, _, lse2 = results["dense"]
    s2_hot = np.einsum("d,qd->q", p.k2[0, 0, 2], p.q2[0, 0]) / np.sqrt(3)
    np.testing.assert_allclose(kl[0, 0], lse2[0, 0] - s2_hot, rtol=1e-13)
    check_grads(p)
    r32 = attention_kl_online(*p.inputs, **p.kw, dtype=np.float32)
    assert np.all(np.isfinite(r32.kl)) and np.all(np.isfinite(r32.lse1))
