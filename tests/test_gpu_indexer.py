"""streamkl_gpu.indexer_kl (Triton interpreter on CPU) against streamkl_ref's float64 indexer loss.

Tolerances follow the project's rule (tests/_gpu_helpers.assert_close): the kernel's error
against float64 within a small multiple of the error the materialised PyTorch form makes at the
inputs' own precision (``indexer_kl_naive``), plus a floor.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import streamkl_gpu
import streamkl_ref
from streamkl_gpu.indexer import configs as idx_configs
from streamkl_gpu.indexer.plan import IndexerConfig
from streamkl_gpu.indexer import host as idx_host
from streamkl_gpu.indexer import plan as idx_plan
from streamkl_gpu.indexer.api import indexer_kl_naive

from _gpu_helpers import assert_close

GRADS = ("dq_idx", "dk_idx", "dweights")
TRAIN = (False, False, True, True, True)  # the teacher is a constant


def make(B, H, HK, NQ, NK, D, HI, HKI, DI, *, dtype=torch.float32, seed=0, wscale=0.5, qscale=1.0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, H, NQ, D), (B, HK, NK, D), (B, HI, NQ, DI), (B, HKI, NK, DI)]
    xs = [qscale * torch.randn(s, generator=gen) for s in shapes]
    xs.append(wscale * torch.randn((B, HI, NQ), generator=gen))
    return [x.to(dtype) for x in xs]


def ref_forward(xs, **kw):
    kl, lse_idx, lse_teacher = streamkl_ref.indexer_kl(*[x.double().numpy() for x in xs], return_lse=True, **kw)
    return kl, lse_idx, lse_teacher


def ref_grads(xs, g, **kw):
    return streamkl_ref.indexer_kl_grad(*[x.double().numpy() for x in xs], g.double().numpy(), **kw)


def same_precision(xs, g, **kw):
    """The materialised form at the inputs' precision: its KL and (with ``g``) gradients."""
    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, TRAIN)]
    kl = indexer_kl_naive(*ins, compute_dtype=xs[0].dtype if xs[0].dtype != torch.bfloat16 else torch.float32, **kw)
    grads = {}
    if g is not None:
        kl.backward(g.to(kl.dtype))
        grads = dict(zip(GRADS, (ins[2].grad, ins[3].grad, ins[4].grad)))
    return kl.detach(), grads


def run(xs, g=None, *, lse=None, **kw):
    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, TRAIN)]
    kl = streamkl_gpu.indexer_kl(*ins, lse=lse, **kw)
    grads = {}
    if g is not None:
        kl.backward(g)
        grads = dict(zip(GRADS, (ins[2].grad, ins[3].grad, ins[4].grad)))
    return kl.detach(), grads


def check_case(xs, *, with_lse, grad=True, ratio=3.0, **kw):
    dtype = xs[0].dtype
    B, NQ = xs[0].shape[0], xs[0].shape[2]
    g = torch.rand((B, NQ), generator=torch.Generator().manual_seed(7)) + 0.5 if grad else None
    kl_ref, _, lse_teacher = ref_forward(xs, **kw)
    lse = torch.from_numpy(lse_teacher).float() if with_lse else None
    kl, grads = run(xs, g, lse=lse, **kw)
    assert kl.dtype == torch.float32 and kl.shape == (B, NQ)
    sp_kl, sp_grads = same_precision(xs, g, **kw)
    tol_dtype = torch.float16 if dtype != torch.float32 else torch.float32
    if not np.any(kl_ref):  # all rows have one key (KL 0): absolute; a given lse is rounded to fp32
        assert kl.abs().max().item() <= 1e-6
    else:
        assert_close("kl", kl, kl_ref, sp_kl, dtype=tol_dtype, ratio=ratio)
    if grad:
        ref = ref_grads(xs, g, **kw)
        for name in GRADS:
            assert grads[name].dtype == {"dq_idx": xs[2], "dk_idx": xs[3], "dweights": xs[4]}[name].dtype
            assert_close(name, grads[name], ref[name], sp_grads[name], dtype=tol_dtype, ratio=ratio)


# (B, H, H_K, N_Q, N_K, D, H_I, H_KI, D_I), causal, lse given
CASES = [
    ((1, 4, 1, 13, 21, 24, 4, 1, 16), False, False),  # MQA teacher, MQA indexer, ragged tiles
    ((1, 4, 1, 13, 21, 24, 4, 1, 16), True, True),
    ((2, 4, 2, 9, 5, 40, 2, 2, 8), True, False),      # GQA teacher, 2 indexer key heads, N_Q > N_K
    ((1, 2, 2, 1, 1, 8, 1, 1, 8), True, True),        # N = 1
    ((1, 6, 3, 17, 17, 16, 3, 1, 12), False, True),   # groups that are not powers of two
]


