"""The indexer forward's launch variants (the performance work) under the interpreter:
key splits merged on the host, and the resident-teacher kernel, each against the float64
reference (streamkl_ref.indexer_kl) and against the one-pass tiled kernel.

Tiny shapes: programs run one after another on CPU. Configs are
``(rows, irows, BLOCK_N, BLOCK_D, warps, stages, hb_max, key_splits, variant)``.
"""
from __future__ import annotations

import pytest
import torch

from streamkl_gpu.indexer.training import accumulate as idx_accumulate
from streamkl_gpu.indexer.training import choice as idx_choice
from streamkl_gpu.indexer import configs as idx_configs
from streamkl_gpu.indexer.plan import IndexerConfig
from streamkl_gpu.indexer import host as idx_host
from streamkl_gpu.indexer import plan as idx_plan
from streamkl_ref._checks import check_indexer_inputs

from test_gpu_indexer import check_case, make, run


def _with_config(monkeypatch, cfg):
    monkeypatch.setattr(idx_configs, "INTERPRETER_CONFIG", cfg)


# (B, H, H_K, N_Q, N_K, D, H_I, H_KI, D_I), causal, lse given, splits
SPLIT_CASES = [
    ((1, 4, 2, 13, 45, 24, 4, 1, 16), True, True, 3),    # N_K > N_Q causal: early splits see all rows
    ((1, 4, 2, 40, 40, 16, 2, 1, 16), True, False, 2),   # square causal: the last split is empty for early blocks
    ((2, 4, 1, 9, 37, 16, 4, 2, 8), False, True, 5),     # more splits asked than key tiles (3)
]


@pytest.mark.parametrize("shape,causal,with_lse,splits", SPLIT_CASES)
def test_key_splits_match_reference(monkeypatch, shape, causal, with_lse, splits):
    _with_config(monkeypatch, IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=32, num_warps=1, num_stages=1, splits=splits))
    xs = make(*shape, seed=sum(shape) + splits)
    pl = idx_plan._plan(check_indexer_inputs(*xs), idx_configs.INTERPRETER_CONFIG, "fwd")
    assert idx_plan._key_splits(check_indexer_inputs(*xs), pl)[0] > 1
    check_case(xs, with_lse=with_lse, causal=causal, grad=False)


def test_key_splits_equal_one_pass(monkeypatch):
    """Split and merged equals one pass to fp32 rounding, KL and the saved LSE_I alike (the
    backward reads LSE_I); a NaN in one key poisons exactly the rows that see it."""
    xs = make(1, 4, 2, 21, 21, 16, 2, 1, 8, seed=31)
    out = {}
    for splits in (1, 2):
        _with_config(monkeypatch, IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=32, num_warps=1, num_stages=1, splits=splits))
        kl, lse_idx, _ = idx_host._forward(*xs, None, True, 0.25, True)
        out[splits] = (kl, lse_idx)
    assert torch.allclose(out[1][0], out[2][0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(out[1][1], out[2][1], rtol=1e-6, atol=1e-6)
    bad = [x.clone() for x in xs]
    bad[1][0, 1, 17, 0] = float("nan")  # teacher key 17: rows 17.. see it (square causal)
    kl_bad = idx_host._forward(*bad, None, True, 0.25, True)[0]
    assert torch.isnan(kl_bad[0, 17:]).all()
    assert torch.equal(kl_bad[0, :17], out[2][0][0, :17])


def test_key_splits_gradients(monkeypatch):
    """The backward reads the merged LSE_I: gradients after a split forward match the reference."""
    _with_config(monkeypatch, IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=32, num_warps=1, num_stages=1, max_heads_per_chunk=1, splits=3))
    xs = make(1, 4, 2, 11, 40, 16, 2, 1, 16, seed=32)
    check_case(xs, with_lse=True, causal=True, grad=True)


# ----------------------------------------------------------------------------------------------
# The accumulating design (STREAMKL_INDEXER_PACC=1): the forward adds the target's share of the
# gradient, the backward runs the indexer alone (TEACHER=False)
# ----------------------------------------------------------------------------------------------

def _loss_and_grads(xs, lse, reduction, **kw):
    import streamkl_gpu

    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, (False, False, True, True, True))]
    loss = streamkl_gpu.indexer_kl(*ins, lse=lse, reduction=reduction, **kw)
    loss.backward(torch.tensor(1.7))
    return loss.detach(), {n: t.grad for n, t in zip(("dq_idx", "dk_idx", "dweights"), ins[2:])}


PACC_CASES = [
    ((1, 4, 1, 13, 21, 24, 4, 1, 16), True, "sum", True),     # MQA teacher, N_K > N_Q
    ((2, 4, 2, 17, 17, 16, 2, 1, 8), True, "mean", False),    # GQA teacher, batch 2, relu off
    ((1, 6, 3, 9, 9, 16, 3, 1, 12), False, "mean", True),     # groups that are not powers of two
]


