"""Compile every Gluon kernel for sm_90 without a GPU, and read its SASS (CI and the GPU scripts).

One method for all: ``triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32))`` on
CPU tensors' descriptors (triton >= 3.9 compiles without a driver); ``sass_of`` disassembles a
compiled kernel with the ``cuobjdump`` bundled in triton; ``sass_counts`` counts what the checks
look at, per main loop (the innermost loops that hold HGMMA).

    python -m streamkl_gpu.devtools.sass [attention_fwd|attention_bwd|indexer_fwd|indexer_lse] SPEC...

prints one JSON object per line (the CI tests run it in a fresh process: the test session runs
under TRITON_INTERPRET=1, which Gluon does not support). Specs, per kernel:

- ``attention_fwd`` (the default; ``compile_sm90``): ``bf16|fp16 : causal|full : D1 : D2``, then
  optionally a launch configuration as ``name=value`` fields of ``fwd_sm90_launch.GluonFwdConfig``
  (``block_n=64:num_stages=4:fence=1``; :func:`config_spec` writes one; default: the first tuning
  candidate).
- ``attention_bwd`` (the Gluon backward; ``compile_attention_bwd_sm90``):
  ``bf16|fp16 : causal|full : D : trained side (1|2) [: gqa] [: lag] [: bufs3]``.
- ``indexer_fwd`` (the Gluon indexer forward; ``compile_indexer_sm90``):
  ``bf16|fp16 : causal|full[+pacc|+student|+store] : H : D : H_I : D_I``, then optionally ``name=value``
  fields of ``indexer.gluon.fwd_sm90.GluonIndexerConfig`` (``block_n=64:num_stages=4``).
- ``indexer_lse`` (the Gluon teacher-LSE pass; ``compile_indexer_lse_sm90``):
  ``bf16|fp16 : causal|full : H : D``, then optionally fields of ``indexer.gluon.lse_sm90.GluonLseConfig``.
"""
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton


def config_spec(cfg) -> str:
    """A launch configuration (a frozen dataclass) as spec fields: ``name=value`` joined by ``:``,
    the required fields and those that differ from their defaults (:func:`config_from_spec`'s input)."""
    items = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            items.append(f"{f.name}={int(value) if isinstance(value, bool) else value}")
    return ":".join(items)


def config_from_spec(cls, items):
    """``cls(**fields)`` from spec fields ``["name=value", ...]`` (integers; flags as 0 or 1);
    a ``ValueError`` naming the fields ``cls`` has for anything else."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    fields = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or name not in names:
            raise ValueError(f"a {cls.__name__} spec field is name=value with name in {sorted(names)}, got {item!r}")
        fields[name] = bool(int(value)) if names[name].type in (bool, "bool") else int(value)
    return cls(**fields)


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


def compile_sm90(d1, d2, dtype, causal, n_q=256, n_k=256, config=None, variant=None):
    """Compile one specialisation of the Gluon forward for sm_90 (no GPU needed); ``variant``: a
    diagnostic variant (``devtools.diagnostics.ATTENTION_FWD_VARIANTS``), forced through the hook."""
    from streamkl_gpu._core.forcing import forcing
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from streamkl_gpu.attention.gluon import fwd_sm90 as g
    from streamkl_gpu.attention.gluon import fwd_sm90_launch as g_launch

    B, H = 1, 2
    q1 = torch.empty(B, H, n_q, d1, dtype=dtype)
    k1 = torch.empty(B, 1, n_k, d1, dtype=dtype)
    q2 = torch.empty(B, H, n_q, d2, dtype=dtype)
    k2 = torch.empty(B, 1, n_k, d2, dtype=dtype)
    out = torch.empty(B, H, n_q, dtype=torch.float32)
    with forcing(attention_fwd_variant=None if variant == "kernel" else variant):
        _, args, constexprs, options = g_launch.launch_args(q1, k1, q2, k2, causal, 0.1, 0.1, out, out, out, config)
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


def mma_loop_spans(ins, innermost=True):
    """The (first, last) address spans, in code order, of the loops of ``ins`` (``_instructions``)
    whose bodies hold HGMMA: the innermost ones, or with ``innermost=False`` the outermost ones.
    A loop is the span of a conditional backward branch (the latch); unconditional backward
    branches are the retry paths of mbarrier waits that ptxas places after the kernel's exit."""
    spans = set()
    for addr, text in ins:
        m = _BRA.search(text)
        if m and text.startswith("@") and int(m.group(1), 16) < addr:
            spans.add((int(m.group(1), 16), addr))
    with_mma = [sp for sp in spans if any("HGMMA" in t for a, t in ins if sp[0] <= a <= sp[1])]
    inside = (lambda sp, o: sp[0] <= o[0] and o[1] <= sp[1]) if innermost else (lambda sp, o: o[0] <= sp[0] and sp[1] <= o[1])
    return sorted(sp for sp in with_mma if not any(o != sp and inside(sp, o) for o in with_mma))


