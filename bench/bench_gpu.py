#!/usr/bin/env python3
"""streamkl benchmark + correctness run: ONE call on one GPU (default run budgeted at ~8 min).

    PYTHONUNBUFFERED=1 python bench/bench_gpu.py                      # everything, H200 budget
    python bench/bench_gpu.py --quick                                 # fewer N, fewer reps
    python bench/bench_gpu.py --sections env,check --out /tmp/x       # a subset
    TRITON_INTERPRET=1 python bench/bench_gpu.py --device cpu --tiny --sections check,fwd   # CPU smoke

    python bench/bench_gpu.py --sections env,host,gluon,nan --out $OUT --pack   # with delegated sections

Sections (see bench/README.md), run in the order given:
  in-process (the default, 'core'): env, check, fwd, bwd, decode, smallq, long;
  delegated ('extra'; each runs one bench script as a subprocess with a time limit, output under
  --out/<section>/): host, decode_sweep, gluon, indexer, varlen, cp, bwd_variants, gluon_bwd,
  indexer_perf, nan, nan_cost.
Outputs under --out: bench.csv (long format, one row per measurement), check.csv (one row per
compared tensor), sections.csv (one row per section: status, seconds, limit), summary.txt (ratios
vs the anchors' targets), env.json, bench.log; with --pack also results.tgz (all of it).
Exit status: 0 ok; 1 a correctness check failed; 3 a section raised, failed or timed out (rows
written so far are kept; the other sections still run).

Baselines mirror /work/shared/anchors/h200-2026-11-29.md:
  eager   = materialised fp32 log_softmax of both score matrices (matmul in the input dtype,
            cast to fp32, scale, mask), then the row sum of P1 * (logP1 - logP2);
  compile = torch.compile of that same function (static shapes, fresh dynamo cache per point);
  chunked = eager over 1024-row query chunks;
  sdpa    = F.scaled_dot_product_attention at the same shape, PyTorch's default backend dispatch
            (cuDNN on the H200 with torch 2.11; the anchors' SDPA numbers match it);
  sdpa_flash = the same call forced to the FlashAttention backend (sdpa_kernel([FLASH_ATTENTION])).
The summary's "ours/SDPA" lines compare against the faster of sdpa and sdpa_flash in this run.

The code is in bench/streamkl_bench/ (cases, providers, timing, checks, perf, report, prewarm,
delegated, runner); this file is the command.
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # streamkl_bench sits beside this file
    sys.path.insert(0, _HERE)

from streamkl_bench.providers import chunked_kl, dense_kl  # noqa: E402,F401  (re-exported for scripts that import bench_gpu)
from streamkl_bench.runner import main as _main  # noqa: E402


def main(argv=None):
    return _main(argv, doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
