"""The indexer loss's training step on every path, under the interpreter: without ``lse`` (the
teacher's LSEs by a first streaming pass, then the forward-formed gradient), teachers with
several key heads (the chunk design; the GQA kernel's storing forward), per-row weights
(``row_weights=``). Loss and gradients against the float64 reference (streamkl_ref.indexer_kl /
indexer_kl_grad) at odd shapes: N not a multiple of the tile, N_Q != N_K causal, batch 2.

Each test also checks which path ran (spies on the host functions), so a fast path that
silently fell back to the recomputing backward cannot pass.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import streamkl_ref
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu.indexer import configs as idx_configs
from streamkl_gpu.indexer.plan import IndexerConfig
from streamkl_gpu.indexer import host as idx_host
from streamkl_gpu.indexer import teacher_lse as _indexer_teacher_lse
from streamkl_gpu.indexer.training import choice as idx_choice
from streamkl_gpu.indexer.training import chunk as idx_chunk
from streamkl_gpu.indexer.triton import fwd_gqa_store as _indexer_gqa_store
from streamkl_ref.testing import relative_error

from test_gpu_indexer import make

NAMES = ("dq_idx", "dk_idx", "dweights")
G_UP = 1.7  # the upstream gradient of the scalar loss


def _rows_with_keys(shape, causal):
    B, NQ, NK = shape[0], shape[3], shape[4]
    return B * (min(NQ, NK) if causal else NQ)


def _reference(xs, shape, causal, relu, reduction, row_weights=None, g=G_UP):
    """(loss, {name: gradient}) in float64 of ``g * reduction(row_weights * KL)``."""
    x64 = [x.double().numpy() for x in xs]
    kl = streamkl_ref.indexer_kl(*x64, causal=causal, relu=relu)
    w = np.ones_like(kl) if row_weights is None else row_weights.double().numpy()
    div = 1.0 if reduction == "sum" else 1.0 / _rows_with_keys(shape, causal)
    grads = streamkl_ref.indexer_kl_grad(*x64, g * div * w, causal=causal, relu=relu)
    return float((w * kl).sum() * div), {n: torch.from_numpy(grads[n]) for n in NAMES}


def _step(xs, reduction, g=G_UP, **kw):
    import streamkl_gpu

    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, (False, False, True, True, True))]
    loss = streamkl_gpu.indexer_kl(*ins, reduction=reduction, **kw)
    loss.backward(torch.tensor(g) if loss.dim() == 0 else g * torch.ones_like(loss))
    return loss.detach(), {n: t.grad for n, t in zip(NAMES, ins[2:])}


def _spy(monkeypatch):
    """Calls of the LSE pass, the chunk design's forward and the recomputing backward."""
    calls = []
    lse_pass, full, bwd = _indexer_teacher_lse.teacher_lse_bits, idx_chunk._forward_full, idx_host._backward
    monkeypatch.setattr(_indexer_teacher_lse, "teacher_lse_bits", lambda *a: calls.append("lse") or lse_pass(*a))
    monkeypatch.setattr(idx_chunk, "_forward_full", lambda *a: calls.append("full") or full(*a))
    monkeypatch.setattr(idx_host, "_backward", lambda *a, **k: calls.append("recompute") or bwd(*a, **k))
    return calls


def _assert_close(loss, grads, ref_loss, ref_grads, loss_tol=1e-5, grad_tol=1e-5):
    assert abs(loss.item() - ref_loss) <= loss_tol * max(1.0, abs(ref_loss)), (loss.item(), ref_loss)
    for name in NAMES:
        err = relative_error(grads[name].double(), ref_grads[name])
        assert err <= grad_tol, (name, err)


# (B, H, H_K, N_Q, N_K, D, H_I, H_KI, D_I), causal, reduction, relu
CASES = [
    ((2, 4, 1, 13, 21, 24, 4, 1, 16), True, "mean", True),    # MQA, batch 2, N_K > N_Q causal, ragged tiles
    ((1, 6, 3, 20, 9, 16, 3, 1, 12), True, "sum", True),      # GQA groups of 2, N_Q > N_K causal: empty rows
    ((2, 8, 2, 17, 17, 16, 4, 1, 8), True, "mean", False),    # GQA groups of 4, batch 2, relu off
    ((1, 4, 4, 9, 40, 16, 2, 1, 16), False, "sum", True),     # MHA teacher, not causal
]


