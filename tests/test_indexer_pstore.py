"""The indexer loss's "store" design (STREAMKL_INDEXER_TRAINING=store; old name STREAMKL_INDEXER_PSTORE=1) and the accumulating
forward's timing-only variants, under the interpreter.

The store design: the forward's tile also writes the target p [B, N_Q, N_K]; the backward's
teacher-free kernels read it back (_indexer_bwd, P_SAVED). Loss and gradients against float64
(streamkl_ref.indexer_kl_grad with the reduction's uniform g) and against the accumulating
design; NaN isolation through the stored p; the dispatch rule (pstore_enabled).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

import pytest
import torch

import streamkl_ref
from streamkl_gpu._core.forcing import forcing
from streamkl_gpu.indexer.training import accumulate as idx_accumulate
from streamkl_gpu.indexer.training import choice as idx_choice
from streamkl_gpu.indexer.training import chunk as idx_chunk
from streamkl_gpu.indexer import configs as idx_configs
from streamkl_gpu.indexer import host as idx_host
from streamkl_gpu.indexer import plan as idx_plan
from streamkl_gpu.indexer.training import store as idx_store
from streamkl_ref._checks import check_indexer_inputs

from test_gpu_indexer import make


def _loss_and_grads(xs, lse, reduction, g=1.7, **kw):
    import streamkl_gpu

    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, (False, False, True, True, True))]
    loss = streamkl_gpu.indexer_kl(*ins, lse=lse, reduction=reduction, **kw)
    loss.backward(torch.tensor(g))
    return loss.detach(), {n: t.grad for n, t in zip(("dq_idx", "dk_idx", "dweights"), ins[2:])}


def _teacher_lse(xs, causal):
    return torch.from_numpy(streamkl_ref.indexer_kl(*[x.double().numpy() for x in xs], return_lse=True,
                                                    causal=causal)[2]).float()


# (B, H, H_K, N_Q, N_K, D, H_I, H_KI, D_I), causal, reduction, relu
PSTORE_CASES = [
    ((1, 4, 1, 13, 21, 24, 4, 1, 16), True, "sum", True),     # MQA teacher, N_K > N_Q
    ((2, 4, 2, 17, 17, 16, 2, 1, 8), True, "mean", False),    # GQA teacher, batch 2, relu off
    ((1, 6, 3, 20, 9, 16, 3, 1, 12), True, "mean", True),     # N_Q > N_K causal: empty rows
    ((1, 4, 1, 9, 40, 16, 2, 1, 16), False, "sum", True),     # not causal, ragged key tiles
]


@pytest.mark.parametrize("shape,causal,reduction,relu", PSTORE_CASES)
def test_stored_target_matches_reference(monkeypatch, poison, shape, causal, reduction, relu):
    xs = make(*shape, seed=sum(shape) + 60)
    B, NQ, NK = shape[0], shape[3], shape[4]
    kw = dict(causal=causal, relu=relu)
    x64 = [x.double().numpy() for x in xs]
    kl_ref, _, lse_t = streamkl_ref.indexer_kl(*x64, return_lse=True, **kw)
    lse = torch.from_numpy(lse_t).float()
    rows = B * (min(NQ, NK) if causal else NQ)
    g_row = 1.7 if reduction == "sum" else 1.7 / rows
    ref = streamkl_ref.indexer_kl_grad(*x64, np.full((B, NQ), g_row), **kw)
    ref_loss = kl_ref.sum() * (1.0 if reduction == "sum" else 1.0 / rows)
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "1")
    calls = []
    fwd, bwd = idx_store._forward_pstore, idx_host._backward
    monkeypatch.setattr(idx_store, "_forward_pstore", lambda *a: calls.append("fwd") or fwd(*a))
    monkeypatch.setattr(idx_host, "_backward", lambda *a, **k: calls.append(k.get("p_saved") is not None) or bwd(*a, **k))
    loss, grads = _loss_and_grads(xs, lse, reduction, **kw)
    assert calls == ["fwd", True]  # the storing forward, the backward reading p
    assert abs(loss.item() - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    for name, got in grads.items():
        want = torch.from_numpy(ref[name])
        err = (got.double() - want).norm() / max(want.norm().item(), 1e-12)
        assert err <= 1e-5, (name, err.item())
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "0")  # the accumulating design: the same numbers
    loss0, grads0 = _loss_and_grads(xs, lse, reduction, **kw)
    assert torch.allclose(loss, loss0, rtol=1e-5, atol=1e-6)
    for name in grads:
        assert torch.allclose(grads[name], grads0[name], rtol=1e-4, atol=1e-6), name


def test_stored_target_is_the_head_mean(poison):
    """The stored p equals the float64 target on every visible entry (rows sum to 1); the loss is
    the reference's sum. (The poison fixture NaN-fills fresh buffers: unwritten entries stay NaN,
    and the backward must never read them: it reads visible entries only.)"""
    xs = make(1, 4, 1, 11, 11, 16, 2, 1, 8, seed=61)
    lse = _teacher_lse(xs, True)
    total, lse_idx, p = idx_store._forward_pstore(*xs, lse, True, 0.25, True)
    x64 = [x.double().numpy() for x in xs]
    q, k = x64[0][0], x64[1][0]
    s = np.einsum("htd,sd->hts", q, k[0]) * 0.25
    s = np.where(np.tril(np.ones((11, 11), bool)), s, -np.inf)
    want = np.exp(s - s.max(-1, keepdims=True))
    want = (want / want.sum(-1, keepdims=True)).mean(0)
    vis = np.tril(np.ones((11, 11), bool))
    got = p[0].double().numpy()
    assert np.allclose(got[vis], want[vis], rtol=1e-5, atol=1e-7)
    assert np.allclose(got.sum(-1, where=vis), 1.0, atol=1e-5)
    ref = streamkl_ref.indexer_kl(*x64, causal=True, scale=0.25)
    assert abs(total.item() - ref.sum()) <= 1e-5 * max(1.0, abs(ref.sum()))


def test_stored_target_nan_isolation(monkeypatch, poison):
    """A NaN in teacher key 17 (square causal: rows 17.. see it) poisons the stored p of those
    rows only: the other rows' dq_idx / dweights equal the clean run's."""
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "1")
    xs = make(1, 2, 1, 21, 21, 16, 2, 1, 8, seed=62)
    lse = _teacher_lse(xs, True)
    _, clean = _loss_and_grads(xs, lse, "sum", causal=True)
    bad = [x.clone() for x in xs]
    bad[1][0, 0, 17, 3] = float("nan")
    _, dirty = _loss_and_grads(bad, lse, "sum", causal=True)
    for name in ("dq_idx", "dweights"):
        assert torch.isfinite(dirty[name][:, :, :17]).all(), name
        assert torch.allclose(dirty[name][:, :, :17], clean[name][:, :, :17], rtol=1e-5, atol=1e-7), name
        assert torch.isnan(dirty[name][:, :, 17:]).any(), name


def test_store_design_dispatch(monkeypatch):
    d = check_indexer_inputs(*make(1, 2, 1, 5, 7, 8, 2, 1, 8, seed=63))
    monkeypatch.delenv("STREAMKL_INDEXER_PSTORE", raising=False)
    assert idx_choice.PSTORE_DEFAULT == "default" and d.HK == 1
    assert idx_choice.pstore_mode(d) == "chunk" and idx_choice.pstore_enabled(d)  # MQA teacher: the chunk design
    gqa = check_indexer_inputs(*make(1, 4, 2, 5, 7, 8, 2, 1, 8, seed=63))
    assert idx_choice.pstore_mode(gqa) == "chunk" and idx_choice.pstore_enabled(gqa)  # several key heads: the same
    monkeypatch.setenv("STREAMKL_INDEXER_TRAINING", "accumulate")  # the accumulating design on request
    assert idx_choice.pstore_mode(gqa) == "0" and not idx_choice.pstore_enabled(gqa)
    monkeypatch.delenv("STREAMKL_INDEXER_TRAINING")
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "auto")
    assert idx_choice.pstore_bytes(d) == 4 * 5 * 7 and idx_choice.pstore_enabled(d)
    monkeypatch.setattr(idx_choice, "PSTORE_MAX_BYTES", 4 * 5 * 7 - 1)
    assert not idx_choice.pstore_enabled(d)
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "yes")
    with pytest.raises(ValueError, match="STREAMKL_INDEXER_PSTORE"):
        idx_choice.pstore_enabled(d)


@pytest.mark.parametrize("variant", ["teacher", "logits", "nodk"])
def test_timing_only_parts_drop_their_work(monkeypatch, variant):
    """The accumulating forward's timing-only variants (forced through the hook) leave out what they say: "nodk" keeps
    KL, dq_p, dweights_p (dk_p stays 0); "logits" keeps KL (no shares); "teacher" drops the
    student's logits (KL changes)."""
    xs = make(1, 4, 1, 9, 9, 16, 2, 1, 8, seed=64)
    lse = _teacher_lse(xs, True)
    full = idx_accumulate._forward_pacc(*xs, lse, True, 0.25, True)
    with forcing(indexer_accumulate_parts=variant):  # the documented hook (devtools.diagnostics)
        part = idx_accumulate._forward_pacc(*xs, lse, True, 0.25, True)
    same_kl = torch.allclose(part[0], full[0], rtol=1e-6)
    assert same_kl == (variant != "teacher")
    assert torch.equal(part[3], torch.zeros_like(part[3]))  # dk_p: zeroed, never added to
    assert torch.allclose(part[2], full[2]) == (variant == "nodk")  # dq_p


