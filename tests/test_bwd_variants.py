"""The backward kernel variants (streamkl_gpu/_core/tuning.py BWD_VARIANTS), each forced by
STREAMKL_BWD_VARIANT, under the interpreter: gradients vs the float64 reference (every setting's
code path, fused and separate, GQA, D1 != D2, causal with empty rows), the NaN-isolation contract
(docs/math.md) bitwise as tests/test_nan_isolation.py checks it, extreme logits for the folded
formulas, and that the forced variant is really the one launched (TMA descriptors included).

The interpreter has no TMA reduce-add: tests/_tma_reduce_shim.py adds it (relaxed fp32 atomic
adds of the in-bounds elements, the hardware's semantics).
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import streamkl_gpu
from streamkl_gpu.attention import launch as _launch
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu.attention import configs as attn_configs
from streamkl_gpu.attention.configs import BwdConfig
from streamkl_gpu.attention.triton.bwd import _exp2_fma

import _tma_reduce_shim
from _gpu_helpers import GRAD_NAMES, assert_close, make_inputs, reference, same_precision
from test_nan_isolation import (DIAGONAL_ROWS, KEY7, KEY40, SETTINGS as NAN_SETTINGS, check, contiguous, run,
                                torch_views)

pytestmark = [pytest.mark.usefixtures("poison"), pytest.mark.filterwarnings("ignore::RuntimeWarning")]

SETTINGS = {"s1": (False, False, True, True), "s2": (True, True, False, False), "both": (True, True, True, True)}
# every new code path at least once: TMA loads, key-major tiles, folds (dK kernel pre-scaled,
# dQ kernel post-scaled), the TMA reduce of the fused dQ, each with and without the others
# ("+heavy": the causal dQ kernel's reversed launch order, HEAVY_FIRST; "+pack": packed row constants)
VARIANTS = ["tma+trans+fold+rows+reduce", "tma+trans+fold+reduce", "tma+trans+reduce", "tma", "trans", "fold",
            "tma+trans+fold+rows+heavy", "tma+trans+fold+rows+pack+reduce", "tma+trans+fold+rows+pack+gexp"]


@pytest.fixture
def variant(request, monkeypatch):
    """Force one backward variant, with TMA descriptors available under the interpreter."""
    _tma_reduce_shim.install()
    monkeypatch.setenv("STREAMKL_BWD_VARIANT", request.param)
    monkeypatch.setattr(_runtime, "INTERPRETER_TMA", True)
    yield request.param


def launched(variant, mode):
    """The (dK, dQ) kernel variants of the cached plans made under ``variant`` in ``mode``."""
    plans = {(p.cfg_dk.variant, p.cfg_dq.variant) for sig, p in _launch._PLANS.items()
             if sig[0] == "bwd" and sig[2][-1] == variant and p.mode == mode}
    assert len(plans) == 1, plans
    return plans.pop()


def expected(variant, mode, tma=True):
    name = variant if tma else variant.replace("tma", "").replace("reduce", "").replace("rows", "").replace("pack", "").replace("gexp", "")
    return (attn_configs._kernel_variant(name, "dk", mode == "fused"),
            attn_configs._kernel_variant(name, "dq", mode == "fused"))


def grads_of(xs, train, g, **kw):
    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, train)]
    streamkl_gpu.attention_kl(*ins, **kw).backward(g)
    return {n: x.grad for n, x in zip(GRAD_NAMES, ins)}


SHAPES = [
    # B, H, HK1, HK2, NQ, NK, D1, D2, causal
    pytest.param(1, 4, 2, 1, 19, 37, 32, 16, False, id="gqa-ragged-d1>d2"),
    pytest.param(1, 2, 2, 1, 40, 13, 16, 24, True, id="causal-nq>nk-empty-rows"),
]


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
@pytest.mark.parametrize("mode", ["fused", "separate"])
@pytest.mark.parametrize("B,H,HK1,HK2,NQ,NK,D1,D2,causal", SHAPES)
def test_variant_gradients(variant, mode, B, H, HK1, HK2, NQ, NK, D1, D2, causal):
    _launch._PLANS.clear()
    train = SETTINGS["both"]
    xs = make_inputs(B, H, HK1, HK2, NQ, NK, D1, D2, seed=NQ + 7 * NK)
    g = torch.randn(B, H, NQ, generator=torch.Generator().manual_seed(1))
    grads = grads_of(xs, train, g, causal=causal, bwd_mode=mode)
    assert launched(variant, mode) == expected(variant, mode)
    *_, ref = reference(xs, g, causal=causal)
    _, same = same_precision(xs, g, train=train, causal=causal)
    for name in GRAD_NAMES:
        assert_close(name, grads[name], ref[name], same[name], dtype=torch.float32)
    if causal and NQ > NK:  # rows with no visible key: zero gradient, no NaN
        for name in ("dq1", "dq2"):
            assert (grads[name][:, :, : NQ - NK] == 0).all()


@pytest.mark.parametrize("variant", ["tma+trans+fold+rows+reduce", "fold", "tma+trans+fold+rows+pack",
                                     "tma+trans+fold+rows+pack+poly"], indirect=True)
@pytest.mark.parametrize("mode", ["fused", "separate"])
@pytest.mark.parametrize("setting", ["s1", "s2"])
def test_variant_one_setting(variant, mode, setting):
    """One trained side: the folds and the key-major tiles specialise on TRAIN1 / TRAIN2 alone."""
    train = SETTINGS[setting]
    xs = make_inputs(1, 2, 1, 2, 24, 35, 16, 32, dtype=torch.float16, seed=12)
    g = torch.randn(1, 2, 24, generator=torch.Generator().manual_seed(2))
    grads = grads_of(xs, train, g, causal=True, bwd_mode=mode)
    *_, ref = reference(xs, g, causal=True)
    _, same = same_precision(xs, g, train=train, causal=True)
    for name, t in zip(GRAD_NAMES, train):
        if t:
            assert grads[name].dtype == torch.float16
            assert_close(name, grads[name], ref[name], same[name], dtype=torch.float16)
        else:
            assert grads[name] is None


@pytest.mark.parametrize("variant", ["tma+trans+fold+rows+reduce", "fold", "tma+trans+fold+rows+pack+gexp"],
                         indirect=True)
def test_variant_extreme_logits(variant):
    """Logits of order 1e3 (test_gpu_backward.test_extreme_logits_gradients' bound): the folded
    log-ratio s1*a1 - (s2*a2 + r) keeps the error model of the unfolded one."""
    xs = make_inputs(1, 2, 2, 2, 15, 27, 16, 16, seed=30)
    g = torch.randn(1, 2, 15, generator=torch.Generator().manual_seed(5))
    kw = dict(scale1=200.0, scale2=80.0)
    for mode in ("fused", "separate"):
        grads = grads_of(xs, SETTINGS["both"], g, bwd_mode=mode, **kw)
        _, lse1, lse2, ref = reference(xs, g, **kw)
        u = 2.0 ** -24
        lse_bits = max(abs(lse1).max(), abs(lse2).max()) / 0.6931471805599453
        for name, scale, k in (("dq1", 200.0, xs[1]), ("dk1", 200.0, xs[0]),
                               ("dq2", 80.0, xs[3]), ("dk2", 80.0, xs[2])):
            assert torch.isfinite(grads[name]).all(), name
            err = (grads[name].double() - torch.as_tensor(ref[name])).norm().item()
            natural = scale * g.norm().item() * k.norm().item()
            assert err <= 16 * u * (1 + lse_bits) * natural, (mode, name, err, natural)


@pytest.mark.parametrize("variant", ["tma+trans+fold+rows+reduce", "tma+trans+fold+reduce", "tma", "fold",
                                     "tma+trans+fold+rows+pack+heavy", "tma+trans+fold+rows+pack+poly",
                                     "tma+trans+fold+rows+pack+gexp"], indirect=True)
@pytest.mark.parametrize("mode", ["fused", "separate"])
@pytest.mark.parametrize("case", [KEY7, KEY40, DIAGONAL_ROWS], ids=["n8-key7", "n64-key40", "diagonal-rows"])
def test_variant_nan_isolation(variant, mode, case):
    """Poisons reach only what they may (``_nan_cases.taint``): unreached outputs bitwise equal to
    the clean run, reached ones NaN, dK of unseen keys exactly 0; inputs as strided views into
    NaN-filled buffers (TMA-aligned rows, so the descriptors really read them)."""
    _launch._PLANS.clear()
    dtype = torch.float32
    clean = case.clean(np.float32)
    bad = case.poisoned(clean)
    kw = dict(causal=case.causal, train=NAN_SETTINGS["both"], bwd_mode=mode)
    views = torch_views(case, bad, dtype, tma_aligned=True)
    assert all(_runtime.tma_ok(v) for v in views)
    out, grads = run(views, bad[4], **kw)
    assert launched(variant, mode) == expected(variant, mode)
    ref, ref_grads = run(contiguous(clean, dtype), clean[4], **kw)
    check(case, out, ref, grads, ref_grads)


@pytest.mark.parametrize("variant", ["tma+trans+fold+rows+pack+gexp"], indirect=True)
def test_gexp_upstream_gradient_signs_zeros_and_magnitudes(variant):
    """The "gexp" fold takes log2|g| into the exponentials and the sign of g apart: per-row upstream
    gradients of both signs, exact zeros (+0 and -0), and every row at 1e-30 or at -1e20 give the
    float64 reference's dK (the relative error of each gradient, as the other variants')."""
    xs = make_inputs(1, 2, 1, 2, 24, 37, 16, 32, seed=21)
    base = torch.randn(1, 2, 24, generator=torch.Generator().manual_seed(4))
    mixed = base.clone()
    mixed[0, 0, :6] = torch.tensor([0.0, -0.0, -3.0, 1e-30, -1e20, 1e20])
    mixed[0, 1, 5:9] = 0.0
    _launch._PLANS.clear()
    for g in (mixed, 1e-30 * base, -1e20 * base.abs()):
        for causal in (False, True):
            grads = grads_of(xs, SETTINGS["both"], g, causal=causal, bwd_mode="separate")
            assert launched(variant, "separate")[0] == "tma+trans+fold+rows+pack+gexp"
            *_, ref = reference(xs, g, causal=causal)
            _, same = same_precision(xs, g, train=SETTINGS["both"], causal=causal)
            for name in GRAD_NAMES:
                assert torch.isfinite(grads[name]).all(), name
                assert_close(name, grads[name], ref[name], same[name], dtype=torch.float32)


def test_variant_names():
    """Every listed variant is accepted; an unknown name is refused with the variable's name."""
    for name in attn_configs.BWD_VARIANTS:
        assert attn_configs.bwd_variant(name) == name
    with pytest.raises(ValueError, match="STREAMKL_BWD_VARIANT"):
        attn_configs.bwd_variant("tma+warp")


