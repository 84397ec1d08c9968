"""streamkl_gpu.indexer_kl_topk (Triton interpreter on CPU) against streamkl_ref.indexer_kl_topk.

Tolerances follow the project's rule (tests/_gpu_helpers.assert_close): the kernel's error against
float64 within a small multiple of the error of the PyTorch gather form at the inputs' precision
(``indexer_kl_topk_naive``), plus a floor.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import streamkl_gpu
import streamkl_ref
from streamkl_gpu.indexer.topk import indexer_kl_topk_naive

from _gpu_helpers import assert_close

GRADS = ("dq_idx", "dk_idx", "dweights")
TRAIN = (False, False, True, True, True)  # the teacher is a constant


def make(B, H, HK, NQ, NK, D, HI, HKI, DI, *, dtype=torch.float32, seed=0, wscale=0.5):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, H, NQ, D), (B, HK, NK, D), (B, HI, NQ, DI), (B, HKI, NK, DI)]
    xs = [torch.randn(s, generator=gen) for s in shapes]
    xs.append(wscale * torch.randn((B, HI, NQ), generator=gen))
    return [x.to(dtype) for x in xs]


def random_sets(B, NQ, NK, K, seed, *, empty_rows=()):
    """``[B, NQ, K]`` int32: each row a random set of 0..K distinct keys, -1 padding anywhere."""
    rng = np.random.default_rng(seed)
    out = np.full((B, NQ, K), -1, np.int32)
    for b in range(B):
        for t in range(NQ):
            if t in empty_rows:
                continue
            chosen = rng.choice(NK, size=rng.integers(1, min(K, NK) + 1), replace=False)
            out[b, t, rng.choice(K, size=len(chosen), replace=False)] = chosen
    return torch.from_numpy(out)


def run(xs, topk, g=None, **kw):
    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, TRAIN)]
    kl = streamkl_gpu.indexer_kl_topk(*ins, topk, **kw)
    grads = {}
    if g is not None:
        kl.backward(g)
        grads = dict(zip(GRADS, (ins[2].grad, ins[3].grad, ins[4].grad)))
    return kl.detach(), grads


def same_precision(xs, topk, g, **kw):
    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, TRAIN)]
    cd = xs[0].dtype if xs[0].dtype != torch.bfloat16 else torch.float32
    kl = indexer_kl_topk_naive(*ins, topk, compute_dtype=cd, **kw)
    kl.backward(g.to(kl.dtype))
    return kl.detach(), dict(zip(GRADS, (ins[2].grad, ins[3].grad, ins[4].grad)))


def check_case(xs, topk, ratio=3.0, **kw):
    B, NQ = topk.shape[:2]
    g = torch.rand((B, NQ), generator=torch.Generator().manual_seed(7)) + 0.5
    x64 = [x.double().numpy() for x in xs]
    kl_ref = streamkl_ref.indexer_kl_topk(*x64, topk.numpy(), **kw)
    ref = streamkl_ref.indexer_kl_topk_grad(*x64, topk.numpy(), g.double().numpy(), **kw)
    kl, grads = run(xs, topk, g, **kw)
    assert kl.dtype == torch.float32 and kl.shape == (B, NQ)
    sp_kl, sp_grads = same_precision(xs, topk, g, **kw)
    tol_dtype = torch.float16 if xs[0].dtype != torch.float32 else torch.float32
    assert_close("kl", kl, kl_ref, sp_kl, dtype=tol_dtype, ratio=ratio)
    for name in GRADS:
        assert grads[name].dtype == {"dq_idx": xs[2], "dk_idx": xs[3], "dweights": xs[4]}[name].dtype
        assert_close(name, grads[name], ref[name], sp_grads[name], dtype=tol_dtype, ratio=ratio)


# (B, H, H_K, N_Q, N_K, D, H_I, H_KI, D_I), K, causal, relu
CASES = [
    ((1, 4, 1, 11, 19, 24, 4, 1, 16), 7, True, True),     # MQA teacher + indexer, K not a power of two
    ((2, 4, 2, 9, 6, 40, 2, 2, 8), 5, True, False),       # GQA both sides, N_Q > N_K causal, relu off
    ((1, 6, 3, 8, 13, 16, 3, 1, 12), 20, False, True),    # groups not powers of two, K > BLOCK_K
]


@pytest.mark.parametrize("shape,K,causal,relu", CASES)
def test_forward_and_gradients_match_reference(shape, K, causal, relu):
    xs = make(*shape, seed=sum(shape))
    topk = random_sets(shape[0], shape[3], shape[4], K, seed=K, empty_rows=(2,))
    check_case(xs, topk, causal=causal, relu=relu)


def test_other_launch_configs_l1_and_wide_slot_tiles(monkeypatch):
    """The benchmark's variants: q rows through L1, 32-slot tiles, heads chunked 16 at a time."""
    from streamkl_gpu.indexer import topk as _indexer_topk

    xs = make(1, 32, 1, 3, 20, 16, 4, 1, 16, seed=2)
    topk = random_sets(1, 3, 20, 19, seed=2)
    monkeypatch.setattr(_indexer_topk, "CONFIG_OVERRIDE",
                        _indexer_topk.TopkConfig(block_k=32, block_d=16, max_heads_per_chunk=16, num_warps=1,
                                                 num_stages=1, teacher_q_l1=True))
    check_case(xs, topk, causal=False)