@pytest.mark.parametrize("design", ["pstore", "pacc", "plain"])
def test_one_kernel_dqk_backward(monkeypatch, poison, design):
    """STREAMKL_INDEXER_BWD=dqk (the dq kernel alone, each key tile's dk share added by atomics)
    gives the reference's gradients, after each forward design; with a NaN indexer key that rows
    < 17 cannot see, their dq_idx / dweights and dk_idx of keys they alone see stay finite."""
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "0" if design == "plain" else "1")
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "1" if design == "pstore" else "0")
    shape = (1, 4, 1, 21, 21, 16, 2, 1, 8)
    xs = make(*shape, seed=65)
    x64 = [x.double().numpy() for x in xs]
    lse = _teacher_lse(xs, True)
    ref = streamkl_ref.indexer_kl_grad(*x64, np.full((1, 21), 1.7), causal=True)
    monkeypatch.setenv("STREAMKL_INDEXER_BWD", "dqk")
    _, grads = _loss_and_grads(xs, lse, "sum", causal=True)
    for name, got in grads.items():
        want = torch.from_numpy(ref[name])
        err = (got.double() - want).norm() / max(want.norm().item(), 1e-12)
        assert err <= 1e-5, (name, err.item())
    bad = [x.clone() for x in xs]
    bad[3][0, 0, 17, 3] = float("nan")
    _, dirty = _loss_and_grads(bad, lse, "sum", causal=True)
    for name in ("dq_idx", "dweights"):
        assert torch.allclose(dirty[name][:, :, :17], grads[name][:, :, :17], rtol=1e-5, atol=1e-7), name
    # dk of a key is a sum over the rows that see it; keys < 17 are also seen by rows 17.. (NaN)
    assert torch.isnan(dirty["dk_idx"][0, 0, 17]).any()


