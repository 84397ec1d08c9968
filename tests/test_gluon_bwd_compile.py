"""The Gluon backward on CI (no GPU): it compiles for sm_90, its SASS has the intended schedule;
the dispatch rule (Gluon vs Triton) and the backend override.

Gluon does not run under the interpreter, so the kernel's numbers are checked on the GPU
(`git show b7066de:bench/gluon_bwd_gpu.py`, the removed GPU script: against the Triton backward and float64). Here a broken kernel fails at
compile time or in the SASS: spills to local memory (STL/LDL), ptxas serialising the wgmma (a
WARPGROUP.DEPBAR per HGMMA instead of the three waits per query tile the source has), dQ added
by per-element atomics instead of one TMA reduce-add per tile, a divergent branch in the loop,
more shared memory than an sm_90 CTA has, or more registers x threads than a CTA may hold
(Triton's launch check).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from streamkl_gpu.attention.gluon import bwd_dispatch as dispatch
from streamkl_ref._checks import Dims
from _compiler_env import compiler_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Specialisations compiled on CI (dtype : causal|full : D : trained side): every axis the dispatch
# can choose is covered at least once; the GPU script compiles and checks every one it runs.
CI_SPECS = ["bf16:full:128:2", "fp16:causal:128:1", "bf16:causal:64:2", "fp16:full:128:1:gqa", "bf16:causal:128:2:gqa",
            # the lagged dQ (DQ_LAG, opt-in until measured faster): causal (finite copies, the tightest
            # shared memory) and full with three dS buffers
            "bf16:causal:128:1:lag", "bf16:full:128:2:lag:bufs3"]
# Local-memory accesses allowed (per main loop, in the whole kernel): none, but causal, D = 128,
# side 1 trained, or side 2 with GQA (dK atomics), where triton 3.9 keeps 1-2 reloads per tile
# (24 B of stack) beside the dQ staging tile; the GPU's triton 3.6 compiles every spec with none
# (bench/results/2026-12-06_cpu-2core_c70607f/gluon_bwd_sass_counts.csv). Key: (mask, D, side, GQA).
SPILLS_ALLOWED = {("causal", 128, "1", False): (2, 40), ("causal", 128, "2", True): (2, 40)}
WAITS_PER_TILE = 3  # S1, S2, then dK + dQ together (_gluon_bwd._bwd_tile)
WAITS_PER_TILE_LAG = 4  # S1, S2, dK, then the previous tile's dQ (_gluon_bwd._dq_tile)


@pytest.fixture(scope="module")
def compiled():
    """Compile CI_SPECS for sm_90 in a fresh process without TRITON_INTERPRET (the test session
    runs under the interpreter, which Gluon does not support); one JSON line per spec."""
    env = compiler_env()
    proc = subprocess.run([sys.executable, "-m", "streamkl_gpu.devtools.sass", "attention_bwd", *CI_SPECS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"Gluon backward compile failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["spec"]: r for r in rows}


@pytest.mark.parametrize("spec", CI_SPECS)
def test_sass_no_spills_three_waits_per_query_tile(compiled, spec):
    from streamkl_gpu.devtools.sass import REGS_PER_CTA, SMEM_LIMIT

    row = compiled[spec]
    _, mode, d, train, *rest = spec.split(":")
    d = int(d)
    waits = WAITS_PER_TILE_LAG if "lag" in rest else WAITS_PER_TILE
    per_loop, in_all = SPILLS_ALLOWED.get((mode, d, train, "gqa" in rest), (0, 0))
    assert row["stl"] + row["ldl"] <= in_all, f"{spec}: local-memory spills in the SASS: {row}"
    assert all(loop["spill"] <= per_loop for loop in row["loops"]), f"{spec}: spills in the main loops: {row}"
    assert row["resources"]["local"] == 0, f"{spec}: ptxas reports local memory: {row['resources']}"
    assert 0 < row["shared_bytes"] <= SMEM_LIMIT, f"{spec}: {row['shared_bytes']} bytes of shared memory"
    # the launch check that refused every launch on the H200 at 184 registers (384 threads)
    assert row["resources"]["reg"] * row["threads"] <= REGS_PER_CTA, (
        f"{spec}: {row['resources']['reg']} registers x {row['threads']} threads > {REGS_PER_CTA}")
    # the main loops: masked and unmasked query-tile loops, in each of the two consumer warpgroups
    loops = row["loops"]
    assert len(loops) == 4, f"{spec}: expected 4 query-tile loops with HGMMA, found {len(loops)}: {loops}"
    # per tile and warpgroup: S1, S2 (64 x 64 x D: D/16 each), dK (64 x D x 64: 2 x 4) and the
    # dQ half (64 x D/2 x 128: 2 x 4) as 64 x N x 16 HGMMA
    hgmma = 2 * (d // 16) + 8 + 8
    exps = 2 if train == "2" else 1  # setting 1 exponentiates S1 and S2, setting 2 only S1
    for loop in loops:
        assert loop["hgmma"] == hgmma, f"{spec}: {loop['hgmma']} HGMMA per query tile, expected {hgmma}"
        # one DEPBAR per HGMMA would be ptxas serialising the products (the sketch's back-edge trap)
        assert 1 <= loop["depbar"] <= waits, f"{spec}: {loop['depbar']} WARPGROUP.DEPBAR per tile: {loop}"
        assert loop["ex2"] == exps * 64 * 64 // 128, f"{spec}: MUFU.EX2 per tile and thread: {loop}"
        # dQ: the warpgroup's 64 x D/2 fp32 tile staged in shared memory, one TMA reduce-add, no
        # atomics from registers
        assert loop["tma_red"] == 1 and loop["red"] == 0, f"{spec}: dQ reduce-adds per tile: {loop}"
        assert loop["bssy"] == 0, f"{spec}: divergent branches in the main loop: {loop}"


# ----------------------------------------------------------------------------------------------
# dispatch rules (pure, CPU)
# ----------------------------------------------------------------------------------------------

def _dims(NQ=4096, NK=4096, D1=128, D2=128, H=32, HK1=32, HK2=32):
    return Dims(B=1, H=H, NQ=NQ, NK=NK, D1=D1, D2=D2, HK1=HK1, HK2=HK2, scale1=0.1, scale2=0.1)


def _contig(n, d, h=32):
    return (h * n * d, n * d, d, 1)


BF = (torch.bfloat16,) * 4
H100 = (9, 0)


def _args(dims=None, dtypes=BF, strides=None, cap=H100, train1=False, train2=True, mode="auto", det=False):
    dims = dims or _dims()
    if strides is None:
        strides = (_contig(dims.NQ, dims.D1), _contig(dims.NK, dims.D1, dims.HK1),
                   _contig(dims.NQ, dims.D2), _contig(dims.NK, dims.D2, dims.HK2))
    return dims, dtypes, strides, cap, train1, train2, mode, det


@pytest.fixture
def backend():
    """Set ``_gluon_bwd_dispatch.BWD_BACKEND`` for one test, restore it after."""
    old = dispatch.BWD_BACKEND

    def set_(value):
        dispatch.BWD_BACKEND = value

    yield set_
    dispatch.BWD_BACKEND = old


def test_gluon_bwd_import_available_with_ci_triton():
    assert dispatch.GLUON_BWD_AVAILABLE, dispatch.GLUON_BWD_IMPORT_ERROR


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("train1,train2", [(False, True), (True, False), (True, True)])
def test_forced_takes_settings_1_2_and_both_half_precision_64_128(d, dtype, train1, train2):
    args = _args(_dims(D1=d, D2=d), dtypes=(dtype,) * 4, train1=train1, train2=train2)
    assert dispatch.gluon_bwd_unsupported(*args) is None
    assert dispatch.use_gluon_bwd(*args, backend="gluon")


def test_auto_default():
    assert dispatch.GLUON_BWD_AUTO  # measured under the no-regression rule (dispatch docstring)


def test_auto_takes_one_trained_side_from_the_measured_sizes(monkeypatch):
    # measured faster than the Triton pair for one trained side, slower for both (dispatch docstring)
    monkeypatch.setattr(dispatch, "GLUON_BWD_AUTO", True)
    assert dispatch.use_gluon_bwd(*_args(train1=False, train2=True), backend="auto")
    assert dispatch.use_gluon_bwd(*_args(train1=True, train2=False), backend="auto")
    assert not dispatch.use_gluon_bwd(*_args(train1=True, train2=True), backend="auto")
    assert dispatch.use_gluon_bwd(*_args(train1=True, train2=True), backend="gluon")
    for small in (_dims(NK=dispatch.GLUON_BWD_MIN_KEYS - 1), _dims(NQ=dispatch.GLUON_BWD_MIN_QUERIES - 1)):
        assert not dispatch.use_gluon_bwd(*_args(small), backend="auto")
        assert dispatch.use_gluon_bwd(*_args(small), backend="gluon")
    assert not dispatch.use_gluon_bwd(*_args(mode="fused"), backend="auto")  # an explicit mode keeps its kernels
    assert dispatch.use_gluon_bwd(*_args(mode="fused"), backend="gluon")
    monkeypatch.setattr(dispatch, "GLUON_BWD_AUTO", False)
    assert not dispatch.use_gluon_bwd(*_args(), backend="auto")


def test_gqa_per_side_taken():
    for dims in (_dims(HK1=8), _dims(HK2=4), _dims(HK1=1, HK2=16)):
        for train1, train2 in ((False, True), (True, False)):
            assert dispatch.gluon_bwd_unsupported(*_args(dims, train1=train1, train2=train2)) is None


def test_transposed_layout_taken():
    bnhd = (4096 * 32 * 128, 128, 32 * 128, 1)  # a [B, N, H, D] tensor viewed as [B, H, N, D]
    assert dispatch.gluon_bwd_unsupported(*_args(strides=(bnhd,) * 4)) is None


@pytest.mark.parametrize("change,reason", [
    (dict(cap=None), "sm_90"),
    (dict(cap=(8, 0)), "sm_90"),
    (dict(cap=(10, 0)), "sm_90"),
    (dict(train1=False, train2=False), "no side"),
    (dict(det=True), "deterministic"),
    (dict(mode="separate"), "separate"),
    (dict(dtypes=(torch.float32,) * 4), "dtype"),
    (dict(dtypes=(torch.bfloat16, torch.bfloat16, torch.float16, torch.float16)), "one dtype"),
    (dict(dims=_dims(D1=64, D2=128)), "D1=64, D2=128"),
    (dict(dims=_dims(D1=96, D2=96)), "D1=96"),
    (dict(dims=_dims(D1=256, D2=256)), "D1=256"),
    (dict(strides=((4096 * 128, 128, 1, 4096), _contig(4096, 128), _contig(4096, 128), _contig(4096, 128))),
     "contiguous"),
    (dict(strides=(_contig(4096, 128), (4096 * 128, 4096 * 128, 129, 1), _contig(4096, 128), _contig(4096, 128))),
     "16 bytes"),
])
def test_gluon_bwd_declines_with_reason(change, reason):
    args = dict(zip(("dims", "dtypes", "strides", "cap", "train1", "train2", "mode", "det"), _args()))
    args.update(change)
    args = _args(**args)
    why = dispatch.gluon_bwd_unsupported(*args)
    assert why is not None and reason in why, why
    assert not dispatch.use_gluon_bwd(*args, backend="auto")
    with pytest.raises(ValueError, match="STREAMKL_BWD_BACKEND=gluon"):
        dispatch.use_gluon_bwd(*args, backend="gluon")
    assert not dispatch.use_gluon_bwd(*args, backend="triton")


def test_misaligned_base_declines():
    args = _args()
    assert "aligned" in dispatch.gluon_bwd_unsupported(*args, data_ptrs=(0, 8, 0, 0))
    assert dispatch.gluon_bwd_unsupported(*args, data_ptrs=(16, 32, 48, 1 << 40)) is None


def test_unavailable_gluon_is_never_chosen(monkeypatch):
    monkeypatch.setattr(dispatch, "GLUON_BWD_AVAILABLE", False)
    monkeypatch.setattr(dispatch, "GLUON_BWD_IMPORT_ERROR", "ImportError: no gluon")
    monkeypatch.setattr(dispatch, "GLUON_BWD_AUTO", True)
    assert not dispatch.use_gluon_bwd(*_args(), backend="auto")
    with pytest.raises(ValueError, match="no gluon"):
        dispatch.use_gluon_bwd(*_args(), backend="gluon")


def test_backend_from_module_setting_then_environment(backend, monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    backend(None)
    assert dispatch.bwd_backend() == "auto"
    monkeypatch.setenv(dispatch.ENV_VAR, "Triton")
    assert dispatch.bwd_backend() == "triton"
    assert not dispatch.use_gluon_bwd(*_args())  # backend=None reads the setting
    backend("gluon")  # the module setting wins over the environment
    assert dispatch.bwd_backend() == "gluon"
    assert dispatch.use_gluon_bwd(*_args())
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    backend(None)
    with pytest.raises(ValueError, match="STREAMKL_BWD_BACKEND"):
        dispatch.bwd_backend()


def test_api_backward_consults_the_dispatch(backend):
    """The API's backward asks use_gluon_bwd: forced gluon on the interpreter's CPU tensors is
    refused with the reason, forced triton runs the Triton kernels as before."""
    from streamkl_gpu import attention_kl

    torch.manual_seed(0)
    q1, k1, q2, k2 = (torch.randn(1, 1, 8, 16) for _ in range(4))
    q2.requires_grad_(True)
    backend("gluon")
    with pytest.raises(ValueError, match="sm_90"):
        attention_kl(q1, k1, q2, k2).sum().backward()
    backend("triton")
    q2.grad = None
    attention_kl(q1, k1, q2, k2).sum().backward()
    assert q2.grad is not None and torch.isfinite(q2.grad).all() and q2.grad.abs().sum() > 0


# Run without TRITON_INTERPRET (Gluon's JIT binder): the launch that a compile-ahead thread makes
# (stand-in buffers, B = H = N_Q = 1) and the real launch of the same problem, both caught before
# Triton sees them, and each's specialisation as Triton's binder forms it for sm_90.
_AHEAD_SPEC_SCRIPT = r'''
import json, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from streamkl_gpu._core import launcher
from streamkl_gpu.attention.gluon import bwd_sm90_launch as gb

kernel = gb._gluon_kl_bwd_kernel
binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
caught = []

class Catch:  # stands in for the JIT function: records the launch's specialisation
    def warmup(self, *args, grid, **kwargs):
        caught.append(binder(*args, **kwargs)[1])
    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.warmup(*args, grid=grid, **kwargs)

gb._gluon_kl_bwd_kernel = Catch()
rows = []
for (h, hk, nq, nk, d, causal, train, dtype) in ((16, 16, 8192, 8192, 128, True, 2, torch.bfloat16),
                                                (32, 8, 4096, 8192, 128, False, 1, torch.float16),
                                                (4, 4, 200, 2100, 64, True, 1, torch.bfloat16)):
    q1, q2 = [torch.zeros(1, h, nq, d, dtype=dtype) for _ in range(2)]
    k1, k2 = [torch.zeros(1, hk, nk, d, dtype=dtype) for _ in range(2)]
    caught.clear()
    launcher._AHEAD.on, launcher._AHEAD.pending = True, None  # a compile-ahead thread, compiling in place
    stand_in = torch.empty(16)
    gb.gluon_backward(stand_in, q1, k1, q2, k2, stand_in, stand_in, stand_in, causal, 0.1, 0.1, train)
    launcher._AHEAD.on = False
    g, kl, lse1, lse2 = (torch.zeros(1, h, nq) for _ in range(4))
    gb.gluon_backward(g, q1, k1, q2, k2, kl, lse1, lse2, causal, 0.1, 0.1, train)
    rows.append(dict(case=[h, hk, nq, nk, d, causal, train, str(dtype)], launches=len(caught),
                     same=len(caught) == 2 and caught[0] == caught[1], ahead=repr(caught[0]), real=repr(caught[-1])))
print(json.dumps(rows))
'''


def test_compile_ahead_launch_has_the_real_launch_specialisation():
    """The backward's first call joins the compile-ahead thread, then launches: the kernel that
    thread compiled is only reused if the stand-in launch specialises exactly as the real one (else
    the real launch compiles a second time, one compile after the forward's instead of beside it)."""
    env = compiler_env()
    proc = subprocess.run([sys.executable, "-c", _AHEAD_SPEC_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 3
    for row in rows:
        assert row["launches"] == 2, row
        assert row["same"], f"{row['case']}: ahead {row['ahead']} != real {row['real']}"
