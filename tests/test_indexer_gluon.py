"""The indexer's Gluon forward (``indexer/gluon/fwd_sm90.py``, Hopper, MQA teacher) on CI, no GPU: it
compiles for sm_90 and its SASS has the intended schedule; the dispatch rules and the forced modes.

Gluon does not run under the interpreter, so the kernel's numbers are checked on the GPU: the
benchmark's ``indexer`` section with ``--forced gluon_store`` checks the training step with the
Gluon storing forward against float64 at odd shapes on every path. Here a broken kernel fails at
compile time or in the SASS (the wgmma count per key tile, ptxas serialising the products, spills
in the key loops).
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from streamkl_gpu.indexer.training import accumulate as idx_accumulate
from streamkl_gpu.indexer import host as idx_host
from streamkl_gpu.indexer import plan as idx_plan
from streamkl_gpu.indexer import teacher_lse as idx_teacher_lse
from streamkl_ref._checks import check_indexer_inputs
from _compiler_env import compiler_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
gluon = idx_host._gluon_indexer
lse_sm90 = idx_teacher_lse._gluon_lse

# DSA-like default config, a small fp16 non-causal case with 48 heads (N = 64), ragged head dims
# (D = 40: one zero-filled chunk; D_I = 24) and H_I < 64, and the accumulating forward at DSA
# (the 4-slot ring candidate differs from the default in NUM_STAGES only: left out, ~15 s each)
CI_SPECS = ["bf16:causal:128:576:64:128", "fp16:full:48:40:24:24", "bf16:causal+pacc:128:576:64:128",
            "bf16:causal+student:128:576:64:128",  # and the backward's student part (no teacher)
            "bf16:causal+store:128:576:64:128"]  # the chunk design's storing forward (the default at DSA)


def _expected(spec):
    from streamkl_gpu.devtools.sass import config_from_spec

    _, mode, H, D, HI, DI, *items = spec.split(":")
    H, D, HI, DI = map(int, (H, D, HI, DI))
    pacc, student = mode.endswith("+pacc"), mode.endswith("+student")
    dims = SimpleNamespace(H=H, D=D, DI=DI)
    cfg = config_from_spec(gluon.GluonIndexerConfig, items) if items else gluon.candidates(dims, pacc, student)[0]
    block_n = cfg.block_n
    nt, dc, dic = 64 if H <= 64 else 128, (0 if student else -(-D // 64)), -(-DI // 64)
    pacc = pacc or student
    # one m64 x N x k16 HGMMA per 16 of each 64-wide chunk (N: all heads); the accumulating fold
    # adds coef^T k_idx and coef q_idx per D_I chunk (K = 64 keys / 64 heads: 4 each)
    return dict(block_n=block_n, nt=nt, dc=dc, dic=dic, pacc=pacc,
                hgmma=(dc + dic) * 4 + (8 * dic if pacc else 0),
                waits=dc + dic + 1 + (dic if pacc else 0))


@pytest.fixture(scope="module")
def compiled():
    env = compiler_env()
    proc = subprocess.run([sys.executable, "-m", "streamkl_gpu.devtools.sass", "indexer_fwd", *CI_SPECS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"Gluon compile failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["spec"]: r for r in rows}


def test_gluon_import_available_with_ci_triton():
    assert gluon is not None, idx_host.GLUON_IMPORT_ERROR
    assert lse_sm90 is not None, idx_teacher_lse.GLUON_IMPORT_ERROR


@pytest.mark.parametrize("spec", CI_SPECS)
def test_sass_one_chain_of_wgmma_per_key_tile(compiled, spec):
    row, want = compiled[spec], _expected(spec)
    assert row["hgmma"] > 0, f"{spec}: no HGMMA (wgmma lowered to something else): {row}"
    assert row["shared"] <= gluon.SMEM_BYTES, f"{spec}: {row['shared']} B of shared memory"
    loops = row["loops"]
    # one key loop per consumer warpgroup (tiles WG, WG + 2, ...)
    assert len(loops) == 2, f"{spec}: expected 2 key-tile loops with HGMMA, found {len(loops)}: {loops}"
    per_thread_exp = want["nt"] * want["block_n"] // 128 if want["dc"] else 1  # teacher exponentials per thread and tile
    for loop in loops:
        assert loop["hgmma"] == want["hgmma"], f"{spec}: {loop['hgmma']} HGMMA per key tile, expected {want['hgmma']}"
        # the source waits once per D chunk and once at the end; one DEPBAR per HGMMA would be
        # ptxas serialising the products
        assert 1 <= loop["depbar"] <= want["waits"], f"{spec}: {loop['depbar']} WARPGROUP.DEPBAR per tile: {loop}"
        assert loop["ex2"] >= per_thread_exp, f"{spec}: too few MUFU.EX2 per key tile: {loop}"
        # (the 4-slot ring: one value of the prologue, spilled across setmaxnreg, reloaded once per
        # tile; never the accumulators, which would be dozens per tile). The accumulating forward
        # holds dq_p (64 registers) across the loop: 15 / 44 local accesses per tile in the two
        # loops (triton 3.9; its 5 ring slots split 3 / 2 between the warpgroups' rings; 16 / 29 with
        # the one shared ring, which raced; triton 3.6, the GPU image's, 97 / 88),
        # 68 / 95 before its LSEs and weights were parked in shared memory
        # triton 3.6 schedules the accumulating loop with about twice the local traffic: a looser
        # limit there, still under the 128 accesses a tile of a spilled dq_p
        older_triton = tuple(int(p) for p in row["triton"].split(".")[:2]) < (3, 9)
        limit = (112 if older_triton else 48) if want["pacc"] else 2
        assert loop["spills"] <= limit, f"{spec}: local-memory traffic in the key loop: {loop}"
    assert row["resources"]["local"] == 0, row["resources"]


# ----------------------------------------------------------------------------------------------
# dispatch rules (pure, CPU)
# ----------------------------------------------------------------------------------------------

def _dims(H=128, HK=1, D=576, HI=64, HKI=1, DI=128, N=4096):
    shapes = [(1, H, N, D), (1, HK, N, D), (1, HI, N, DI), (1, HKI, N, DI), (1, HI, N)]
    return check_indexer_inputs(*[torch.empty(s, device="meta") for s in shapes], scale=0.07)


BF = (torch.bfloat16,) * 4


def test_applies_to_the_dsa_like_config():
    assert gluon.why_not(_dims(), BF, True, (9, 0)) == ""
    assert gluon.why_not(_dims(), BF, True, (9, 0), pacc=True) == ""
    cfg = gluon.GluonIndexerConfig
    assert gluon.candidates(_dims(), pacc=True) == [cfg(64, 5, 240), cfg(64, 4, 240)]  # beside 2 coefficient tiles
    assert "D_I" in gluon.why_not(_dims(DI=256), BF, True, (9, 0), pacc=True)
    # 7 slots of 8 KB beside 160 KB: rings of 4 and 3 for the two consumer warpgroups
    assert gluon.candidates(_dims()) == [cfg(block_n=64, num_stages=7), cfg(block_n=64, num_stages=4)]


@pytest.mark.parametrize("dims,dtypes,tma,cap,word", [
    (_dims(), BF, True, (10, 0), "capability"),
    (_dims(), BF, True, (8, 0), "capability"),
    (_dims(), (torch.float32,) * 4, True, (9, 0), "dtypes"),
    (_dims(), (torch.bfloat16, torch.bfloat16, torch.float16, torch.float16), True, (9, 0), "dtypes"),
    (_dims(H=32, HK=8, D=128, HI=16, DI=64), BF, True, (9, 0), "H_K"),
    (_dims(HKI=2, HI=64), BF, True, (9, 0), "H_KI"),
    (_dims(H=256), BF, True, (9, 0), "at most"),
    (_dims(HI=128), BF, True, (9, 0), "at most"),
    (_dims(), BF, False, (9, 0), "TMA"),
])
def test_does_not_apply(dims, dtypes, tma, cap, word):
    assert word in gluon.why_not(dims, dtypes, tma, cap)


def test_candidates_fit_shared_memory():
    for dims, pacc in ((_dims(), False), (_dims(), True), (_dims(H=64, D=128, HI=32, DI=64), True),
                       (_dims(D=512, DI=256), False)):
        for c in gluon.candidates(dims, pacc):
            block_n, stages, regs = c.block_n, c.num_stages, c.consumer_regs
            used = (gluon.resident_bytes(dims.H, dims.D, dims.DI) + stages * block_n * 64 * 2
                    + (2 * block_n * 64 * 2 + 4 * 128 * 4 if pacc else 0))
            assert stages >= 2 and used + gluon.SMEM_RESERVE <= gluon.SMEM_BYTES
            assert 2 * 128 * regs + 128 * gluon.producer_regs(regs) <= gluon.CTA_REGS
            assert gluon.producer_regs(regs) >= 24


def test_mode_default_and_forced_mode_says_why(monkeypatch):
    """Default "auto" for the plain forward (the measured family only; a CPU tensor never), 0 for
    the accumulating one (not timed); 1 on a CPU tensor is a ValueError naming the reason, never a
    silent fallback; anything else is a ValueError naming the variable."""
    monkeypatch.delenv("STREAMKL_INDEXER_GLUON", raising=False)
    monkeypatch.delenv("STREAMKL_INDEXER_BACKEND", raising=False)
    assert idx_host.gluon_mode() == "auto"
    xs = [torch.randn(s) for s in [(1, 2, 8, 16), (1, 1, 8, 16), (1, 2, 8, 16), (1, 1, 8, 16), (1, 2, 8)]]
    d = check_indexer_inputs(*xs, scale=0.25)
    assert not idx_host._use_gluon(d, *xs[:4])
    monkeypatch.setenv("STREAMKL_INDEXER_GLUON", "auto")
    assert not idx_host._use_gluon(d, *xs[:4])  # CPU: does not apply, falls back
    monkeypatch.setenv("STREAMKL_INDEXER_GLUON", "1")
    with pytest.raises(ValueError, match="does not apply"):
        idx_host._use_gluon(d, *xs[:4])
    monkeypatch.setenv("STREAMKL_INDEXER_GLUON", "yes")
    with pytest.raises(ValueError, match="STREAMKL_INDEXER_GLUON"):
        idx_host.gluon_mode()
    # the accumulating forward has its own switch, same rules
    monkeypatch.delenv("STREAMKL_INDEXER_GLUON_PACC", raising=False)
    assert idx_host.gluon_mode(pacc=True) == "0"
    monkeypatch.setenv("STREAMKL_INDEXER_GLUON_PACC", "1")
    with pytest.raises(ValueError, match="STREAMKL_INDEXER_GLUON_PACC=1"):
        idx_host._use_gluon(d, *xs[:4], pacc=True)


# ----------------------------------------------------------------------------------------------
# the kernel's schedule (emulated in float64 on CPU) against the reference and the Triton pacc
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,relu,nq,nk", [(True, True, 20, 20), (True, False, 13, 30), (False, True, 9, 150)])
def test_emulated_schedule_matches_the_reference(causal, relu, nq, nk):
    """Interleaved key splits (tile i to warpgroup i % 2), merged by idx_plan._merge_splits,
    with 8-key tiles so that tokens walk several tiles: the KL of streamkl_ref.indexer_kl."""
    import numpy as np
    import streamkl_ref

    gen = torch.Generator().manual_seed(5)
    H, HI, D, DI = 3, 2, 8, 4
    xs = [torch.randn(s, generator=gen) for s in [(1, H, nq, D), (1, 1, nk, D), (1, HI, nq, DI), (1, 1, nk, DI)]]
    xs.append(torch.rand(1, HI, nq, generator=gen))
    scale = 0.4
    x64 = [x.double().numpy() for x in xs]
    kl_ref, lse_i_ref, lse_t = streamkl_ref.indexer_kl(*x64, causal=causal, scale=scale, relu=relu, return_lse=True)
    lse_bits = torch.from_numpy(lse_t).float() * idx_plan.LOG2E
    part = gluon.emulate_states(*xs, lse_bits, causal, scale, relu, block_n=8)
    kl, lse_i = idx_plan._merge_splits(part)
    np.testing.assert_allclose(kl.numpy(), kl_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse_i.numpy(), lse_i_ref, rtol=1e-5, atol=1e-5)


def test_emulated_shares_match_the_triton_accumulating_forward():
    """The accumulating shares (rotated walk) equal _indexer_pacc's dq_p, dw_p, dk_p."""
    gen = torch.Generator().manual_seed(6)
    nq = nk = 24
    xs = [torch.randn(s, generator=gen) for s in [(1, 2, nq, 8), (1, 1, nk, 8), (1, 2, nq, 8), (1, 1, nk, 8)]]
    xs.append(torch.rand(1, 2, nq, generator=gen))
    import streamkl_ref

    _, _, lse_t = streamkl_ref.indexer_kl(*[x.double().numpy() for x in xs], causal=True, scale=0.3, return_lse=True)
    lse = torch.from_numpy(lse_t).float()
    total, _, dq_p, dk_p, dw_p = idx_accumulate._forward_pacc(*xs, lse, True, 0.3, True)
    grads = (torch.zeros_like(dq_p), torch.zeros_like(dw_p), torch.zeros_like(dk_p))
    part = gluon.emulate_states(*xs, lse * idx_plan.LOG2E, True, 0.3, True, block_n=8, grads=grads)
    kl, _ = idx_plan._merge_splits(part)
    assert torch.allclose(kl.sum(), total, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, (dq_p, dw_p, dk_p)):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_emulated_student_backward_completes_the_gradient():
    """The backward's student shares (g = 1) minus the accumulating forward's target shares is
    the gradient of the summed KL (streamkl_ref.indexer_kl_grad with grad_kl = 1)."""
    import numpy as np
    import streamkl_ref

    gen = torch.Generator().manual_seed(7)
    nq, nk = 12, 20
    xs = [torch.randn(s, generator=gen) for s in [(1, 3, nq, 8), (1, 1, nk, 8), (1, 2, nq, 4), (1, 1, nk, 4)]]
    xs.append(torch.rand(1, 2, nq, generator=gen))
    x64 = [x.double().numpy() for x in xs]
    kl, lse_i, lse_t = streamkl_ref.indexer_kl(*x64, causal=True, scale=0.3, return_lse=True)
    ref = streamkl_ref.indexer_kl_grad(*x64, np.ones_like(kl), causal=True, scale=0.3)
    shapes = [(1, 2, nq, 4), (1, 2, nq), (1, 1, nk, 4)]
    target = tuple(torch.zeros(s) for s in shapes)
    student = tuple(torch.zeros(s) for s in shapes)
    gluon.emulate_states(*xs, torch.from_numpy(lse_t).float() * idx_plan.LOG2E, True, 0.3, True, block_n=8,
                         grads=target)
    gluon.emulate_states(*xs, torch.from_numpy(lse_i).float(), True, 0.3, True, block_n=8, grads=student,
                         student=True)
    for name, s_, t_ in zip(("dq_idx", "dweights", "dk_idx"), student, target):
        np.testing.assert_allclose((s_ - t_).numpy(), ref[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_auto_only_for_the_measured_family():
    assert idx_host._gluon_auto(_dims(N=8192))
    assert not idx_host._gluon_auto(_dims(N=1024))  # short: launch-bound, not measured
    assert not idx_host._gluon_auto(_dims(H=32, D=128, N=8192))  # a narrow teacher: not measured


@pytest.mark.parametrize("kernel", ["storing forward", "teacher-LSE pass"])
def test_gluon_default_family_and_forced_choices(monkeypatch, kernel):
    """The chunk design's storing forward (host.use_gluon_store) and the teacher-LSE pass
    (teacher_lse.use_gluon): by default the Gluon kernel only where it applies in the measured
    family (a CPU tensor: never, silently); forced "gluon", by the forcing hook or the backend
    variable, where it does not apply is a ValueError saying why; "triton" never runs it."""
    from streamkl_gpu._core.forcing import forcing
    from streamkl_gpu.indexer import teacher_lse

    if kernel == "storing forward":
        module, choice, rule = idx_host, "indexer_storing_forward_backend", lambda d, xs: idx_host.use_gluon_store(d, *xs[:4])
    else:
        module, choice, rule = teacher_lse, "indexer_teacher_lse_config", lambda d, xs: teacher_lse.use_gluon(d, *xs[:2])
    monkeypatch.delenv("STREAMKL_INDEXER_BACKEND", raising=False)
    xs = [torch.randn(s) for s in [(1, 128, 8, 512), (1, 1, 2048, 512), (1, 64, 8, 16), (1, 1, 2048, 16), (1, 64, 8)]]
    d = check_indexer_inputs(*xs, scale=0.25)
    assert not rule(d, xs)  # the family, but a CPU tensor: does not apply
    with forcing(**{choice: "triton"}):
        assert not rule(d, xs)
    with forcing(**{choice: "gluon"}), pytest.raises(ValueError, match="does not apply"):
        rule(d, xs)
    monkeypatch.setenv("STREAMKL_INDEXER_BACKEND", "gluon")
    with pytest.raises(ValueError, match="STREAMKL_INDEXER_BACKEND=gluon"):
        rule(d, xs)
    # where it would apply (patched: a Hopper device), the default takes it in the family only
    monkeypatch.delenv("STREAMKL_INDEXER_BACKEND")
    monkeypatch.setattr(module, "gluon_why_not", lambda *a, **k: "")
    assert rule(d, xs) and not rule(_dims(N=1024), xs)
    with forcing(**{choice: "triton"}):
        assert not rule(d, xs)
    if kernel == "storing forward":
        with forcing(**{choice: "yes"}), pytest.raises(ValueError, match="'gluon' or 'triton'"):
            rule(d, xs)
    else:  # any other word names a Triton launch config
        with forcing(**{choice: "qreg_128x64_w8s3"}):
            assert not rule(d, xs)


# ----------------------------------------------------------------------------------------------
# the teacher-LSE pass in Gluon (indexer/gluon/lse_sm90.py)
# ----------------------------------------------------------------------------------------------

LSE_SPEC = "bf16:causal:128:576"  # DSA-like: one token per CTA, 9 q chunks in registers


@pytest.fixture(scope="module")
def compiled_lse():
    env = compiler_env()
    proc = subprocess.run([sys.executable, "-m", "streamkl_gpu.devtools.sass", "indexer_lse", LSE_SPEC], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"Gluon compile failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][0])


def test_lse_sass_one_chain_of_register_a_products_per_key_tile(compiled_lse):
    """Per key tile of each consumer warpgroup (whole tiles, then the masked band): one HGMMA per 16
    dims of D (the q chunks from registers), one wait, the tile's 64 x 64 exponentials (32 per
    thread, and the rescale), no local memory in the loops."""
    row = compiled_lse
    assert row["shared"] <= lse_sm90.SMEM_BYTES and row["resources"]["local"] == 0, row
    assert len(row["loops"]) == 4, row["loops"]  # two warpgroups x (whole tiles, masked tiles)
    for loop in row["loops"]:
        assert loop["hgmma"] == 576 // 16, loop
        assert loop["depbar"] == 1, f"ptxas serialising the products: {loop}"
        assert loop["ex2"] >= 32 and loop["spills"] == 0, loop


@pytest.mark.parametrize("dims,dtype,tma,cap,word", [
    (_dims(), torch.bfloat16, True, (10, 0), "capability"),
    (_dims(), torch.float32, True, (9, 0), "dtype"),
    (_dims(H=32, HK=8, D=128, HI=16, DI=64), torch.bfloat16, True, (9, 0), "H_K"),
    (_dims(H=256), torch.bfloat16, True, (9, 0), "at most"),
    (_dims(D=640), torch.bfloat16, True, (9, 0), "D = 640"),
    (_dims(), torch.bfloat16, False, (9, 0), "TMA"),
])
def test_lse_does_not_apply(dims, dtype, tma, cap, word):
    assert lse_sm90.why_not(_dims(), torch.bfloat16, True, (9, 0)) == ""
    assert word in lse_sm90.why_not(dims, dtype, tma, cap)
