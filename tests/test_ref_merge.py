"""merge_states: split-K combination of partial online states."""
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from streamkl_ref.strategies import EPS64, ROWS, tiles
from streamkl_ref import OnlineState, finalize_state, initial_state, merge_states, update_state

pytestmark = pytest.mark.filterwarnings("error")



def state_of(s1, s2, mask, cols, base2=False):
    return update_state(initial_state((ROWS,)), s1[:, cols], s2[:, cols], mask[:, cols], base2=base2)


def assert_states_close(a: OnlineState, b: OnlineState, s1, s2, mask, base2=False):
    """Maxima are exact (max is exact); sums agree to rounding relative to the magnitudes summed."""
    assert np.array_equal(a.m1, b.m1) and np.array_equal(a.m2, b.m2)
    exp = np.exp2 if base2 else np.exp
    ref1 = np.where(np.isneginf(a.m1), 0, a.m1)[:, None]
    w1 = np.where(mask, exp(np.where(mask, s1, ref1) - ref1), 0)  # |terms| of l1 and acc
    size = s1.shape[1]
    tol = 4 * size * EPS64
    np.testing.assert_allclose(a.l1, b.l1, rtol=tol, atol=0)
    np.testing.assert_allclose(a.l2, b.l2, rtol=tol, atol=0)
    acc_scale = np.sum(w1 * np.abs(np.where(mask, s1, 0) - np.where(mask, s2, 0)), axis=-1)
    assert np.all(np.abs(a.acc - b.acc) <= tol * acc_scale)


@given(tiles(), st.data(), st.booleans())
@example((np.zeros((ROWS, 2)), np.zeros((ROWS, 2)), np.zeros((ROWS, 2), bool)), None, False)
def test_any_split_in_any_order_gives_the_same_state(tile, data, base2):
    s1, s2, mask = tile
    n = s1.shape[1]
    whole = state_of(s1, s2, mask, np.arange(n), base2)
    if data is None:  # the @example: all masked, a single split
        labels, order = [0] * n, [0]
    else:
        parts = data.draw(st.integers(1, n))
        labels = data.draw(st.lists(st.integers(0, parts - 1), min_size=n, max_size=n))
        order = data.draw(st.permutations(range(parts)))
    partial = [state_of(s1, s2, mask, [j for j in range(n) if labels[j] == p], base2) for p in order]
    merged = partial[0]
    for p in partial[1:]:
        merged = merge_states(merged, p, base2=base2)
    assert_states_close(merged, whole, s1, s2, mask, base2)
    a, b = finalize_state(merged, base2), finalize_state(whole, base2)
    assert all(np.array_equal(np.isneginf(x), np.isneginf(y)) for x, y in zip(a, b))
    assert not any(np.isnan(x).any() for x in a)


@given(tiles(), tiles(), tiles())
def test_merge_is_commutative_and_associative(ta, tb, tc):
    a, b, c = (state_of(*t, np.arange(t[0].shape[1])) for t in (ta, tb, tc))
    ab, ba = merge_states(a, b), merge_states(b, a)
    assert all(np.array_equal(x, y) for x, y in zip(ab, ba))  # commutative exactly
    left = merge_states(ab, c)
    right = merge_states(a, merge_states(b, c))
    # reference: the three key sets side by side, in one state
    s1, s2, mask = (np.concatenate([t[i] for t in (ta, tb, tc)], axis=1) for i in range(3))
    assert_states_close(left, right, s1, s2, mask)


@given(tiles())
def test_start_state_is_the_identity(tile):
    a = state_of(*tile, np.arange(tile[0].shape[1]))
    e = initial_state((ROWS,))
    for merged in (merge_states(a, e), merge_states(e, a)):
        assert all(np.array_equal(x, y) for x, y in zip(merged, a))  # bit-for-bit
    ee = merge_states(e, e)
    assert all(np.array_equal(x, y) for x, y in zip(ee, e))  # empty + empty: empty, no NaN
