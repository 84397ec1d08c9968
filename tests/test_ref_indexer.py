"""The indexer loss reference (streamkl_ref._indexer): dense vs mpmath, online vs dense over
tilings, gradients vs finite differences, extreme logits, NaN isolation, bad input."""
import math

import mpmath
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from _indexer_strategies import (
    GRADS,
    NAMES,
    IndexerProblem,
    indexer_logit_scale,
    indexer_problems,
    make_indexer_problem,
)
from streamkl_ref.strategies import EPS32, EPS64, assert_close_rows, kl_tolerance
from streamkl_ref import (
    attention_kl,
    indexer_kl,
    indexer_kl_grad,
    indexer_kl_mp,
    indexer_kl_online,
)
from streamkl_ref._checks import check_indexer_inputs
from streamkl_ref._indexer import check_indexer_call, dense_indexer_kl

pytestmark = pytest.mark.filterwarnings("error")  # NaN propagates quietly, without invalid-value warnings

# pinned shapes: N = 1, N_Q > N_K causal (empty rows), GQA/MQA on both sides, relu off
CASES = {
    "n1": dict(seed=1, NQ=1, NK=1, H=2, HK=1, HI=2, HKI=1),
    "causal_nq_gt_nk_gqa": dict(seed=2, NQ=6, NK=3, H=4, HK=2, HI=4, HKI=2, causal=True),
    "mqa_both_causal_nk_gt_nq": dict(seed=3, NQ=3, NK=7, H=4, HK=1, HI=3, HKI=1, causal=True, scale=0.3),
    "mha_both_relu_off": dict(seed=4, B=2, NQ=4, NK=5, H=2, HK=2, HI=2, HKI=2, relu=False),
}


def _pinned(name):
    return make_indexer_problem(**CASES[name])


# ---- dense vs mpmath ------------------------------------------------------------------------
def _check_against_mp(p: IndexerProblem):
    kl, lse_idx, lse_teacher = indexer_kl(*p.inputs, **p.kw, return_lse=True)
    kl_mp, lse_idx_mp, lse_teacher_mp = indexer_kl_mp(*p.inputs, **p.kw, return_lse=True)
    assert kl.shape == (p.dims.B, p.dims.NQ) and kl.dtype == np.float64
    scale = indexer_logit_scale(p)
    assert_close_rows(kl, kl_mp, scale)
    assert_close_rows(lse_idx, lse_idx_mp, scale, what="lse_idx")
    assert_close_rows(lse_teacher, lse_teacher_mp, scale[:, None], what="lse_teacher")
    assert (kl >= -kl_tolerance(0.0, scale)).all()  # a KL divergence, up to rounding
    empty = ~p.mask.any(axis=1)
    assert (kl[:, empty] == 0).all() and (lse_idx[:, empty] == -np.inf).all()


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_matches_mpmath_on_pinned_shapes(case):
    _check_against_mp(_pinned(case))


@given(indexer_problems())
def test_dense_matches_mpmath(p):
    _check_against_mp(p)


def test_student_equal_to_one_teacher_head_gives_zero():
    # H = 1, no ReLU, one indexer head with weight = sigma reading the teacher's own q, k: I = S
    p = make_indexer_problem(seed=5, H=1, HK=1, D=3, NQ=4, NK=5, causal=True)
    sigma = 1 / math.sqrt(3)
    kl = indexer_kl(p.q, p.k, p.q, p.k, np.full((1, 1, 4), sigma), causal=True, relu=False)
    assert np.abs(kl).max() <= 16 * EPS64


def test_one_teacher_head_is_attention_kl():
    # with H = 1 the target is P_1 itself: KL equals attention_kl with side 2 = the student,
    # when the student is a scaled dot product (no ReLU, one head)
    p = make_indexer_problem(seed=6, H=1, HK=1, HI=1, HKI=1, NQ=4, NK=6, D=3, DI=2, causal=True)
    w = np.full((1, 1, 4), 0.7)
    want = attention_kl(p.q, p.k, p.q_idx, p.k_idx, causal=True, scale2=0.7)[:, 0]
    got = indexer_kl(p.q, p.k, p.q_idx, p.k_idx, w, causal=True, relu=False)
    assert np.abs(got - want).max() <= 64 * EPS64


