"""streamkl benchmark suite: ONE command, its sections run in the order given.

    PYTHONUNBUFFERED=1 python bench/bench_gpu.py                             # the core sections (~8 min)
    python bench/bench_gpu.py --sections env,check --out /tmp/x              # a subset
    python bench/bench_gpu.py --sections host,first_call,nan --out 'bench/results/{date}_{gpu}_{commit}' --pack
    python bench/bench_gpu.py --device cpu --tiny --sections check,fwd       # CPU smoke (the interpreter)

Sections (bench/README.md):
  in-process ('core', the default): env, check, fwd, bwd, decode, smallq, long;
  delegated ('extra'; each a subprocess with a time limit, output under --out/<section>/): host,
  first_call, first_call_big, decode_sweep, indexer, varlen, cp, nan, nan_cost, peers, compare.
Outputs under --out (placeholders {date}, {gpu}, {commit} are filled): bench.csv (long format,
one row per measurement), check.csv, sections.csv (status, seconds, limit per section),
results.csv (every CSV of the run in one long format with gpu_name, timestamp, version, commit,
section, run_status), env.json (GPU, driver, torch, triton, commit, the exact command),
summary.txt (ratios vs the anchors' targets), bench.log; with --pack also results.tgz.
Exit status: 0 ok; 1 a correctness check failed; 3 a section raised, failed or timed out (rows
written so far are kept; the other sections still run).

Baselines mirror /work/shared/anchors/h200-2026-11-29.md:
  eager   = materialised fp32 log_softmax of both score matrices (matmul in the input dtype,
            cast to fp32, scale, mask), then the row sum of P1 * (logP1 - logP2);
  compile = torch.compile of that same function (static shapes, fresh dynamo cache per point);
  chunked = eager over 1024-row query chunks;
  sdpa    = F.scaled_dot_product_attention at the same shape, PyTorch's default backend dispatch;
  sdpa_flash = the same call forced to the FlashAttention backend (sdpa_kernel([FLASH_ATTENTION])).
The summary's "ours/SDPA" lines compare against the faster of sdpa and sdpa_flash in this run.

Imports: bench/ is on sys.path as this script's folder; streamkl_gpu comes from the installed
package or the repository root, which the command adds to PYTHONPATH and runs itself again with
when streamkl_gpu is not importable (the code is in bench/streamkl_bench/).
"""
import importlib.util
import os
import sys

from streamkl_bench import child_env
from streamkl_bench.runner import main as _main


def main(argv=None):
    if importlib.util.find_spec("streamkl_gpu") is None and not os.environ.get("STREAMKL_BENCH_REEXEC"):
        env = child_env(STREAMKL_BENCH_REEXEC="1")  # PYTHONPATH = bench/, the repository root, ...
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + list(sys.argv[1:] if argv is None
                                                                                     else argv), env)
    return _main(argv, doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
