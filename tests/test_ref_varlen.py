"""streamkl_ref.attention_kl_varlen(_grad): packed sequences, checked against independent code.

- forward: each sequence against the float64 PyTorch materialisation (streamkl_gpu.naive), a
  different implementation from the dense reference the packing calls;
- gradients: against central finite differences of the packed forward itself (so a row or key
  scattered to the wrong place cannot pass);
- conventions: zero-length sequences, queries without keys (KL 0, LSE -inf, zero gradients),
  sequences that cannot see each other; bad input -> ValueError naming it.
"""
import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import streamkl_ref
from streamkl_gpu.naive import attention_kl_naive

GRADS = ("dq1", "dk1", "dq2", "dk2")


def packed(lens_q, lens_k, H=2, HK1=1, HK2=2, D1=4, D2=3, seed=0):
    rng = np.random.default_rng(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    xs = [rng.standard_normal(s) for s in ((tq, H, D1), (tk, HK1, D1), (tq, H, D2), (tk, HK2, D2))]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    return xs, cu_q, cu_k, max(lens_q, default=0), max(lens_k, default=0)


lengths = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4)


@given(lens=lengths, causal=st.booleans(), seed=st.integers(0, 2**16))
@example(lens=[(3, 0), (0, 4), (1, 1), (5, 2)], causal=True, seed=1)
@example(lens=[(2, 5), (4, 4)], causal=False, seed=2)
def test_forward_matches_torch_float64_per_sequence(lens, causal, seed):
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    xs, cu_q, cu_k, mq, mk = packed(lens_q, lens_k, seed=seed)
    kl, lse1, lse2 = streamkl_ref.attention_kl_varlen(*xs, cu_q, cu_k, mq, mk, causal=causal,
                                                      return_lse=True)
    assert kl.shape == lse1.shape == lse2.shape == (sum(lens_q), 2) and kl.dtype == np.float64
    for i, (nq, nk) in enumerate(lens):
        rows = slice(cu_q[i], cu_q[i + 1])
        if nk == 0:  # queries but no keys: the empty-row convention
            assert (kl[rows] == 0).all() and (lse1[rows] == -np.inf).all() and (lse2[rows] == -np.inf).all()
            continue
        if nq == 0:
            continue
        seq = [torch.from_numpy(x[sl]).transpose(0, 1)[None]  # [1, H, n, D]
               for x, sl in zip(xs, (rows, slice(cu_k[i], cu_k[i + 1])) * 2)]
        want = attention_kl_naive(*seq, causal=causal, compute_dtype=torch.float64)[0].T.numpy()
        np.testing.assert_allclose(kl[rows], want, rtol=1e-10, atol=1e-12)


def test_gradients_match_finite_differences():
    lens_q, lens_k = [3, 0, 2, 4], [2, 3, 0, 5]
    xs, cu_q, cu_k, mq, mk = packed(lens_q, lens_k, H=2, HK1=1, HK2=2, seed=5)
    g = np.random.default_rng(6).standard_normal((sum(lens_q), 2))
    for causal in (False, True):
        grads = streamkl_ref.attention_kl_varlen_grad(*xs, cu_q, cu_k, mq, mk, g, causal=causal)

        def loss(inputs):
            return float(np.sum(g * streamkl_ref.attention_kl_varlen(*inputs, cu_q, cu_k, mq, mk, causal=causal)))

        for which, name in enumerate(GRADS):
            assert grads[name].shape == xs[which].shape
            fd = np.zeros_like(xs[which])
            for idx in np.ndindex(xs[which].shape):
                up = [x.copy() for x in xs]
                down = [x.copy() for x in xs]
                up[which][idx] += 1e-6
                down[which][idx] -= 1e-6
                fd[idx] = (loss(up) - loss(down)) / 2e-6
            np.testing.assert_allclose(grads[name], fd, rtol=1e-5, atol=1e-7, err_msg=f"{name} causal={causal}")
        # keys of the sequence with no queries (keys 2..4) and rows of the one with no keys
        # (rows 3..4) get exactly 0
        assert (grads["dk1"][2:5] == 0).all() and (grads["dk2"][2:5] == 0).all()
        assert (grads["dq1"][3:5] == 0).all() and (grads["dq2"][3:5] == 0).all()


