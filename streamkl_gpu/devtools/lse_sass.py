"""Per-key-tile SASS of the teacher-LSE kernel (``indexer/triton/fwd.py _teacher_lse_kernel``) under
every GPU "lse" candidate, compiled for sm_90 without a GPU (``offline_call``'s stand-in driver),
each candidate forced through the hook (``indexer_teacher_lse_config``), as a CSV.

Per key-tile loop (whole tiles, then the masked band): registers, stack (spills), shared memory,
and per key tile: instructions, HGMMA (and those with A in registers), warpgroup arrive / depbar,
whether ptxas serialised the products (every HGMMA followed by a DEPBAR), loads by kind (LDG,
LDGSTS = cp.async, UTMALDG = TMA, LDS, LDSM = ldmatrix), MEMBAR / FENCE, BAR.SYNC, mbarrier ops,
MUFU.EX2, FP32, shuffles, spill instructions. A key loop holding a D-chunk loop (the "tiles"
kernels) is counted as its body plus the chunk loop's body once per further trip (the trips from
the HGMMA a key tile needs).

    python -m streamkl_gpu.devtools.lse_sass OUT.csv [dsa] [gqa]

Run it in its own process (no ``TRITON_INTERPRET``); with another triton first on ``PYTHONPATH``
(the GPU image's 3.6) it counts that triton's build.
"""
import csv
import os
import re
import sys
import time

import torch
import triton

from streamkl_gpu.devtools import offline_call
from streamkl_gpu.devtools import sass as S
from streamkl_gpu.devtools import sass_table as T
from streamkl_ref._checks import check_indexer_inputs

def _inputs(teacher, n):
    """Zero stand-ins of ``teacher``'s q, k, indexer q, k and weights at N = n (bf16)."""
    H, HK, D, HI, DI = offline_call.TEACHERS[teacher]
    bf = torch.bfloat16
    return (torch.zeros(1, H, n, D, dtype=bf), torch.zeros(1, HK, n, D, dtype=bf), torch.zeros(1, HI, n, DI, dtype=bf),
            torch.zeros(1, 1, n, DI, dtype=bf), torch.zeros(1, HI, n, dtype=bf))


def launches(teacher, n, name):
    """The teacher-LSE launches (kernel, grid, args, kwargs) of ``teacher``'s call at N = n, forced to ``name``."""
    from streamkl_gpu._core.forcing import forcing
    from streamkl_gpu.indexer import teacher_lse as TL

    xs = _inputs(teacher, n)
    with forcing(indexer_teacher_lse_config=name):
        found = offline_call.recorded_launches(lambda: TL.teacher_lse(*xs, causal=True, scale=192 ** -0.5),
                                               f"teacher_lse {teacher} {name}")
    return [f for f in found if f[0].fn.__name__ == "_teacher_lse_kernel"]


def dims_of(teacher, n):
    return check_indexer_inputs(*_inputs(teacher, n), scale=None)

FIELDS = ["triton", "teacher", "config", "rule_choice", "grid", "rows", "block_n", "warps", "stages", "loop", "stage",
          "registers", "stack", "shared_bytes", "d_chunk_loop", "instructions", "hgmma", "hgmma_a_regs", "wg_arrive",
          "wg_depbar", "serialised", "ldg", "ldgsts", "utmaldg", "lds", "ldsm", "sts", "membar", "bar_sync", "mbarrier",
          "mufu_ex2", "fp32", "shfl", "spill", "run_status"]

def key_loops(text):
    """(outer body, inner bodies) per key-tile loop: the outermost loops with HGMMA, each with the
    innermost HGMMA loops nested in it (the D-chunk loop of the "tiles" kernels; none for "qreg")."""
    ins = S._instructions(text)
    inner = S.mma_loop_spans(ins)
    return [(S.loop_body(ins, o), [S.loop_body(ins, i) for i in inner if i != o and o[0] <= i[0] and i[1] <= o[1]])
            for o in S.mma_loop_spans(ins, innermost=False)]

