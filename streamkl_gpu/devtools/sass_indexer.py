"""Compile the indexer's Gluon forward (``_gluon_indexer``) for sm_90 without a GPU, and count
what its SASS holds (CI and the GPU script): ``python -m streamkl_gpu.devtools.sass_indexer SPEC...``
with SPEC = ``bf16|fp16 : causal|full[+pacc|+student] : H : D : H_I : D_I [: BLOCK_N : NUM_STAGES : REGS]``; one
JSON object per line (the CI test runs this in a fresh process: Gluon does not run under
TRITON_INTERPRET=1). Shares the SASS tools of ``_gluon_sass``."""
import json
import sys
import time

import torch
import triton

from streamkl_gpu.devtools.sass import DTYPES, gluon_signature, resource_usage, sass_counts, sass_of


def compile_sm90(H, D, HI, DI, dtype, causal, n=256, config=None, relu=True, pacc=False, student=False):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from streamkl_gpu.experimental import indexer_fwd_sm90 as g

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
    _, args, constexprs, options = g.launch_args(q, k, qi, ki, w, lse, part, causal, 0.07, relu, config, grads,
                                                 student=student)
    sig = gluon_signature(g._gluon_indexer_fwd_kernel, args, constexprs)
    src = GluonASTSource(g._gluon_indexer_fwd_kernel, sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _main(argv):
    for spec in argv:
        dtype, mode, H, D, HI, DI, *cand = spec.split(":")
        pacc = mode.endswith("+pacc")  # causal+pacc / full+pacc: the accumulating forward
        student = mode.endswith("+student")  # the backward's student part
        config = tuple(map(int, cand)) if cand else None
        t0 = time.time()
        kernel = compile_sm90(int(H), int(D), int(HI), int(DI), DTYPES[dtype], mode.startswith("causal"),
                              config=config, pacc=pacc, student=student)
        sass = sass_of(kernel)
        row = dict(spec=spec, seconds=round(time.time() - t0, 1), triton=triton.__version__,
                   shared=kernel.metadata.shared, resources=resource_usage(kernel), **sass_counts(sass))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