def loop_body(ins, span):
    """The instruction texts of ``ins`` inside ``span`` (its first and last address)."""
    return [t for a, t in ins if span[0] <= a <= span[1]]


def main_loops(sass):
    """The innermost loops whose bodies hold HGMMA (``mma_loop_spans``): a list of instruction lists."""
    ins = _instructions(sass)
    return [loop_body(ins, sp) for sp in mma_loop_spans(ins)]


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


def _main_attention_fwd(argv):
    from streamkl_gpu.attention.gluon import fwd_sm90_launch as _gluon_fwd_launch

    for spec in argv:
        dtype, mode, d1, d2, *items = spec.split(":")
        # "variant=NAME": a forced variant (devtools.diagnostics); without it, what runs unforced
        variant = next((i.split("=", 1)[1] for i in items if i.startswith("variant=")), "kernel")
        items = [i for i in items if not i.startswith("variant=")]
        config = config_from_spec(_gluon_fwd_launch.GluonFwdConfig, items) if items else None
        t0 = time.time()
        kernel = compile_sm90(int(d1), int(d2), DTYPES[dtype], mode == "causal", config=config, variant=variant)
        sass = sass_of(kernel)
        row = dict(spec=spec, seconds=round(time.time() - t0, 1), triton=triton.__version__,
                   resources=resource_usage(kernel), **sass_counts(sass))
        print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------------------------
# The Gluon backward of the attention KL
# ----------------------------------------------------------------------------------------------

SMEM_LIMIT = 227 * 1024  # dynamic shared memory per CTA on sm_90
REGS_PER_CTA = 65536  # Triton's launch check: registers per thread x threads per CTA


def bwd_counts(sass):
    """``sass_counts`` plus, per main loop, the dQ atomics from registers (REDG/ATOMG), the TMA
    reduce-adds from shared memory (UTMAREDG), the divergent-branch scopes (BSSY: a masked atomic is
    one per element) and the local-memory accesses (STL/LDL)."""
    counts = sass_counts(sass)
    for loop, body in zip(counts["loops"], main_loops(sass)):
        loop["red"] = sum(bool(re.search(r"\b(REDG|ATOMG|RED)\.", t)) for t in body)
        loop["tma_red"] = sum("UTMAREDG" in t for t in body)
        loop["bssy"] = sum("BSSY" in t for t in body)
        loop["spill"] = sum(bool(re.search(r"\b(STL|LDL)\b", t)) for t in body)
    return counts