def test_sequence_order_permutes_rows():
    lens = [(3, 4), (0, 2), (5, 5), (1, 0)]
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    xs, cu_q, cu_k, mq, mk = packed(lens_q, lens_k, seed=9)
    kl = streamkl_ref.attention_kl_varlen(*xs, cu_q, cu_k, mq, mk, causal=True)
    order = [2, 0, 3, 1]
    rows = [np.arange(cu_q[i], cu_q[i + 1]) for i in range(4)]
    keys = [np.arange(cu_k[i], cu_k[i + 1]) for i in range(4)]
    r = np.concatenate([rows[i] for i in order])
    c = np.concatenate([keys[i] for i in order])
    perm = [xs[0][r], xs[1][c], xs[2][r], xs[3][c]]
    _, cu_q2, cu_k2, _, _ = packed([lens_q[i] for i in order], [lens_k[i] for i in order])
    kl2 = streamkl_ref.attention_kl_varlen(*perm, cu_q2, cu_k2, mq, mk, causal=True)
    assert np.array_equal(kl2, kl[r])


def test_nan_in_one_sequence_stays_there():
    xs, cu_q, cu_k, mq, mk = packed([3, 4], [5, 2], seed=3)
    clean = streamkl_ref.attention_kl_varlen(*xs, cu_q, cu_k, mq, mk)
    xs[1][1] = np.nan  # a key of sequence 0
    dirty = streamkl_ref.attention_kl_varlen(*xs, cu_q, cu_k, mq, mk)
    assert np.isnan(dirty[:3]).all() and np.array_equal(dirty[3:], clean[3:])


def test_empty_batch_and_empty_sequences():
    xs, cu_q, cu_k, mq, mk = packed([0, 0], [0, 3])
    assert streamkl_ref.attention_kl_varlen(*xs, cu_q, cu_k, mq, mk).shape == (0, 2)
    grads = streamkl_ref.attention_kl_varlen_grad(*xs, cu_q, cu_k, mq, mk, np.zeros((0, 2)))
    assert (grads["dk1"] == 0).all() and grads["dk1"].shape == (3, 1, 4)
    xs, _, _, _, _ = packed([], [])
    assert streamkl_ref.attention_kl_varlen(*xs, [0], [0], 0, 0).shape == (0, 2)


@pytest.mark.parametrize("change,pattern", [
    (dict(cu_q=[1, 3, 7]), r"cu_seqlens_q must start at 0"),
    (dict(cu_k=[0, 5, 4]), r"cu_seqlens_k must be non-decreasing.*cu_seqlens_k\[2\] = 4 < cu_seqlens_k\[1\] = 5"),
    (dict(cu_q=[0, 3, 6]), r"cu_seqlens_q must end at the number of packed rows \(7\), got 6"),
    (dict(mq=3), r"cu_seqlens_q: sequence 1 has length 4 > max_seqlen_q = 3"),
    (dict(mk=-1), r"max_seqlen_k must be a non-negative integer"),
    (dict(cu_k=[0, 5]), r"cu_seqlens_q has 3 entries but cu_seqlens_k has 2"),
    (dict(cu_q=[[0, 3, 7]]), r"cu_seqlens_q must be 1-D"),
    (dict(cu_k=[0.0, 5.0, 7.0]), r"cu_seqlens_k must hold integers"),
    (dict(q1=np.zeros((1, 7, 2, 4))), r"q1 must have 3 dimensions \[total, H, D\]"),
    (dict(k2=np.zeros((6, 2, 3))), r"k2 has 6 key rows, but k1 has 7"),
])
def test_bad_input(change, pattern):
    xs, cu_q, cu_k, mq, mk = packed([3, 4], [5, 2])
    args = dict(q1=xs[0], k1=xs[1], q2=xs[2], k2=xs[3], cu_q=cu_q, cu_k=cu_k, mq=mq, mk=mk)
    args.update(change)
    with pytest.raises(ValueError, match=pattern):
        streamkl_ref.attention_kl_varlen(args["q1"], args["k1"], args["q2"], args["k2"], args["cu_q"],
                                         args["cu_k"], args["mq"], args["mk"])
