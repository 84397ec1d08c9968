"""Checks for statement 9 (09_indexer_loss.md): the indexer loss KL(p || softmax I) with the
head-averaged target p = (1/H) sum_h P_h: the decomposition, the streamed state (sum p log p
without rescaling, sum p (I - m) re-referenced to the student's running max), the merge, the
gradient in the student's inputs, masks and empty rows, and float32 at large logits."""
import math

import mpmath
import numpy as np
import pytest
import sympy as sp
from hypothesis import assume, example, given
from hypothesis import strategies as st

from proofs._mpkit import (
    DPS, NINF, U32, close, cuts_for, finite, indexer_grads, indexer_loss, indexer_row,
    indexer_student_logits, ix_finalize, ix_identity, ix_merge, ix_row_np, ix_update,
    mixture_target, online_row, sym_nonzero_at, sym_zero, teacher_lses, tiles_from_cuts,
)

TRAP = dict(invalid="raise", divide="raise", over="raise")  # as in test_06

# ---- symbolic: two teacher heads, three keys ----------------------------------------------------
N, H = 3, 2
E = [sp.symbols(f"E{h}_0:{N}", positive=True) for h in range(H)]  # exp(S_h[s]) of the teacher
Y = sp.symbols(f"I_0:{N}", real=True)  # student logits
m, m_new = sp.symbols("m mnew", real=True)  # arbitrary shifts (not necessarily maxima)
P = [[E[h][s] / sum(E[h]) for s in range(N)] for h in range(H)]
p = [sum(P[h][s] for h in range(H)) / H for s in range(N)]
LSE_I = sp.log(sum(sp.exp(y) for y in Y))
q = [sp.exp(Y[s]) / sum(sp.exp(y) for y in Y) for s in range(N)]
KL = sum(p[s] * (sp.log(p[s]) - sp.log(q[s])) for s in range(N))  # the definition
PLOGP = sum(p[s] * sp.log(p[s]) for s in range(N))
POINT = {**dict(zip(E[0], [1.3, 0.3, 7.4])), **dict(zip(E[1], [4.5, 1.1, 0.5])),
         **dict(zip(Y, [0.4, 1.1, -0.9])), m: 0.8, m_new: 1.9}


def test_statement_9_decomposition_symbolically():
    assert sym_zero(sum(p) - 1)
    assert sym_zero(KL - (PLOGP - sum(p[s] * Y[s] for s in range(N)) + LSE_I))
    # with ANY shift m of the student's logits (the re-referenced finalisation, uses sum p = 1)
    c = sum(p[s] * (Y[s] - m) for s in range(N))
    ell = sum(sp.exp(Y[s] - m) for s in range(N))
    assert sym_zero(KL - (PLOGP - c + sp.log(ell)))


def test_statement_9_logit_gradient_is_softmax_minus_target_symbolically():
    # the teacher is a constant: any target that sums to 1 (the mixture does, by the test above)
    pg = sp.symbols("p_0:2", positive=True)
    target = list(pg) + [1 - pg[0] - pg[1]]
    kl = sum(target[s] * (sp.log(target[s]) - sp.log(q[s])) for s in range(N))
    for s in range(N):
        assert sym_zero(sp.diff(kl, Y[s]) - (q[s] - target[s]))
    assert sym_zero(sum(q[s] - target[s] for s in range(N)))  # sums to 0: KL ignores a shift of I