def compile_attention_bwd_sm90(d, dtype, causal, train, n_q=256, n_k=256, config=None, variant="kernel", gqa=False):
    """Compile one specialisation of the Gluon backward for sm_90 (no GPU needed); ``gqa``: two
    query heads per key head (the trained side's dK by atomics)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from streamkl_gpu.attention.gluon import bwd_sm90_launch as gb

    B, H = 1, 2
    q = torch.empty(B, H, n_q, d, dtype=dtype)
    k = torch.empty(B, 1 if gqa else H, n_k, d, dtype=dtype)
    rows = torch.empty(B, H, n_q, dtype=torch.float32)
    dq = torch.empty(B, H, triton.cdiv(n_q, 64) * 64, d, dtype=torch.float32)
    dk = (torch.empty(B, 1, triton.cdiv(n_k, 128) * 128, d, dtype=torch.float32) if gqa
          else torch.empty(B, H, n_k, d, dtype=dtype))
    _, args, constexprs, options = gb.launch_args(rows, q, k, q, k, rows, rows, rows, causal, 0.1, 0.1, train,
                                                  dq, dk, config, variant)
    sig = gluon_signature(gb._gluon_kl_bwd_kernel, args, constexprs)
    src = GluonASTSource(gb._gluon_kl_bwd_kernel, sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def bwd_spec_name(dtype: str, causal: bool, d: int, train: int, gqa: bool = False) -> str:
    return f"{dtype}:{'causal' if causal else 'full'}:{d}:{train}" + (":gqa" if gqa else "")


# backward spec suffixes that change the launch config (``bwd_sm90_launch.GluonBwdConfig``
# fields replaced in ``kernel_config``'s)
SPEC_CONFIGS = {"lag": dict(dq_lag=True), "bufs3": dict(ds_bufs=3)}


def parse_bwd_spec(spec):
    """dtype, causal, D, trained side, gqa, config from
    ``bf16|fp16 : causal|full : D : 1|2 [: gqa] [: lag] [: bufs3]`` (config None: the default)."""
    from streamkl_gpu.attention.gluon import bwd_sm90_launch as gb

    dtype, mode, d, train, *rest = spec.split(":")
    changes = {}
    for r in rest:
        if r != "gqa":
            changes.update(SPEC_CONFIGS[r])
    config = dataclasses.replace(gb.kernel_config(int(d), mode == "causal"), **changes) if changes else None
    return DTYPES[dtype], mode == "causal", int(d), int(train), "gqa" in rest, config


def _main_attention_bwd(argv):
    for spec in argv:
        dtype, causal, d, train, gqa, config = parse_bwd_spec(spec)
        t0 = time.time()
        kernel = compile_attention_bwd_sm90(d, dtype, causal, train, config=config, gqa=gqa)
        sass = sass_of(kernel)
        row = dict(spec=spec, seconds=round(time.time() - t0, 1), triton=triton.__version__,
                   resources=resource_usage(kernel), shared_bytes=int(kernel.metadata.shared),
                   threads=int(kernel.metadata.num_warps) * 32, **bwd_counts(sass))
        print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------------------------
# The Gluon indexer forward
# ----------------------------------------------------------------------------------------------

def compile_indexer_sm90(H, D, HI, DI, dtype, causal, n=256, config=None, relu=True, pacc=False, student=False,
                         store=False):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from streamkl_gpu.indexer.gluon import fwd_sm90 as g

    B = 1
    q = torch.empty(B, H, n, D, dtype=dtype)
    k = torch.empty(B, 1, n, D, dtype=dtype)
    qi = torch.empty(B, HI, n, DI, dtype=dtype)
    ki = torch.empty(B, 1, n, DI, dtype=dtype)
    w = torch.empty(B, HI, n, dtype=dtype)
    lse = torch.empty(B, H, n, dtype=torch.float32)
    part = torch.empty(5, 2, B, n, dtype=torch.float32)
    grads = (torch.empty(B, HI, n, DI), torch.empty(B, HI, n), torch.empty(B, 1, n, DI)) if (pacc or student) else None
    if student:
        lse = torch.empty(B, n, dtype=torch.float32)
    p = (torch.empty(B, n, n, dtype=torch.float32), 0, n) if store else None  # the chunk design's storing forward
    _, args, constexprs, options = g.launch_args(q, k, qi, ki, w, lse, part, causal, 0.07, relu, config, grads,
                                                 student=student, store=p)
    sig = gluon_signature(g._gluon_indexer_fwd_kernel, args, constexprs)
    src = GluonASTSource(g._gluon_indexer_fwd_kernel, sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _main_indexer_fwd(argv):
    for spec in argv:
        from streamkl_gpu.indexer.gluon import fwd_sm90 as g

        dtype, mode, H, D, HI, DI, *items = spec.split(":")
        pacc = mode.endswith("+pacc")  # causal+pacc / full+pacc: the accumulating forward
        student = mode.endswith("+student")  # the backward's student part
        store = mode.endswith("+store")  # the chunk design's storing forward
        config = config_from_spec(g.GluonIndexerConfig, items) if items else None
        t0 = time.time()
        kernel = compile_indexer_sm90(int(H), int(D), int(HI), int(DI), DTYPES[dtype], mode.startswith("causal"),
                              config=config, pacc=pacc, student=student, store=store)
        sass = sass_of(kernel)
        row = dict(spec=spec, seconds=round(time.time() - t0, 1), triton=triton.__version__,
                   shared=kernel.metadata.shared, resources=resource_usage(kernel), **sass_counts(sass))
        print(json.dumps(row), flush=True)


def compile_indexer_lse_sm90(H, D, dtype, causal, n=256, config=None):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from streamkl_gpu.indexer.gluon import lse_sm90 as g

    q, k = torch.empty(1, H, n, D, dtype=dtype), torch.empty(1, 1, n, D, dtype=dtype)
    lse = torch.empty(1, H, n, dtype=torch.float32)
    _, args, constexprs, options = g.launch_args(q, k, lse, causal, 0.07, config)
    sig = gluon_signature(g._gluon_teacher_lse_kernel, args, constexprs)
    src = GluonASTSource(g._gluon_teacher_lse_kernel, sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _main_indexer_lse(argv):
    for spec in argv:
        from streamkl_gpu.indexer.gluon import lse_sm90 as g

        dtype, mode, H, D, *items = spec.split(":")
        config = config_from_spec(g.GluonLseConfig, items) if items else None
        t0 = time.time()
        kernel = compile_indexer_lse_sm90(int(H), int(D), DTYPES[dtype], mode == "causal", config=config)
        row = dict(spec=spec, seconds=round(time.time() - t0, 1), triton=triton.__version__,
                   shared=kernel.metadata.shared, resources=resource_usage(kernel), **sass_counts(sass_of(kernel)))
        print(json.dumps(row), flush=True)


def _main(argv):
    """The command line (module docstring): an optional kernel name, then its specs."""
    kernels = {"attention_fwd": _main_attention_fwd, "attention_bwd": _main_attention_bwd,
               "indexer_fwd": _main_indexer_fwd, "indexer_lse": _main_indexer_lse}
    if argv and argv[0] in kernels:
        return kernels[argv[0]](argv[1:])
    return _main_attention_fwd(argv)


if __name__ == "__main__":
    _main(sys.argv[1:])