def test_store_design_traced_by_torch_compile(monkeypatch):
    """torch.compile(fullgraph=True) traces the store design's custom ops; same loss and
    gradients as eager."""
    import streamkl_gpu

    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "1")
    xs = make(1, 4, 1, 7, 9, 16, 2, 1, 8, seed=66)
    lse = _teacher_lse(xs, True)

    def step(q, k, qi, ki, w):
        return streamkl_gpu.indexer_kl(q, k, qi, ki, w, causal=True, lse=lse, reduction="mean")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        ins = [x.clone().requires_grad_(t) for x, t in zip(xs, (False, False, True, True, True))]
        loss = fn(*ins)
        loss.backward()
        results.append((loss.detach(), [x.grad for x in ins[2:]]))
    (l_e, g_e), (l_c, g_c) = results
    assert torch.equal(l_e, l_c)
    for a, b in zip(g_e, g_c):
        assert torch.equal(a, b)


def test_stored_target_in_float16(monkeypatch):
    """p stored in float16 (PSTORE_DTYPE): half the memory; gradients within 1e-3 of float64
    (p in [0, 1]: relative rounding 2^-11), the loss unchanged (the forward's sums use fp32 p)."""
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "1")
    monkeypatch.setattr(idx_choice, "PSTORE_DTYPE", torch.float16)
    shape = (1, 4, 1, 13, 21, 24, 4, 1, 16)
    xs = make(*shape, seed=67)
    x64 = [x.double().numpy() for x in xs]
    kl_ref, _, lse_t = streamkl_ref.indexer_kl(*x64, return_lse=True, causal=True)
    ref = streamkl_ref.indexer_kl_grad(*x64, np.full((1, 13), 1.7), causal=True)
    d = check_indexer_inputs(*xs)
    assert idx_choice.pstore_bytes(d) == 2 * 13 * 21
    _, _, p = idx_store._forward_pstore(*xs, torch.from_numpy(lse_t).float(), True, 24 ** -0.5, True)
    assert p.dtype == torch.float16
    loss, grads = _loss_and_grads(xs, torch.from_numpy(lse_t).float(), "sum", causal=True)
    assert abs(loss.item() - kl_ref.sum()) <= 1e-5 * max(1.0, abs(kl_ref.sum()))
    for name, got in grads.items():
        want = torch.from_numpy(ref[name])
        err = (got.double() - want).norm() / max(want.norm().item(), 1e-12)
        assert err <= 1e-3, (name, err.item())