@pytest.fixture
def gpu_rules(monkeypatch):
    """The candidate lists as on a GPU (the interpreter's single fixed config switched off)."""
    monkeypatch.setattr(attn_configs, "interpreting", lambda: False)
    monkeypatch.delenv("STREAMKL_BWD_VARIANT", raising=False)
    return monkeypatch


def test_default_candidates_keep_the_old_configs(gpu_rules):
    """Unforced, the tuner times the old configs ("ptr", exactly bwd_candidates') and new ones;
    without TMA no descriptor variant; fp32 (IEEE) only the old ones."""
    for kind in ("dk", "dq"):
        for both in (False, True):
            for fused in (False, True):
                old = attn_configs.bwd_candidates(128, both, kind)
                with_tma = attn_configs.bwd_variant_candidates(128, both, kind, False, True, fused)
                assert set(old) < set(with_tma)  # every old config, and new ones (the shape rule's may lead)
                for c in (c for c in with_tma if c not in old):
                    parts = c.variant.split("+")
                    assert "tma" in parts
                    assert ("reduce" in parts) <= (fused and kind == "dk"), c
                    assert ("trans" in parts or "rows" in parts) <= (kind == "dk"), c
                no_tma = attn_configs.bwd_variant_candidates(128, both, kind, False, False, fused)
                assert all("tma" not in c.variant for c in no_tma)
                assert (attn_configs.bwd_variant_candidates(128, both, kind, True, True, fused)
                        == attn_configs.bwd_candidates(128, both, kind, True))