@pytest.mark.parametrize("shape,causal,reduction,relu", CASES)
def test_training_step_without_lse_takes_the_fast_path(monkeypatch, poison, shape, causal, reduction, relu):
    """No lse: the LSE pass, then the chunk design (the gradient formed in the forward); the
    backward recomputes nothing. Loss and gradients vs float64."""
    monkeypatch.setattr(idx_chunk, "PCHUNK_TOKENS", 8)  # several chunks of tokens
    xs = make(*shape, seed=sum(shape) + 80)
    calls = _spy(monkeypatch)
    loss, grads = _step(xs, reduction, causal=causal, relu=relu)
    assert calls == ["lse", "full"], calls
    _assert_close(loss, grads, *_reference(xs, shape, causal, relu, reduction))


def test_teacher_lse_pass_matches_reference(poison):
    """The first pass alone: natural-log LSEs [B, H, N_Q], -inf on rows with no visible key."""
    xs = make(2, 6, 3, 19, 11, 24, 2, 1, 8, seed=81)
    want = streamkl_ref.indexer_kl(*[x.double().numpy() for x in xs], return_lse=True, causal=True)[2]
    got = _indexer_teacher_lse.teacher_lse(*xs, causal=True, scale=24 ** -0.5)
    assert got.dtype == torch.float32 and got.shape == (2, 6, 19)
    empty = np.isneginf(want)
    assert empty.any() and np.array_equal(np.isneginf(got.numpy()), empty)
    assert np.abs(got.numpy()[~empty] - want[~empty]).max() <= 1e-5


def test_without_lse_matches_with_lse(monkeypatch):
    """The same step with the reference's lse given: the same loss and gradients (the pass's
    LSEs equal the reference's to fp32 rounding)."""
    # the chunk design on both steps (a GQA teacher with lse given takes the accumulating one by default)
    monkeypatch.setenv("STREAMKL_INDEXER_TRAINING", "chunk")
    shape = (1, 4, 2, 14, 14, 16, 2, 1, 8)
    xs = make(*shape, seed=82)
    lse = torch.from_numpy(streamkl_ref.indexer_kl(*[x.double().numpy() for x in xs], return_lse=True,
                                                   causal=True)[2]).float()
    calls = _spy(monkeypatch)
    loss, grads = _step(xs, "mean", causal=True, lse=lse)
    assert calls == ["full"]
    loss0, grads0 = _step(xs, "mean", causal=True)
    assert calls == ["full", "lse", "full"]
    assert torch.allclose(loss, loss0, rtol=1e-5, atol=1e-7)
    for name in NAMES:
        assert torch.allclose(grads[name], grads0[name], rtol=1e-4, atol=1e-7), name


def test_fp16_without_lse(monkeypatch, poison):
    """fp16 inputs (the interpreter's bf16 dot is not usable): vs float64 of the same fp16 values."""
    shape = (2, 4, 2, 15, 23, 32, 4, 1, 16)
    xs = make(*shape, seed=83, dtype=torch.float16)
    calls = _spy(monkeypatch)
    loss, grads = _step(xs, "mean", causal=True)
    assert calls == ["lse", "full"]
    _assert_close(loss, grads, *_reference(xs, shape, True, True, "mean"), loss_tol=1e-5, grad_tol=5e-3)


# ----------------------------------------------------------------------------------------------
# Per-row weights
# ----------------------------------------------------------------------------------------------

