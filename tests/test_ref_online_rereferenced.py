"""The kernels' accumulator in streamkl_ref: ``accumulator="max_referenced"``.

The Triton kernels keep ``acc* = Σ e^{s1−m1}·((s1 − m1) − (s2 − m2))`` (docs/math.md's ``acc`` minus
``l1·(m1 − m2)``) and finalise ``KL = acc*/l1 + log(l2/l1)``. Checked here:

- both forms equal the dense float64 reference over tilings, ragged and causal, base 2, split-K;
- the two forms' states are one state (``convert_state``) after every tile;
- merging max-referenced states: any split in any order equals one pass, commutative exactly,
  associative to rounding, the start state is the identity, forms never mix;
- float32 at large logits (``|S| ~ 1e3–1e4``): the max-referenced KL stays within a float32
  rounding model that does not grow with ``|m|``, and on pinned inputs it is orders of magnitude
  more accurate than the plain form (which cancels ``acc/l1`` against ``m2 − m1``);
- the Triton forward kernel under the interpreter agrees with the float32 max-referenced
  emulation at the interpreter's 16 x 16 tiles within the rounding model below (and the plain
  emulation does not, where the maxima are large); with inputs whose dot products are exact in
  float32 the two are bit-for-bit equal, split-K included;
- ``streamkl trace --accumulator max_referenced`` reports the kernels' ``acc``; the default
  output is unchanged.

The float32 rounding model (:func:`f32_error_bound`), with ``u = 2^-24``, ``γ_n = n·u/(1 − n·u)``:
a score of side ``t`` is a ``D_t``-term dot product, scaled once (and folded with ``log2 e``), so
``|δS_j| ≤ γ_{D_t+2}·σ_t·Σ_d |q_d k_jd|``; first order, the KL moves by
``Σ_j |∂KL/∂S1_j|·|δS1_j| + |∂KL/∂S2_j|·|δS2_j|`` with docs/math.md's derivatives
``∂KL/∂S1_j = P1_j·(log P1_j − log P2_j − KL)`` and ``∂KL/∂S2_j = P2_j − P1_j``. The recurrence
rounds every quantity it accumulates; its terms are ``P1_j·((s1_j − m1) − (s2_j − m2))`` and the
re-referencing ``l1·moved``, bounded by ``M = 1 + |KL| + Σ_j P1_j·(|S1_j − m1| + |S2_j − m2|)``
(the exponents of the kernels, never the maxima themselves), and each of the ``ops`` rounding
steps on a row (per tile: the pairwise tile sum, the exponential at 4 ulps, the products and the
update; per merge and at the end a few more) costs at most ``u·M``. Two independent float32
evaluations may differ by twice the bound of one.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from streamkl_ref.strategies import EPS64, ROWS, Problem, assert_close_rows, logit_scale, make_problem, problems, tiles
from streamkl_ref import (
    ACCUMULATORS,
    MaxReferencedState,
    OnlineState,
    attention_kl,
    attention_kl_online,
    convert_state,
    finalize_state,
    initial_state,
    merge_states,
    update_state,
)
from streamkl_ref._dense import dense_scores, masked_log_softmax
from streamkl_ref._scores import expand_key_heads, scaled_scores

pytestmark = pytest.mark.filterwarnings("error")

U32 = 2.0 ** -24  # float32 unit roundoff
EXP_ULPS = 4  # NumPy's SIMD float32 exp/exp2/log/log2 are accurate to a few ulps
blocks = st.integers(1, 9)


# ------------------------------------------------------------------------------------------------
# float64: both forms are the same algorithm
# ------------------------------------------------------------------------------------------------
@given(problems(), blocks, blocks, st.booleans(), st.integers(1, 4))
@example(make_problem(seed=1, NQ=7, NK=3, causal=True), 2, 2, False, 1)  # empty rows, ragged tiles
@example(make_problem(seed=2, NQ=3, NK=7, causal=True), 16, 16, True, 1)  # one tile, diagonal masked
@example(make_problem(seed=3, NQ=5, NK=5, causal=True), 1, 1, True, 3)  # 1x1 tiles, split-K
@example(make_problem(seed=4, NQ=6, NK=11, causal=True), 4, 3, True, 2)  # ragged split past the frontier
def test_both_forms_float64_equal_dense(problem, block_q, block_k, base2, split_k):
    ref_kl, ref_lse1, ref_lse2 = attention_kl(*problem.inputs, **problem.kw, return_lse=True)
    scale = logit_scale(problem)
    for accumulator in ACCUMULATORS:
        res = attention_kl_online(*problem.inputs, **problem.kw, block_q=block_q, block_k=block_k,
                                  base2=base2, accumulator=accumulator, split_k=split_k)
        assert_close_rows(res.kl, ref_kl, scale, what=f"{accumulator} kl")
        assert_close_rows(res.lse1, ref_lse1, scale, what=f"{accumulator} lse1")
        assert_close_rows(res.lse2, ref_lse2, scale, what=f"{accumulator} lse2")


def test_default_is_plain_and_one_split_is_the_old_loop():
    p = make_problem(seed=5, NQ=9, NK=13, causal=True)
    events = {}
    for kw in ({}, {"accumulator": "plain", "split_k": 1}):
        ev = []
        res = attention_kl_online(*p.inputs, **p.kw, block_q=4, block_k=3, on_tile=ev.append, **kw)
        events[len(events)] = (res, ev)
    (a, ev_a), (b, ev_b) = events.values()
    assert all(np.array_equal(x, y) for x, y in zip(a[:3], b[:3]))
    assert all(type(e.state) is OnlineState and e.state.accumulator == "plain" and e.split == 0 for e in ev_a)
    ev = []
    attention_kl_online(*p.inputs, **p.kw, block_q=4, block_k=3, accumulator="max_referenced",
                        split_k=2, on_tile=ev.append)
    assert all(isinstance(e.state, MaxReferencedState) for e in ev)
    assert [e.split for e in ev if e.q_block == 0] == [0, 0, 0, 1, 1]  # 5 tiles: 3 + 2
    with pytest.raises(ValueError, match="accumulator"):
        attention_kl_online(*p.inputs, accumulator="shifted")
    with pytest.raises(ValueError, match="split_k"):
        attention_kl_online(*p.inputs, split_k=0)


# ------------------------------------------------------------------------------------------------
# state level: tiles, conversion, merge
# ------------------------------------------------------------------------------------------------


def state_of(s1, s2, mask, cols, accumulator="max_referenced", base2=False):
    start = initial_state((ROWS,), accumulator=accumulator)
    return update_state(start, s1[:, cols], s2[:, cols], mask[:, cols], base2=base2)


def acc_scale(state, s1, s2, mask, base2=False):
    """``Σ_j e^{s1_j − m1}·(|s1_j − m1| + |s2_j − m2|)``: what the max-referenced sum rounds at."""
    exp = np.exp2 if base2 else np.exp
    ref1 = np.where(np.isneginf(state.m1), 0, state.m1)[:, None]
    ref2 = np.where(np.isneginf(state.m2), 0, state.m2)[:, None]
    w1 = np.where(mask, exp(np.where(mask, s1, ref1) - ref1), 0)
    dev = np.abs(np.where(mask, s1, ref1) - ref1) + np.abs(np.where(mask, s2, ref2) - ref2)
    return np.sum(w1 * dev, axis=-1)


def assert_states_close(a, b, s1, s2, mask, base2=False):
    """Maxima exact; sums to rounding relative to the magnitudes summed."""
    assert type(a) is type(b)
    assert np.array_equal(a.m1, b.m1) and np.array_equal(a.m2, b.m2)
    tol = 8 * s1.shape[1] * EPS64
    np.testing.assert_allclose(a.l1, b.l1, rtol=tol, atol=0)
    np.testing.assert_allclose(a.l2, b.l2, rtol=tol, atol=0)
    assert np.all(np.abs(a.acc - b.acc) <= tol * acc_scale(a, s1, s2, mask, base2))


@given(st.lists(tiles(max_keys=5), min_size=1, max_size=4), st.booleans())
def test_the_two_forms_hold_one_state_after_every_tile(tile_list, base2):
    plain = initial_state((ROWS,), accumulator="plain")
    reref = initial_state((ROWS,), accumulator="max_referenced")
    seen = [np.zeros((ROWS, 0))] * 2 + [np.zeros((ROWS, 0), bool)]
    for s1, s2, mask in tile_list:
        plain = update_state(plain, s1, s2, mask, base2=base2)
        reref = update_state(reref, s1, s2, mask, base2=base2)
        seen = [np.concatenate([x, y], axis=1) for x, y in zip(seen, (s1, s2, mask))]
        # m and l are computed identically in both forms: bit-for-bit equal
        assert all(np.array_equal(x, y) for x, y in zip(plain[:4], reref[:4]))
        converted = convert_state(plain, "max_referenced")
        assert isinstance(converted, MaxReferencedState)
        # the plain acc carries |s1 − s2| terms (up to 120 here), the conversion one more rounding
        ref1 = np.where(np.isneginf(plain.m1), 0, plain.m1)
        big = acc_scale(plain, *seen, base2) + np.abs(plain.l1 * ref1) + np.abs(
            plain.l1 * np.where(np.isneginf(plain.m2), 0, plain.m2))
        assert np.all(np.abs(converted.acc - reref.acc) <= 8 * seen[0].shape[1] * EPS64 * big)
        back = convert_state(reref, "plain")
        assert type(back) is OnlineState
        for x, y in zip(finalize_state(back, base2), finalize_state(reref, base2)):
            assert np.array_equal(np.isneginf(x), np.isneginf(y))
    assert convert_state(reref, "max_referenced") is reref


@given(tiles(), st.data(), st.booleans())
@example((np.zeros((ROWS, 2)), np.zeros((ROWS, 2)), np.zeros((ROWS, 2), bool)), None, False)
def test_any_split_in_any_order_gives_the_one_pass_state(tile, data, base2):
    s1, s2, mask = tile
    n = s1.shape[1]
    whole = state_of(s1, s2, mask, np.arange(n), base2=base2)
    if data is None:  # the @example: all masked, a single split
        labels, order = [0] * n, [0]
    else:
        parts = data.draw(st.integers(1, n))
        labels = data.draw(st.lists(st.integers(0, parts - 1), min_size=n, max_size=n))
        order = data.draw(st.permutations(range(parts)))
    partial = [state_of(s1, s2, mask, [j for j in range(n) if labels[j] == p], base2=base2) for p in order]
    merged = initial_state((ROWS,), accumulator="max_referenced")  # as the combine kernel starts
    for p in partial:
        merged = merge_states(merged, p, base2=base2)
    assert_states_close(merged, whole, s1, s2, mask, base2)
    a, b = finalize_state(merged, base2), finalize_state(whole, base2)
    assert all(np.array_equal(np.isneginf(x), np.isneginf(y)) for x, y in zip(a, b))
    assert not any(np.isnan(x).any() for x in a)
    kl_tol = 16 * n * EPS64 * (1 + acc_scale(whole, s1, s2, mask, base2) / np.where(whole.l1 > 0, whole.l1, 1))
    assert np.all(np.abs(a[0] - b[0]) <= kl_tol * (math.log(2) if base2 else 1))


@given(tiles(), tiles(), tiles())
def test_merge_is_commutative_and_associative(ta, tb, tc):
    a, b, c = (state_of(*t, np.arange(t[0].shape[1])) for t in (ta, tb, tc))
    ab, ba = merge_states(a, b), merge_states(b, a)
    assert all(np.array_equal(x, y) for x, y in zip(ab, ba))  # commutative exactly
    left = merge_states(ab, c)
    right = merge_states(a, merge_states(b, c))
    s1, s2, mask = (np.concatenate([t[i] for t in (ta, tb, tc)], axis=1) for i in range(3))
    assert_states_close(left, right, s1, s2, mask)
    assert_states_close(left, state_of(s1, s2, mask, np.arange(s1.shape[1])), s1, s2, mask)


@given(tiles())
def test_start_state_is_the_identity_and_forms_do_not_mix(tile):
    a = state_of(*tile, np.arange(tile[0].shape[1]))
    e = initial_state((ROWS,), accumulator="max_referenced")
    for merged in (merge_states(a, e), merge_states(e, a)):
        assert all(np.array_equal(x, y) for x, y in zip(merged, a))  # bit-for-bit
    ee = merge_states(e, e)
    assert all(np.array_equal(x, y) for x, y in zip(ee, e)) and isinstance(ee, MaxReferencedState)
    with pytest.raises(ValueError, match="cannot merge"):
        merge_states(a, initial_state((ROWS,)))


# ------------------------------------------------------------------------------------------------
# float32 at large logits
# ------------------------------------------------------------------------------------------------
def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def f32_error_bound(problem: Problem, *, block_k: int, split_k: int = 1, base2: bool = True,
                    evaluations: int = 1):
    """``(kl_bound, lse1_bound, lse2_bound)`` per row ``[B, H, N_Q]``: the float32 rounding model
    of the module docstring for the max-referenced streaming KL (``evaluations=2``: the distance
    between two float32 evaluations that follow the model independently)."""
    d = problem.dims
    s1, s2, mask = dense_scores(*problem.inputs, d, problem.causal)
    abs_in = [np.abs(x) for x in problem.inputs]
    size1 = scaled_scores(abs_in[0], expand_key_heads(abs_in[1], d.group1), d.scale1)
    size2 = scaled_scores(abs_in[2], expand_key_heads(abs_in[3], d.group2), d.scale2)
    fold = 1 if base2 else 0  # one more rounding: σ·log2(e) is a product
    ds1 = gamma(d.D1 + 2 + fold) * size1
    ds2 = gamma(d.D2 + 2 + fold) * size2
    lp1, lse1 = masked_log_softmax(s1, mask)
    lp2, lse2 = masked_log_softmax(s2, mask)
    p1 = np.where(mask, np.exp(lp1), 0.0)
    p2 = np.where(mask, np.exp(lp2), 0.0)
    kl = np.sum(p1 * np.where(mask, lp1 - lp2, 0.0), axis=-1)
    sens = np.sum(p1 * np.abs(np.where(mask, lp1 - lp2, 0.0) - kl[..., None]) * ds1 + np.abs(p2 - p1) * ds2, axis=-1)
    row_has_key = mask.any(axis=-1)
    m1 = np.max(np.where(mask, s1, -np.inf), axis=-1, initial=-np.inf)
    m2 = np.max(np.where(mask, s2, -np.inf), axis=-1, initial=-np.inf)
    m1, m2 = (np.where(row_has_key, m, 0.0)[..., None] for m in (m1, m2))
    dev = np.where(mask, np.abs(s1 - m1) + np.abs(s2 - m2), 0.0)
    magnitude = 1 + np.abs(kl) + np.sum(p1 * dev, axis=-1)
    n_tiles = -(-d.NK // block_k)
    n_splits = -(-n_tiles // -(-n_tiles // min(split_k, n_tiles)))
    per_tile = math.ceil(math.log2(block_k)) + 1 + EXP_ULPS + 5  # tile sum, exp, products, update
    ops = n_tiles * per_tile + n_splits * (EXP_ULPS + 6) + 2 * EXP_ULPS + 6  # merges, finalisation
    kl_bound = evaluations * (sens + ops * U32 * magnitude)
    lse_bounds = []
    for p, ds, lse in ((p1, ds1, lse1), (p2, ds2, lse2)):
        lse_sens = np.sum(p * ds, axis=-1)
        lse_bounds.append(evaluations * (lse_sens + ops * U32 * (1 + np.abs(np.where(row_has_key, lse, 0.0)))))
    return (kl_bound, *lse_bounds)


def offset_problem(seed, scale, c1, c2, spread, close, *, B=1, H=1, NQ=4, NK=24, D=4):
    """Large logits with a small spread: an extra head dim holds a per-row offset ``c_t`` (keys 1
    there), the rest is ``spread``-sized noise, the student's ``close`` times the teacher's plus
    noise of that size; ``|S_t| ≈ scale·|c_t|``. Values exactly representable in float32."""
    rng = np.random.default_rng(seed)
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731 (inputs a kernel could be given)
    q1 = rng.standard_normal((B, H, NQ, D))
    q2 = q1 + close * rng.standard_normal((B, H, NQ, D))  # the student near the teacher
    k1 = rng.standard_normal((B, H, NK, D))
    k2 = k1 + close * rng.standard_normal((B, H, NK, D))
    col = lambda n, v: np.full((B, H, n, 1), v)  # noqa: E731
    return Problem(
        q1=f32(np.concatenate([spread * q1, col(NQ, c1)], -1)), k1=f32(np.concatenate([k1, col(NK, 1.0)], -1)),
        q2=f32(np.concatenate([spread * q2, col(NQ, c2)], -1)), k2=f32(np.concatenate([k2, col(NK, 1.0)], -1)),
        scale1=scale, scale2=scale,
    )


@given(st.integers(0, 2**16), st.sampled_from([1e2, 3e2, 1e3]), st.floats(-10, 10), st.floats(-10, 10),
       st.sampled_from([1e-2, 3e-2, 0.1, 1.0, 10.0]), st.sampled_from([1e-2, 0.1, 1.0]), st.booleans(),
       st.sampled_from([3, 4, 16]))
@example(0, 1e3, 10.0, -10.0, 1e-2, 1e-2, True, 4)  # |S| = 1e4
@example(1, 1e2, 10.0, 5.0, 1e-2, 1e-2, True, 16)  # |S| = 1e3, one tile
@example(2, 1e3, -7.0, 3.0, 3e-2, 1e-2, False, 3)  # base e, ragged tiles
def test_float32_large_logits_max_referenced_within_its_model(seed, scale, c1, c2, spread, close, base2, block_k):
    """The max-referenced float32 KL stays within the rounding model (sized by the exponents
    ``s − m``, not by ``|m|``). Where the student is near the teacher (``close`` small, the regime
    of distillation) the KL is small and so is its sensitivity to the float32 rounding of the
    scores, which both forms share; what is left of the plain form's error is its cancellation
    of ``acc/l1 ≈ m1 − m2`` (``~1e4`` here) against ``m2 − m1``. At the pinned inputs the plain
    form's error is at least 30 times the max-referenced one's (measured: 75–2000 times)."""
    p = offset_problem(seed, scale, c1, c2, spread, close)
    ref = attention_kl(*p.inputs, **p.kw, return_lse=True)
    bounds = f32_error_bound(p, block_k=block_k, base2=base2)
    err = {}
    for accumulator in ACCUMULATORS:
        res = attention_kl_online(*p.inputs, **p.kw, dtype=np.float32, base2=base2, block_q=4,
                                  block_k=block_k, accumulator=accumulator)
        err[accumulator] = np.abs(res.kl - ref[0]).max()
        if accumulator == "max_referenced":
            for name, got, want, bound in zip(("kl", "lse1", "lse2"), res[:3], ref, bounds):
                assert np.all(np.abs(got - want) <= bound), (name, np.abs(got - want).max(), bound.max())
    if (seed, scale, c1, c2, spread, close, base2, block_k) in PINNED:
        assert logit_scale(p).min() >= 900  # |S| ~ 1e3–1e4
        assert err["plain"] >= 30 * err["max_referenced"], err


PINNED = {(0, 1e3, 10.0, -10.0, 1e-2, 1e-2, True, 4), (1, 1e2, 10.0, 5.0, 1e-2, 1e-2, True, 16),
          (2, 1e3, -7.0, 3.0, 3e-2, 1e-2, False, 3)}


# ------------------------------------------------------------------------------------------------
# the Triton forward kernel (interpreter) against the float32 max-referenced emulation
# ------------------------------------------------------------------------------------------------
def normal_problem(seed, B, H, HK1, HK2, NQ, NK, D1, D2, causal):
    p = make_problem(seed=seed, B=B, H=H, HK1=HK1, HK2=HK2, NQ=NQ, NK=NK, D1=D1, D2=D2, causal=causal)
    for name in ("q1", "k1", "q2", "k2"):  # what the kernel is handed: float32 values
        setattr(p, name, getattr(p, name).astype(np.float32).astype(np.float64))
    return p


KERNEL_CASES = [
    pytest.param(lambda: normal_problem(20, 1, 2, 1, 2, 20, 37, 5, 3, False), 1, False, id="ragged-gqa"),
    pytest.param(lambda: normal_problem(21, 1, 2, 2, 1, 23, 13, 4, 6, True), 1, False, id="causal-empty-rows"),
    pytest.param(lambda: normal_problem(22, 2, 1, 1, 1, 17, 50, 3, 3, True), 3, False, id="causal-split3"),
    pytest.param(lambda: offset_problem(23, 1e3, 10.0, -10.0, 1e-2, 1e-2, H=2, NQ=18, NK=40), 1, True,
                 id="logits1e4"),
    pytest.param(lambda: offset_problem(24, 3e2, -8.0, 6.0, 3e-2, 1e-2, NQ=5, NK=70), 2, True,
                 id="logits3e3-split2"),
]


@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("make,split_k,large", KERNEL_CASES)
def test_triton_forward_runs_the_max_referenced_recurrence(make, split_k, large):
    """``streamkl_gpu.attention_kl_with_lse`` on fp32 inputs under the Triton interpreter (16 x 16
    tiles) against ``attention_kl_online(dtype=float32, base2=True, accumulator="max_referenced")``
    at the same tiles and split: the two are the same float32 arithmetic up to the order of the
    dot products, so they agree within two evaluations of the rounding model. At large logits
    the plain-form emulation does not: it is not what the kernel runs."""
    import torch  # a missing install step must fail here, not skip
    import triton  # noqa: F401
    import streamkl_gpu
    from streamkl_gpu import api
    from streamkl_gpu._core import runtime as _runtime

    if not api.interpreting():
        pytest.skip("the kernels are compiled for a GPU here; this check needs the Triton interpreter's fixed tiles")
    block_q, block_k = _runtime.INTERPRETER_BLOCK
    assert (block_q, block_k) == (16, 16)
    p = make()
    kl, lse1, lse2 = streamkl_gpu.attention_kl_with_lse(
        *(torch.from_numpy(x.astype(np.float32)) for x in p.inputs), **p.kw, split_k=split_k)
    kernel = [x.numpy().astype(np.float64) for x in (kl, lse1, lse2)]
    bounds = f32_error_bound(p, block_k=block_k, split_k=split_k, base2=True, evaluations=2)
    gaps = {}
    for accumulator in ACCUMULATORS:
        emu = attention_kl_online(*p.inputs, **p.kw, dtype=np.float32, base2=True, block_q=block_q,
                                  block_k=block_k, accumulator=accumulator, split_k=split_k)
        gaps[accumulator] = []
        for name, k_out, e_out, bound in zip(("kl", "lse1", "lse2"), kernel, emu[:3], bounds):
            assert np.array_equal(np.isneginf(k_out), np.isneginf(e_out)), name
            assert not np.isnan(k_out).any(), name
            empty = np.isneginf(k_out)
            gap = np.abs(np.where(empty, 0.0, k_out) - np.where(empty, 0.0, e_out))
            gaps[accumulator].append(float((gap / bound).max()))  # in units of the bound
    assert max(gaps["max_referenced"]) <= 1.0, gaps
    if large:
        assert gaps["plain"][0] > 1.0, gaps  # the check tells the two forms apart


def dyadic(problem: Problem, step: float) -> Problem:
    """The problem with every input rounded to a multiple of ``step`` (a power of 2): with small
    head dims every ``q·k`` is then exact in float32, whatever order a dot product sums in."""
    for name in ("q1", "k1", "q2", "k2"):
        setattr(problem, name, np.round(getattr(problem, name) / step) * step)
    return problem


EXACT_DOT_CASES = [
    pytest.param(lambda: dyadic(normal_problem(20, 1, 2, 1, 2, 20, 37, 5, 3, False), 1 / 8), 1, id="ragged-gqa"),
    pytest.param(lambda: dyadic(normal_problem(21, 1, 2, 2, 1, 23, 13, 4, 6, True), 1 / 8), 1,
                 id="causal-empty-rows"),
    pytest.param(lambda: dyadic(normal_problem(22, 2, 1, 1, 1, 17, 50, 3, 3, True), 1 / 8), 3, id="causal-split3"),
    pytest.param(lambda: dyadic(offset_problem(25, 1e3, 10.0, -10.0, 0.25, 0.1, H=2, NQ=18, NK=40), 1 / 64), 2,
                 id="logits1e4-split2"),
]


@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("make,split_k", EXACT_DOT_CASES)
def test_triton_forward_bit_for_bit_when_the_dots_are_exact(make, split_k):
    """With exact dot products nothing is left to differ: the interpreter evaluates the kernel's
    float32 operations with NumPy (``exp2``, ``log2``, pairwise ``sum`` over a tile row), and
    the emulation performs the same operations in the same order, so KL and both LSEs are
    bit-for-bit equal. (A Triton or NumPy release that changes how the interpreter reduces or
    exponentiates would break this test and not the one above: then the emulation is still right
    to rounding, but no longer bit-exact.) The plain form is not bit-exact."""
    import torch  # a missing install step must fail here, not skip
    import triton  # noqa: F401
    import streamkl_gpu
    from streamkl_gpu import api
    from streamkl_gpu._core import runtime as _runtime

    if not api.interpreting():
        pytest.skip("the kernels are compiled for a GPU here; this check needs the Triton interpreter")
    block_q, block_k = _runtime.INTERPRETER_BLOCK
    p = make()
    out = streamkl_gpu.attention_kl_with_lse(
        *(torch.from_numpy(x.astype(np.float32)) for x in p.inputs), **p.kw, split_k=split_k)
    emu = {acc: attention_kl_online(*p.inputs, **p.kw, dtype=np.float32, base2=True, block_q=block_q,
                                    block_k=block_k, accumulator=acc, split_k=split_k)
           for acc in ACCUMULATORS}
    for name, k_out, e_out in zip(("kl", "lse1", "lse2"), out, emu["max_referenced"][:3]):
        assert np.array_equal(k_out.numpy(), e_out), (name, np.abs(k_out.numpy() - e_out).max())
    assert not np.array_equal(out[0].numpy(), emu["plain"].kl)


# ------------------------------------------------------------------------------------------------
# streamkl trace --accumulator
# ------------------------------------------------------------------------------------------------
def test_trace_shows_the_kernels_form_and_keeps_its_default(capsys):
    import json

    from streamkl_ref import cli

    def run(*argv):
        assert cli.main(["trace", *argv]) == 0
        return capsys.readouterr().out

    args = ["--causal", "--nq", "6", "--nk", "9", "--block-q", "2", "--block-k", "4", "--base2"]
    assert run(*args) == run(*args, "--accumulator", "plain")  # the default is the plain form
    text = run(*args, "--accumulator", "max_referenced")
    assert "accumulator max_referenced:" in text and "accumulator max_referenced:" not in run(*args)
    plain = json.loads(run(*args, "--json"))
    reref = json.loads(run(*args, "--json", "--accumulator", "max_referenced"))
    assert (plain["params"]["accumulator"], reref["params"]["accumulator"]) == ("plain", "max_referenced")
    for row_p, row_r in zip(plain["rows"], reref["rows"]):
        assert abs(row_r["kl_online"] - row_p["kl_online"]) <= 64 * EPS64 * (1 + abs(row_p["kl_online"]))
        for t_p, t_r in zip(row_p["tiles"], row_r["tiles"]):
            assert all(t_p[k] == t_r[k] for k in ("m1", "l1", "m2", "l2"))  # only acc differs
            if t_p["m1"] != "-inf":  # acc* = acc − l1·(m1 − m2)
                assert abs(t_r["acc"] - (t_p["acc"] - t_p["l1"] * (t_p["m1"] - t_p["m2"]))) <= 64 * EPS64 * (
                    abs(t_p["acc"]) + abs(t_p["l1"] * (t_p["m1"] - t_p["m2"])))
        if row_r["tiles"][-1]["m1"] != "-inf":  # the reported state finalises to the reported KL
            state = MaxReferencedState(*(np.array([float(row_r["tiles"][-1][k])]) for k in OnlineState._fields))
            assert finalize_state(state, base2=True)[0][0] == row_r["kl_online"]
