"""streamkl benchmark suite: ONE command, its sections run in the order given (bench/README.md).

    python bench/bench_gpu.py [--sections core|extra|all|NAME,...] [--quick|--tiny] [--device cpu] \
        [--out 'bench/results/{date}_{gpu}_{commit}'] [--pack]

In-process sections ('core', the default): env, check, fwd, bwd, decode, smallq, long. Delegated
('extra'; each a subprocess with a time limit, output under --out/<section>/): host, first_call,
first_call_big, indexer, varlen, cp, nan, nan_cost, peers, compare. Outputs: bench.csv,
check.csv, sections.csv, results.csv (every CSV of the run, long format, with gpu_name, timestamp,
version, commit, run_status), env.json, summary.txt, bench.log (results.tgz with --pack).
Exit status: 0 ok; 1 a correctness check failed; 3 a section raised, failed or timed out.
Baselines (eager, torch.compile, chunked, SDPA default dispatch and flash backend) mirror
/work/shared/anchors/h200-2026-11-29.md; streamkl_bench/providers.py defines them.
bench/ is on sys.path as this script's folder; when streamkl_gpu is not importable from this tree
the command runs itself again with the repository root first on PYTHONPATH.
"""
import importlib.util
import os
import sys

from streamkl_bench import ROOT, child_env
from streamkl_bench.runner import main as _main


def main(argv=None):
    spec = importlib.util.find_spec("streamkl_gpu")  # this tree's, not another install's
    if (spec is None or not (spec.origin or "").startswith(ROOT + os.sep)) and not os.environ.get("STREAMKL_BENCH_REEXEC"):
        env = child_env(STREAMKL_BENCH_REEXEC="1")  # PYTHONPATH = bench/, the repository root, ...
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + list(sys.argv[1:] if argv is None
                                                                                     else argv), env)
    return _main(argv, doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
