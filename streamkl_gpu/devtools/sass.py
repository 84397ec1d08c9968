"""Compile the Gluon forward for sm_90 without a GPU, and read its SASS (CI and the GPU script).

``compile_sm90`` runs ``triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32))``
on CPU tensors' descriptors (triton >= 3.9 compiles without a driver); ``sass_of`` disassembles a
compiled kernel with the ``cuobjdump`` bundled in triton; ``sass_counts`` counts what the checks
look at, per main loop (the innermost loops that hold HGMMA).
"""
import os
import re
import subprocess
import tempfile

import torch
import triton


def cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def gluon_signature(kernel, args, constexprs) -> dict:
    """The type signature ``GluonASTSource`` wants for a launch's arguments (what the JIT would
    derive): descriptor type strings, pointer dtypes, fp32 scalars, i32 integers, constexprs."""
    sig = {}
    for name, a in zip(kernel.arg_names, args):
        if hasattr(a, "__mangle__"):
            sig[name] = a.__mangle__()
        elif hasattr(a, "block_shape"):  # triton < 3.9 descriptors: the same type string by hand
            from triton._utils import canonicalize_dtype

            block = ",".join(map(str, a.block_shape))
            sig[name] = f"tensordesc<{canonicalize_dtype(a.base.dtype)}[{block}],{a.layout!r}>"
        elif isinstance(a, torch.Tensor):
            sig[name] = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}[a.dtype]
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    for name in constexprs:
        sig[name] = "constexpr"
    return sig


def compile_sm90(d1, d2, dtype, causal, n_q=256, n_k=256, config=None, variant="kernel"):
    """Compile one specialisation of the Gluon forward for sm_90 (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from streamkl_gpu.attention.gluon import fwd_sm90 as g

    B, H = 1, 2
    q1 = torch.empty(B, H, n_q, d1, dtype=dtype)
    k1 = torch.empty(B, 1, n_k, d1, dtype=dtype)
    q2 = torch.empty(B, H, n_q, d2, dtype=dtype)
    k2 = torch.empty(B, 1, n_k, d2, dtype=dtype)
    out = torch.empty(B, H, n_q, dtype=torch.float32)
    _, args, constexprs, options = g.launch_args(q1, k1, q2, k2, causal, 0.1, 0.1, out, out, out, config, variant)
    sig = gluon_signature(g._gluon_kl_fwd_kernel, args, constexprs)
    src = GluonASTSource(g._gluon_kl_fwd_kernel, sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(kernel, flag) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([cuobjdump(), flag, path], capture_output=True, text=True, check=True).stdout


def resource_usage(kernel) -> dict:
    """ptxas' registers per thread, stack and local-memory bytes of the compiled kernel."""
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", _cuobjdump(kernel, "-res-usage"))
    return dict(zip(("reg", "stack", "shared", "local"), map(int, m.groups()))) if m else {}


def sass_of(kernel) -> str:
    """Raw ``cuobjdump -sass`` of a compiled kernel, with addresses (triton's ``asm['sass']``
    rewrites branch targets as labels, which ``main_loops`` cannot follow)."""
    return _cuobjdump(kernel, "-sass")


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRA = re.compile(r"\bBRA\b[^0-9]*0x([0-9a-f]+)")


def _instructions(sass):
    return [(int(a, 16), text) for a, text in _INSTR.findall(sass)]


def main_loops(sass):
    """The innermost loops whose bodies hold HGMMA: a list of instruction lists. A loop is the
    span of a conditional backward branch (the latch); unconditional backward branches are the
    retry paths of mbarrier waits that ptxas places after the kernel's exit."""
    ins = _instructions(sass)
    spans = []
    for addr, text in ins:
        m = _BRA.search(text)
        if m and text.startswith("@") and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    bodies = {sp: [t for a, t in ins if sp[0] <= a <= sp[1]] for sp in spans}
    with_mma = [sp for sp in spans if any("HGMMA" in t for t in bodies[sp])]
    innermost = [sp for sp in with_mma
                 if not any(o != sp and sp[0] <= o[0] and o[1] <= sp[1] for o in with_mma)]
    return [bodies[sp] for sp in sorted(set(innermost))]


def sass_counts(sass):
    """Whole-kernel counts and, per main loop, instructions / HGMMA / DEPBAR / MUFU.EX2 / BAR.SYNC counts and the
    number of MUFU.EX2 between the loop's first and second DEPBAR (the S1 exponentials overlapping
    S2). BAR.SYNC: the warpgroup rendezvous triton 3.6's membar puts at the loop's mbarrier ops."""
    count = lambda pat: len(re.findall(pat, sass))
    loops = []
    for body in main_loops(sass):
        dep = [k for k, t in enumerate(body) if "WARPGROUP.DEPBAR" in t]
        between = sum("MUFU.EX2" in t for t in body[dep[0]:dep[1]]) if len(dep) >= 2 else 0
        loops.append(dict(instructions=len(body), hgmma=sum("HGMMA" in t for t in body), depbar=len(dep),
                          bar=sum(bool(re.search(r"\bBAR\.SYNC", t)) for t in body),
                          ex2=sum("MUFU.EX2" in t for t in body), ex2_between_waits=between,
                          spills=sum(bool(re.search(r"\b(STL|LDL)\b", t)) for t in body)))
    return dict(hgmma=count(r"\bHGMMA\b"), depbar=count(r"WARPGROUP\.DEPBAR"), stl=count(r"\bSTL\b"),
                ldl=count(r"\bLDL\b"), ex2=count(r"MUFU\.EX2"), loops=loops)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def spec_name(dtype: str, causal: bool, d1: int, d2: int) -> str:
    return f"{dtype}:{'causal' if causal else 'full'}:{d1}:{d2}"


def _main(argv):
    """``python -m streamkl_gpu.devtools.sass SPEC...`` (SPEC = bf16|fp16 : causal|full : D1 : D2, then
    optionally a candidate tuple ``_gluon_fwd.CAND_FIELDS`` as : BLOCK_N : NUM_STAGES : maxnreg
    [: PINGPONG : SPLIT : POLY : RESCALE : FENCE]; default: the first tuning candidate):
    compile each for sm_90 and print one JSON object per line (the CI test runs this in a fresh
    process: the test session runs under TRITON_INTERPRET=1, which Gluon does not support)."""
    import json
    import time

    from streamkl_gpu.attention.gluon import fwd_sm90 as _gluon_fwd

    for spec in argv:
        dtype, mode, d1, d2, *cand = spec.split(":")
        config = _gluon_fwd.config_of(tuple(map(int, cand))) if cand else None
        t0 = time.time()
        kernel = compile_sm90(int(d1), int(d2), DTYPES[dtype], mode == "causal", config=config)
        sass = sass_of(kernel)
        row = dict(spec=spec, seconds=round(time.time() - t0, 1), triton=triton.__version__,
                   resources=resource_usage(kernel), **sass_counts(sass))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
