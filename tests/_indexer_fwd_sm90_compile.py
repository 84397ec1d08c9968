"""Test helper (run in its own process by tests/test_indexer_keys_major.py): offline sm_90 compile
of the DSA-like indexer forward (lse given), no GPU needed: registers, spills, shared memory, and
what the score tile's epilogue costs (TTGIR layout conversions, SASS instruction counts: HGMMA,
MUFU.EX2, SHFL, BAR, STS/LDS, STL/LDL) for each forward config given.

    python tests/_indexer_fwd_sm90_compile.py "128,128,128,64,4,3;128,128,128,64,4,3,None,1,keys"
    DUMP=/tmp/ttgir python tests/_indexer_fwd_sm90_compile.py ...   # also write TTGIR / SASS per config

It intercepts the launch of streamkl_gpu.indexer.host._forward (CPU tensors, no kernel runs; a
test helper may patch the library's private names, a benchmark never does) and compiles with
triton.compile for GPUTarget("cuda", 90, 32). Moved here from the benchmark folder, where its
sweep over candidates was an exploration whose results are committed.
"""
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["STREAMKL_AUTOTUNE"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from streamkl_gpu.indexer import configs as idx_configs  # noqa: E402
from streamkl_gpu.indexer.plan import IndexerConfig  # noqa: E402
from streamkl_gpu.indexer import host as idx_host  # noqa: E402
from streamkl_gpu.indexer.triton import fwd as _indexer_fwd
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning

_runtime.tma_ok = lambda t: os.environ.get("TMA", "1") == "1"
_runtime.n_sm = lambda d: 132
TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
records = []


class Rec:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __getitem__(self, grid):
        def call(*args, **kw):
            records.append((self.name, self.fn, args, kw))
        return call


_indexer_fwd._indexer_fwd_kernel = Rec("_indexer_fwd_kernel", _indexer_fwd._indexer_fwd_kernel)


def parse_cfg(text):
    """``"128,128,64,64,4,3,None,1,keys"`` as an IndexerConfig (its fields in order)."""
    fields = [None if v == "None" else (int(v) if v.lstrip("-").isdigit() else v) for v in text.split(",")]
    return IndexerConfig(*fields)


def cfg_text(cfg):
    return "[" + ", ".join(repr(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)) + "]"


def compile_one(name, fn, args, kw):
    kw = dict(kw)
    opts = {"num_warps": kw.pop("num_warps", 4), "num_stages": kw.pop("num_stages", 2)}
    if "maxnreg" in kw:
        opts["maxnreg"] = kw.pop("maxnreg")
    vals = dict(zip(fn.arg_names, args))
    vals.update(kw)
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        v, p = vals[n], fn.params[i]
        if p.is_constexpr or v is None:
            sig[n] = "constexpr"
            consts[(i,)] = v
        elif isinstance(v, int) and not isinstance(v, bool) and v == 1 and not p.do_not_specialize:
            sig[n] = "constexpr"
            consts[(i,)] = 1  # what the JIT does with an int equal to 1
        else:
            sig[n] = mangle_type(v)
            if (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0) or isinstance(v, torch.Tensor):
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET, options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
        cub = f.name
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", cub], capture_output=True, text=True).stdout
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cub], capture_output=True, text=True).stdout
    os.unlink(cub)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    ttgir = k.asm["ttgir"]
    counts = {
        "cvt": ttgir.count("ttg.convert_layout"), "lalloc": ttgir.count("ttg.local_alloc"),
        "HGMMA": len(re.findall(r"\bHGMMA\.", sass)), "EX2": len(re.findall(r"MUFU\.EX2", sass)),
        "SHFL": len(re.findall(r"\bSHFL\.", sass)), "BAR": len(re.findall(r"\bBAR\.", sass)),
        "STS": len(re.findall(r"\bSTS", sass)), "LDS": len(re.findall(r"\bLDS", sass)),
        "STL": len(re.findall(r"\bSTL", sass)), "LDL": len(re.findall(r"\bLDL", sass)),
        "instr": len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass)),
    }
    meta = {n: vals[n] for n in ("BLOCK_T", "BLOCK_N", "BLOCK_D", "HB", "IB") if n in vals}
    line = (f"{name:26s} w{opts['num_warps']} s{opts['num_stages']} r{opts.get('maxnreg')} {meta} smem={k.metadata.shared} "
            f"regs={regs.group(1) if regs else '?'} stack={stack.group(1) if stack else '?'} "
            + " ".join(f"{a}={b}" for a, b in counts.items()))
    dump = os.environ.get("DUMP")
    if dump:
        os.makedirs(dump, exist_ok=True)
        tag = f"{name}_w{opts['num_warps']}s{opts['num_stages']}_" + "_".join(f"{a}{b}" for a, b in meta.items())
        with open(os.path.join(dump, tag + ".ttgir"), "w") as f:
            f.write(ttgir)
        with open(os.path.join(dump, tag + ".sass"), "w") as f:
            f.write(sass)
    return line


def main(argv):
    cfgs = [parse_cfg(c) for c in argv[0].split(";")]
    orig = idx_configs._candidates
    _tuning.pick = lambda key, cands, launch, *a, **k: [launch(c) for c in cands] and cands[0]
    N = int(os.environ.get("N", "256"))
    H, D, HI, DI = 128, 576, 64, 128
    dt = torch.bfloat16
    q, k = torch.empty(1, H, N, D, dtype=dt), torch.empty(1, 1, N, D, dtype=dt)
    qi, ki, w = torch.empty(1, HI, N, DI, dtype=dt), torch.empty(1, 1, N, DI, dtype=dt), torch.empty(1, HI, N, dtype=dt)
    print(f"triton {triton.__version__}, sm_90, DSA-like forward, lse given, causal", flush=True)
    for cfg in cfgs:
        records.clear()
        idx_configs._candidates = lambda kind, *a, **kw: [cfg] if kind == "fwd" else orig(kind, *a, **kw)
        try:
            idx_host._forward(q, k, qi, ki, w, torch.zeros(1, H, N), True, 192 ** -0.5, True)
            for name, fn, args, kw in records[:1]:  # pick's launches and the chosen one's: one compile
                print(f"{cfg_text(cfg)}: " + compile_one(name, fn, args, kw), flush=True)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{cfg_text(cfg)}: FAILED {type(exc).__name__}: {str(exc)[:1500]}", flush=True)
    idx_configs._candidates = orig


if __name__ == "__main__":
    main(sys.argv[1:])