def test_separate_student_kernel_equals_the_one_kernel_forward(monkeypatch):
    """``TopkConfig.separate_student``: the student's logits and LSE by their own kernel first; same KL,
    gradients and empty/NaN rows as the default."""
    from streamkl_gpu.indexer import topk as _indexer_topk

    xs = make(1, 4, 2, 7, 9, 16, 3, 1, 8, seed=18)
    topk = random_sets(1, 7, 9, 20, seed=18, empty_rows=(2,))
    g = torch.rand(1, 7) + 0.5
    bad = [x.clone() for x in xs]
    bad[2][0, 1, 4, 0] = float("nan")  # indexer query row 4
    base = run(xs, topk, g, causal=True), run(bad, topk, g, causal=True)
    monkeypatch.setattr(_indexer_topk, "CONFIG_OVERRIDE",
                        _indexer_topk.TopkConfig(block_k=16, block_d=32, max_heads_per_chunk=32, num_warps=1,
                                                 num_stages=1, separate_student=True))
    check_case(xs, topk, causal=True)
    for (kl0, gr0), (kl1, gr1) in zip(base, (run(xs, topk, g, causal=True), run(bad, topk, g, causal=True))):
        assert torch.allclose(kl1, kl0, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert torch.equal(torch.isnan(kl1), torch.isnan(kl0)) and kl1[0, 2] == 0
        for name in GRADS:
            assert torch.allclose(gr1[name], gr0[name], rtol=1e-5, atol=1e-6, equal_nan=True), name


def test_fp16_and_bf16():
    for dtype in (torch.float16, torch.bfloat16):
        xs = make(1, 4, 1, 7, 10, 16, 2, 1, 16, dtype=dtype, seed=3)
        check_case(xs, random_sets(1, 7, 10, 6, seed=4), causal=True)


def test_every_visible_key_listed_equals_dense_indexer_kl():
    xs = make(1, 4, 2, 9, 9, 16, 2, 1, 8, seed=5)
    perm = torch.stack([torch.randperm(9, generator=torch.Generator().manual_seed(t)) for t in range(9)])
    topk = torch.cat([perm, torch.full((9, 3), -1)], -1)[None].to(torch.int32)  # all keys + padding
    ours, _ = run(xs, topk, causal=True)
    dense = streamkl_gpu.indexer_kl(*xs, causal=True)
    assert torch.allclose(ours, dense, rtol=1e-5, atol=1e-6)


def test_lse_over_the_set_given_equals_computed():
    """``lse`` = the teacher's LSEs over each row's set (what a sparse attention returns): the
    forward skips its first pass; same KL and gradients (an empty row's -inf included)."""
    xs = make(1, 4, 2, 7, 9, 16, 2, 1, 8, seed=15)
    topk = random_sets(1, 7, 9, 5, seed=15, empty_rows=(3,))
    g = torch.ones(1, 7)
    kl, grads = run(xs, topk, g, causal=True)
    _, _, lse_set = streamkl_ref.indexer_kl_topk(*[x.double().numpy() for x in xs], topk.numpy(), causal=True,
                                                 return_lse=True)
    assert np.isneginf(lse_set[0, :, 3]).all()
    kl_l, grads_l = run(xs, topk, g, causal=True, lse=torch.from_numpy(lse_set).float())
    assert torch.allclose(kl_l, kl, rtol=1e-5, atol=1e-6)
    for name in GRADS:
        assert torch.allclose(grads_l[name], grads[name], rtol=1e-5, atol=1e-6), name
    with pytest.raises(ValueError, match=r"\blse\b"):
        streamkl_gpu.indexer_kl_topk(*xs, topk, lse=torch.zeros(1, 4, 6))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reductions(reduction):
    xs = make(2, 2, 1, 6, 8, 16, 2, 1, 8, seed=6)
    topk = random_sets(2, 6, 8, 5, seed=6, empty_rows=(0,))
    kl, _ = run(xs, topk, causal=True)
    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, TRAIN)]
    loss = streamkl_gpu.indexer_kl_topk(*ins, topk, causal=True, reduction=reduction)
    assert loss.shape == ()
    want = kl.sum() if reduction == "sum" else kl.sum() / (2 * 6)  # rows with a visible key: all 12
    assert torch.allclose(loss.detach(), want, rtol=1e-6)
    loss.backward()
    _, grads = run(xs, topk, torch.full((2, 6), 1.0 if reduction == "sum" else 1 / 12), causal=True)
    for name, leaf in zip(GRADS, ins[2:]):
        assert torch.allclose(leaf.grad, grads[name], rtol=1e-5, atol=1e-7), name