def test_long_problems_get_one_new_candidate(gpu_rules):
    for kind in ("dk", "dq"):
        old = attn_configs.bwd_candidates(128, False, kind)
        few = attn_configs.bwd_variant_candidates(128, False, kind, False, True, True, few=True, n_q=8192)
        assert set(old) < set(few) and len(few) == len(old) + 1
        new = [c for c in few if c not in old]
        assert new[0] in attn_configs.bwd_variant_candidates(128, False, kind, False, True, True, n_q=8192)


def test_forced_variant_restricts_the_candidates(gpu_rules):
    gpu_rules.setenv("STREAMKL_BWD_VARIANT", "tma+trans+fold+rows+reduce")
    dk = attn_configs.bwd_variant_candidates(128, False, "dk", False, True, True)
    assert dk and {c.variant for c in dk} == {"tma+trans+fold+rows+reduce"}
    assert {c.variant for c in attn_configs.bwd_variant_candidates(128, False, "dk", False, True, False)} == {
        "tma+trans+fold+rows"}  # separate kernels: no reduce
    assert {c.variant for c in attn_configs.bwd_variant_candidates(128, False, "dq", False, True, False)} == {"tma+fold"}
    with pytest.raises(ValueError, match="TMA"):  # on a GPU a descriptor variant without TMA is an error
        attn_configs.bwd_variant_candidates(128, False, "dk", False, False, True)
    gpu_rules.setenv("STREAMKL_BWD_VARIANT", "ptr")
    assert (attn_configs.bwd_variant_candidates(128, False, "dk", False, True, True)
            == attn_configs.bwd_candidates(128, False, "dk"))