@pytest.mark.parametrize("shape,causal,with_lse", CASES)
def test_forward_and_gradients_match_reference(shape, causal, with_lse):
    xs = make(*shape, seed=sum(shape))
    check_case(xs, with_lse=with_lse, causal=causal)


@pytest.mark.parametrize("tma", [True], indirect=True)
def test_tma_descriptor_path(tma):
    """Score tiles through TMA descriptors (the Hopper path). Groups of 3 in boxes of 4 heads: a
    teacher box's 4th row is the next group's first head, counted twice unless masked by row."""
    xs = make(1, 6, 2, 11, 13, 16, 3, 1, 16, seed=23)
    assert idx_plan._use_tma(*xs[:4])
    check_case(xs, with_lse=False, causal=True)


def test_dk_token_splits_equal_one_pass():
    """The dk kernel's token splits (fp32 atomics) give the single-split dk_idx (to rounding)."""
    xs = make(1, 2, 1, 23, 23, 16, 2, 1, 8, seed=22)
    g = torch.rand(1, 23, generator=torch.Generator().manual_seed(1))
    out = {}
    old = idx_host.INTERPRETER_DK_SPLIT
    try:
        for per in (1000, 1):  # one split; BLOCK_T tokens per split
            idx_host.INTERPRETER_DK_SPLIT = per
            out[per] = run(xs, g, causal=True)[1]
    finally:
        idx_host.INTERPRETER_DK_SPLIT = old
    assert torch.allclose(out[1]["dk_idx"], out[1000]["dk_idx"], rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1]["dq_idx"], out[1000]["dq_idx"])


def test_fused_backward_equals_separate(monkeypatch):
    """STREAMKL_INDEXER_BWD=fused (dq_idx, dweights by atomics from the dk kernel) against the
    reference, with token splits, and against the separate kernels; NaN in a key rows 0..8 cannot
    see stays out of their dq_idx (the masked stage zeroes non-finite key rows)."""
    xs = make(1, 4, 2, 13, 21, 24, 4, 1, 16, seed=24)
    monkeypatch.setattr(idx_host, "INTERPRETER_DK_SPLIT", 8)
    monkeypatch.setenv("STREAMKL_INDEXER_BWD", "fused")
    check_case(xs, with_lse=True, causal=True)
    g = torch.ones(1, 13)
    fused = run(xs, g, causal=True)[1]
    bad = [x.clone() for x in xs]
    bad[3][0, 0, 17, 1] = float("nan")  # key 17 of 21: rows 0..8 cannot see it
    fused_bad = run(bad, g, causal=True)[1]
    monkeypatch.setenv("STREAMKL_INDEXER_BWD", "separate")
    sep = run(xs, g, causal=True)[1]
    for name in GRADS:
        assert torch.allclose(fused[name], sep[name], rtol=1e-5, atol=1e-6), name
    assert torch.equal(fused_bad["dq_idx"][0, :, :9], fused["dq_idx"][0, :, :9])
    assert torch.equal(fused_bad["dweights"][0, :, :9], fused["dweights"][0, :, :9])


def test_one_head_chunks(monkeypatch):
    """Plans with one teacher head per chunk (``max_heads_per_chunk=1``, tried for GQA on the GPU)."""
    monkeypatch.setattr(idx_configs, "INTERPRETER_CONFIG", IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=32, block_d=32, num_warps=1, num_stages=1, max_heads_per_chunk=1))
    xs = make(1, 4, 2, 11, 13, 16, 2, 1, 16, seed=25)
    from streamkl_ref._checks import check_indexer_inputs

    assert idx_plan._plan(check_indexer_inputs(*xs), idx_configs.INTERPRETER_CONFIG, "fwd")["HB"] == 1
    check_case(xs, with_lse=False, causal=True, grad=False)


def test_small_tiles_many_stages():
    """16-wide tiles: several key tiles, token blocks and D chunks per program (causal stages)."""
    old = idx_configs.INTERPRETER_CONFIG
    idx_configs.INTERPRETER_CONFIG = IndexerConfig(teacher_rows=16, indexer_rows=16, block_n=16, block_d=16, num_warps=1, num_stages=1)
    try:
        xs = make(1, 4, 2, 9, 35, 20, 4, 1, 16, seed=21)
        check_case(xs, with_lse=False, causal=True)
    finally:
        idx_configs.INTERPRETER_CONFIG = old


