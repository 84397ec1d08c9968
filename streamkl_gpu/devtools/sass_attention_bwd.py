"""Compile the Gluon backward for sm_90 without a GPU, and count its SASS (CI and the GPU script).

Same method as ``_gluon_sass`` (the forward's): ``triton.compile(GluonASTSource(...),
target=GPUTarget("cuda", 90, 32))`` on CPU tensors' descriptors, the SASS from triton's bundled
``cuobjdump``, counts per main loop (innermost loops holding HGMMA).

    python -m streamkl_gpu.devtools.sass_attention_bwd SPEC...   SPEC = bf16|fp16 : causal|full : D : train side (1|2) [: gqa]

prints one JSON object per line (the CI test runs it in a fresh process without TRITON_INTERPRET).
"""
import torch
import triton

import re

from streamkl_gpu.devtools.sass import DTYPES, gluon_signature, main_loops, resource_usage, sass_counts, sass_of

SMEM_LIMIT = 227 * 1024  # dynamic shared memory per CTA on sm_90
REGS_PER_CTA = 65536  # Triton's launch check: registers per thread x threads per CTA


def bwd_counts(sass):
    """``sass_counts`` plus, per main loop, the dQ atomics (REDG/ATOMG), the divergent-branch
    scopes (BSSY: a masked atomic is one per element) and the local-memory accesses (STL/LDL)."""
    counts = sass_counts(sass)
    for loop, body in zip(counts["loops"], main_loops(sass)):
        loop["red"] = sum(bool(re.search(r"\b(REDG|ATOMG|RED)\.", t)) for t in body)
        loop["bssy"] = sum("BSSY" in t for t in body)
        loop["spill"] = sum(bool(re.search(r"\b(STL|LDL)\b", t)) for t in body)
    return counts


def compile_sm90(d, dtype, causal, train, n_q=256, n_k=256, config=None, variant="kernel", gqa=False):
    """Compile one specialisation of the Gluon backward for sm_90 (no GPU needed); ``gqa``: two
    query heads per key head (the trained side's dK by atomics)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from streamkl_gpu.experimental import attention_bwd_sm90 as gb

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


def spec_name(dtype: str, causal: bool, d: int, train: int, gqa: bool = False) -> str:
    return f"{dtype}:{'causal' if causal else 'full'}:{d}:{train}" + (":gqa" if gqa else "")


# spec suffixes that change the launch config (``_gluon_bwd.kernel_config`` entries)
SPEC_CONFIGS = {"lag": dict(DQ_LAG=True), "bufs3": dict(DS_BUFS=3)}


def parse_spec(spec):
    """dtype, causal, D, trained side, gqa, config from
    ``bf16|fp16 : causal|full : D : 1|2 [: gqa] [: lag] [: bufs3]``."""
    dtype, mode, d, train, *rest = spec.split(":")
    config = {}
    for r in rest:
        if r != "gqa":
            config.update(SPEC_CONFIGS[r])
    return DTYPES[dtype], mode == "causal", int(d), int(train), "gqa" in rest, config or None


def _main(argv):
    import json
    import time

    for spec in argv:
        dtype, causal, d, train, gqa, config = parse_spec(spec)
        t0 = time.time()
        kernel = compile_sm90(d, dtype, causal, train, config=config, gqa=gqa)
        sass = sass_of(kernel)
        row = dict(spec=spec, seconds=round(time.time() - t0, 1), triton=triton.__version__,
                   resources=resource_usage(kernel), shared_bytes=int(kernel.metadata.shared),
                   threads=int(kernel.metadata.num_warps) * 32, **bwd_counts(sass))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