def test_statement_9_symbolic_check_rejects_averaging_log_probabilities():
    avg_log = [sum(sp.log(P[h][s]) for h in range(H)) / H for s in range(N)]
    # (a) log p replaced by the head average of log P_h (Jensen: log p >= avg_log, = only if
    # all heads agree at s): a different value, off by a term without I (the same gradient)
    wrong_a = sum(p[s] * avg_log[s] for s in range(N)) - sum(p[s] * Y[s] for s in range(N)) + LSE_I
    # (b) the mean of the per-head KLs: mean_h KL(P_h || q) = KL(p || q) + mean_h KL(P_h || p),
    # again off by a term without I
    mean_kl = sum(sum(P[h][s] * (sp.log(P[h][s]) - sp.log(q[s])) for s in range(N)) for h in range(H)) / H
    spread = sum(sum(P[h][s] * (sp.log(P[h][s]) - sp.log(p[s])) for s in range(N)) for h in range(H)) / H
    assert sym_zero(mean_kl - KL - spread)
    assert not set(Y) & spread.free_symbols
    for wrong in (wrong_a - KL, spread):  # nonzero (at a point): only a value check sees them
        assert sym_nonzero_at(wrong, POINT)
    # (c) the normalised geometric mean as the target (average log-probabilities, then
    # softmax): its gradient q - geo differs from q - p as well
    geo = [sp.exp(a) / sum(sp.exp(b) for b in avg_log) for a in avg_log]
    assert sym_nonzero_at(geo[0] - p[0], POINT)


# ---- symbolic: the student's update and merge ----------------------------------------------------
pw = sp.symbols("p_0:4", positive=True)  # absolute target weights (any, they need not sum to 1)
Iw = sp.symbols("i_0:4", real=True)
mA, mB, M = sp.symbols("mA mB M", real=True)


def invariant(keys, shift):
    """The state (l, mass, c, plogp) that represents ``keys`` with the shift ``shift``."""
    return (sum(sp.exp(Iw[j] - shift) for j in keys), sum(pw[j] for j in keys),
            sum(pw[j] * (Iw[j] - shift) for j in keys), sum(pw[j] * sp.log(pw[j]) for j in keys))


def sym_update(state, shift, shift_new, tile, variant=None):
    l_, mass, c, plogp = state
    a = sp.exp(shift - shift_new)
    c_old = c - (0 if variant == "no_move" else mass * (shift_new - shift))
    if variant == "rescale":
        c_old = c_old * a
    return (a * l_ + sum(sp.exp(Iw[j] - shift_new) for j in tile), mass + sum(pw[j] for j in tile),
            c_old + sum(pw[j] * (Iw[j] - shift_new) for j in tile),
            plogp + sum(pw[j] * sp.log(pw[j]) for j in tile))


def sym_merge(A, B, variant=None):
    (lA, massA, cA, pA), (lB, massB, cB, pB) = A, B
    if variant == "no_move":
        c = cA + cB
    elif variant == "rescale":
        c = (cA - massA * (M - mA)) * sp.exp(mA - M) + (cB - massB * (M - mB)) * sp.exp(mB - M)
    else:
        c = (cA - massA * (M - mA)) + (cB - massB * (M - mB))
    return (sp.exp(mA - M) * lA + sp.exp(mB - M) * lB, massA + massB, c, pA + pB)


def test_statement_9_update_preserves_the_invariant_symbolically():
    got = sym_update(invariant((0, 1), m), m, m_new, (2, 3))
    for g_, w_ in zip(got, invariant((0, 1, 2, 3), m_new)):
        assert sym_zero(g_ - w_)


def test_statement_9_merge_preserves_the_invariant_symbolically():
    got = sym_merge(invariant((0, 2), mA), invariant((1, 3), mB))
    for g_, w_ in zip(got, invariant((0, 1, 2, 3), M)):
        assert sym_zero(g_ - w_)


def test_statement_9_symbolic_check_rejects_a_forgotten_move_and_a_rescaled_c():
    point = {**dict(zip(pw, [0.1, 0.4, 0.2, 0.3])), **dict(zip(Iw, [0.5, -1.0, 2.0, 0.7])),
             m: 0.5, m_new: 2.0, mA: 2.0, mB: 0.7, M: 2.0}
    want = invariant((0, 1, 2, 3), m_new)[2]
    for variant in ("no_move", "rescale"):
        bad = sym_update(invariant((0, 1), m), m, m_new, (2, 3), variant)[2] - want
        assert sym_nonzero_at(bad, point) and not sym_zero(bad)
        bad = sym_merge(invariant((0, 2), mA), invariant((1, 3), mB), variant)[2] - invariant((0, 1, 2, 3), M)[2]
        assert sym_nonzero_at(bad, point) and not sym_zero(bad)


