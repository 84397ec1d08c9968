"""streamkl_gpu.nn: the loss modules equal the functions exactly and trace under torch.compile.

Kernels under the Triton interpreter on CPU (tests/conftest). "Exactly": the same bits as the
function called with the same options, then reduced as the docstring says, loss and gradients.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import streamkl_gpu
from streamkl_gpu import attention_kl, indexer_kl, indexer_kl_topk
from streamkl_gpu.nn import AttentionKLLoss, IndexerKLLoss

STUDENT = (False, False, True, True)  # attention: setting 1, the student side learns
INDEXER = (False, False, True, True, True)  # indexer: the teacher is a constant


def attention_inputs(NQ=10, NK=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1, 4, NQ, 8), (1, 2, NK, 8), (1, 4, NQ, 4), (1, 1, NK, 4)]  # GQA per side, D1 != D2
    return [torch.randn(s, generator=gen) for s in shapes]


def indexer_inputs(seed=0, NQ=9, NK=9):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1, 4, NQ, 16), (1, 1, NK, 16), (1, 2, NQ, 8), (1, 1, NK, 8)]
    xs = [torch.randn(s, generator=gen) for s in shapes]
    return xs + [0.5 * torch.randn((1, 2, NQ), generator=gen)]


def topk_sets(NQ, NK, K, seed):
    """Distinct keys per row with -1 slots: a random permutation's first K, some slots cleared."""
    gen = torch.Generator().manual_seed(seed)
    sets = torch.stack([torch.randperm(NK, generator=gen)[:K] for _ in range(NQ)])[None].to(torch.int32)
    return sets.masked_fill(torch.rand(sets.shape, generator=gen) < 0.25, -1)


def run(fn, xs, train):
    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, train)]
    out = fn(*ins)
    weights = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)  # a non-uniform upstream gradient
    (out * weights).sum().backward()
    return out.detach(), [x.grad for x in ins]


def assert_same(got, want):
    (out_g, grads_g), (out_w, grads_w) = got, want
    assert torch.equal(out_g, out_w), (out_g, out_w)
    for i, (a, b) in enumerate(zip(grads_g, grads_w)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), i


def reduce_by_hand(kl, reduction, rows):
    if reduction == "none":
        return kl
    return kl.sum() if reduction == "sum" else kl.sum() / rows


@pytest.mark.parametrize("NQ,NK", [(8, 8), (10, 6)])  # N_Q > N_K causal: rows with no visible key
def test_attention_module_equals_function(NQ, NK):
    xs = attention_inputs(NQ, NK, seed=NQ)
    options = dict(causal=True, scale1=0.3, scale2=None)
    rows = 1 * 4 * min(NQ, NK)  # B * H * rows that see a key
    kl = attention_kl(*xs, **options)
    for reduction in ("none", "sum", "mean"):  # forward: every reduction
        got = AttentionKLLoss(**options, reduction=reduction)(*xs)
        assert torch.equal(got, reduce_by_hand(kl, reduction, rows)), reduction
    # the mean over rows that see a key: with N_Q <= N_K, every row (the plain mean)
    got = AttentionKLLoss(**options)(*xs)
    assert torch.allclose(got, kl[..., max(NQ - NK, 0):].mean(), rtol=1e-6, atol=0)
    # backward through the reduction: the same gradients as the function reduced by hand
    loss = AttentionKLLoss(**options, reduction="sum" if NQ > NK else "mean")
    assert_same(run(loss, xs, STUDENT),
                run(lambda *ins: reduce_by_hand(attention_kl(*ins, **options), loss.reduction, rows), xs, STUDENT))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk"])
def test_indexer_module_equals_function(sparse):
    xs = indexer_inputs(seed=3 + sparse)
    topk = topk_sets(9, 9, 5, seed=5) if sparse else None

    def function(*ins, reduction):
        options = dict(causal=True, scale=0.2, relu=True, reduction=reduction)
        return indexer_kl_topk(*ins, topk, **options) if sparse else indexer_kl(*ins, **options)

    for reduction in ("none", "sum", "mean"):
        loss = IndexerKLLoss(causal=True, scale=0.2, relu=True, reduction=reduction)
        assert torch.equal(loss(*xs, topk), function(*xs, reduction=reduction)), reduction
    loss = IndexerKLLoss(causal=True, scale=0.2, reduction="mean" if sparse else "none")
    assert_same(run(lambda *ins: loss(*ins, topk), xs, INDEXER),
                run(lambda *ins: function(*ins, reduction=loss.reduction), xs, INDEXER))


def test_indexer_module_passes_lse():
    """The teacher's LSEs (FlashAttention's softmax_lse) reach the function: its one-pass forward."""
    xs = indexer_inputs(seed=7)
    q, k = xs[0], xs[1]
    scores = (q @ k.transpose(-1, -2)) * 0.25
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    loss = IndexerKLLoss(causal=True, scale=0.25, reduction="sum")
    want = run(lambda *ins: indexer_kl(*ins, causal=True, scale=0.25, lse=lse, reduction="sum"), xs, INDEXER)
    assert_same(run(lambda *ins: loss(*ins, lse=lse), xs, INDEXER), want)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk"])
