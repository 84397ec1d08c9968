"""The benchmark suite: ``bench/bench_gpu.py`` (the one command) and its sections, one concern per module.

In-process sections (``bench_gpu.py``'s own process):
- ``cases``: section names, the shape grids of the perf sections, the correctness matrix.
- ``providers``: the eager / chunked baselines (``dense_kl``, ``chunked_kl``) and the timed
  closures: ours, eager, ``torch.compile``, chunked, SDPA (default dispatch and flash backend).
- ``timing``: the one timing helper (``time_ms``, ``event_ms``, memory, OOM), the run's ``Budget``.
- ``checks``: the correctness section against the float64 reference and ``streamkl_ref``.
- ``perf``: the perf sections (env, fwd, bwd, decode, smallq, long).
- ``report``: ``bench.csv``, ``check.csv``, ``sections.csv``, ``results.csv``, ``env.json``, the summary.
- ``prewarm``: the parallel compile workers.
- ``delegated``: the feature sections below, each run as a subprocess with a time limit.
- ``runner``, ``cli``: the section loop and the command line.

Feature sections (``python -m streamkl_bench.<module> OUT ...``, run by ``delegated``): ``host``,
``first_call``, ``decode_sweep``, ``indexer``, ``varlen``, ``context_parallel``, ``nan_check``,
``conformance_peers``; ``bench/compare_trees.py`` (no-regression) is the ``nan_cost`` and
``compare`` sections.

How it is imported: ``python bench/bench_gpu.py`` has bench/ on ``sys.path`` (the script's folder,
Python's own rule); ``streamkl_gpu`` comes from the installed package or ``PYTHONPATH=.``; the
sections' subprocesses get ``PYTHONPATH`` = bench/ and the repository root (``child_env``); the
tests get bench/ from pytest's ``pythonpath`` (pyproject.toml). Nothing here edits ``sys.path``.
"""
import os

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH_DIR)
SCRIPT = os.path.join(BENCH_DIR, "bench_gpu.py")  # the one command; the prewarm workers re-run it


def child_env(extra_paths=(), **variables):
    """The environment of a section's subprocess: PYTHONPATH = extra, bench/, the repository root,
    then whatever PYTHONPATH was (so ``streamkl_bench`` and this tree's ``streamkl_gpu`` import)."""
    env = dict(os.environ, **variables)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*extra_paths, BENCH_DIR, ROOT, env.get("PYTHONPATH", "")]))
    return env
