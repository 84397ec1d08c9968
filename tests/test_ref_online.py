"""The streaming recurrence against the dense reference: tilings, base 2, float32, the guards."""
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from streamkl_ref.strategies import EPS32, Problem, assert_close_rows, logit_scale, make_problem, problems
from streamkl_ref import (
    OnlineResult,
    OnlineState,
    attention_kl,
    attention_kl_online,
    finalize_state,
    initial_state,
    update_state,
)
from streamkl_ref._dense import dense_kl_lse

pytestmark = pytest.mark.filterwarnings("error")  # the guards must keep every step warning-free

blocks = st.integers(1, 9)


@given(problems(), blocks, blocks, st.booleans())
@example(make_problem(seed=1, NQ=7, NK=3, causal=True), 2, 2, False)  # empty rows, ragged tiles
@example(make_problem(seed=2, NQ=3, NK=7, causal=True), 16, 16, True)  # one tile, diagonal masked
@example(make_problem(seed=3, NQ=5, NK=5, causal=True), 1, 1, True)  # every tile 1x1
def test_online_float64_equals_dense(problem, block_q, block_k, base2):
    ref_kl, ref_lse1, ref_lse2 = attention_kl(*problem.inputs, **problem.kw, return_lse=True)
    res = attention_kl_online(*problem.inputs, **problem.kw, block_q=block_q, block_k=block_k, base2=base2)
    assert isinstance(res, OnlineResult)
    kl, lse1, lse2, visited, skipped = res
    scale = logit_scale(problem)
    assert_close_rows(kl, ref_kl, scale, what="kl")
    assert_close_rows(lse1, ref_lse1, scale, what="lse1")
    assert_close_rows(lse2, ref_lse2, scale, what="lse2")
    d = problem.dims
    assert visited + skipped == (-(-d.NQ // block_q)) * (-(-d.NK // block_k))
    if not problem.causal:
        assert skipped == 0


# found by Hypothesis: eight 1-wide tiles on a row whose dense float32 result is nearly exact
# (the floor must grow with the number of sequential tile updates)
_EIGHT_KEYS = Problem(
    q1=np.array([[[[-3.0, 1.875]]]]),
    k1=np.array([[[[-3.0, 1.76772479]] + [[1.76772479, 1.76772479]] * 7]]).reshape(1, 1, 8, 2),
    q2=np.zeros((1, 1, 1, 1)), k2=np.zeros((1, 1, 8, 1)), scale1=0.36751035625072015,
)


@given(problems(max_n=12, max_d=8, amplitude=3.0), blocks, blocks, st.booleans())
@example(_EIGHT_KEYS, 1, 1, False)
def test_online_float32_within_float32_rounding_of_dense(problem, block_q, block_k, base2):
    """FlashAttention-style tolerance. The float32 dense computation (every step in float32) shows
    how much float32 rounding this input costs; the float32 streaming result may be at most twice
    as far from the float64 truth, plus a floor for inputs where the dense result happens to be
    nearly exact: float32 roundings at the logit magnitude, one per key tile (each tile rescales
    and adds to the running sums) and four more (the score itself and the three terms
    ``acc/l1``, ``m2 − m1``, ``log(l2/l1)`` added at the end)."""
    ref = attention_kl(*problem.inputs, **problem.kw, return_lse=True)
    dense32 = dense_kl_lse(*problem.inputs, problem.dims, problem.causal, np.float32)
    online32 = attention_kl_online(*problem.inputs, **problem.kw, block_q=block_q, block_k=block_k,
                                   dtype=np.float32, base2=base2)
    n_tiles = -(-problem.dims.NK // block_k)
    floor = (4 + n_tiles) * EPS32 * (1 + float(logit_scale(problem).max(initial=0.0)))
    for name, r, d32, o32 in zip(("kl", "lse1", "lse2"), ref, dense32, online32[:3]):
        assert o32.dtype == np.float32 and d32.dtype == np.float32
        finite = np.isfinite(r)
        assert np.array_equal(np.isneginf(o32), np.isneginf(r)), name
        err_dense = np.abs(d32[finite] - r[finite]).max(initial=0.0)
        err_online = np.abs(o32[finite] - r[finite]).max(initial=0.0)
        assert err_online <= 2 * err_dense + floor, (name, err_online, err_dense, floor)


def test_float32_mode_really_rounds_to_float32():
    p = make_problem(seed=8, NQ=6, NK=9, D1=7, D2=5)
    r64 = attention_kl_online(*p.inputs, **p.kw, block_q=4, block_k=4)
    events = []
    r32 = attention_kl_online(*p.inputs, **p.kw, block_q=4, block_k=4, dtype=np.float32, on_tile=events.append)
    diff = np.abs(r32.kl.astype(np.float64) - r64.kl)
    assert r32.kl.dtype == np.float32
    # nothing was promoted to float64 on the way: the running state stays float32 throughout
    assert all(x.dtype == np.float32 for e in events for x in e.state)
    assert diff.max() > 0  # float32 arithmetic is not float64 arithmetic in disguise
    assert diff.max() < 1e3 * EPS32 * (1 + np.abs(r64.kl).max())


def test_causal_tiles_skipped_and_counted():
    # N_Q = N_K = 8, 2x2 tiles: the 4x4 tile grid keeps the lower triangle incl. the diagonal
    p = make_problem(seed=9, NQ=8, NK=8, causal=True)
    res = attention_kl_online(*p.inputs, **p.kw, block_q=2, block_k=2)
    assert (res.tiles_visited, res.tiles_skipped) == (10, 6)
    # bottom-right: with N_K = N_Q + 4 the frontier moves right by 4 keys = 2 tiles
    p = make_problem(seed=9, NQ=4, NK=8, causal=True)
    res = attention_kl_online(*p.inputs, **p.kw, block_q=2, block_k=2)
    assert (res.tiles_visited, res.tiles_skipped) == (7, 1)
    # N_Q > N_K: rows 0-3 see no key, so the first two query blocks skip all their tiles
    p = make_problem(seed=9, NQ=6, NK=2, causal=True)
    res = attention_kl_online(*p.inputs, **p.kw, block_q=2, block_k=1)
    assert (res.tiles_visited, res.tiles_skipped) == (2, 4)
    assert np.all(res.kl[..., :4] == 0) and np.all(np.isneginf(res.lse1[..., :4]))


def test_trace_hook_reports_every_tile_and_final_state():
    p = make_problem(seed=10, B=1, H=1, HK1=1, HK2=1, NQ=5, NK=7, causal=True)
    events = []
    res = attention_kl_online(*p.inputs, **p.kw, block_q=2, block_k=3, on_tile=events.append)
    assert len(events) == res.tiles_visited + res.tiles_skipped == 3 * 3
    assert sum(e.skipped for e in events) == res.tiles_skipped
    for qb in range(3):
        last = [e for e in events if e.q_block == qb][-1]
        kl, lse1, lse2 = finalize_state(last.state)
        rows = slice(last.row_start, last.row_stop)
        assert np.array_equal(kl, res.kl[..., rows]) and np.array_equal(lse1, res.lse1[..., rows])
    # the state a skipped tile reports is the state before it
    for prev, ev in zip(events, events[1:]):
        if ev.skipped and ev.q_block == prev.q_block:
            assert all(np.array_equal(a, b) for a, b in zip(prev.state, ev.state))
    assert events[-1].row_stop == 5 and events[-1].key_stop == 7  # padding is not reported


def test_update_state_all_masked_rows_keep_state_exactly():
    rng = np.random.default_rng(11)
    s1, s2 = rng.normal(size=(2, 2, 4, 5)) * 10
    state = update_state(initial_state((2, 4)), s1, s2)
    mask = np.zeros((2, 4, 5), dtype=bool)
    mask[0, 1, 2] = True  # one row gets one visible entry, all others none
    junk1 = np.where(mask, s1 + 50.0, -np.inf)  # masked values are ignored, -inf included
    junk2 = np.where(mask, s2, np.nan)
    new = update_state(state, junk1, junk2, mask)
    keep = ~mask.any(-1)
    for a, b in zip(state, new):
        assert np.array_equal(a[keep], b[keep])  # bit-for-bit
    assert new.m1[0, 1] == s1[0, 1, 2] + 50.0
    # a still-empty row with an all-masked tile stays the start state
    empty = update_state(initial_state((3,)), np.full((3, 2), -np.inf), np.full((3, 2), -np.inf),
                         np.zeros((3, 2), dtype=bool))
    assert all(np.array_equal(a, b) for a, b in zip(empty, initial_state((3,))))
    kl, lse1, lse2 = finalize_state(empty)
    assert np.all(kl == 0) and np.all(np.isneginf(lse1)) and np.all(np.isneginf(lse2))


def test_base2_state_is_in_bits():
    p = make_problem(seed=12, B=1, H=1, HK1=1, HK2=1, NQ=2, NK=4)
    nat, bit = [], []
    attention_kl_online(*p.inputs, block_q=2, block_k=4, on_tile=nat.append)
    attention_kl_online(*p.inputs, block_q=2, block_k=4, base2=True, on_tile=bit.append)
    log2e = 1 / np.log(2)
    np.testing.assert_allclose(bit[0].state.m1, nat[0].state.m1 * log2e, rtol=1e-14)
    np.testing.assert_allclose(bit[0].state.acc / bit[0].state.l1,
                               nat[0].state.acc / nat[0].state.l1 * log2e, rtol=1e-12)
    np.testing.assert_allclose(bit[0].state.l1, nat[0].state.l1, rtol=1e-14)  # l is unit-free


def test_online_state_is_five_named_arrays():
    st0 = initial_state((2, 3), np.float32)
    assert isinstance(st0, OnlineState) and st0._fields == ("m1", "l1", "m2", "l2", "acc")
    assert all(x.dtype == np.float32 and x.shape == (2, 3) for x in st0)
    assert np.all(np.isneginf(st0.m1)) and np.all(st0.l1 == 0) and np.all(st0.acc == 0)