def test_tuner_skips_an_unusable_variant(monkeypatch):
    """A new variant that fails to compile (UnusableConfig) is skipped; an old config's failure is raised."""
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def launch(cfg):
        if cfg.variant != "ptr":
            raise _tuning.UnusableConfig(f"{cfg}: CompilationError")

    cands = [BwdConfig(block_m=64, block_n=128, num_warps=8, num_stages=2, variant="ptr"),
             BwdConfig(block_m=64, block_n=128, num_warps=8, num_stages=2, variant="tma+trans")]
    assert _tuning._time_candidates(("k",), cands, launch) == cands[0]

    def broken(cfg):
        raise RuntimeError("a bug in the old kernels")
    with pytest.raises(RuntimeError, match="a bug"):
        _tuning._time_candidates(("k2",), cands, broken)


@pytest.mark.parametrize("variant", ["tma+trans+fold+rows+reduce"], indirect=True)
@pytest.mark.parametrize("mode", ["fused", "separate"])
def test_variant_strided_inputs(variant, mode):
    """[B, N, H, D]-laid-out inputs seen as [B, H, N, D] views (the descriptors take the strides)."""
    _launch._PLANS.clear()
    xs = [x.transpose(1, 2).contiguous().transpose(1, 2)
          for x in make_inputs(2, 2, 1, 2, 21, 30, 16, 8, seed=9)]
    assert not xs[0].is_contiguous() and all(_runtime.tma_ok(x) for x in xs)
    g = torch.randn(2, 2, 21, generator=torch.Generator().manual_seed(3))
    grads = grads_of(xs, SETTINGS["both"], g, causal=True, bwd_mode=mode)
    assert launched(variant, mode) == expected(variant, mode)
    *_, ref = reference([x.contiguous() for x in xs], g, causal=True)
    _, same = same_precision([x.contiguous() for x in xs], g, causal=True)
    for name in GRAD_NAMES:
        assert_close(name, grads[name], ref[name], same[name], dtype=torch.float32)


