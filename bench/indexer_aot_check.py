"""Offline compile of the indexer kernels for sm_90, no GPU needed: compile errors, shared memory,
registers and spills (STACK > 0) of every launch candidate the host code would try.

    python bench/indexer_aot_check.py dsa gqa fp32 odd      # from the repository root
    TMA=0 python bench/indexer_aot_check.py dsa             # the pointer-load path
    PYTHONPATH=/path/to/triton-3.6 python bench/indexer_aot_check.py dsa   # another triton

It intercepts the launches of streamkl_gpu.indexer.host (CPU tensors, no kernel runs) and compiles
each with triton.compile for GPUTarget("cuda", 90); cuobjdump -res-usage gives the counts.
"""
import os, sys, itertools
os.environ.pop("TRITON_INTERPRET", None)
os.environ["STREAMKL_AUTOTUNE"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from streamkl_gpu.indexer.training import accumulate as idx_accumulate
from streamkl_gpu.indexer import configs as idx_configs
from streamkl_gpu.indexer import host as idx_host
from streamkl_gpu.indexer.triton import fwd as _indexer_fwd
from streamkl_gpu.indexer.triton import bwd as _indexer_bwd
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning
from triton.runtime.jit import mangle_type
_runtime.tma_ok = lambda t: os.environ.get('TMA', '1') == '1'

TARGET = GPUTarget("cuda", int(os.environ.get("ARCH", "90")), 32)
records = []
FWD_ONLY = os.environ.get("FWD_ONLY", "0") == "1"  # the forward with lse given only
PACC = os.environ.get("PACC", "0") == "1"  # the accumulating forward + teacher-free backward only
BWD_ONLY = os.environ.get("BWD_ONLY", "0") == "1"

class Rec:
    def __init__(self, name, fn): self.name, self.fn = name, fn
    def __getitem__(self, grid):
        def call(*args, **kw):
            records.append((self.name, self.fn, grid, args, kw))
        return call

from streamkl_gpu.indexer.triton import accumulate as _indexer_pacc
for mod, name in ((_indexer_pacc, "_indexer_fwd_pacc_kernel"),
                  (_indexer_fwd, "_indexer_fwd_kernel"), (_indexer_fwd, "_teacher_lse_kernel"),
                  (_indexer_bwd, "_indexer_bwd_dq_kernel"), (_indexer_bwd, "_indexer_bwd_dk_kernel")):
    setattr(mod, name, Rec(name, getattr(mod, name)))

if os.environ.get("FWD_CONFIGS"):  # e.g. FWD_CONFIGS="128,128,256,64,16,2;256,128,128,64,16,2": these instead
    _want = [tuple(None if v == "None" else (int(v) if v.lstrip("-").isdigit() else v) for v in c.split(","))
             for c in os.environ["FWD_CONFIGS"].split(";")]
    _orig_cands = idx_configs._candidates
    idx_configs._candidates = lambda kind, *a, **k: _want if kind == "fwd" else _orig_cands(kind, *a, **k)


if os.environ.get("PACC_CONFIGS"):  # the accumulating forward's candidates, as FWD_CONFIGS
    _pwant = [tuple(None if v == "None" else (int(v) if v.lstrip("-").isdigit() else v) for v in c.split(","))
              for c in os.environ["PACC_CONFIGS"].split(";")]
    _orig_cands2 = idx_configs._candidates
    idx_configs._candidates = lambda kind, *a, **k: _pwant if kind == "pacc" else _orig_cands2(kind, *a, **k)


if os.environ.get("BWD_CONFIGS"):  # the plain backward's candidates, as FWD_CONFIGS
    _bwant = [tuple(None if v == "None" else (int(v) if v.lstrip("-").isdigit() else v) for v in c.split(","))
              for c in os.environ["BWD_CONFIGS"].split(";")]
    _orig_cands3 = idx_configs._candidates
    idx_configs._candidates = lambda kind, *a, **k: _bwant if kind == "bwd" else _orig_cands3(kind, *a, **k)


def pick_all(key, cands, launch, *a, **k):
    for c in cands: launch(c)
    return cands[0]
_tuning.pick = pick_all
_runtime.n_sm = lambda d: 132

TY = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}