def test_statement_9_target_cannot_be_rescaled_after_the_fact():
    # p from provisional per-head LSEs L_h (say, after the first tile) differs from the true p by
    # the factors e^{L_h - LSE_h}; unless H = 1 (or all factors agree) the ratio depends on the
    # key, so no rescale of sum p log p or sum p I fixes it afterwards: the LSEs come first
    heads = [[1.0, 2.0, -1.0, 3.0], [0.5, -2.0, 2.5, 0.0]]
    with mpmath.workdps(DPS):
        provisional = [online_row(h[:2], h[:2])[1] for h in heads]  # LSEs of the first tile only
        true_p = mixture_target(heads)
        prov_p = mixture_target(heads, provisional)
        ratios = [a / b for a, b in zip(true_p, prov_p)]
        assert abs(ratios[0] - ratios[2]) > 1e-3
        one = [heads[0]]
        r1 = [a / b for a, b in zip(mixture_target(one), mixture_target(one, [online_row(heads[0][:2], heads[0][:2])[1]]))]
        assert all(close(r, r1[0]) for r in r1)  # one head: a single factor


# ---- mpmath, 60 digits -------------------------------------------------------------------------
@st.composite
def indexer_rows(draw, max_n=8, max_h=3, lo=-20.0, hi=20.0):
    """Teacher heads (H lists), student logits, one mask (-inf everywhere masked; rows may be
    empty)."""
    n = draw(st.integers(1, max_n))
    h = draw(st.integers(1, max_h))
    masked = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    heads = [[-math.inf if k else x for k, x in zip(masked, draw(st.lists(finite(lo, hi), min_size=n, max_size=n)))]
             for _ in range(h)]
    logits = [-math.inf if k else x for k, x in zip(masked, draw(st.lists(finite(lo, hi), min_size=n, max_size=n)))]
    return heads, logits


def _streamed(heads, logits, cuts, lses=None):
    """Pass 1 (statement 2's recurrence per head, unless ``lses``), pass 2 (the student's state)."""
    if lses is None:
        lses = [online_row(h, h, cuts)[1] for h in heads]
    pvals = mixture_target(heads, lses)
    state = ix_identity()
    for a, b in tiles_from_cuts(len(logits), cuts):
        state = ix_update(state, pvals[a:b], logits[a:b])
    return state


@given(indexer_rows(), st.data())
@example(([[1.0, 2.0, 3.0], [3.0, 2.0, -1.0]], [0.0, 5.0, -1.0]), None)  # the max moves every tile
@example(([[-math.inf, -math.inf, 5.0]], [-math.inf, -math.inf, -5.0]), None)  # masked first tiles
@example(([[-math.inf] * 2, [-math.inf] * 2], [-math.inf] * 2), None)  # an empty row
def test_statement_9_streamed_state_finalises_to_the_definition(row, data):
    heads, logits = row
    n = len(logits)
    cuts = data.draw(cuts_for(n)) if data is not None else list(range(1, n))
    state = _streamed(heads, logits, cuts)
    got = ix_finalize(state)
    want = indexer_row(heads, logits)
    assert close(got[0], want[0]) and close(got[1], want[1])
    if want[1] != NINF:
        assert close(state.mass, 1)  # the target sums to 1 over the visible keys
        assert close(ix_finalize(state, use_mass=True)[0], want[0])
    # the same with the teacher LSEs given (the caller's lse=), and with them exact
    assert close(ix_finalize(_streamed(heads, logits, cuts, teacher_lses(heads)))[0], want[0])


@st.composite
def sharded_rows(draw):
    heads, logits = draw(indexer_rows(max_n=9))
    n = len(logits)
    k = draw(st.integers(1, n))
    owner = draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n))  # any key sharding
    shards = [[j for j in range(n) if owner[j] == s] for s in range(k)]
    tilings = [draw(st.lists(st.integers(1, max(len(sh) - 1, 1)), max_size=3)) for sh in shards]
    picks = draw(st.lists(st.integers(0, 10 ** 6), min_size=2 * k, max_size=2 * k))
    return heads, logits, shards, tilings, picks