# ---- online vs dense ------------------------------------------------------------------------
def _check_online(p: IndexerProblem, block_q, block_k, with_lse):
    kl, lse_idx, lse_teacher = indexer_kl(*p.inputs, **p.kw, return_lse=True)
    res = indexer_kl_online(*p.inputs, **p.kw, lse=lse_teacher if with_lse else None,
                            block_q=block_q, block_k=block_k)
    got_kl, got_lse, stats = res
    scale = indexer_logit_scale(p)
    assert_close_rows(got_kl, kl, scale)
    assert_close_rows(got_lse, lse_idx, scale, what="lse_idx")
    d = p.dims
    n_tiles = -(-d.NQ // block_q) * -(-d.NK // block_k)
    want_skipped = 0
    if p.causal:
        for r0 in range(0, d.NQ, block_q):
            last = min(r0 + block_q, d.NQ) - 1
            want_skipped += sum(c0 > last + d.NK - d.NQ for c0 in range(0, d.NK, block_k))
    assert (stats.tiles_visited, stats.tiles_skipped) == (n_tiles - want_skipped, want_skipped)
    lse_pass = (0, 0) if with_lse else (n_tiles - want_skipped, want_skipped)
    assert (stats.lse_tiles_visited, stats.lse_tiles_skipped) == lse_pass


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("blocks", [(1, 1), (2, 3), (4, 2), (16, 16)])
@pytest.mark.parametrize("with_lse", [False, True])
def test_online_matches_dense_on_pinned_shapes(case, blocks, with_lse):
    _check_online(_pinned(case), *blocks, with_lse)


@given(indexer_problems(), st.integers(1, 7), st.integers(1, 7), st.booleans())
def test_online_matches_dense(p, block_q, block_k, with_lse):
    _check_online(p, block_q, block_k, with_lse)


def test_online_skips_causal_tiles():
    p = make_indexer_problem(seed=7, NQ=16, NK=16, causal=True)
    stats = indexer_kl_online(*p.inputs, **p.kw, block_q=4, block_k=4).stats
    assert stats == (10, 6, 10, 6)  # 4x4 grid: the 6 tiles above the diagonal are skipped


def test_online_float32_tracks_the_float32_dense_error():
    # the tolerance rule: the float32 recurrence errs like a float32 dense computation
    p = make_indexer_problem(seed=8, H=4, HK=1, HI=4, HKI=1, NQ=24, NK=24, D=8, DI=4, causal=True,
                             weight_amplitude=3.0)
    exact = indexer_kl(*p.inputs, **p.kw)
    arrays, dims, relu = check_indexer_call(*p.inputs, scale=p.scale, relu=p.relu, dtype=np.float32)
    dense32 = dense_indexer_kl(arrays, dims, p.causal, relu)[0]
    online32 = indexer_kl_online(*p.inputs, **p.kw, block_q=8, block_k=4, dtype=np.float32).kl
    assert online32.dtype == np.float32
    ref_err = np.abs(dense32 - exact).max()
    floor = 8 * EPS32 * (1 + indexer_logit_scale(p).max())
    assert np.abs(online32 - exact).max() <= 4 * ref_err + floor


# ---- extreme logits -------------------------------------------------------------------------
EXTREME = {
    # teacher scale 1e3: every head one-hot (to double precision), p a mixture of one-hots
    "one_hot_teacher": dict(seed=9, H=4, HK=2, NQ=5, NK=6, D=4, scale=1e3),
    # weights scaled so |I| reaches 1e4: LSE_I and Σ p·I are ~1e4 and cancel to a moderate KL
    "large_indexer_logits": dict(seed=10, H=2, HK=1, HI=3, NQ=5, NK=7, D=3, DI=3, weight_amplitude=3e3,
                                 causal=True),
    "both": dict(seed=11, H=2, HK=2, HI=2, HKI=2, NQ=4, NK=4, D=2, DI=2, scale=5e2, weight_amplitude=2e3,
                 relu=False),
}


@pytest.mark.parametrize("case", sorted(EXTREME))
def test_extreme_logits_online_float64_stays_accurate(case):
    p = make_indexer_problem(**EXTREME[case])
    scale = indexer_logit_scale(p)
    assert scale.max() >= 1e3  # the case is extreme
    kl_mp, lse_mp, lse_t_mp = indexer_kl_mp(*p.inputs, **p.kw, return_lse=True)
    assert_close_rows(indexer_kl(*p.inputs, **p.kw), kl_mp, scale)
    for blocks in ((1, 1), (2, 3), (8, 8)):
        for lse in (None, lse_t_mp):
            kl, lse_idx, _ = indexer_kl_online(*p.inputs, **p.kw, lse=lse, block_q=blocks[0], block_k=blocks[1])
            assert_close_rows(kl, kl_mp, scale)
            assert_close_rows(lse_idx, lse_mp, scale, what="lse_idx")


def test_rereferenced_accumulator_beats_the_plain_one_at_large_logits():
    # logits ~1e4 with the student equal to the target (KL ~ 0): the plain form cancels Σ p·I
    # against LSE_I (both ~1e4) and loses eps32·1e4; the re-referenced sum never holds the max.
    # One teacher head, no ReLU, I = S + 1e4: an extra indexer dim with key 1 and query c.
    p = make_indexer_problem(seed=12, H=1, HK=1, NQ=6, NK=8, D=2)
    big = 1e4
    sigma = 1 / math.sqrt(2)
    q_idx = np.concatenate([p.q, np.full((1, 1, 6, 1), big / sigma)], axis=-1)
    k_idx = np.concatenate([p.k, np.ones((1, 1, 8, 1))], axis=-1)
    weights = np.full((1, 1, 6), sigma)
    kl_mp = indexer_kl_mp(p.q, p.k, q_idx, k_idx, weights, relu=False)
    assert np.abs(kl_mp).max() <= 1e-12  # the student is the target
    errs = {}
    for acc in ("max_referenced", "plain"):
        got = indexer_kl_online(p.q, p.k, q_idx, k_idx, weights, relu=False, block_k=3, accumulator=acc,
                                dtype=np.float32).kl
        errs[acc] = np.abs(got - kl_mp).max()
    # (the float32 logits themselves err by eps32·1e4 per entry; at KL's minimum that costs
    # only second order, so the re-referenced error is far below eps32·1e4)
    assert errs["plain"] >= 10 * errs["max_referenced"], errs
    assert errs["max_referenced"] <= 64 * EPS32 * 10, errs


# ---- gradients ------------------------------------------------------------------------------
DPS = 50
STEP = mpmath.mpf("1e-20")


def _mp_objects(x):
    obj = np.empty(x.shape, dtype=object)
    for idx in np.ndindex(x.shape):
        obj[idx] = mpmath.mpf(float(x[idx]))
    return obj


def _mp_fd(p, g, which):
    """``∂(Σ g·KL)/∂input[which]`` by central differences in mpmath (step 1e-20 at 50 digits)."""
    objs = [_mp_objects(x) for x in p.inputs]

    def loss():
        kl = indexer_kl_mp(*objs, **p.kw, dps=DPS, return_mpf=True)
        with mpmath.workdps(DPS):
            return mpmath.fsum(mpmath.mpf(float(a)) * b for a, b in zip(g.ravel(), kl.ravel()))

    target = objs[which]
    out = np.empty(target.shape)
    for idx in np.ndindex(target.shape):
        orig = target[idx]
        with mpmath.workdps(DPS):
            target[idx] = orig + STEP
            up = loss()
            target[idx] = orig - STEP
            down = loss()
            target[idx] = orig
            out[idx] = float((up - down) / (2 * STEP))
    return out


GRAD_CASES = {
    "gqa_causal_nq_gt_nk": dict(seed=21, H=2, HK=1, HI=2, HKI=1, NQ=4, NK=3, D=2, DI=2, causal=True),
    "mha_idx_relu_off": dict(seed=22, H=2, HK=2, HI=2, HKI=2, NQ=2, NK=4, D=2, DI=3, relu=False),
    "scaled_batch2": dict(seed=23, B=2, H=1, HK=1, HI=3, HKI=1, NQ=2, NK=3, D=2, DI=2, scale=0.7, causal=True),
}


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_closed_form_matches_mpmath_finite_differences(case):
    p = make_indexer_problem(**GRAD_CASES[case])
    g = np.random.default_rng(99).standard_normal((p.dims.B, p.dims.NQ))
    grads = indexer_kl_grad(*p.inputs, g, **p.kw)
    assert set(grads) == set(GRADS)
    for which, name in zip((2, 3, 4), GRADS):
        assert grads[name].shape == p.inputs[which].shape and grads[name].dtype == np.float64
        fd = _mp_fd(p, g, which)
        scale = (1 + np.abs(fd).max()) * (1 + indexer_logit_scale(p).max())
        assert np.abs(grads[name] - fd).max() <= 1e-13 * scale, name
        assert np.abs(fd).max() > 1e-3  # a real gradient, not two zeros


@given(indexer_problems(max_n=5, max_d=3), st.integers(0, 2**32 - 1))
@settings(max_examples=10)
def test_closed_form_matches_float64_central_differences(p, seed):
    # a directional derivative: (L(x + hv) − L(x − hv)) / 2h against <grad, v> for all three inputs
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((p.dims.B, p.dims.NQ))
    grads = indexer_kl_grad(*p.inputs, g, **p.kw)
    dirs = [rng.standard_normal(p.inputs[i].shape) for i in (2, 3, 4)]
    h = 1e-6

    def loss(t):
        x = list(p.inputs)
        for i, v in zip((2, 3, 4), dirs):
            x[i] = x[i] + t * v
        return float(np.sum(g * indexer_kl(*x, **p.kw)))

    fd = (loss(h) - loss(-h)) / (2 * h)
    claimed = sum(float(np.sum(grads[n] * v)) for n, v in zip(GRADS, dirs))
    size = sum(float(np.sum(np.abs(grads[n] * v))) for n, v in zip(GRADS, dirs))
    if p.relu:  # a kink of a ReLU within h of the point would make the difference meaningless
        d = p.dims
        from streamkl_ref._scores import expand_key_heads
        a = p.q_idx @ np.swapaxes(expand_key_heads(p.k_idx, d.group_idx), -1, -2)
        if np.min(np.abs(a), initial=np.inf) < 1e-3:
            return
    assert abs(fd - claimed) <= 1e-6 * (1 + size) * (1 + float(indexer_logit_scale(p).max())) ** 2


def test_empty_rows_and_masked_entries_get_zero_gradient():
    p = _pinned("causal_nq_gt_nk_gqa")  # rows 0..2 see no key
    g = np.ones((1, 6))
    grads = indexer_kl_grad(*p.inputs, g, **p.kw)
    assert not grads["dq_idx"][:, :, :3].any() and not grads["dweights"][:, :, :3].any()
    # the gradient of the empty rows' g does not matter either
    g2 = g.copy()
    g2[:, :3] = 123.0
    for name, v in indexer_kl_grad(*p.inputs, g2, **p.kw).items():
        assert np.array_equal(v, grads[name]), name


def test_teacher_inputs_get_no_gradient_key():
    p = _pinned("n1")
    assert set(indexer_kl_grad(*p.inputs, np.ones((1, 1)), **p.kw)) == {"dq_idx", "dk_idx", "dweights"}


# ---- NaN isolation --------------------------------------------------------------------------
def _nan_reach(p: IndexerProblem, which: int, idx: tuple):
    """Rows ``[B, NQ]`` that a NaN at ``inputs[which][idx]`` must reach (and no others)."""
    d = p.dims
    mask = p.mask
    has_key = mask.any(axis=1)
    rows = np.zeros((d.B, d.NQ), dtype=bool)
    b = idx[0]
    if which in (0, 2):  # a query row (teacher or indexer)
        rows[b, idx[2]] = has_key[idx[2]]
    elif which in (1, 3):  # a key: every row that sees it (p mixes all teacher heads)
        rows[b] = mask[:, idx[2]]
    else:  # weights [b, j, t]
        rows[b, idx[2]] = has_key[idx[2]]
    return rows


@st.composite
def nan_cases(draw):
    p = draw(indexer_problems(max_n=5, max_d=3))
    which = draw(st.integers(0, 4))
    x = p.inputs[which]
    idx = tuple(draw(st.integers(0, n - 1)) for n in x.shape)
    return p, which, idx


@given(nan_cases())
@example((make_indexer_problem(seed=30, NQ=5, NK=3, causal=True), 1, (0, 0, 2, 1)))  # key seen by 3 rows
@example((make_indexer_problem(seed=31, NQ=5, NK=3, causal=True), 0, (0, 1, 0, 0)))  # NaN in an empty row
@example((make_indexer_problem(seed=32, NQ=5, NK=3, causal=True), 3, (0, 0, 2, 1)))  # indexer key seen by 1 row
@example((make_indexer_problem(seed=33, NQ=5, NK=3, causal=True), 2, (0, 1, 0, 0)))  # indexer query, empty row
def test_nan_reaches_exactly_the_rows_it_touches(case):
    p, which, idx = case
    clean = indexer_kl(*p.inputs, **p.kw)
    clean_online = indexer_kl_online(*p.inputs, **p.kw, block_q=2, block_k=2).kl
    g = np.ones((p.dims.B, p.dims.NQ))
    clean_grads = indexer_kl_grad(*p.inputs, g, **p.kw)
    inputs = [x.copy() for x in p.inputs]
    inputs[which][idx] = np.nan
    reach = _nan_reach(p, which, idx)
    for got, base in ((indexer_kl(*inputs, **p.kw), clean),
                      (indexer_kl_online(*inputs, **p.kw, block_q=2, block_k=2).kl, clean_online)):
        assert np.array_equal(np.isnan(got), reach)
        np.testing.assert_allclose(got[~reach], base[~reach], rtol=1e-13, atol=1e-13)
    grads = indexer_kl_grad(*inputs, g, **p.kw)
    # row gradients: NaN in exactly the reached rows (every indexer head); keys: the keys any
    # reached row sees (G is shared by the heads, so every indexer key head)
    key_reach = (reach[:, :, None] & p.mask[None]).any(axis=1)  # [B, NK]
    want = {"dq_idx": reach[:, None, :, None], "dweights": reach[:, None, :], "dk_idx": key_reach[:, None, :, None]}
    for name in GRADS:
        got_nan = np.isnan(grads[name])
        assert np.array_equal(got_nan, np.broadcast_to(want[name], got_nan.shape)), name
        np.testing.assert_allclose(grads[name][~got_nan], clean_grads[name][~got_nan], rtol=1e-12, atol=1e-13)


def test_nan_in_grad_kl_reaches_only_its_row():
    p = make_indexer_problem(seed=32, NQ=4, NK=4, causal=True)
    g = np.ones((1, 4))
    g[0, 1] = np.nan
    grads = indexer_kl_grad(*p.inputs, g, **p.kw)
    assert np.isnan(grads["dweights"][0, :, 1]).all() and not np.isnan(grads["dweights"][0, :, [0, 2, 3]]).any()
    assert np.isnan(grads["dk_idx"][0, 0, :2]).all() and not np.isnan(grads["dk_idx"][0, 0, 2:]).any()


# ---- bad input ------------------------------------------------------------------------------
def _good():
    return list(make_indexer_problem(seed=40, H=4, HK=2, HI=4, HKI=2, NQ=3, NK=5).inputs)


def _bad_inputs():
    q, k, qi, ki, w = _good()
    return {
        "q 3-D": ([q[0], k, qi, ki, w], "q"),
        "k batch": ([q, np.concatenate([k, k]), qi, ki, w], "k"),
        "k head dim": ([q, k[..., :2], qi, ki, w], "k"),
        "k heads not dividing H": ([q, np.concatenate([k, k[:, :1]], axis=1), qi, ki, w], "k"),
        "q_idx batch": ([q, k, np.concatenate([qi, qi]), ki, w], "q_idx"),
        "q_idx rows": ([q, k, qi[:, :, :2], ki, w], "q_idx"),
        "k_idx keys": ([q, k, qi, ki[:, :, :4], w], "k_idx"),
        "k_idx head dim": ([q, k, qi, ki[..., :1], w], "k_idx"),
        "k_idx heads not dividing H_I": ([q, k, qi, np.concatenate([ki, ki[:, :1]], axis=1), w], "k_idx"),
        "k_idx 5-D": ([q, k, qi, ki[None], w], "k_idx"),
        "weights heads": ([q, k, qi, ki, w[:, :2]], "weights"),
        "weights rows": ([q, k, qi, ki, w[:, :, :2]], "weights"),
        "weights 2-D": ([q, k, qi, ki, w[:, 0]], "weights"),
        "weights list": ([q, k, qi, ki, None], "weights"),
        "q complex": ([q + 1j, k, qi, ki, w], "q"),
    }


def _call(fn, inputs, **kw):
    B, NQ = 1, 3
    if fn is indexer_kl_grad:
        return fn(*inputs, kw.pop("grad_kl", np.zeros((B, NQ))), **kw)
    return fn(*inputs, **kw)


FUNCTIONS = [indexer_kl, indexer_kl_mp, indexer_kl_online, indexer_kl_grad]
BAD = _bad_inputs()


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_shapes_name_the_argument(fn, case):
    inputs, name = BAD[case]
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        _call(fn, inputs)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("kw, name", [
    (dict(scale=-1.0), "scale"), (dict(scale=float("nan")), "scale"), (dict(scale=True), "scale"),
    (dict(scale="0.5"), "scale"), (dict(relu="yes"), "relu"), (dict(relu=None), "relu"),
])
def test_bad_options_name_the_argument(fn, kw, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        _call(fn, _good(), **kw)


@pytest.mark.parametrize("kw, name", [
    (dict(lse=np.zeros((1, 4))), "lse"), (dict(lse=np.zeros((1, 2, 3))), "lse"),
    (dict(lse=np.zeros((1, 4, 3), dtype=complex)), "lse"),
    (dict(block_q=0), "block_q"), (dict(block_k=2.0), "block_k"),
    (dict(dtype=np.float16), "dtype"), (dict(accumulator="bits"), "accumulator"),
])
def test_bad_online_options_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        indexer_kl_online(*_good(), **kw)


@pytest.mark.parametrize("grad_kl", [np.zeros((1, 4, 3)), np.zeros((1, 2)), np.zeros(3)])
def test_bad_grad_kl_names_the_argument(grad_kl):
    with pytest.raises(ValueError, match=r"\bgrad_kl\b"):
        indexer_kl_grad(*_good(), grad_kl)


@pytest.mark.parametrize("dps", [10, 50.0, True])
def test_bad_dps_names_the_argument(dps):
    with pytest.raises(ValueError, match=r"\bdps\b"):
        indexer_kl_mp(*_good(), dps=dps)


def test_check_indexer_inputs_works_on_shapes_only():
    class Fake:  # anything with .ndim and .shape (a torch tensor, say)
        def __init__(self, *shape):
            self.shape, self.ndim = shape, len(shape)

    d = check_indexer_inputs(Fake(2, 8, 5, 576), Fake(2, 1, 7, 576), Fake(2, 4, 5, 64), Fake(2, 1, 7, 64),
                             Fake(2, 4, 5), scale=192 ** -0.5)
    assert (d.B, d.H, d.HK, d.NQ, d.NK, d.D, d.HI, d.HKI, d.DI) == (2, 8, 1, 5, 7, 576, 4, 1, 64)
    assert d.group == 8 and d.group_idx == 4 and d.scale == 192 ** -0.5
    assert check_indexer_inputs(Fake(1, 2, 3, 16), Fake(1, 2, 4, 16), Fake(1, 1, 3, 2), Fake(1, 1, 4, 2),
                                Fake(1, 1, 3)).scale == 0.25
