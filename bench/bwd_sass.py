"""Offline sm_90 compile of the backward kernels (streamkl_gpu/attention/triton/bwd.py), no GPU needed: for every
launch candidate of every variant, registers, spills (STL/LDL), shared memory, and per main loop
the HGMMA / MUFU.EX2 / instruction counts of the SASS (the proxy for speed used before a GPU run).

    python bench/bwd_sass.py [VARIANT ...] [--setting s1,s2] [--causal 0,1] [--d 128] [--first]
    PYTHONPATH=/tmp/t36 python bench/bwd_sass.py ...      # another triton (e.g. the GPU image's 3.6)

It intercepts the launches of streamkl_gpu.attention.launch.backward (CPU tensors, nothing runs) and
compiles each with triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)).
"""
import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ["STREAMKL_AUTOTUNE"] = "0"
os.environ["STREAMKL_FAST_LAUNCH"] = "0"  # every launch through fn[grid] (the recorder below)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from streamkl_gpu.attention.triton import bwd as _bwd  # noqa: E402
from streamkl_gpu.devtools import sass as _gluon_sass
from streamkl_gpu.attention import launch as _launch
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning

TARGET = GPUTarget("cuda", 90, 32)
records = []


class _Rec:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __getitem__(self, grid):
        def call(*args, **kw):
            records.append((self.name, self.fn, args, kw))
        return call


def _mangle(v):
    from triton.runtime.jit import mangle_type
    if hasattr(v, "block_shape") and hasattr(v, "base"):  # a host TensorDescriptor (any triton)
        try:
            return mangle_type(v)
        except Exception:
            from triton._utils import canonicalize_dtype
            return f"tensordesc<{canonicalize_dtype(v.base.dtype)}[{','.join(map(str, v.block_shape))}]>"
    return mangle_type(v)


def compile_rec(rec):
    name, fn, args, kw = rec
    kw = dict(kw)
    opts = {"num_warps": kw.pop("num_warps", 4), "num_stages": kw.pop("num_stages", 2)}
    if "maxnreg" in kw:  # a register cap (launch option, not a kernel argument)
        opts["maxnreg"] = kw.pop("maxnreg")
    vals = dict(zip(fn.arg_names, args))
    vals.update(kw)
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        v = vals.get(n, fn.params[i].default)
        if fn.params[i].is_constexpr or v is None:
            sig[n] = "constexpr"
            consts[(i,)] = v
        elif isinstance(v, (int, torch.Tensor)) and not isinstance(v, bool):
            # the JIT's own specialisation: ints equal to 1 become constants, ints and pointers
            # divisible by 16 carry tt.divisibility (what lets it vectorise the pointer loads)
            ty, key = _specialize(v)
            if ty == "constexpr":
                sig[n] = "constexpr"
                consts[(i,)] = key
            else:
                sig[n] = ty
                if isinstance(key, str) and key:
                    attrs[(i,)] = BaseBackend.parse_attr(key)
        else:
            sig[n] = _mangle(v)
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET, options=opts)


def _specialize(v):
    from triton._C.libtriton import native_specialize_impl
    return native_specialize_impl(BaseBackend, v, False, True, True)[:2]


def analyse(kernel):
    sass = _gluon_sass.sass_of(kernel)
    res = _gluon_sass.resource_usage(kernel)
    counts = _gluon_sass.sass_counts(sass)
    loops = _gluon_sass.main_loops(sass)
    return dict(reg=res.get("reg"), stack=res.get("stack"), smem=kernel.metadata.shared,
                stl=counts["stl"], ldl=counts["ldl"], hgmma=counts["hgmma"],
                loops=[(len(b), sum("HGMMA" in t for t in b), sum("MUFU.EX2" in t for t in b),
                        sum(bool(re.match(r"(@!?P\d+ )?F(FMA|MUL|ADD)\b", t)) for t in b)) for b in loops])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="*", default=["ptr", "tma", "tma+trans", "tma+trans+fold",
                                                    "tma+trans+fold+reduce"])
    ap.add_argument("--setting", default="s1,s2")
    ap.add_argument("--causal", default="0")
    ap.add_argument("--mode", default="fused,separate")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--first", action="store_true", help="only the first candidate of each kernel")
    a = ap.parse_args(argv)
    _bwd_kernels = {n: getattr(_bwd, n) for n in ("_kl_bwd_dk_kernel", "_kl_bwd_dq_kernel", "_kl_bwd_rows_kernel")}
    for n, fn in _bwd_kernels.items():
        setattr(_bwd, n, _Rec(n, fn))
    _runtime.tma_ok = lambda t: True
    _launch.tma_ok = lambda t: True
    _runtime.n_sm = _launch.n_sm = lambda d: 132

    def pick_all(key, cands, launch, *x, **k):
        for c in (cands[:1] if a.first else cands):
            launch(c)
        return cands[0]
    _launch.pick = pick_all
    train = {"s1": (False, True), "s2": (True, False), "both": (True, True)}
    N, D, H = 1024, a.d, 2
    print(f"triton {triton.__version__}; D={D}; reg/stack/smem, STL/LDL, HGMMA; per main loop "
          "(instructions, HGMMA, MUFU.EX2, FFMA/FMUL/FADD)", flush=True)
    for variant in a.variants:
        os.environ["STREAMKL_BWD_VARIANT"] = variant
        for setting in a.setting.split(","):
            for causal in (c == "1" for c in a.causal.split(",")):
                for mode in a.mode.split(","):
                    t1, t2 = train[setting]
                    xs = [torch.empty(1, H, N, D, dtype=torch.bfloat16) for _ in range(4)]
                    z = torch.zeros(1, H, N)
                    records.clear()
                    _launch._PLANS.clear()
                    try:
                        _launch.backward(z, *xs, z, z, z, causal, 0.1, 0.1, t1, t2, mode, False)
                    except Exception as exc:
                        print(f"{variant} {setting} {mode}: host FAILED {type(exc).__name__}: {exc}")
                        continue
                    seen = set()
                    for rec in records:
                        kw = rec[3]
                        if "BLOCK_M" not in kw:  # the rows pre-pass: O(N), not a main loop
                            continue
                        cfg = (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"])
                        key = (rec[0], cfg)
                        if key in seen:
                            continue
                        seen.add(key)
                        tag = f"{variant:22s} {setting} {'causal' if causal else 'full  '} {mode:8s} " \
                              f"{rec[0][8:10]} {cfg}"
                        try:
                            print(tag, analyse(compile_rec(rec)), flush=True)
                        except Exception as exc:
                            print(tag, f"FAILED {type(exc).__name__}: {str(exc)[:800]}", flush=True)


if __name__ == "__main__":
    main()