def test_empty_sets_and_causally_hidden_indices_give_zero():
    xs = make(1, 2, 1, 5, 5, 16, 2, 1, 8, seed=8)
    # row 0 sees key 0 only: listing keys 3, 4 there leaves an empty set; row 1 lists nothing
    topk = torch.tensor([[[3, 4, -1], [-1, -1, -1], [0, 2, 1], [1, -1, 3], [4, 0, 2]]], dtype=torch.int32)
    kl, grads = run(xs, topk, torch.ones(1, 5), causal=True)
    assert kl[0, 0] == 0 and kl[0, 1] == 0 and (kl[0, 2:] > 0).all()
    assert not grads["dq_idx"][0, :, :2].any() and not grads["dweights"][0, :, :2].any()


def test_int64_indices_and_any_strides():
    xs = make(1, 4, 1, 8, 10, 16, 2, 1, 8, seed=9)
    topk = random_sets(1, 8, 10, 6, seed=9)
    base, _ = run(xs, topk, causal=True)
    wide = torch.full((1, 8, 12), -7, dtype=torch.int64)
    wide[:, :, ::2] = topk.long()  # a strided int64 view of the same sets
    other, _ = run(xs, wide[:, :, ::2], causal=True)
    assert torch.equal(base, other)


def test_unchecked_values_as_documented_for_gpu_tensors():
    """What a GPU run (no value check) does, through the custom op: an out-of-range value reads as
    an unused slot; a key listed twice counts twice (as the PyTorch gather form does)."""
    from streamkl_gpu.indexer.topk import _topk_fwd_op

    xs = make(1, 2, 1, 4, 6, 16, 2, 1, 8, seed=16)
    topk = torch.tensor([[[0, 1, -1], [2, 0, -1], [3, 1, 5], [4, 2, 0]]], dtype=torch.int32)
    base = _topk_fwd_op(*xs, topk, None, False, 0.25, True)[0]
    wild = topk.clone()
    wild[0, :2, 2] = torch.tensor([6, -5])  # outside [0, N_K)
    assert torch.equal(_topk_fwd_op(*xs, wild, None, False, 0.25, True)[0], base)
    twice = topk.clone()
    twice[0, 0, 2] = 1  # key 1 listed twice in row 0
    got = _topk_fwd_op(*xs, twice, None, False, 0.25, True)[0]
    want = indexer_kl_topk_naive(*xs, twice, scale=0.25)
    assert torch.equal(got[0, 1:], base[0, 1:]) and abs(got[0, 0] - base[0, 0]) > 1e-4
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_poisoned_outputs_are_all_written(poison):
    xs = make(1, 2, 1, 6, 7, 16, 2, 1, 8, seed=10)
    kl, grads = run(xs, random_sets(1, 6, 7, 5, seed=10, empty_rows=(3,)), torch.ones(1, 6), causal=True)
    assert torch.isfinite(kl).all()
    for name in GRADS:
        assert torch.isfinite(grads[name]).all(), name