@pytest.mark.parametrize("with_lse", [False, True])
def test_relu_off(with_lse):
    xs = make(1, 2, 1, 11, 14, 16, 2, 1, 16, seed=3)
    check_case(xs, with_lse=with_lse, causal=True, relu=False)


def test_absorbed_mla_teacher_head_dim_576():
    """A 576-wide teacher head is tiled along D (16-wide chunks under the interpreter)."""
    xs = make(1, 2, 1, 5, 6, 576, 2, 1, 16, seed=5, qscale=0.1)
    check_case(xs, with_lse=False, causal=True, scale=192 ** -0.5, grad=False)


def test_fp16_and_bf16():
    for dtype in (torch.float16, torch.bfloat16):
        xs = make(1, 4, 1, 10, 12, 16, 2, 1, 16, seed=11, dtype=dtype)
        check_case(xs, with_lse=False, causal=True)


def test_mixed_dtypes_weights_fp32():
    xs = make(1, 2, 1, 6, 9, 16, 2, 1, 16, seed=2, dtype=torch.float16)
    xs[4] = xs[4].float()
    kl, grads = run(xs, torch.ones(1, 6), causal=False)
    ref = ref_forward(xs)[0]
    assert_close("kl", kl, ref, same_precision(xs, None)[0], dtype=torch.float16)
    assert grads["dweights"].dtype == torch.float32 and grads["dq_idx"].dtype == torch.float16


def test_lse_given_equals_computed():
    xs = make(1, 4, 2, 12, 12, 16, 2, 1, 16, seed=4)
    lse = torch.from_numpy(ref_forward(xs, causal=True)[2]).float()
    a = streamkl_gpu.indexer_kl(*xs, causal=True)
    b = streamkl_gpu.indexer_kl(*xs, causal=True, lse=lse)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reductions(reduction):
    """Scalar reductions; "mean" divides by the rows that see a key (causal N_Q > N_K: 5 of 9)."""
    xs = make(2, 2, 1, 9, 5, 16, 2, 1, 8, seed=6)
    kl_ref = ref_forward(xs, causal=True)[0]
    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, TRAIN)]
    out = streamkl_gpu.indexer_kl(*ins, causal=True, reduction=reduction)
    assert out.shape == ()
    want = kl_ref.sum() / (1 if reduction == "sum" else 2 * 5)
    assert abs(out.item() - want) <= 1e-5 * max(1.0, abs(want))
    out.backward()
    g = torch.full((2, 9), 1.0 if reduction == "sum" else 0.1, dtype=torch.float64)
    ref = ref_grads(xs, g, causal=True)
    for name, x in zip(GRADS, ins[2:]):
        assert_close(name, x.grad, ref[name], None, dtype=torch.float32, floor=1e-5)


def test_empty_rows_zero_kl_and_zero_grads():
    xs = make(1, 2, 1, 7, 3, 16, 2, 1, 8, seed=8)
    kl, grads = run(xs, torch.ones(1, 7), causal=True)
    assert torch.equal(kl[:, :4], torch.zeros(1, 4))
    assert torch.equal(grads["dq_idx"][:, :, :4], torch.zeros_like(grads["dq_idx"][:, :, :4]))
    assert torch.equal(grads["dweights"][:, :, :4], torch.zeros_like(grads["dweights"][:, :, :4]))


def test_one_visible_key_gives_exactly_zero():
    xs = make(1, 4, 1, 6, 6, 16, 2, 1, 8, seed=9)
    kl = streamkl_gpu.indexer_kl(*xs, causal=True)
    assert kl[0, 0].item() == 0.0


def test_teacher_gets_no_gradient():
    xs = make(1, 2, 1, 6, 8, 16, 2, 1, 8, seed=10)
    ins = [x.clone().requires_grad_(True) for x in xs]
    streamkl_gpu.indexer_kl(*ins, causal=True, reduction="mean").backward()
    assert ins[0].grad is None and ins[1].grad is None
    assert all(x.grad is not None for x in ins[2:])