@given(sharded_rows())
@example(([[1.0, -math.inf, 3.0, 0.0]], [2.0, -math.inf, -1.0, 0.5], [[0], [1], [2, 3]],
          [[], [], [1]], [0, 1, 0, 0, 1, 0]))  # a shard that sees only masked keys
def test_statement_9_every_sharding_tiling_and_merge_order_agrees(case):
    heads, logits, shards, tilings, picks = case
    pvals = mixture_target(heads)  # p needs only the teacher LSEs: any shard can form it
    states = []
    for keys, cuts in zip(shards, tilings):
        pv, lv = [pvals[j] for j in keys], [logits[j] for j in keys]
        state = ix_identity()
        for a, b in tiles_from_cuts(len(keys), cuts):
            state = ix_update(state, pv[a:b], lv[a:b])
        states.append(state)
    it = iter(picks)
    while len(states) > 1:  # a random merge tree, random argument order
        A = states.pop(next(it) % len(states))
        B = states.pop(next(it) % len(states))
        states.append(ix_merge(A, B))
    got, want = ix_finalize(states[0]), indexer_row(heads, logits)
    assert close(got[0], want[0]) and close(got[1], want[1])


def test_statement_9_numeric_check_rejects_a_forgotten_move_and_a_rescaled_c():
    heads, logits = [[1.0, 2.0, 3.0], [0.0, -1.0, 4.0]], [1.0, 2.5, 4.0]  # the max moves twice
    pvals = mixture_target(heads)
    exact = indexer_row(heads, logits)[0]

    def run(variant):
        state = ix_identity()
        for j in range(3):
            state = ix_update(state, pvals[j:j + 1], logits[j:j + 1], variant=variant)
        return ix_finalize(state)[0]

    assert close(run(None), exact)
    for variant in ("no_move", "rescale"):
        assert not close(run(variant), exact)


# ---- gradients: mpmath numerical differentiation ----------------------------------------------
@st.composite
def grad_problems(draw):
    H_ = draw(st.integers(1, 2))
    HI = draw(st.sampled_from([1, 2]))
    HKI = draw(st.sampled_from([h for h in (1, 2) if HI % h == 0]))
    nq, nk, di = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 2))

    def mat(*shape, lo=-2.0, hi=2.0):
        if len(shape) == 1:
            return draw(st.lists(finite(lo, hi), min_size=shape[0], max_size=shape[0]))
        return [mat(*shape[1:], lo=lo, hi=hi) for _ in range(shape[0])]

    S = mat(H_, nq, nk, lo=-4, hi=4)  # teacher scores: a constant
    Qi, Ki, W, G = mat(HI, nq, di), mat(HKI, nk, di), mat(HI, nq), mat(nq)
    causal = draw(st.booleans())
    mask = [[s <= t + (nk - nq) for s in range(nk)] for t in range(nq)] if causal else None
    relu = draw(st.booleans())
    return S, Qi, Ki, W, G, mask, relu


def _paths(t, path=()):
    if isinstance(t, list):
        for i, x in enumerate(t):
            yield from _paths(x, path + (i,))
    else:
        yield path


def _get(t, path):
    for i in path:
        t = t[i]
    return t


def _set(t, path, value):
    for i in path[:-1]:
        t = t[i]
    t[path[-1]] = value


def _numeric_grads(prob):
    """d loss / d (each entry of Qi, Ki, W) by mpmath ``diff`` (raised precision)."""
    import copy
    args = list(prob)
    out = []
    with mpmath.workdps(DPS):
        for which in (1, 2, 3):
            grad = copy.deepcopy(args[which])
            for path in _paths(args[which]):
                def f(x, path=path, which=which):
                    arg = copy.deepcopy(args[which])
                    _set(arg, path, x)
                    return indexer_loss(*(args[:which] + [arg] + args[which + 1:]))
                _set(grad, path, mpmath.diff(f, mpmath.mpf(_get(args[which], path))))
            out.append(grad)
    return out


