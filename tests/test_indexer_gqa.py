"""The GQA teacher's forward kernel (``_indexer_fwd_gqa``, config variants "gqa", "gqa-flat", "gqa-pp")
under the interpreter: against the float64 reference (streamkl_ref.indexer_kl), against the
general kernel, its key splits, masks, NaN isolation, and that it really is the kernel launched.

Tiny shapes (programs run one after another on CPU); TMA descriptors (the kernel's only load
path) through the ``tma`` fixture. Configs are ``(rows, irows, BLOCK_N, BLOCK_D, warps, stages,
hb_max, key_splits, variant)``.
"""
from __future__ import annotations

import pytest
import torch

from streamkl_gpu.indexer import configs as idx_configs
from streamkl_gpu.indexer.plan import IndexerConfig
from streamkl_gpu.indexer import host as idx_host
from streamkl_gpu.indexer import plan as idx_plan
from streamkl_gpu.indexer.triton import fwd_gqa as _indexer_fwd_gqa
from streamkl_ref._checks import check_indexer_inputs

from test_gpu_indexer import check_case, make

# (B, H, H_K, N_Q, N_K, D, H_I, H_KI, D_I), causal, lse given, key splits, variant
CASES = [
    ((1, 8, 2, 21, 21, 32, 4, 1, 16), True, True, 1, "gqa"),      # square causal, the anchor's shape family
    ((1, 8, 2, 21, 21, 32, 4, 1, 16), True, True, 2, "gqa-flat"),   # one flat head loop (K per head), two key splits
    ((2, 8, 2, 35, 35, 32, 4, 1, 16), True, True, 3, "gqa-tm"),     # the token-major grid, B = 2, 3 splits
    ((2, 6, 3, 13, 29, 24, 4, 2, 12), True, False, 2, "gqa"),     # N_K > N_Q, D/D_I padded, 2 indexer key heads, B = 2 split, no lse
    ((1, 6, 2, 17, 9, 16, 2, 1, 16), True, True, 1, "gqa-pp"),      # N_Q > N_K: early rows see no key (KL 0)
    ((1, 4, 2, 19, 23, 16, 4, 1, 16), False, True, 3, "gqa-r168"),  # non-causal, ragged tile, 3 splits (cap: GPU only)
    ((1, 8, 2, 37, 37, 32, 4, 1, 16), True, True, 2, "gqa-band"),   # the masked band in its own launch, 2 splits
    ((2, 6, 2, 17, 29, 16, 2, 1, 16), True, False, 1, "gqa-band"),  # N_K > N_Q, one split + the band, no lse
    ((1, 4, 2, 19, 21, 16, 4, 1, 16), False, True, 1, "gqa-flat-tm-band"),  # non-causal: the band = the ragged tile
    ((1, 8, 2, 37, 37, 32, 4, 1, 16), True, True, 2, "gqa-band-ss"),   # side stream (a GPU only: in turn here)
]


def _config(monkeypatch, block_n, splits, variant):
    monkeypatch.setattr(idx_configs, "INTERPRETER_CONFIG", IndexerConfig(teacher_rows=16, indexer_rows=16, block_n=block_n, block_d=32, num_warps=1, num_stages=1, max_heads_per_chunk=1, splits=splits, variant=variant))


def _launched(monkeypatch):
    """Count the GQA kernel's launches (the general kernel must not run instead)."""
    calls = []
    real = _indexer_fwd_gqa.launch

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(_indexer_fwd_gqa, "launch", spy)
    return calls


@pytest.mark.parametrize("tma", [True], indirect=True)
@pytest.mark.parametrize("shape,causal,with_lse,splits,variant", CASES)
def test_gqa_kernel_matches_reference(monkeypatch, poison, tma, shape, causal, with_lse, splits, variant):
    _config(monkeypatch, 16, splits, variant)
    calls = _launched(monkeypatch)
    xs = make(*shape, seed=sum(shape) + splits)
    check_case(xs, with_lse=with_lse, causal=causal, grad=False)
    assert calls, "the GQA kernel did not run"


@pytest.mark.parametrize("tma", [True], indirect=True)
def test_gqa_kernel_fp16_relu_off(monkeypatch, poison, tma):
    _config(monkeypatch, 16, 1, "gqa")
    calls = _launched(monkeypatch)
    xs = make(1, 8, 4, 18, 18, 32, 4, 1, 16, dtype=torch.float16, seed=5)
    check_case(xs, with_lse=True, causal=True, grad=False, relu=False)
    assert calls