@pytest.mark.parametrize("shape,causal,relu", [
    ((1, 4, 1, 13, 21, 24, 4, 1, 16), True, True),    # N_K > N_Q causal
    ((2, 4, 2, 17, 17, 16, 2, 1, 8), True, False),    # GQA teacher, batch 2, relu off
    ((1, 6, 3, 9, 40, 16, 3, 1, 12), False, True),    # not causal, groups not powers of two
])
def test_accumulating_forward_keys_as_rows(monkeypatch, poison, shape, causal, relu):
    """The accumulating forward's "kt" variant (the indexer's products transposed: keys as rows)
    gives the default variant's KL, LSE_I and target shares to fp32 rounding, and fwd+bwd matches
    float64; a NaN indexer key leaves the rows that cannot see it unchanged."""
    xs = make(*shape, seed=sum(shape) + 68)
    lse = _teacher_lse(xs, causal)
    base = idx_accumulate._forward_pacc(*xs, lse, causal, 0.3, relu)
    monkeypatch.setattr(idx_configs, "INTERPRETER_CONFIG", replace(idx_configs.INTERPRETER_CONFIG, variant="kt"))
    kt = idx_accumulate._forward_pacc(*xs, lse, causal, 0.3, relu)
    for name, a, b in zip(("total", "lse_idx", "dq_p", "dk_p", "dw_p"), base, kt):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "0")
    B, NQ, NK = shape[0], shape[3], shape[4]
    x64 = [x.double().numpy() for x in xs]
    rows = B * (min(NQ, NK) if causal else NQ)
    ref = streamkl_ref.indexer_kl_grad(*x64, np.full((B, NQ), 1.7 / rows), causal=causal, relu=relu)
    _, grads = _loss_and_grads(xs, lse, "mean", causal=causal, relu=relu)
    for name, got in grads.items():
        want = torch.from_numpy(ref[name])
        err = (got.double() - want).norm() / max(want.norm().item(), 1e-12)
        assert err <= 1e-5, (name, err.item())
    if causal and NQ == NK:
        bad = [x.clone() for x in xs]
        bad[3][0, 0, 9, 2] = float("nan")  # rows < 9 cannot see indexer key 9
        _, dirty = _loss_and_grads(bad, lse, "mean", causal=causal, relu=relu)
        for name in ("dq_idx", "dweights"):
            assert torch.allclose(dirty[name][:, :, :9], grads[name][:, :, :9], rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("variant", ["tm", "kt+tm"])
def test_accumulating_forward_token_major_q(monkeypatch, variant):
    """The "tm" flag (one token per program: q read through a token-major [B, N, H, D]
    descriptor, so the teacher's product reads its rows from shared memory) gives the default
    variant's outputs (interpreter with TMA descriptors)."""
    from streamkl_gpu._core import runtime as _runtime

    monkeypatch.setattr(_runtime, "INTERPRETER_TMA", True)
    xs = make(1, 32, 1, 11, 19, 32, 16, 1, 16, seed=69)  # 32 heads x 1 token: the 32 teacher rows
    lse = _teacher_lse(xs, True)
    base = idx_accumulate._forward_pacc(*xs, lse, True, 0.3, True)
    assert idx_plan._plan(check_indexer_inputs(*xs), idx_configs.INTERPRETER_CONFIG, "bwd")["BLOCK_T"] == 1
    monkeypatch.setattr(idx_configs, "INTERPRETER_CONFIG", replace(idx_configs.INTERPRETER_CONFIG, variant=variant))
    got = idx_accumulate._forward_pacc(*xs, lse, True, 0.3, True)
    for name, a, b in zip(("total", "lse_idx", "dq_p", "dk_p", "dw_p"), base, got):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("shape,causal,reduction,relu,chunk", [
    ((1, 4, 1, 13, 21, 24, 4, 1, 16), True, "sum", True, 4),     # N_K > N_Q causal, 4 chunks
    ((2, 4, 2, 17, 17, 16, 2, 1, 8), True, "mean", False, 8),    # GQA teacher, batch 2, ragged last chunk
    ((1, 6, 3, 20, 9, 16, 3, 1, 12), True, "mean", True, 6),     # N_Q > N_K causal: empty rows
    ((1, 4, 1, 9, 40, 16, 2, 1, 16), False, "sum", True, 64),    # one chunk
])
def test_chunked_full_gradient_in_forward(monkeypatch, poison, shape, causal, reduction, relu, chunk):
    """STREAMKL_INDEXER_PSTORE=chunk: p stored chunk by chunk of tokens, the gradient of the sum
    formed in the forward; loss and gradients vs float64 and vs the accumulating design."""
    xs = make(*shape, seed=sum(shape) + 70)
    B, NQ, NK = shape[0], shape[3], shape[4]
    kw = dict(causal=causal, relu=relu)
    x64 = [x.double().numpy() for x in xs]
    kl_ref, _, lse_t = streamkl_ref.indexer_kl(*x64, return_lse=True, **kw)
    lse = torch.from_numpy(lse_t).float()
    rows = B * (min(NQ, NK) if causal else NQ)
    g_row = 1.7 if reduction == "sum" else 1.7 / rows
    ref = streamkl_ref.indexer_kl_grad(*x64, np.full((B, NQ), g_row), **kw)
    ref_loss = kl_ref.sum() * (1.0 if reduction == "sum" else 1.0 / rows)
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "chunk")
    monkeypatch.setattr(idx_chunk, "PCHUNK_TOKENS", chunk)
    calls = []
    full = idx_chunk._forward_full
    monkeypatch.setattr(idx_chunk, "_forward_full", lambda *a: calls.append("full") or full(*a))
    loss, grads = _loss_and_grads(xs, lse, reduction, **kw)
    assert calls == ["full"]
    assert abs(loss.item() - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    for name, got in grads.items():
        want = torch.from_numpy(ref[name])
        err = (got.double() - want).norm() / max(want.norm().item(), 1e-12)
        assert err <= 1e-5, (name, err.item())
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "0")
    loss0, grads0 = _loss_and_grads(xs, lse, reduction, **kw)
    assert torch.allclose(loss, loss0, rtol=1e-5, atol=1e-6)
    for name in grads:
        assert torch.allclose(grads[name], grads0[name], rtol=1e-4, atol=1e-6), name