def _all_close(A, B, rel=mpmath.mpf(10) ** -25):
    return all(close(_get(A, p_), _get(B, p_), rel) for p_ in _paths(A))


def _away_from_kinks(prob):
    S, Qi, Ki, W, G, mask, relu = prob
    if not relu:
        return True
    _, a = indexer_student_logits(Qi, Ki, W, relu)
    return all(abs(x) > 1e-6 for x in _paths_values(a))


def _paths_values(t):
    return [_get(t, p_) for p_ in _paths(t)]


PINNED_GRAD = ([[[1.0, -0.5, 2.0], [0.0, 1.5, -1.0]], [[-1.0, 0.5, 0.3], [2.0, -2.0, 1.0]]],  # S [2][2][3]
               [[[1.0, -0.5], [0.3, 0.8]], [[-0.7, 1.2], [0.9, -0.4]]],  # Qi [2][2][2]
               [[[0.6, 1.1], [-1.3, 0.2], [0.5, -0.9]]],  # Ki [1][3][2]: MQA on the indexer side
               [[0.8, -1.1], [1.4, 0.6]],  # W [2][2]
               [1.0, -0.7], None, True)


@given(grad_problems())
@example(PINNED_GRAD)
@example(([[[0.5, -0.3]]], [[[1.0]], [[-1.0]]], [[[0.5], [2.0]]], [[1.0], [0.5]], [1.5],
          [[False, True]], True))  # two indexer heads, one key head, one masked key
def test_statement_9_student_gradients_match_finite_differences(prob):
    assume(_away_from_kinks(prob))  # the ReLU is not differentiable at a = 0
    dQ, dK, dW = indexer_grads(*prob)
    num = _numeric_grads(prob)
    for claim, numeric in zip((dQ, dK, dW), num):
        assert _all_close(numeric, claim)


def test_statement_9_gradient_check_rejects_no_indicator_no_gqa_sum_and_a_flipped_sign():
    num = _numeric_grads(PINNED_GRAD)
    _, a = indexer_student_logits(*PINNED_GRAD[1:4])
    assert min(_paths_values(a)) < 0 < max(_paths_values(a))  # the indicator matters here
    assert all(_all_close(n, c) for n, c in zip(num, indexer_grads(*PINNED_GRAD)))
    for variant in ("no_indicator", "no_gqa_sum", "flipped"):
        claimed = indexer_grads(*PINNED_GRAD, variant=variant)
        assert not all(_all_close(n, c) for n, c in zip(num, claimed)), variant


# ---- masks, empty rows, one-hot teachers: the kernel's row in float64, every invalid op trapped --
@st.composite
def kernel_rows(draw):
    heads, logits = draw(indexer_rows(max_n=10, lo=-30, hi=30))
    B = draw(st.integers(1, 5))
    teacher_scale = draw(st.sampled_from([1.0, 1.0, 50.0]))  # 50: one-hot heads, p underflows to 0
    heads = [[x * teacher_scale for x in h] for h in heads]
    return heads, logits, B, draw(st.booleans())


@given(kernel_rows())
@example(([[-math.inf] * 3, [-math.inf] * 3], [-math.inf] * 3, 2, False))  # an empty row
@example(([[-math.inf, 1500.0, -1500.0], [-math.inf, -1500.0, 1500.0]], [-math.inf, 1.0, 2.0], 1, True))
def test_statement_9_kernel_row_never_forms_nan_and_matches_the_definition(case):
    heads, logits, B, given_lses = case
    lses = [float(x) for x in teacher_lses(heads)] if given_lses else None
    with np.errstate(**TRAP):  # any -inf - (-inf), 0 * inf, 0/0, log 0 or overflow would raise
        kl, lse_i = ix_row_np(heads, logits, B, np.float64, lses=lses)
    want_kl, want_lse = indexer_row(heads, logits)
    if want_lse == NINF:
        assert (kl, lse_i) == (0, -np.inf)
        return
    size = 1 + max(abs(x) for h in heads + [logits] for x in h if x != -math.inf)
    assert abs(float(kl) - float(want_kl)) <= 64 * 2.0 ** -52 * size
    assert abs(float(lse_i) - float(want_lse)) <= 64 * 2.0 ** -52 * size