def test_auto_mode_separate_for_one_setting_with_the_new_kernels():
    """With the TMA variants as candidates, one setting runs separate where the dQ kernel has
    programs for >= 90 % of the SMs (bench/results/2026-12-01_h200_121408f/bwd_sweep.csv: setting 2
    at 8K, separate 5.80 ms vs fused 6.79; run
    an H200 run: N_Q 512 x N_K 32K separate 0.87-0.91x, N_Q 16 fused 2.1-2.3x faster); smaller N_Q, both
    settings and the old kernels (varlen, fp32, no TMA) keep their rules."""
    from streamkl_ref._checks import Dims

    def dims(nq, nk, h=32):
        return Dims(B=1, H=h, NQ=nq, NK=nk, D1=128, D2=128, HK1=h, HK2=h, scale1=0.1, scale2=0.1)

    assert attn_configs.auto_bwd_mode(dims(8192, 8192), 132, False, new_kernels=True) == "separate"
    assert attn_configs.auto_bwd_mode(dims(8192, 8192), 132, False, new_kernels=False) == "fused"
    assert attn_configs.auto_bwd_mode(dims(512, 32768), 132, False, new_kernels=True) == "separate"  # 128 dQ programs
    assert attn_configs.auto_bwd_mode(dims(256, 32768), 132, False, new_kernels=True) == "fused"  # 64: half a wave
    assert attn_configs.auto_bwd_mode(dims(16, 32768), 132, False, new_kernels=True) == "fused"  # 32 (an H200 run)
    assert attn_configs.auto_bwd_mode(dims(16, 32768), 132, True, new_kernels=True) == "fused"  # both, small N_Q
    # both (an H100 sweep): fused at N_Q = 64; the separate kernels from 96 against 8K keys or more,
    # from 256 against fewer
    for nq, nk, mode in ((64, 32768, "fused"), (96, 32768, "separate"), (96, 8192, "separate"), (192, 4096, "fused"),
                         (256, 4096, "separate"), (256, 32768, "separate")):
        assert attn_configs.auto_bwd_mode(dims(nq, nk), 132, True, new_kernels=True) == mode, (nq, nk)
    # fewer batch x heads than the sweep ran (32) keep N_Q = 512
    assert attn_configs.auto_bwd_mode(dims(256, 32768, h=8), 132, True, new_kernels=True) == "fused"
    assert attn_configs.auto_bwd_mode(dims(96, 32768, h=64), 132, True, new_kernels=True) == "separate"
    # the kernels without TMA (packed sequences, fp32, no Hopper) keep the rule measured on them
    assert attn_configs.auto_bwd_mode(dims(256, 32768), 132, True, new_kernels=False) == "fused"
    assert attn_configs.auto_bwd_mode(dims(512, 32768), 132, True, new_kernels=False) == "separate"
    assert attn_configs.auto_bwd_mode(dims(8192, 8192), 132, True, new_kernels=True) == "separate"
    assert attn_configs.auto_bwd_mode(dims(4096, 64, h=2), 132, False, new_kernels=True) == "separate"  # few keys


@triton.jit
def _apply_exp2_fma(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _exp2_fma(tl.load(X + offs)))


def test_exp2_on_the_fma_pipe():
    """_bwd._exp2_fma (the "poly" variant's exponentials): within 4e-6 of exp2 relative on the
    range the backward sees (x = log2 P <= 0, and above), 2^-125 at most for -inf and below -125
    (masked entries, empty rows: selected or multiplied by g = 0 after), NaN for NaN."""
    apply = _apply_exp2_fma

    x = torch.cat([torch.linspace(-126.0, 20.0, 1021), torch.tensor([float("-inf"), float("nan"), -1e30])])
    x = torch.cat([x, torch.zeros(1024 - x.numel())]).to(torch.float32)
    y = torch.empty_like(x)
    apply[(1,)](x, y, N=1024)
    want = torch.exp2(x.double())
    finite = torch.isfinite(x) & (x >= -125)
    assert ((y.double()[finite] - want[finite]).abs() <= 4e-6 * want[finite]).all()
    assert (y[~torch.isnan(x) & ~finite] <= 2.0 ** -125).all() and (y[~torch.isnan(x) & ~finite] >= 0).all()
    assert torch.isnan(y[torch.isnan(x)]).all()


def test_second_stream_rule(monkeypatch):
    """STREAMKL_BWD_STREAMS forces the separate backward's second stream on or off (unset: off, its
    gain within the noise in an H200 run); never on CPU tensors or under the interpreter."""
    from streamkl_ref._checks import Dims
    dims = Dims(B=1, H=32, NQ=8192, NK=8192, D1=128, D2=128, HK1=32, HK2=32, scale1=0.1, scale2=0.1)
    monkeypatch.delenv("STREAMKL_BWD_STREAMS", raising=False)
    assert attn_configs.bwd_streams(dims, 132) is False
    monkeypatch.setenv("STREAMKL_BWD_STREAMS", "1")
    assert attn_configs.bwd_streams(dims, 132) is True
    assert _launch._side_stream(dims, torch.device("cpu")) is None
    monkeypatch.setenv("STREAMKL_BWD_STREAMS", "0")
    assert attn_configs.bwd_streams(dims, 132) is False