def test_chunked_design_nan_isolation_and_trace(monkeypatch, poison):
    """The chunk design: a NaN in teacher key 17 (square causal) poisons rows 17.. only; and
    torch.compile(fullgraph=True) traces it (same loss and gradients as eager)."""
    import streamkl_gpu

    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "chunk")
    monkeypatch.setattr(idx_chunk, "PCHUNK_TOKENS", 8)
    xs = make(1, 2, 1, 21, 21, 16, 2, 1, 8, seed=71)
    lse = _teacher_lse(xs, True)
    _, clean = _loss_and_grads(xs, lse, "sum", causal=True)
    bad = [x.clone() for x in xs]
    bad[1][0, 0, 17, 3] = float("nan")
    _, dirty = _loss_and_grads(bad, lse, "sum", causal=True)
    for name in ("dq_idx", "dweights"):
        assert torch.allclose(dirty[name][:, :, :17], clean[name][:, :, :17], rtol=1e-5, atol=1e-7), name
        assert torch.isnan(dirty[name][:, :, 17:]).any(), name

    def step(q, k, qi, ki, w):
        return streamkl_gpu.indexer_kl(q, k, qi, ki, w, causal=True, lse=lse, reduction="mean")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        ins = [x.clone().requires_grad_(t) for x, t in zip(xs, (False, False, True, True, True))]
        loss = fn(*ins)
        loss.backward()
        results.append((loss.detach(), [x.grad for x in ins[2:]]))
    (l_e, g_e), (l_c, g_c) = results
    assert torch.equal(l_e, l_c)
    for a, b in zip(g_e, g_c):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", ["keys", "tiles"])