# ---- float32 at large student logits --------------------------------------------------------------
def _large_case(seed, n, offset, noise, B):
    """A target p and student logits log p + noise + offset (KL ~ noise^2, |I| ~ offset)."""
    rng = np.random.default_rng(seed)
    p_ = rng.dirichlet(np.ones(n))
    logits = (np.log(p_) + rng.normal(0, noise, n) + offset).astype(np.float32)
    return p_.astype(np.float32), logits, B


LARGE = [_large_case(1, 32, 1e4, 0.05, 8), _large_case(2, 48, -7e3, 0.2, 1), _large_case(3, 64, 3e3, 0.01, 16)]


def _exact_kl(p32, logits):
    heads = [[math.log(float(x)) for x in p32]]  # a one-head teacher with P = p32 / sum(p32)
    return float(indexer_row(heads, [float(x) for x in logits])[0])


@pytest.mark.parametrize("case", LARGE)
def test_statement_9_float32_kl_at_large_logits_is_far_below_the_plain_forms_error(case):
    p32, logits, B = case
    p32 = (p32 / p32.sum(dtype=np.float32)).astype(np.float32)
    exact = _exact_kl(p32, logits)
    rr = abs(float(ix_row_np(None, logits, B, np.float32, p=p32)[0]) - exact)
    plain = abs(float(ix_row_np(None, logits, B, np.float32, p=p32, plain=True)[0]) - exact)
    assert plain >= 10 * rr  # measured 100x and more on these rows
    assert rr <= 64 * U32 * (1 + math.log(len(logits)) + exact + (logits.max() - logits.min()))


@st.composite
def grid_logits_and_offsets(draw, max_n=24):
    """Logits on the grid 2^-10 with |I| < 8 and integer offsets |c| <= 16000: every I + c is a
    float32 exactly, so the offset is exact."""
    n = draw(st.integers(1, max_n))
    B = draw(st.integers(1, 8))
    I = np.array(draw(st.lists(st.integers(-8 * 1024 + 1, 8 * 1024 - 1), min_size=n, max_size=n)),
                 np.float32) / np.float32(1024)
    w = np.array(draw(st.lists(st.floats(0.01, 1.0), min_size=n, max_size=n)))
    return (w / w.sum()).astype(np.float32), I, B, np.float32(draw(st.integers(-16000, 16000)))


@given(grid_logits_and_offsets())
@example((np.array([0.25, 0.5, 0.25], np.float32), np.array([0.5, -3.25, 7.0], np.float32), 1, np.float32(9000)))
def test_statement_9_float32_kl_is_bitwise_invariant_under_exact_student_offsets(case):
    p32, I, B, c = case
    shifted = I + c
    assert (shifted.astype(np.float64) == I.astype(np.float64) + float(c)).all()  # exact offsets
    assert ix_row_np(None, shifted, B, np.float32, p=p32)[0] == ix_row_np(None, I, B, np.float32, p=p32)[0]


def test_statement_9_offset_check_rejects_the_plain_form():
    p32 = np.array([0.25, 0.5, 0.125, 0.125], np.float32)
    I = np.array([0.5, -3.25, 7.0, 1.125], np.float32)
    shifted = I + np.float32(9000)
    assert ix_row_np(None, shifted, 1, np.float32, p=p32)[0] == ix_row_np(None, I, 1, np.float32, p=p32)[0]
    assert (ix_row_np(None, shifted, 1, np.float32, p=p32, plain=True)[0]
            != ix_row_np(None, I, 1, np.float32, p=p32, plain=True)[0])