def compile_rec(rec):
    name, fn, grid, args, kw = rec
    names = fn.arg_names
    sig, consts, attrs = {}, {}, {}
    kw = dict(kw)
    opts = {"num_warps": kw.pop("num_warps", 4), "num_stages": kw.pop("num_stages", 2)}
    vals = dict(zip(names, args)); vals.update(kw)
    for i, n in enumerate(names):
        v = vals[n]
        p = fn.params[i]
        if p.is_constexpr:
            sig[n] = "constexpr"; consts[(i,)] = v
        elif v is None:
            sig[n] = "constexpr"; consts[(i,)] = None
        elif isinstance(v, int) and not isinstance(v, bool) and v == 1 and not p.do_not_specialize:
            sig[n] = "constexpr"; consts[(i,)] = 1  # what the JIT does with an int equal to 1
        else:
            sig[n] = mangle_type(v)
            # the JIT's divisibility specialisation: ints divisible by 16, 16-byte aligned pointers
            if (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0) or isinstance(v, torch.Tensor):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=TARGET, options=opts)
    md = k.metadata
    n_regs = n_spills = None
    try:
        from triton.backends.nvidia.driver import CudaUtils  # needs a driver: skip
    except Exception:
        pass
    asm = k.asm.get("sass") or ""
    ptx = k.asm["ptx"]
    # registers from ptxas via cubin info is not available without the driver; parse ptx .maxnreg? use cuobjdump
    import subprocess, tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"]); cub = f.name
    info = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump") if os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")) else "/work/main/.venv/lib/python3.11/site-packages/triton/backends/nvidia/bin/cuobjdump", "-res-usage", cub],
                          capture_output=True, text=True).stdout
    line = [l.strip() for l in info.splitlines() if "REG" in l]
    cfg = {k2: vals[k2] for k2 in ("BLOCK_T", "BLOCK_N", "BLOCK_D", "HB", "IB", "GI_PAD", "SPLIT", "TEACHER", "ATOMIC")
           if k2 in vals}
    print(f"{name:26s} warps={opts['num_warps']} stages={opts['num_stages']} {cfg} smem={md.shared} {line[0] if line else ''}", flush=True)

def run(cfgname, H, HK, D, HI, HKI, DI, dtype, causal=True, lse=True, N=int(os.environ.get("N", "256"))):
    q = torch.empty(1, H, N, D, dtype=dtype); k = torch.empty(1, HK, N, D, dtype=dtype)
    qi = torch.empty(1, HI, N, DI, dtype=dtype); ki = torch.empty(1, HKI, N, DI, dtype=dtype)
    w = torch.empty(1, HI, N, dtype=dtype)
    lse_t = torch.zeros(1, H, N) if lse else None
    records.clear()
    if PACC:  # the accumulating forward and the teacher-free backward only
        idx_accumulate._forward_pacc(q, k, qi, ki, w, lse_t, causal, 0.07, True)
        if FWD_ONLY:
            return _compile_all(cfgname, dtype)
        z = torch.zeros(())
        idx_host._backward(torch.zeros(1, N), q, k, qi, ki, w, lse_t, torch.zeros(1, N), causal, 0.07, True,
                           target_part=(z, torch.zeros(1, HI, N, DI), torch.zeros(1, 1, N, DI), torch.zeros(1, HI, N)))
    elif BWD_ONLY:  # the plain backward's kernels only (BWD_CONFIGS: these candidates instead)
        idx_host._backward(torch.zeros(1, N), q, k, qi, ki, w, torch.zeros(1, H, N), torch.zeros(1, N), causal, 0.07, True)
        return _compile_all(cfgname, dtype)
    else:
        idx_host._forward(q, k, qi, ki, w, lse_t, causal, 0.07, True)
    if FWD_ONLY or PACC:
        pass
    elif lse:
        idx_host._forward(q, k, qi, ki, w, None, causal, 0.07, True)
    if not (FWD_ONLY or PACC):
        idx_host._backward(torch.zeros(1, N), q, k, qi, ki, w, torch.zeros(1, H, N), torch.zeros(1, N), causal, 0.07, True)
    _compile_all(cfgname, dtype)


def _compile_all(cfgname, dtype):
    print(f"== {cfgname} {dtype}")
    seen = set()
    for r in records:
        key = (r[0], repr(sorted((k2, v) for k2, v in r[4].items())))
        if key in seen: continue
        seen.add(key)
        try:
            compile_rec(r)
        except Exception as e:
            print(f"{r[0]} FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)

which = sys.argv[1:] or ["dsa", "gqa"]
if "dsa" in which: run("dsa", 128, 1, 576, 64, 1, 128, torch.bfloat16)
if "gqa" in which: run("gqa", 32, 8, 128, 16, 1, 64, torch.bfloat16)
if "fp32" in which: run("gqa", 32, 8, 128, 16, 1, 64, torch.float32)
if "odd" in which: run("odd", 6, 3, 40, 3, 1, 24, torch.float16)