@pytest.mark.parametrize("shape,causal,reduction,relu", PACC_CASES)
def test_accumulated_target_part_matches_reference(monkeypatch, shape, causal, reduction, relu):
    """Loss and gradients of the accumulating design vs float64 (streamkl_ref.indexer_kl_grad with
    the reduction's uniform g), and vs the plain design (to fp32 rounding)."""
    import numpy as np
    import streamkl_ref

    xs = make(*shape, seed=sum(shape) + 40)
    B, NQ = shape[0], shape[3]
    kw = dict(causal=causal, relu=relu)
    x64 = [x.double().numpy() for x in xs]
    kl_ref, _, lse_t = streamkl_ref.indexer_kl(*x64, return_lse=True, **kw)
    lse = torch.from_numpy(lse_t).float()
    rows = B * (min(NQ, shape[4]) if causal else NQ)
    g_row = 1.7 if reduction == "sum" else 1.7 / rows
    ref = streamkl_ref.indexer_kl_grad(*x64, np.full((B, NQ), g_row), **kw)
    ref_loss = kl_ref.sum() * (1.0 if reduction == "sum" else 1.0 / rows)
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "0")  # the accumulating design (MQA teachers default to chunk)
    calls = []
    fwd, bwd = idx_accumulate._forward_pacc, idx_host._backward
    monkeypatch.setattr(idx_accumulate, "_forward_pacc", lambda *a: calls.append("fwd") or fwd(*a))
    monkeypatch.setattr(idx_host, "_backward", lambda *a, **k: calls.append(k.get("target_part") is not None) or bwd(*a, **k))
    loss, grads = _loss_and_grads(xs, lse, reduction, **kw)
    assert calls == ["fwd", True]  # the accumulating forward, the teacher-free backward
    assert abs(loss.item() - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    for name, got in grads.items():
        want = torch.from_numpy(ref[name])
        err = (got.double() - want).norm() / max(want.norm().item(), 1e-12)
        assert err <= 1e-5, (name, err.item())
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "0")
    loss0, grads0 = _loss_and_grads(xs, lse, reduction, **kw)
    assert torch.allclose(loss, loss0, rtol=1e-5, atol=1e-6)
    for name in grads:
        assert torch.allclose(grads[name], grads0[name], rtol=1e-4, atol=1e-6), name


def test_accumulated_design_only_where_it_applies(monkeypatch):
    """Per-row losses, no lse, no gradient wanted: the plain forward (no gradient buffers)."""
    from streamkl_ref._checks import check_indexer_inputs as dims_of

    xs = make(1, 2, 1, 5, 5, 8, 2, 1, 8, seed=41)
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    d = dims_of(*xs)
    lse = torch.zeros(1, 2, 5)
    train = [x.clone().requires_grad_(True) for x in xs]
    assert idx_choice._use_pacc(d, lse, "sum", *train[2:])
    assert not idx_choice._use_pacc(d, lse, "none", *train[2:])
    assert not idx_choice._use_pacc(d, None, "sum", *train[2:])
    assert not idx_choice._use_pacc(d, lse, "sum", *xs[2:])
    with torch.no_grad():
        assert not idx_choice._use_pacc(d, lse, "mean", *train[2:])
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "auto")  # the default: on (MQA and GQA teachers)
    assert idx_choice._use_pacc(d, lse, "sum", *train[2:])
    gqa = dims_of(*make(1, 4, 2, 5, 5, 8, 2, 1, 8, seed=41))
    assert idx_choice._use_pacc(gqa, torch.zeros(1, 4, 5), "sum", *train[2:])
    two_key_heads = dims_of(*make(1, 4, 2, 5, 5, 8, 2, 2, 8, seed=41))  # H_KI = 2: the plain design
    assert not idx_choice._use_pacc(two_key_heads, torch.zeros(1, 4, 5), "sum", *train[2:])
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "0")
    assert not idx_choice._use_pacc(d, lse, "sum", *train[2:])
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "2")
    with pytest.raises(ValueError, match="STREAMKL_INDEXER_PACC"):
        idx_choice.pacc_enabled(d)


def test_accumulated_nan_isolation(monkeypatch):
    """A NaN in indexer key 17, which only rows 17.. see (square causal): the other rows'
    dq_idx / dweights stay finite and equal the clean run's."""
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    xs = make(1, 2, 1, 21, 21, 16, 2, 1, 8, seed=42)
    lse = torch.from_numpy(
        __import__("streamkl_ref").indexer_kl(*[x.double().numpy() for x in xs], return_lse=True, causal=True)[2]).float()
    _, clean = _loss_and_grads(xs, lse, "sum", causal=True)
    bad = [x.clone() for x in xs]
    bad[3][0, 0, 17, 3] = float("nan")  # an indexer key: rows < 17 cannot see it
    _, dirty = _loss_and_grads(bad, lse, "sum", causal=True)
    assert torch.isfinite(dirty["dq_idx"][0, :, :17]).all()
    assert torch.allclose(dirty["dq_idx"][0, :, :17], clean["dq_idx"][0, :, :17], rtol=1e-5, atol=1e-6)
    assert torch.allclose(dirty["dweights"][0, :, :17], clean["dweights"][0, :, :17], rtol=1e-5, atol=1e-6)
    assert torch.isnan(dirty["dweights"][0, :, 17:]).any()