def test_indexer_module_passes_row_weights(sparse):
    """Per-row weights reach the function; the top-k loss weights its rows as the dense one does
    (``row_weights * KL``, the "mean" divisor unchanged), in the loss and the gradients."""
    xs = indexer_inputs(seed=11 + sparse)
    topk = topk_sets(9, 9, 5, seed=13) if sparse else None
    w = torch.linspace(0.0, 2.0, 9).reshape(1, 9)  # a zero weight among them: a masked row
    options = dict(causal=True, scale=0.2, relu=True)

    def function(*ins, reduction, row_weights=None):
        kw = dict(options, reduction=reduction, row_weights=row_weights)
        return indexer_kl_topk(*ins, topk, **kw) if sparse else indexer_kl(*ins, **kw)

    rows = function(*xs, reduction="none")
    assert torch.equal(function(*xs, reduction="none", row_weights=w), rows * w)
    for reduction in ("sum", "mean"):
        loss = IndexerKLLoss(**options, reduction=reduction)
        got = run(lambda *ins: loss(*ins, topk, row_weights=w), xs, INDEXER)
        assert_same(got, run(lambda *ins: function(*ins, reduction=reduction, row_weights=w), xs, INDEXER))
        by_hand = run(lambda *ins: reduce_by_hand(function(*ins, reduction="none") * w, reduction, 9), xs, INDEXER)
        torch.testing.assert_close(got[0], by_hand[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(got[1], by_hand[1]):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_torch_compile_fullgraph():
    """Both modules in one compiled step: no graph break (fullgraph), the eager loss and gradients."""
    att_xs, idx_xs = attention_inputs(seed=11), indexer_inputs(seed=11)
    topk = topk_sets(9, 9, 4, seed=11)
    att = AttentionKLLoss(causal=True, reduction="mean")
    dense = IndexerKLLoss(causal=True, reduction="mean")
    sparse = IndexerKLLoss(causal=True, reduction="sum")

    def step(q1, k1, q2, k2, q, k, qi, ki, w):
        return att(q1, k1, q2, k2) + dense(q, k, qi, ki, w) + 0.5 * sparse(q, k, qi, ki, w, topk)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        ins = [x.clone().requires_grad_(t) for x, t in zip(att_xs + idx_xs, STUDENT + INDEXER)]
        loss = fn(*ins)
        loss.backward()
        results.append((loss.detach(), [x.grad for x in ins]))
    (l_e, g_e), (l_c, g_c) = results
    assert torch.allclose(l_e, l_c, rtol=1e-6, atol=0), (l_e, l_c)
    for i, (a, b) in enumerate(zip(g_e, g_c)):
        assert (a is None) == (b is None), i
        if a is not None:  # dk: atomic adds in any order
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), i


def test_extra_repr_and_checks():
    assert repr(AttentionKLLoss(causal=True, scale2=0.5)) == \
        "AttentionKLLoss(causal=True, scale1=None, scale2=0.5, reduction='mean')"
    assert repr(AttentionKLLoss(bwd_mode="separate", deterministic=True, reduction="sum")) == \
        "AttentionKLLoss(causal=False, scale1=None, scale2=None, bwd_mode='separate', deterministic=True, reduction='sum')"
    assert repr(IndexerKLLoss(causal=True, relu=False, reduction="none")) == \
        "IndexerKLLoss(causal=True, scale=None, relu=False, reduction='none')"
    assert list(AttentionKLLoss().parameters()) == [] and AttentionKLLoss().state_dict() == {}
    for bad, match in [(dict(reduction="avg"), "reduction must be one of"), (dict(causal=1), "causal must be"),
                       (dict(scale1="0.5"), "scale1 must be"), (dict(split_k=0), "split_k"),
                       (dict(bwd_mode="dq"), "bwd_mode")]:
        with pytest.raises(ValueError, match=match):
            AttentionKLLoss(**bad)
    with pytest.raises(ValueError, match="reduction must be one of"):
        IndexerKLLoss(reduction="batchmean")


def test_public_module():
    """streamkl_gpu.nn is an attribute of the package, and importing it loads no kernel module."""
    assert streamkl_gpu.nn.AttentionKLLoss is AttentionKLLoss
    code = ("import sys, streamkl_gpu; m = streamkl_gpu.nn; import streamkl_gpu.nn as n; assert m is n; "
            "assert not any(k.startswith('streamkl_gpu.') and k != 'streamkl_gpu.nn' for k in sys.modules), "
            "sorted(k for k in sys.modules if k.startswith('streamkl_gpu'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