def test_chunked_design_keys_major_forward(monkeypatch, poison, variant):
    """The chunk design's storing forward with the forward's keys-major tile (variant "keys",
    _indexer_fwd.variant_meta): the same loss and gradients as the reference."""
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "1")
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "chunk")
    monkeypatch.setattr(idx_chunk, "PCHUNK_TOKENS", 8)
    monkeypatch.setattr(idx_configs, "INTERPRETER_CONFIG", replace(idx_configs.INTERPRETER_CONFIG, variant=variant))
    shape = (1, 4, 1, 13, 21, 24, 4, 1, 16)
    xs = make(*shape, seed=72)
    x64 = [x.double().numpy() for x in xs]
    kl_ref, _, lse_t = streamkl_ref.indexer_kl(*x64, return_lse=True, causal=True)
    ref = streamkl_ref.indexer_kl_grad(*x64, np.full((1, 13), 1.7), causal=True)
    loss, grads = _loss_and_grads(xs, torch.from_numpy(lse_t).float(), "sum", causal=True)
    assert abs(loss.item() - kl_ref.sum()) <= 1e-5 * max(1.0, abs(kl_ref.sum()))
    for name, got in grads.items():
        want = torch.from_numpy(ref[name])
        err = (got.double() - want).norm() / max(want.norm().item(), 1e-12)
        assert err <= 1e-5, (name, err.item())


def test_chunk_design_moves_past_a_config_that_does_not_fit(monkeypatch):
    """_forward_full takes the first (storing forward, gradient kernel) pair whose launches fit the
    device: a launch raising Triton's OutOfResources (shared memory at D = 96 on the H200) moves to the next pair; the pair that fit is remembered; other errors propagate."""
    class OutOfResources(RuntimeError):
        pass

    plans = {"pstore": [("f0",), ("f1",)], "bwd": [("b0",)]}
    monkeypatch.setattr(idx_configs, "_candidates", lambda kind, ieee, dims=None, n_sm=132, **kw: plans[kind])
    monkeypatch.setattr(idx_chunk, "_FULL_CONFIGS", {})
    tried = []

    def fake(fcfg, bcfg, *a):
        tried.append((fcfg, bcfg))
        if fcfg == ("f0",):
            raise OutOfResources("shared memory")
        return "ran"

    monkeypatch.setattr(idx_chunk, "_forward_full_with", fake)
    xs = make(1, 2, 1, 5, 7, 8, 2, 1, 8, seed=63)
    lse = torch.zeros(1, 2, 5)
    assert idx_chunk._forward_full(*xs, lse, True, 0.3, True) == "ran"
    keys = replace(idx_configs.INTERPRETER_CONFIG, variant="keys")  # the keys-major tile, listed last
    assert tried == [(("f0",), ("b0",)), (("f0",), keys), (("f1",), ("b0",))]
    assert idx_chunk._forward_full(*xs, lse, True, 0.3, True) == "ran"
    assert tried[-1] == (("f1",), ("b0",)) and len(tried) == 4  # remembered: no second try of f0

    def broken(*a):
        raise ValueError("not a resource problem")

    monkeypatch.setattr(idx_chunk, "_forward_full_with", broken)
    monkeypatch.setattr(idx_chunk, "_FULL_CONFIGS", {})
    with pytest.raises(ValueError, match="not a resource problem"):
        idx_chunk._forward_full(*xs, lse, True, 0.3, True)