COLS = ["instructions", "hgmma", "hgmma_a_regs", "wg_arrive", "wg_depbar", "ldg", "ldgsts", "utmaldg", "lds", "ldsm",
        "sts", "membar", "bar_sync", "mbarrier", "mufu_ex2", "fp32", "shfl", "spill"]

def counts(body):
    cls = T.classify(body)
    ops = [T.opcode(t) for t in body]
    cnt = lambda pat: sum(bool(re.match(pat, o)) for o in ops)
    return dict(instructions=len(body), hgmma=cls["hgmma"],
                hgmma_a_regs=sum(bool(re.search(r"HGMMA\S*\s+R\d+,\s*R\d+", t)) for t in body),
                wg_arrive=cls["wg_arrive"], wg_depbar=cls["wg_depbar"], ldg=cnt(r"^LDG\b"), ldgsts=cnt(r"^LDGSTS\b"),
                utmaldg=cnt(r"^UTMALDG\b"), lds=cnt(r"^LDS\b"), ldsm=cnt(r"^LDSM\b"), sts=cnt(r"^STS\b"),
                membar=cnt(r"^(MEMBAR|FENCE)\b"), bar_sync=cls["bar_sync"], mbarrier=cls["mbarrier"],
                mufu_ex2=cls["mufu_ex2"], fp32=cls["fp32"], shfl=cls["shfl"], spill=cls["spill"])

def rows_for(teacher, n, name, rule, dims):
    """The CSV rows (FIELDS) of one candidate: one per key-tile loop."""
    from streamkl_gpu.indexer import configs as C
    from streamkl_gpu.indexer import plan as P
    out = []
    base = dict(triton=triton.__version__, teacher=teacher, config=name, rule_choice=int(rule))
    try:
        (fn, grid, args, kwargs), *_ = launches(teacher, n, name)
        kernel = fn.warmup(*args, grid=grid, **kwargs)
    except Exception as exc:
        return [dict(base, run_status=f"failed: {type(exc).__name__}")]
    cfg = C.forced_lse_config(name, dims)
    pl = P._plan(dims, cfg, "fwd")
    rows = pl["HB"] * pl["BLOCK_T"]
    nch = -(-dims.D // pl["BLOCK_D"])
    hgmma_tile = nch * (pl["BLOCK_D"] // 16) * max(1, rows // 64 // max(1, pl["warps"] // 4))
    text = S.sass_of(kernel)
    res = S.resource_usage(kernel)
    for k, (outer, inners) in enumerate(key_loops(text)):
        c = counts(outer)
        if inners:  # the D-chunk loop's body once per further trip (its static copy is in the outer body)
            ci = counts(inners[0])
            extra = (hgmma_tile - c["hgmma"]) // max(1, ci["hgmma"])
            c = {key: c[key] + extra * ci[key] for key in c}
            d_loop = f"{len(inners[0])} x {extra + 1}"
        else:
            d_loop = "unrolled"
        out.append(dict(base, grid="x".join(map(str, grid)), rows=rows, block_n=pl["BLOCK_N"], warps=pl["warps"],
                        stages=pl["stages"], loop=k, stage="whole" if k % 2 == 0 else "masked",
                        registers=res.get("reg"), stack=res.get("stack"), shared_bytes=kernel.metadata.shared,
                        d_chunk_loop=d_loop, **c, serialised=int(T.serialised(outer)),
                        run_status="ok"))
    return out

def main(argv):
    if not argv:
        print(__doc__)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    offline_call._stand_in_gpu()
    from streamkl_gpu.indexer import configs as C
    out = argv[0]
    specs = argv[1:] or ["dsa", "gqa"]
    rows = []
    for teacher in specs:
        dims = dims_of(teacher, 8192)
        names = C.lse_config_names(dims)
        for i, name in enumerate(names):
            t0 = time.time()
            r = rows_for(teacher, 8192, name, i == 0, dims)
            rows += r
            for x in r:
                print(" ".join(f"{f}={x.get(f, '')}" for f in FIELDS[1:]), f"({time.time() - t0:.0f} s)", flush=True)
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
