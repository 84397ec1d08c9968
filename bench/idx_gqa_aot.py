"""Offline sm_90 compile of the GQA forward kernel (``_indexer_fwd_gqa``), no GPU needed: shared
memory, registers and spills of each launch config at the GQA-like anchor (H=32, D=128, H_K=8;
H_I=16, D_I=64, H_KI=1), bf16, causal, lse given.

    python bench/idx_gqa_aot.py                       # the configs of bench/idx_gqa_gpu.py (GQA_CONFIGS)
    CONFIGS="64,64,64,64,4,3,1,5,gqa;128,128,64,64,8,2,1,5,gqa-kv" python bench/idx_gqa_aot.py

It intercepts the kernel launch (CPU tensors; TMA reported available) and compiles it with
triton.compile for GPUTarget("cuda", 90); cuobjdump -res-usage gives registers and stack.
"""
import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["STREAMKL_AUTOTUNE"] = "0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from streamkl_gpu.indexer import configs as idx_configs  # noqa: E402
from streamkl_gpu.indexer import host as idx_host  # noqa: E402
from streamkl_gpu.indexer.triton import fwd_gqa as _indexer_fwd_gqa
from streamkl_gpu._core import runtime as _runtime

TARGET = GPUTarget("cuda", 90, 32)
_runtime.tma_ok = lambda t: True
_runtime.n_sm = lambda d: 132
records = []


class Rec:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def call(*args, **kw):
            records.append((self.fn, grid, args, kw))
        return call


def parse(text):
    return [tuple(None if v == "None" else (int(v) if v.lstrip("-").isdigit() else v) for v in c.split(","))
            for c in text.split(";") if c]


def compile_rec(fn, args, kw):
    kw = dict(kw)
    opts = {"num_warps": kw.pop("num_warps", 4), "num_stages": kw.pop("num_stages", 2)}
    if kw.get("maxnreg") or os.environ.get("MAXNREG"):  # a register cap (ptxas -maxrregcount)
        opts["maxnreg"] = int(kw.pop("maxnreg", None) or os.environ["MAXNREG"])
    vals = dict(zip(fn.arg_names, args))
    vals.update(kw)
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        v, p = vals[n], fn.params[i]
        if p.is_constexpr:
            sig[n] = "constexpr"
            consts[(i,)] = v
        elif isinstance(v, int) and not isinstance(v, bool) and v == 1:
            sig[n] = "constexpr"
            consts[(i,)] = 1
        else:
            sig[n] = mangle_type(v)
            if (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0) or isinstance(v, torch.Tensor):
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET, options=opts)
    if os.environ.get("DUMP"):  # e.g. DUMP=/tmp/gqa: the TTGIR and SASS of the last config
        for ext in ("ttgir", "ptx"):
            with open(f"{os.environ['DUMP']}.{ext}", "w") as f:
                f.write(k.asm[ext])
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    info = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    line = [x.strip() for x in info.splitlines() if "REG" in x]
    return k.metadata.shared, (line[0] if line else "?")


def main():
    if os.environ.get("CONFIGS"):
        cfgs = parse(os.environ["CONFIGS"])
    else:
        from idx_gqa_gpu import GQA_CONFIGS  # the configs the GPU script times
        cfgs = GQA_CONFIGS
    _indexer_fwd_gqa._indexer_fwd_gqa_kernel = Rec(_indexer_fwd_gqa._indexer_fwd_gqa_kernel)
    _indexer_fwd_gqa.MERGE_KERNEL = False  # (the host merge of CPU tensors: no launch)
    N = int(os.environ.get("N", "8192"))
    H, HK, D, HI, HKI, DI = 32, 8, 128, 16, 1, 64
    bf = torch.bfloat16
    xs = [torch.empty(1, H, N, D, dtype=bf), torch.empty(1, HK, N, D, dtype=bf), torch.empty(1, HI, N, DI, dtype=bf),
          torch.empty(1, HKI, N, DI, dtype=bf), torch.empty(1, HI, N, dtype=bf)]
    lse = torch.zeros(1, H, N)
    for cfg in cfgs:
        records.clear()
        idx_configs._candidates = lambda kind, *a, _c=cfg, **k: [_c]
        try:
            idx_host._forward(*xs, lse, True, D ** -0.5, True)
            if not records:
                print(f"{cfg}: the GQA kernel was not launched (general kernel)")
                continue
            fn, grid, args, kw = records[0]
            smem, regs = compile_rec(fn, args, kw)
            print(f"{str(cfg):44s} grid={grid} smem={smem} {regs}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"{cfg}: FAILED {type(exc).__name__}: {str(exc)[:1500]}", flush=True)


if __name__ == "__main__":
    main()
