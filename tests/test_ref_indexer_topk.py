"""The sparse stage's indexer loss reference (streamkl_ref.indexer_kl_topk): the KL over each
row's selected keys, each teacher head's softmax and the student's taken over the set
(Megatron-LM's sparse_loss convention)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _indexer_strategies import GRADS, indexer_logit_scale, indexer_problems, make_indexer_problem
from streamkl_ref.strategies import assert_close_rows
from streamkl_ref import indexer_kl, indexer_kl_grad, indexer_kl_topk, indexer_kl_topk_grad, indexer_kl_topk_mp

pytestmark = pytest.mark.filterwarnings("error")


def _random_sets(rng, B, NQ, NK, K):
    """``[B, NQ, K]`` int32: each row a random set of 0..K distinct keys, padded with -1 anywhere."""
    out = np.full((B, NQ, K), -1, np.int32)
    for b in range(B):
        for t in range(NQ):
            chosen = rng.choice(NK, size=rng.integers(0, min(K, NK) + 1), replace=False)
            slots = rng.choice(K, size=len(chosen), replace=False)
            out[b, t, slots] = chosen
    return out


@given(indexer_problems(max_n=5, max_d=3), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_topk_matches_mpmath(p, K, seed):
    sets = _random_sets(np.random.default_rng(seed), p.dims.B, p.dims.NQ, p.dims.NK, K)
    assert_close_rows(indexer_kl_topk(*p.inputs, sets, **p.kw), indexer_kl_topk_mp(*p.inputs, sets, **p.kw),
                      indexer_logit_scale(p))


@given(indexer_problems(max_n=6), st.integers(0, 2**32 - 1))
def test_every_visible_key_listed_is_the_dense_loss(p, seed):
    rng = np.random.default_rng(seed)
    d = p.dims
    extra = int(rng.integers(0, 3))  # -1 padding slots, anywhere
    sets = np.full((d.B, d.NQ, d.NK + extra), -1, np.int32)
    for b in range(d.B):
        for t in range(d.NQ):
            sets[b, t, rng.choice(d.NK + extra, size=d.NK, replace=False)] = rng.permutation(d.NK)
    scale = indexer_logit_scale(p)
    assert_close_rows(indexer_kl_topk(*p.inputs, sets, **p.kw), indexer_kl(*p.inputs, **p.kw), scale)
    g = rng.standard_normal((d.B, d.NQ))
    got, want = indexer_kl_topk_grad(*p.inputs, sets, g, **p.kw), indexer_kl_grad(*p.inputs, g, **p.kw)
    for name in GRADS:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12 * (1 + scale.max()))


def test_slot_order_and_padding_do_not_matter():
    p = make_indexer_problem(seed=50, B=2, NQ=5, NK=7, H=4, HK=2, HI=2, causal=True)
    rng = np.random.default_rng(1)
    sets = _random_sets(rng, 2, 5, 7, 4)
    base = indexer_kl_topk(*p.inputs, sets, **p.kw)
    shuffled = np.stack([np.stack([rng.permutation(row) for row in batch]) for batch in sets])
    padded = np.concatenate([np.full((2, 5, 2), -1, np.int32), shuffled], axis=-1)
    for other in (shuffled, padded):
        np.testing.assert_allclose(indexer_kl_topk(*p.inputs, other, **p.kw), base, rtol=1e-14, atol=1e-15)


def test_rows_with_an_empty_set_give_zero_loss_and_gradient():
    p = make_indexer_problem(seed=51, NQ=4, NK=5, causal=True)
    sets = np.array([[[4, -1], [-1, -1], [0, 1], [2, 3]]], np.int32)  # row 0 sees keys 0..1 only
    kl = indexer_kl_topk(*p.inputs, sets, **p.kw)
    assert kl[0, 0] == 0 and kl[0, 1] == 0 and (kl[0, 2:] > 0).all()
    grads = indexer_kl_topk_grad(*p.inputs, sets, np.ones((1, 4)), **p.kw)
    assert not grads["dq_idx"][:, :, :2].any() and not grads["dweights"][:, :, :2].any()
    assert not grads["dk_idx"][:, :, 4].any()  # key 4 is in no row's visible set


def test_each_head_renormalised_over_the_set_not_the_full_row_mixture():
    # two one-hot-ish heads on different keys; the set holds one of them plus a neutral key
    q = np.array([[[[1.0]], [[1.0]]]])
    k = np.array([[[[3.0], [0.0], [0.0]], [[0.0], [0.0], [3.0]]]])  # head 0 -> key 0, head 1 -> key 2
    zero = np.zeros((1, 1, 1, 1))
    sets = np.array([[[0, 1]]], np.int32)
    kl = indexer_kl_topk(q, k, zero, np.zeros((1, 1, 3, 1)), np.ones((1, 1, 1)), sets, scale=1.0, relu=False)
    P0 = np.exp([3.0, 0.0, 0.0]) / np.exp([3.0, 0.0, 0.0]).sum()
    P1 = np.exp([0.0, 0.0, 3.0]) / np.exp([0.0, 0.0, 3.0]).sum()
    per_head = (P0[:2] / P0[:2].sum() + P1[:2] / P1[:2].sum()) / 2  # Megatron: softmax per head over {0, 1}
    want = float(np.sum(per_head * np.log(per_head / 0.5)))  # the student is uniform (all logits 0)
    mix = (P0 + P1)[:2] / (P0 + P1)[:2].sum()  # the other convention: the full-row mixture renormalised
    other = float(np.sum(mix * np.log(mix / 0.5)))
    assert abs(kl[0, 0] - want) <= 1e-14 and abs(want - other) > 1e-2


def test_topk_gradient_matches_float64_central_differences():
    p = make_indexer_problem(seed=53, B=2, NQ=5, NK=6, H=2, HK=1, HI=3, HKI=1, causal=True)
    rng = np.random.default_rng(2)
    sets = _random_sets(rng, 2, 5, 6, 4)
    g = rng.standard_normal((2, 5))
    grads = indexer_kl_topk_grad(*p.inputs, sets, g, **p.kw)
    h = 1e-6
    for which, name in zip((2, 3, 4), GRADS):
        x = p.inputs[which]
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xs = [a.copy() for a in p.inputs]
            xs[which][idx] += h
            up = np.sum(g * indexer_kl_topk(*xs, sets, **p.kw))
            xs[which][idx] -= 2 * h
            down = np.sum(g * indexer_kl_topk(*xs, sets, **p.kw))
            fd[idx] = (up - down) / (2 * h)
        assert np.abs(grads[name] - fd).max() <= 1e-7 * (1 + np.abs(fd).max()), name
        assert np.abs(fd).max() > 1e-3


def test_nan_at_an_unselected_key():
    p = make_indexer_problem(seed=54, NQ=3, NK=4)
    sets = np.array([[[0, 1], [0, 1], [2, 3]]], np.int32)
    q, k, q_idx, k_idx, w = (x.copy() for x in p.inputs)
    k_idx[0, 0, 3] = np.nan  # the student's key 3: only row 2 selects it
    kl = indexer_kl_topk(q, k, q_idx, k_idx, w, sets, **p.kw)
    assert np.isnan(kl).tolist() == [[False, False, True]]
    grads = indexer_kl_topk_grad(q, k, q_idx, k_idx, w, sets, np.ones((1, 3)), **p.kw)
    assert np.isnan(grads["dweights"][0, :, 2]).all() and not np.isnan(grads["dweights"][0, :, :2]).any()
    k = p.k.copy()
    k[0, 0, 3] = np.nan  # the teacher's key 3: the LSEs are over each row's set, so only row 2
    kl = indexer_kl_topk(k=k, q=p.q, q_idx=p.q_idx, k_idx=p.k_idx, weights=p.weights, topk_indices=sets, **p.kw)
    assert np.isnan(kl).tolist() == [[False, False, True]]


@pytest.mark.parametrize("bad", [
    np.zeros((1, 3), np.int32),  # 2-D
    np.zeros((1, 2, 2), np.int32),  # wrong N_Q
    np.zeros((1, 3, 2)),  # floats
    np.full((1, 3, 2), 4, np.int32),  # out of range (N_K = 4)
    np.full((1, 3, 2), -2, np.int32),  # below -1
    np.array([[[1, 1], [0, -1], [2, 3]]], np.int32),  # a key twice in one row
])
def test_bad_topk_indices_name_the_argument(bad):
    p = make_indexer_problem(seed=55, NQ=3, NK=4)
    with pytest.raises(ValueError, match=r"\btopk_indices\b"):
        indexer_kl_topk(*p.inputs, bad, **p.kw)
    with pytest.raises(ValueError, match=r"\btopk_indices\b"):
        indexer_kl_topk_grad(*p.inputs, bad, np.zeros((1, 3)), **p.kw)


def test_topk_checks_the_other_inputs_too():
    p = make_indexer_problem(seed=56, NQ=3, NK=4)
    sets = np.zeros((1, 3, 1), np.int32)
    with pytest.raises(ValueError, match=r"\bweights\b"):
        indexer_kl_topk(p.q, p.k, p.q_idx, p.k_idx, p.weights[:, :, :2], sets)
    with pytest.raises(ValueError, match=r"\bgrad_kl\b"):
        indexer_kl_topk_grad(*p.inputs, sets, np.zeros((1, 4)))
