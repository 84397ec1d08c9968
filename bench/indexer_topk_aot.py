"""Offline sm_90 compile of the indexer_kl_topk kernels, no GPU needed: compile errors, shared
memory, registers and spills (STACK > 0) of the default launch and the benchmark's variants.

    python bench/indexer_topk_aot.py dsa gqa fp32            # from the repository root
    PYTHONPATH=/path/to/triton-3.6 python bench/indexer_topk_aot.py dsa   # another triton

The launches of streamkl_gpu.indexer.topk are intercepted (CPU tensors, no kernel runs) and
compiled with triton.compile for GPUTarget("cuda", 90); cuobjdump -res-usage gives the counts
(as bench/indexer_aot_check.py does for indexer_kl).
"""
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
os.environ["STREAMKL_AUTOTUNE"] = "0"  # no timing: each config is compiled through CONFIG_OVERRIDE
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch, triton, subprocess, tempfile
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from streamkl_gpu.indexer import topk as _indexer_topk
from streamkl_gpu.indexer.triton import topk as K
from streamkl_gpu._core import runtime as _runtime
_runtime.interpreting = lambda: False
TARGET = GPUTarget("cuda", 90, 32)
records = []
class Rec:
    def __init__(self, name, fn): self.name, self.fn = name, fn
    def __getitem__(self, grid):
        def call(*args, **kw): records.append((self.name, self.fn, args, kw))
        return call
for n in ("_topk_fwd_kernel", "_topk_bwd_kernel", "_topk_student_kernel"):
    setattr(K, n, Rec(n, getattr(K, n)))
CUOBJ = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
def compile_rec(rec):
    name, fn, args, kw = rec
    kw = dict(kw); opts = {"num_warps": kw.pop("num_warps", 4), "num_stages": kw.pop("num_stages", 2)}
    vals = dict(zip(fn.arg_names, args)); vals.update(kw)
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        v = vals.get(n, fn.params[i].default)
        p = fn.params[i]
        if p.is_constexpr:
            sig[n] = "constexpr"; consts[(i,)] = v
        elif v is None:
            sig[n] = "constexpr"; consts[(i,)] = None
        elif isinstance(v, int) and not isinstance(v, bool) and v == 1:
            sig[n] = "constexpr"; consts[(i,)] = 1
        else:
            sig[n] = mangle_type(v)
            if (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0) or isinstance(v, torch.Tensor):
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET, options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"]); cub = f.name
    info = subprocess.run([CUOBJ, "-res-usage", cub], capture_output=True, text=True).stdout
    line = [l.strip() for l in info.splitlines() if "REG" in l]
    cfg = {c: vals[c] for c in ("BLOCK_K", "BLOCK_D", "HB", "HI_PAD", "HAS_LSE", "A_L1") if c in vals}
    print(f"{name:18s} w={opts['num_warps']} s={opts['num_stages']} {cfg} smem={k.metadata.shared} {line[0] if line else ''}", flush=True)

def run(H, HK, D, HI, HKI, DI, dtype, N=256, KS=100, cfgs=(None,), lse=False):
    q = torch.empty(1, H, N, D, dtype=dtype); k = torch.empty(1, HK, N, D, dtype=dtype)
    qi = torch.empty(1, HI, N, DI, dtype=dtype); ki = torch.empty(1, HKI, N, DI, dtype=dtype)
    w = torch.empty(1, HI, N, dtype=dtype); topk = torch.zeros(1, N, KS, dtype=torch.int32)
    for c in cfgs:
        _indexer_topk.CONFIG_OVERRIDE = c
        records.clear()
        _indexer_topk._forward(q, k, qi, ki, w, topk, torch.zeros(1, H, N) if lse else None, True, 0.07, True)
        _indexer_topk._backward(torch.zeros(1, N), qi, ki, w, topk, torch.zeros(1, N, KS), torch.zeros(1, N), True, True)
        for r in records:
            try: compile_rec(r)
            except Exception as e: print("COMPILE FAILED", r[0], c, repr(e)[:2000])
which = sys.argv[1:] or ["dsa"]
if "dsa" in which:
    print("== dsa bf16"); run(128, 1, 576, 64, 1, 128, torch.bfloat16, cfgs=(None, (64, 64, 128, 8, 2, True), (128, 64, 128, 8, 2), (64, 64, 128, 8, 2, False, True), (64, 64, 128, 8, 2, True, True)))
    run(128, 1, 576, 64, 1, 128, torch.bfloat16, lse=True)
if "gqa" in which:
    print("== gqa bf16"); run(32, 8, 128, 16, 1, 64, torch.bfloat16)
if "fp32" in which:
    print("== small fp32/fp16"); run(8, 1, 72, 4, 1, 32, torch.float32); run(4, 2, 40, 6, 2, 24, torch.float16)