def test_accumulated_design_traceable_fullgraph(monkeypatch):
    """The accumulating design's custom ops under torch.compile(fullgraph=True): the same loss
    and gradients as eager."""
    import streamkl_gpu

    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    xs = make(1, 4, 1, 7, 9, 16, 2, 1, 8, seed=43)
    lse = torch.zeros(1, 4, 7)  # any finite lse: the loss is then not a KL, but eager and compiled must agree

    def step(q, k, qi, ki, w, lse):
        return streamkl_gpu.indexer_kl(q, k, qi, ki, w, causal=True, lse=lse, reduction="mean")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        ins = [x.clone().requires_grad_(t) for x, t in zip(xs, (False, False, True, True, True))]
        loss = fn(*ins, lse)
        loss.backward()
        results.append((loss.detach(), [x.grad for x in ins[2:]]))
    (l_e, g_e), (l_c, g_c) = results
    assert torch.equal(l_e, l_c)
    for a, b in zip(g_e, g_c):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tma", [True], indirect=True)
def test_l1_variant_pointer_loads(monkeypatch, tma):
    """The "l1" variant (``IndexerConfig.variant``): pointer loads (q rows cached in L1 on the GPU) even where TMA
    is available; forward and the accumulating forward vs the reference."""
    xs = make(1, 4, 1, 13, 21, 24, 4, 1, 16, seed=44)
    assert idx_plan._use_tma(*xs[:4])
    cfg = IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=32, num_warps=1, num_stages=1, variant="l1")
    pl = idx_plan._plan(check_indexer_inputs(*xs), cfg, "fwd")
    assert idx_plan._load_mode(pl, True) == (False, True)
    _with_config(monkeypatch, cfg)
    check_case(xs, with_lse=True, causal=True, grad=False)
    import streamkl_ref
    lse = torch.from_numpy(streamkl_ref.indexer_kl(*[x.double().numpy() for x in xs], return_lse=True, causal=True)[2]).float()
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    loss, grads = _loss_and_grads(xs, lse, "sum", causal=True)
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "0")
    loss0, grads0 = _loss_and_grads(xs, lse, "sum", causal=True)
    assert torch.allclose(loss, loss0, rtol=1e-5)
    for name in grads:
        assert torch.allclose(grads[name], grads0[name], rtol=1e-4, atol=1e-6), name


def test_accumulated_rotated_key_order(monkeypatch):
    """Several whole key tiles per token block (16-wide tiles, N_K > N_Q causal): the
    accumulating forward walks them from a block-dependent tile; loss and gradients still match
    the plain design."""
    import streamkl_ref

    _with_config(monkeypatch, IndexerConfig(teacher_rows=16, indexer_rows=16, block_n=16, block_d=16, num_warps=1, num_stages=1))
    xs = make(1, 2, 1, 20, 70, 16, 2, 1, 8, seed=45)
    pl = idx_plan._plan(check_indexer_inputs(*xs), idx_configs.INTERPRETER_CONFIG, "bwd")
    assert pl["BLOCK_N"] == 16 and pl["BLOCK_T"] < 20  # several token blocks, each with >= 3 whole tiles
    lse = torch.from_numpy(streamkl_ref.indexer_kl(*[x.double().numpy() for x in xs], return_lse=True,
                                                   causal=True)[2]).float()
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    loss, grads = _loss_and_grads(xs, lse, "mean", causal=True)
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "0")
    loss0, grads0 = _loss_and_grads(xs, lse, "mean", causal=True)
    assert torch.allclose(loss, loss0, rtol=1e-5)
    for name in grads:
        assert torch.allclose(grads[name], grads0[name], rtol=1e-4, atol=1e-6), name


def test_l1_variant_teacher_lse_pass(monkeypatch):
    """The teacher-LSE first pass (no lse given) with the "l1" variant's pointer loads."""
    _with_config(monkeypatch, IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=32, num_warps=1, num_stages=1, variant="l1"))
    xs = make(1, 4, 1, 13, 21, 24, 4, 1, 16, seed=46)
    check_case(xs, with_lse=False, causal=True, grad=False)


@pytest.mark.parametrize("fused", [False, True])
def test_l1_variant_backward(monkeypatch, fused):
    """The plain backward's kernels with the "l1" variant's pointer loads (q rows of the dq
    kernel / key tile of the dk kernel cached in L1 on the GPU): gradients vs the reference."""
    _with_config(monkeypatch, IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=32, num_warps=1, num_stages=1, variant="l1"))
    monkeypatch.setenv("STREAMKL_INDEXER_BWD", "fused" if fused else "separate")
    xs = make(1, 4, 1, 13, 21, 24, 4, 1, 16, seed=47)
    check_case(xs, with_lse=True, causal=True, grad=True)