def test_any_strides_megatron_layout():
    """[S, B, H, D] tensors transposed to [B, H, S, D] views, no copy: same result as contiguous."""
    B, H, HK, N, D, HI, DI = 2, 2, 1, 9, 16, 2, 8
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(N, B, H, D, generator=gen).permute(1, 2, 0, 3)
    k = torch.randn(N, B, HK, D, generator=gen).permute(1, 2, 0, 3)
    qi = torch.randn(N, B, HI, DI, generator=gen).permute(1, 2, 0, 3)
    ki = torch.randn(N, B, 1, DI, generator=gen).permute(1, 2, 0, 3)
    w = torch.randn(N, B, HI, generator=gen).permute(1, 2, 0)
    xs = [q, k, qi, ki, w]
    assert not q.is_contiguous()
    g = torch.rand(B, N, generator=gen)
    kl_s, gr_s = run(xs, g, causal=True)
    kl_c, gr_c = run([x.contiguous() for x in xs], g, causal=True)
    assert torch.equal(kl_s, kl_c)
    for name in GRADS:
        assert torch.allclose(gr_s[name], gr_c[name], rtol=1e-6, atol=1e-7), name


def test_poisoned_outputs_are_all_written(poison):
    """Fresh buffers start as NaN (api.POISON_FRESH): an unwritten element would fail here."""
    xs = make(1, 4, 2, 13, 21, 16, 4, 2, 8, seed=13)
    kl, grads = run(xs, torch.ones(1, 13), causal=True)
    assert torch.isfinite(kl).all()
    for name in GRADS:
        assert torch.isfinite(grads[name]).all(), name


def _padded_view(x, extra_n, extra_d, n_dim):
    """``x`` as a strided view into a larger NaN-filled buffer (NaN past N and past D)."""
    shape = list(x.shape)
    shape[n_dim] += extra_n
    if x.dim() == 4:
        shape[-1] += extra_d
    buf = torch.full(shape, float("nan"), dtype=x.dtype)
    view = buf[tuple(slice(0, s) for s in x.shape)]
    view.copy_(x)
    return view


def test_nan_isolation():
    """NaN in a key some rows cannot see, NaN in a query row, NaN in the storage past N and past
    D: the rows (and keys) it cannot reach are bitwise equal to the clean run."""
    N = 12
    xs = make(1, 2, 1, N, N, 16, 2, 1, 8, seed=14)
    g = torch.ones(1, N)
    padded = [_padded_view(x, 3, 5, 2) for x in xs]
    kl0, gr0 = run(padded, g, causal=True)
    kl_c, gr_c = run(xs, g, causal=True)
    assert torch.equal(kl0, kl_c)
    for name in GRADS:
        assert torch.equal(gr0[name], gr_c[name]), name
    assert torch.isfinite(kl0).all()
    # NaN at key 9 of the teacher keys and of the indexer keys: rows 0..8 cannot see it
    bad = [x.clone() for x in padded]
    bad[1][0, 0, 9, 0] = float("nan")
    bad[3][0, 0, 9, 2] = float("nan")
    kl, gr = run(bad, g, causal=True)
    assert torch.equal(kl[0, :9], kl0[0, :9]) and torch.isnan(kl[0, 9:]).all()
    assert torch.equal(gr["dq_idx"][0, :, :9], gr0["dq_idx"][0, :, :9])
    assert torch.equal(gr["dweights"][0, :, :9], gr0["dweights"][0, :, :9])
    # NaN in indexer query row 4: only row 4's outputs, and dk of keys <= 4 (which row 4 sees)
    bad = [x.clone() for x in padded]
    bad[2][0, 1, 4, 3] = float("nan")
    kl, gr = run(bad, g, causal=True)
    others = [t for t in range(N) if t != 4]
    assert torch.equal(kl[0, others], kl0[0, others]) and torch.isnan(kl[0, 4])
    assert torch.equal(gr["dq_idx"][0, :, others], gr0["dq_idx"][0, :, others])
    assert torch.equal(gr["dk_idx"][0, :, 5:], gr0["dk_idx"][0, :, 5:])


def test_torch_compile_fullgraph_matches_eager():
    xs = make(1, 4, 1, 7, 9, 16, 2, 1, 8, seed=15)

    def step(q, k, qi, ki, w):
        return streamkl_gpu.indexer_kl(q, k, qi, ki, w, causal=True, reduction="mean")

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
        assert torch.equal(a, b), name


def test_large_logits_rereferenced():
    """|I| near 1e4: the re-referenced accumulator keeps the KL accurate (no eps * |I| loss)."""
    xs = make(1, 2, 1, 8, 10, 16, 2, 1, 8, seed=16, wscale=2000.0)
    kl_ref = ref_forward(xs, causal=True)[0]
    kl = streamkl_gpu.indexer_kl(*xs, causal=True)
    sp = same_precision(xs, None, causal=True)[0]
    assert_close("kl", kl, kl_ref, sp, dtype=torch.float32, floor=1e-5)