def test_nan_isolation():
    """A NaN in a key reaches exactly the rows that selected it; a NaN query row only its own row."""
    N = 8
    xs = make(1, 2, 1, N, N, 16, 2, 1, 8, seed=11)
    topk = torch.tensor([[[0, 1, -1]] * 4 + [[2, 5, 6]] * 4], dtype=torch.int32)  # key 5 only in rows 4..7
    g = torch.ones(1, N)
    kl0, gr0 = run(xs, topk, g)
    for which in (1, 3):  # the teacher's key 5, the indexer's key 5
        bad = [x.clone() for x in xs]
        bad[which][0, 0, 5, 1] = float("nan")
        kl, gr = run(bad, topk, g)
        assert torch.equal(kl[0, :4], kl0[0, :4]) and torch.isnan(kl[0, 4:]).all(), which
        assert torch.equal(gr["dq_idx"][0, :, :4], gr0["dq_idx"][0, :, :4])
        assert torch.equal(gr["dk_idx"][0, :, :2], gr0["dk_idx"][0, :, :2])
    bad = [x.clone() for x in xs]
    bad[2][0, 1, 1, 3] = float("nan")  # indexer query row 1
    kl, gr = run(bad, topk, g)
    others = [t for t in range(N) if t != 1]
    assert torch.equal(kl[0, others], kl0[0, others]) and torch.isnan(kl[0, 1])
    assert torch.equal(gr["dk_idx"][0, :, 2:], gr0["dk_idx"][0, :, 2:])  # row 1 selects keys 0, 1 only


def test_teacher_gets_no_gradient():
    xs = make(1, 2, 1, 4, 5, 16, 2, 1, 8, seed=12)
    ins = [x.clone().requires_grad_(True) for x in xs]
    streamkl_gpu.indexer_kl_topk(*ins, random_sets(1, 4, 5, 3, seed=12), reduction="sum").backward()
    assert ins[0].grad is None and ins[1].grad is None and ins[2].grad is not None


def test_torch_compile_fullgraph_matches_eager():
    xs = make(1, 4, 1, 6, 8, 16, 2, 1, 8, seed=13)
    topk = random_sets(1, 6, 8, 5, seed=13)

    def step(q, k, qi, ki, w):
        return streamkl_gpu.indexer_kl_topk(q, k, qi, ki, w, topk, causal=True, reduction="mean")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        ins = [x.clone().requires_grad_(t) for x, t in zip(xs, TRAIN)]
        loss = fn(*ins)
        loss.backward()
        results.append((loss.detach(), [x.grad for x in ins[2:]]))
    (l_e, g_e), (l_c, g_c) = results
    assert torch.equal(l_e, l_c)
    for name, a, b in zip(GRADS, g_e, g_c):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), name  # dk_idx: atomic adds, any order


@pytest.mark.parametrize("bad,match", [
    (lambda t: t.float(), "int32"),
    (lambda t: t.to(torch.int16), "int32"),
    (lambda t: t[:, :3], r"\[B, N_Q, K\]"),
    (lambda t: t[0], r"\[B, N_Q, K\]"),
    (lambda t: torch.full_like(t, 9), r"\[0, 8\)"),
    (lambda t: torch.full_like(t, -2), r"\[0, 8\)"),
    (lambda t: torch.zeros_like(t), "twice"),
])
def test_bad_topk_indices_name_the_argument(bad, match):
    xs = make(1, 2, 1, 4, 8, 16, 2, 1, 8, seed=14)
    topk = random_sets(1, 4, 8, 3, seed=14)
    with pytest.raises(ValueError, match=r"\btopk_indices\b.*" + match):
        streamkl_gpu.indexer_kl_topk(*xs, bad(topk))
    with pytest.raises(ValueError, match=r"\btopk_indices\b"):
        streamkl_gpu.indexer_kl_topk(*xs, topk.tolist())
    with pytest.raises(ValueError, match=r"\breduction\b"):
        streamkl_gpu.indexer_kl_topk(*xs, topk, reduction="avg")


def test_too_many_indexer_heads_names_q_idx():
    xs = make(1, 2, 1, 2, 3, 16, 129, 1, 8, seed=17)
    with pytest.raises(ValueError, match=r"\bq_idx\b.*129"):
        streamkl_gpu.indexer_kl_topk(*xs, torch.zeros(1, 2, 1, dtype=torch.int32))