def _row_weights(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand((shape[0], shape[3]), generator=gen) * 2.0
    w[:, ::3] = 0.0  # masked rows
    return w


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("shape,causal,reduction,relu", CASES[:3])
def test_row_weights_keep_the_fast_path(monkeypatch, poison, shape, causal, reduction, relu, with_lse):
    """row_weights: the chunk design's gradient kernel takes them as its per-row g; the loss is
    sum_t w_t KL_t (divided by the rows with keys for "mean")."""
    monkeypatch.setattr(idx_chunk, "PCHUNK_TOKENS", 8)
    xs = make(*shape, seed=sum(shape) + 84)
    w = _row_weights(shape, 85)
    lse = None
    if with_lse:
        lse = torch.from_numpy(streamkl_ref.indexer_kl(*[x.double().numpy() for x in xs], return_lse=True,
                                                       causal=causal, relu=relu)[2]).float()
    calls = _spy(monkeypatch)
    loss, grads = _step(xs, reduction, causal=causal, relu=relu, lse=lse, row_weights=w)
    assert calls == (["full"] if with_lse else ["lse", "full"]), calls
    _assert_close(loss, grads, *_reference(xs, shape, causal, relu, reduction, row_weights=w))


def test_row_weights_other_designs_and_rows(monkeypatch):
    """Where the chunk design does not run (another design forced, reduction "none"), the plain
    forward's rows are weighted and the recomputing backward gets g * w: the same numbers."""
    shape = (2, 4, 1, 11, 11, 16, 2, 1, 8)
    xs = make(*shape, seed=86)
    w = _row_weights(shape, 87)
    ref_loss, ref_grads = _reference(xs, shape, True, True, "sum", row_weights=w)
    calls = _spy(monkeypatch)
    for mode in ("accumulate", "store"):  # neither takes row weights
        monkeypatch.setenv("STREAMKL_INDEXER_TRAINING", mode)
        loss, grads = _step(xs, "sum", causal=True, row_weights=w)
        assert calls[-1] == "recompute", (mode, calls)
        _assert_close(loss, grads, ref_loss, ref_grads)
    monkeypatch.delenv("STREAMKL_INDEXER_TRAINING")
    import streamkl_gpu

    rows = streamkl_gpu.indexer_kl(*xs, causal=True, row_weights=w)
    plain = streamkl_gpu.indexer_kl(*xs, causal=True)
    assert torch.equal(rows, plain * w)
    ones = streamkl_gpu.indexer_kl(*xs, causal=True, row_weights=torch.ones(2, 11), reduction="mean")
    assert torch.allclose(ones, plain.sum() / 22, rtol=1e-6)


def test_row_weights_checks():
    import streamkl_gpu

    xs = make(1, 2, 1, 5, 5, 8, 2, 1, 8, seed=88)
    with pytest.raises(ValueError, match=r"row_weights must have shape \[B, N_Q\] = \[1, 5\]"):
        streamkl_gpu.indexer_kl(*xs, row_weights=torch.ones(5))
    with pytest.raises(ValueError, match="row_weights must be a floating-point tensor"):
        streamkl_gpu.indexer_kl(*xs, row_weights=torch.ones(1, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="row_weights must be None or a torch.Tensor"):
        streamkl_gpu.indexer_kl(*xs, row_weights=[1.0] * 5)


def test_no_lse_and_row_weights_traceable_fullgraph(monkeypatch):
    """The LSE pass's custom op and the chunk op with row weights under torch.compile(fullgraph=True)."""
    import streamkl_gpu

    xs = make(1, 4, 2, 7, 9, 16, 2, 1, 8, seed=89)
    w = _row_weights((1, 4, 2, 7), 90)

    def step(q, k, qi, ki, wt, rw):
        return streamkl_gpu.indexer_kl(q, k, qi, ki, wt, causal=True, reduction="mean", row_weights=rw)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        ins = [x.clone().requires_grad_(t) for x, t in zip(xs, (False, False, True, True, True))]
        loss = fn(*ins, w)
        loss.backward()
        results.append((loss.detach(), [x.grad for x in ins[2:]]))
    (l_e, g_e), (l_c, g_c) = results
    assert torch.equal(l_e, l_c)
    for a, b in zip(g_e, g_c):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# Several key heads: the GQA kernel's storing forward (TMA descriptors: the ``tma`` fixture)
# ----------------------------------------------------------------------------------------------

# (B, H, H_K, N_Q, N_K, D, H_I, H_KI, D_I), causal, key splits, variant, lse given, row weights.
# N_K a multiple of 4: p stored through a TMA descriptor (its row stride 16-byte aligned), else by pointers
GQA_CASES = [
    ((2, 8, 2, 37, 37, 32, 4, 1, 16), True, 2, "gqa", False, False),          # batch 2, 3 chunks, 2 splits
    ((1, 6, 3, 21, 36, 24, 4, 1, 12), True, 3, "gqa-flat-tm", True, True),    # N_K > N_Q, padded dims, row weights
    ((2, 8, 4, 29, 20, 16, 2, 1, 16), True, 1, "gqa-band", False, True),      # N_Q > N_K: empty rows, the band launch
    ((1, 4, 4, 19, 23, 16, 4, 2, 16), False, 2, "gqa-pp-band", True, False),  # MHA, not causal, 2 indexer key heads
    ((1, 4, 2, 18, 20, 16, 2, 1, 16), True, 1, "gqa-flat", True, False),     # one split, no band: KL stored directly
    # the forms -wm (splits merged side by side, in place) and -one (one chunk within PCHUNK_MAX_BYTES)
    ((2, 8, 2, 37, 37, 32, 4, 1, 16), True, 2, "gqa-band-wm", False, False),  # batch 2, 3 chunks merged in place
    ((2, 6, 3, 21, 36, 24, 4, 1, 12), True, 3, "gqa-wm-one", True, True),     # batch 2, N_K > N_Q, one chunk
    ((2, 8, 4, 29, 20, 16, 2, 1, 16), True, 2, "gqa-band-wm-one", False, False),  # N_Q > N_K: empty rows
    ((1, 4, 4, 19, 23, 16, 4, 2, 16), False, 2, "gqa-band-one", True, False),  # not causal, one chunk, old merge
]


@pytest.mark.parametrize("tma", [True], indirect=True)
@pytest.mark.parametrize("shape,causal,splits,variant,with_lse,weighted", GQA_CASES)
def test_gqa_storing_forward(monkeypatch, poison, tma, shape, causal, splits, variant, with_lse, weighted):
    """The chunk design with the GQA kernel's storing forward: vs float64, and vs the general
    storing forward on the same plan (variant "tiles")."""
    monkeypatch.setenv("STREAMKL_INDEXER_TRAINING", "chunk")  # with lse given too (default there: accumulate)
    monkeypatch.setattr(idx_chunk, "PCHUNK_TOKENS", 16)
    xs = make(*shape, seed=sum(shape) + splits + 90)
    relu = True
    w = _row_weights(shape, 91) if weighted else None
    lse = None
    if with_lse:
        lse = torch.from_numpy(streamkl_ref.indexer_kl(*[x.double().numpy() for x in xs], return_lse=True,
                                                       causal=causal)[2]).float()
    launches, stores = [], set()
    real = _indexer_gqa_store.launch_chunk

    def spy(*a):
        launches.append(a[12])  # the chunk's rows
        stores.add("tma" if _runtime.tma_ok(a[10]) else "pointers")  # p's store path
        return real(*a)
    monkeypatch.setattr(_indexer_gqa_store, "launch_chunk", spy)
    out = {}
    for v in (variant, "tiles"):
        monkeypatch.setattr(idx_configs, "INTERPRETER_CONFIG", IndexerConfig(teacher_rows=16, indexer_rows=16, block_n=16, block_d=32, num_warps=1, num_stages=1, max_heads_per_chunk=1, splits=splits, variant=v))
        if shape[7] > 1:  # two indexer key heads: not the accumulating designs' case (H_KI = 1)
            monkeypatch.setattr(idx_choice, "_use_pacc", lambda d, l, r, *t: _use_pacc_any_hki(d, l, r, *t))
        out[v] = _step(xs, "mean", causal=causal, relu=relu, lse=lse, row_weights=w)
        if v == variant:
            assert launches and sum(launches) == shape[3], launches  # every token, chunk by chunk
            assert len(launches) == (1 if "-one" in variant else -(-shape[3] // 16)), launches
            launches.clear()
    assert not launches  # "tiles": the general storing forward
    assert stores == {"tma" if shape[4] % 4 == 0 else "pointers"}
    loss, grads = out[variant]
    _assert_close(loss, grads, *_reference(xs, shape, causal, relu, "mean", row_weights=w))
    loss0, grads0 = out["tiles"]
    assert torch.allclose(loss, loss0, rtol=1e-5, atol=1e-7)
    for name in NAMES:
        assert torch.allclose(grads[name], grads0[name], rtol=1e-4, atol=1e-6), name


def _use_pacc_any_hki(dims, lse, reduction, q_idx, k_idx, weights):
    """``choice._use_pacc`` without its H_KI = 1 condition (the chunk design has none)."""
    return (reduction != "none" and lse is not None and idx_choice.pacc_enabled(dims) and torch.is_grad_enabled()
            and any(t.requires_grad for t in (q_idx, k_idx, weights)))


@pytest.mark.parametrize("tma", [False, True], indirect=True)
def test_without_lse_nan_isolation(monkeypatch, tma):
    """No lse: a NaN in teacher key 20 (causal, N_K - N_Q = 3) reaches rows 17.. only, through the LSE
    pass and the chunk design alike (tma: the GQA kernel's storing forward, p by TMA stores);
    the other rows' gradients equal the clean run's."""
    monkeypatch.setattr(idx_chunk, "PCHUNK_TOKENS", 8 if not tma else 16)
    launches = []
    real = _indexer_gqa_store.launch_chunk
    monkeypatch.setattr(_indexer_gqa_store, "launch_chunk", lambda *a: launches.append(1) or real(*a))
    if tma:
        monkeypatch.setattr(idx_configs, "INTERPRETER_CONFIG", IndexerConfig(teacher_rows=16, indexer_rows=16, block_n=16, block_d=32, num_warps=1, num_stages=1, max_heads_per_chunk=1, splits=2, variant="gqa-band"))
    xs = make(1, 4, 2, 21, 24, 16, 2, 1, 8, seed=92)
    _, clean = _step(xs, "sum", causal=True)
    bad = [x.clone() for x in xs]
    bad[1][0, 1, 20, 3] = float("nan")  # key 20: rows 17.. see it (N_K - N_Q = 3)
    _, dirty = _step(bad, "sum", causal=True)
    for name in ("dq_idx", "dweights"):
        assert torch.isfinite(dirty[name][:, :, :17]).all(), name
        assert torch.allclose(dirty[name][:, :, :17], clean[name][:, :, :17], rtol=1e-5, atol=1e-7), name
        assert torch.isnan(dirty[name][:, :, 17:]).any(), name
    assert bool(launches) == tma  # the GQA kernel's storing forward ran where TMA loads were on