@pytest.mark.parametrize("tma", [True], indirect=True)
def test_gqa_kernel_equals_general_kernel(monkeypatch, tma):
    """The same plan through both kernels: KL and the saved LSE_I agree to fp32 rounding (the
    folded FFMA and head mean change only the last bits); gradients (the backward reads LSE_I)."""
    xs = make(1, 8, 2, 24, 24, 16, 4, 1, 16, seed=11)
    out = {}
    for variant in ("tiles", "gqa", "gqa-flat", "gqa-pp", "gqa-tm", "gqa-band"):
        _config(monkeypatch, 16, 2, variant)
        kl, lse_idx, _ = idx_host._forward(*xs, None, True, 0.3, True)
        out[variant] = (kl, lse_idx)
    for variant in ("gqa", "gqa-flat", "gqa-pp", "gqa-tm", "gqa-band"):
        assert torch.allclose(out[variant][0], out["tiles"][0], rtol=1e-4, atol=1e-6), variant
        assert torch.allclose(out[variant][1], out["tiles"][1], rtol=1e-5, atol=1e-5), variant
    _config(monkeypatch, 16, 2, "gqa")
    check_case(xs, with_lse=True, causal=True, grad=True)


@pytest.mark.parametrize("tma", [True], indirect=True)
@pytest.mark.parametrize("variant", ["gqa", "gqa-band"])
def test_gqa_kernel_nan_isolation(monkeypatch, tma, variant):
    """A NaN in teacher key 17 reaches exactly the rows that see it (square causal: 17..); a NaN
    lse row stays NaN, its neighbours do not."""
    _config(monkeypatch, 16, 1, variant)
    xs = make(1, 4, 2, 24, 24, 16, 2, 1, 16, seed=12)
    good = idx_host._forward(*xs, None, True, 0.3, True)[0]
    bad = [x.clone() for x in xs]
    bad[1][0, 1, 17, 3] = float("nan")
    kl_bad = idx_host._forward(*bad, None, True, 0.3, True)[0]
    assert torch.isnan(kl_bad[0, 17:]).all()
    assert torch.equal(kl_bad[0, :17], good[0, :17])
    lse = idx_host._forward(*xs, None, True, 0.3, True)[2] / idx_plan.LOG2E
    lse[0, 2, 5] = float("nan")
    kl_lse = idx_host._forward(*xs, lse, True, 0.3, True)[0]
    assert torch.isnan(kl_lse[0, 5])
    others = torch.arange(24) != 5
    assert torch.allclose(kl_lse[0, others], good[0, others], rtol=1e-5, atol=1e-6)


def test_gqa_kernel_applies_only_where_it_can():
    """TMA loads and head dims <= 128 only; otherwise the general kernel runs the plan."""
    xs = make(1, 8, 2, 8, 8, 32, 4, 1, 16)
    dims = check_indexer_inputs(*xs)
    pl = idx_plan._plan(dims, IndexerConfig(teacher_rows=16, indexer_rows=16, block_n=16, block_d=32, num_warps=1, num_stages=1, max_heads_per_chunk=1, variant="gqa"), "fwd")
    assert _indexer_fwd_gqa.applies(pl, dims, True)
    assert not _indexer_fwd_gqa.applies(pl, dims, False)
    assert not _indexer_fwd_gqa.applies(dict(pl, variant="tiles"), dims, True)
    wide = check_indexer_inputs(*make(1, 8, 2, 8, 8, 192, 4, 1, 16))
    assert not _indexer_fwd_gqa.applies(idx_plan._plan(wide, IndexerConfig(teacher_rows=16, indexer_rows=16, block_n=16, block_d=32, num_warps=1, num_stages=1, max_heads_per_chunk=1, variant="gqa"), "fwd"), wide, True)


