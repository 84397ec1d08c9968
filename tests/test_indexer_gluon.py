"""The indexer's Gluon forward (``_gluon_indexer``, Hopper, MQA teacher) on CI, no GPU: it
compiles for sm_90 and its SASS has the intended schedule; the dispatch rule and the forced mode.

Gluon does not run under the interpreter, so the kernel's numbers are checked on the GPU
(bench/indexer_perf_gpu.py: against float64 and the Triton forward, with and without lse). Here a
broken kernel fails at compile time or in the SASS (the wgmma count per key tile, ptxas
serialising the products, spills in the key loops).
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from streamkl_gpu import _indexer
from streamkl_ref._checks import check_indexer_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
gluon = _indexer._gluon_indexer

# DSA-like default config, its 4-slot ring candidate, and a small fp16 non-causal case with one
# 64-head half, ragged head dims (D = 40: one zero-filled chunk; D_I = 24) and H_I < 64
CI_SPECS = ["bf16:causal:128:576:64:128", "bf16:causal:128:576:64:128:64:4:240", "fp16:full:48:40:24:24"]


def _expected(spec):
    _, _, H, D, HI, DI, *cand = spec.split(":")
    H, D, HI, DI = map(int, (H, D, HI, DI))
    dims = SimpleNamespace(H=H, D=D, DI=DI)
    block_n, stages, regs = tuple(map(int, cand)) if cand else gluon.candidates(dims)[0]
    nt, dc, dic = 64 if H <= 64 else 128, -(-D // 64), -(-DI // 64)
    return dict(block_n=block_n, nt=nt, dc=dc, dic=dic,
                hgmma=(dc + dic) * 4,  # one m64 x N x k16 HGMMA per 16 of each 64-wide chunk (N: all heads)
                waits=dc + dic + 1)


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "streamkl_gpu._gluon_indexer_sass", *CI_SPECS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"Gluon compile failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["spec"]: r for r in rows}


def test_gluon_import_available_with_ci_triton():
    assert gluon is not None, _indexer.GLUON_IMPORT_ERROR


@pytest.mark.parametrize("spec", CI_SPECS)
def test_sass_one_chain_of_wgmma_per_key_tile(compiled, spec):
    row, want = compiled[spec], _expected(spec)
    assert row["hgmma"] > 0, f"{spec}: no HGMMA (wgmma lowered to something else): {row}"
    assert row["shared"] <= gluon.SMEM_BYTES, f"{spec}: {row['shared']} B of shared memory"
    loops = row["loops"]
    # one key loop per consumer warpgroup (tiles WG, WG + 2, ...)
    assert len(loops) == 2, f"{spec}: expected 2 key-tile loops with HGMMA, found {len(loops)}: {loops}"
    per_thread_exp = want["nt"] * want["block_n"] // 128  # teacher exponentials per thread and tile
    for loop in loops:
        assert loop["hgmma"] == want["hgmma"], f"{spec}: {loop['hgmma']} HGMMA per key tile, expected {want['hgmma']}"
        # the source waits once per D chunk and once at the end; one DEPBAR per HGMMA would be
        # ptxas serialising the products
        assert 1 <= loop["depbar"] <= want["waits"], f"{spec}: {loop['depbar']} WARPGROUP.DEPBAR per tile: {loop}"
        assert loop["ex2"] >= per_thread_exp, f"{spec}: too few MUFU.EX2 per key tile: {loop}"
        # (the 4-slot ring: one value of the prologue, spilled across setmaxnreg, reloaded once per
        # tile; never the accumulators, which would be dozens per tile)
        assert loop["spills"] <= 2, f"{spec}: local-memory traffic in the key loop: {loop}"
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
    assert gluon.candidates(_dims()) == [(64, 7, 240), (64, 4, 240)]  # 7 slots of 8 KB beside 160 KB


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
    for dims in (_dims(), _dims(H=64, D=128, HI=32, DI=64), _dims(D=512, DI=256)):
        for block_n, stages, regs in gluon.candidates(dims):
            used = gluon.resident_bytes(dims.H, dims.D, dims.DI) + stages * block_n * 64 * 2
            assert stages >= 2 and used + gluon.SMEM_RESERVE <= gluon.SMEM_BYTES
            assert 2 * 128 * regs + 128 * gluon.producer_regs(regs) <= gluon.CTA_REGS
            assert gluon.producer_regs(regs) >= 24


def test_mode_default_off_and_forced_mode_says_why(monkeypatch):
    """Default 0 (not yet measured faster); 1 on a CPU tensor is a ValueError naming the reason,
    never a silent fallback; anything else is a ValueError naming the variable."""
    monkeypatch.delenv("STREAMKL_INDEXER_GLUON", raising=False)
    assert _indexer.gluon_mode() == "0"
    xs = [torch.randn(s) for s in [(1, 2, 8, 16), (1, 1, 8, 16), (1, 2, 8, 16), (1, 1, 8, 16), (1, 2, 8)]]
    d = check_indexer_inputs(*xs, scale=0.25)
    assert not _indexer._use_gluon(d, *xs[:4])
    monkeypatch.setenv("STREAMKL_INDEXER_GLUON", "auto")
    assert not _indexer._use_gluon(d, *xs[:4])  # CPU: does not apply, falls back
    monkeypatch.setenv("STREAMKL_INDEXER_GLUON", "1")
    with pytest.raises(ValueError, match="does not apply"):
        _indexer._use_gluon(d, *xs[:4])
    monkeypatch.setenv("STREAMKL_INDEXER_GLUON", "yes")
    with pytest.raises(ValueError, match="STREAMKL_INDEXER_GLUON"):
        _indexer.gluon_mode()