BAD = [
    (dict(weights=lambda xs: xs[4][:, :, :-1]), "weights"),
    (dict(k=lambda xs: xs[1].half()), "k"),
    (dict(k_idx=lambda xs: xs[3].half()), "k_idx"),
    (dict(q=lambda xs: xs[0].double(), k=lambda xs: xs[1].double()), "q"),
    (dict(q=lambda xs: torch.zeros(1, 2, 6, 600), k=lambda xs: torch.zeros(1, 1, 8, 600)), "q"),
    (dict(q_idx=lambda xs: torch.zeros(1, 2, 6, 300), k_idx=lambda xs: torch.zeros(1, 1, 8, 300)), "q_idx"),
    (dict(k=lambda xs: torch.zeros(1, 3, 8, 16)), "k"),
    (dict(q_idx=lambda xs: xs[2][:, :, :-1]), "q_idx"),
    (dict(q=lambda xs: xs[0].numpy()), "q"),
]


@pytest.mark.parametrize("change,name", BAD)
def test_bad_inputs_name_the_argument(change, name):
    xs = make(1, 2, 1, 6, 8, 16, 2, 1, 8)
    args = dict(zip(("q", "k", "q_idx", "k_idx", "weights"), xs))
    for key, fn in change.items():
        args[key] = fn(xs)
    with pytest.raises(ValueError, match=name):
        streamkl_gpu.indexer_kl(**args)


def test_bad_options_name_the_argument():
    xs = make(1, 2, 1, 6, 8, 16, 2, 1, 8)
    for kw, name in ((dict(reduction="avg"), "reduction"), (dict(scale=-1.0), "scale"),
                     (dict(relu=1), "relu"), (dict(causal="yes"), "causal"),
                     (dict(lse=torch.zeros(1, 2, 5)), "lse"), (dict(lse=torch.zeros(1, 2, 6).double()), "lse"),
                     (dict(lse=[0.0]), "lse")):
        with pytest.raises(ValueError, match=name):
            streamkl_gpu.indexer_kl(*xs, **kw)


def test_plan_tiles_are_at_least_16_wide():
    """Every dot of every launch plan is >= 16 in M, N and K (tl.dot's minimum)."""
    from streamkl_ref._checks import check_indexer_inputs

    for H, HK, HI, HKI in ((128, 1, 64, 1), (32, 8, 16, 1), (1, 1, 1, 1), (6, 3, 3, 1), (8, 8, 4, 4)):
        xs = make(1, H, HK, 2, 2, 8, HI, HKI, 8)
        dims = check_indexer_inputs(*xs)
        for cfg in (IndexerConfig(teacher_rows=128, indexer_rows=128, block_n=64, block_d=64, num_warps=8, num_stages=2), IndexerConfig(teacher_rows=256, indexer_rows=128, block_n=64, block_d=64, num_warps=8, num_stages=2), IndexerConfig(teacher_rows=16, indexer_rows=16, block_n=16, block_d=16, num_warps=1, num_stages=1)):
            for kind in ("fwd", "bwd"):
                pl = idx_plan._plan(dims, cfg, kind)
                assert pl["HB"] * pl["BLOCK_T"] >= 16 and pl["IB"] * pl["BLOCK_T"] >= 16
                assert pl["n_chunks"] * pl["HB"] >= H
                assert pl["n_ichunks"] * pl["IB"] >= HI
                if kind == "bwd":
                    assert pl["GI_PAD"] * pl["BLOCK_T"] >= 16 and pl["GI_PAD"] >= HI // HKI
                assert math.log2(pl["BLOCK_T"]).is_integer()


@pytest.mark.parametrize("n", [1000, 8192, 32768, 131072])
@pytest.mark.parametrize("causal", [True, False])
def test_dk_token_split_does_not_depend_on_the_batch_size(n, causal):
    """A batch entry's dk is summed over the same token splits as the entry alone, so a batched
    call's dk_idx equals the entries' own calls (the 128K first-call check): the split is chosen
    from one entry's key programs."""
    from streamkl_ref._checks import check_indexer_inputs

    def inputs(b):
        shapes = [(b, 2, n, 16), (b, 1, n, 16), (b, 2, n, 8), (b, 1, n, 8), (b, 2, n)]
        return [torch.empty(s, device="meta") for s in shapes]

    dims = {b: check_indexer_inputs(*inputs(b), scale=0.25) for b in (1, 2, 8)}
    splits = {b: idx_host.dk_token_split(d, 64, 64, 132, causal) for b, d in dims.items()}
    assert len(set(splits.values())) == 1, splits