def test_variant_names():
    """``gqa[-flat|-pp][-tm][-band[-ss]][-rNNN]``: the loop, the grid order, the band launch (on
    a side stream), the register cap; other variants are not this kernel's."""
    parse = _indexer_fwd_gqa.parse_variant
    assert parse("gqa") == (1, None, True, False, False, False, False)
    assert parse("gqa-flat") == (0, None, True, False, False, False, False)
    assert parse("gqa-pp") == (2, None, True, False, False, False, False)
    assert parse("gqa-r168") == (1, 168, True, False, False, False, False)
    assert parse("gqa-tm") == (1, None, False, False, False, False, False)
    assert parse("gqa-band") == (1, None, True, True, False, False, False)
    assert parse("gqa-band-ss") == (1, None, True, True, True, False, False)
    assert parse("gqa-flat-tm-band-r128") == (0, 128, False, True, False, False, False)
    for other in ("tiles", "l1", None, "gqa-x", "gqa-r", "flat", "gqa-r168-tm", "tm", "gqa-band-tm", "gqa-band-band",
                  "gqa-ss", "gqa-ss-band"):
        assert parse(other) is None, other


def test_merge_kernel_equals_host_merge():
    """merge_states (one launch) against idx_plan._merge_splits: random states, a split that saw
    no key (m = -inf, l = 0), a row no split saw (KL 0, LSE_I -inf), a NaN state (NaN row)."""
    gen = torch.Generator().manual_seed(3)
    splits, B, N = 3, 2, 37
    part = torch.empty(5, splits, B, N)
    part[0] = 4 * torch.randn(splits, B, N, generator=gen)            # m
    part[1] = torch.rand(splits, B, N, generator=gen) * 5 + 1          # l >= 1 (the max's own exp)
    part[2] = torch.rand(splits, B, N, generator=gen) / splits         # mass
    part[3] = torch.randn(splits, B, N, generator=gen)                 # acc
    part[4] = -torch.rand(splits, B, N, generator=gen)                 # plogp
    part[:, 1, 0, 5] = torch.tensor([float("-inf"), 0.0, 0.0, 0.0, 0.0])   # split 1 saw no key of row 5
    part[:, :, 1, 7] = torch.tensor([float("-inf"), 0.0, 0.0, 0.0, 0.0])[:, None]  # nobody saw row (1, 7)
    part[0, 2, 1, 9] = float("nan")
    kl_ref, lse_ref = idx_plan._merge_splits(part)
    kl, lse = torch.full((B, N), 7.0), torch.full((B, N), 7.0)
    _indexer_fwd_gqa.merge_states(part.contiguous(), kl, lse)
    assert torch.allclose(kl, kl_ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.allclose(lse, lse_ref, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert kl[1, 7] == 0 and lse[1, 7] == float("-inf")
    assert torch.isnan(kl[1, 9]) and torch.isfinite(kl[0]).all()


@pytest.mark.parametrize("splits,t_off,n_valid,t0", [(3, 0, 37, 0), (5, 11, 30, 0), (44, 4, 19, 0), (3, 9, 20, 3),
                                                     (7, 0, 1, 36)])
def test_wide_merge_kernel_equals_host_merge(splits, t_off, n_valid, t0):
    """merge_states_wide (all splits of a row block at once, written in place at a row offset) against
    idx_plan._merge_splits: odd split counts (padded to a power of 2), batch 2, the special rows of
    test_merge_kernel_equals_host_merge; part rows from t0 on (a chunk inside a full-length part);
    rows past n_valid and outside [t_off, t_off + n_valid) untouched."""
    gen = torch.Generator().manual_seed(splits)
    B, N, NQ = 2, 37, 53
    part = torch.empty(5, splits, B, N)
    part[0] = 4 * torch.randn(splits, B, N, generator=gen)
    part[1] = torch.rand(splits, B, N, generator=gen) * 5 + 1
    part[2] = torch.rand(splits, B, N, generator=gen) / splits
    part[3] = torch.randn(splits, B, N, generator=gen)
    part[4] = -torch.rand(splits, B, N, generator=gen)
    part[:, 1, 0, 5] = torch.tensor([float("-inf"), 0.0, 0.0, 0.0, 0.0])
    part[:, :, 1, 7] = torch.tensor([float("-inf"), 0.0, 0.0, 0.0, 0.0])[:, None]
    part[0, 2, 1, 9] = float("nan")
    kl_ref, lse_ref = idx_plan._merge_splits(part)
    kl, lse = torch.full((B, NQ), 7.0), torch.full((B, NQ), 7.0)
    _indexer_fwd_gqa.merge_states_wide(part.contiguous(), kl, lse, t_off, n_valid, t0=t0)
    got_kl, got_lse = kl[:, t_off:t_off + n_valid], lse[:, t_off:t_off + n_valid]
    assert torch.allclose(got_kl, kl_ref[:, t0:t0 + n_valid], rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.allclose(got_lse, lse_ref[:, t0:t0 + n_valid], rtol=1e-6, atol=1e-6, equal_nan=True)
    if t0 == 0:
        assert got_kl[1, 7] == 0 and got_lse[1, 7] == float("-inf") and torch.isnan(got_kl[1, 9])
    outside = torch.ones(B, NQ, dtype=torch.bool)
    outside[:, t_off:t_off + n_valid] = False
    assert (kl[outside] == 7.0).all() and (lse[outside] == 7.0).all()


def test_variant_flags():
    """The flags -wm and -one parse, and with_flags adds them in their place (before -rNNN)."""
    g = _indexer_fwd_gqa
    assert g.with_flags("gqa-band-r128", ["one", "wm"]) == "gqa-band-wm-one-r128"
    var = g.parse_variant("gqa-band-wm-one-r128")
    assert var.band and var.wide_merge and var.one_chunk and var.cap == 128
    assert not g.parse_variant("gqa-band-r128").wide_merge and g.parse_variant("gqa-one-wm") is None
    with pytest.raises(ValueError):
        g.with_flags("gqa", ["x"])
    cands = idx_configs.storing_forward_candidates(False, None, 132, "candidates+wm")  # no GQA candidate: unchanged
    assert cands == idx_configs.storing_forward_candidates(False, None, 132, "candidates")
    with pytest.raises(ValueError):
        idx_configs.storing_forward_candidates(False, None, 132, "fast")


def test_default_candidates_and_split_rule():
    """The untuned default of a GQA teacher (the first candidate) is the GQA kernel's 64 x 64
    band config capped at 128 registers (an H200 run); its key splits follow key_splits: 48 from 8K to 64K on 132 SMs (measured best), fewer for longer sequences (the split states stay small), never more than
    MAX_SPLITS, at least one, and the plan caps them at the key tiles."""
    from streamkl_gpu.indexer.triton import fwd_gqa as g

    rule = {n: g.key_splits(n, 64, 132) for n in (64, 8192, 16384, 32768, 65536, 1 << 17, 1 << 20, 1 << 24)}
    assert rule[8192] == rule[16384] == rule[32768] == rule[65536] == g.MAX_SPLITS == 48
    assert rule[1 << 20] < rule[1 << 17] < rule[65536]
    assert all(1 <= v <= g.MAX_SPLITS for v in rule.values()) and rule[1 << 24] == 1
    assert g.key_splits(8192, 64, 66) == 48 and g.key_splits(1 << 17, 64, 66) < rule[1 << 17]  # fewer SMs, fewer
    for n in (8192, 65536):
        xs = [torch.empty(s, device="meta") for s in ((1, 32, n, 128), (1, 8, n, 128), (1, 16, n, 64), (1, 1, n, 64),
                                                     (1, 16, n))]
        dims = check_indexer_inputs(*xs)
        first = idx_configs._new_fwd_candidates(dims, True, 132)[0]
        assert first == IndexerConfig(teacher_rows=64, indexer_rows=64, block_n=64, block_d=64, num_warps=4, num_stages=2, max_heads_per_chunk=1, splits=g.key_splits(n, 64, 132), variant="gqa-band-r128")
        pl = idx_plan._plan(dims, first, "fwd")
        assert _indexer_fwd_gqa.applies(pl, dims, True)
        tiles = n // 64
        per = -(-tiles // first.splits)  # whole tiles per split (8K: 48 asked, 3 tiles each, 43 splits)
        assert idx_plan._key_splits(dims, pl) == (-(-tiles // per), per * 64)
    small = check_indexer_inputs(*make(1, 8, 2, 100, 100, 32, 4, 1, 16))
    pl = idx_plan._plan(small, IndexerConfig(teacher_rows=64, indexer_rows=64, block_n=64, block_d=64, num_warps=4, num_stages=3, max_heads_per_chunk=1, splits=24, variant="gqa-band"), "fwd")
    assert idx_plan._key_splits(small, pl)[0] == 2  # 100 keys: two 64-key tiles
