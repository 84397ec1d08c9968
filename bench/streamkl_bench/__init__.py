"""The benchmark suite: ``bench/bench_gpu.py`` (the one command) and its sections, one concern per module.

In-process: ``cases`` (grids, the check matrix), ``providers`` (baselines and timed closures),
``timing`` (the one timing helper, the run's Budget), ``checks`` (vs float64), ``perf`` (env, fwd,
bwd, decode, smallq, long), ``report`` (CSVs, env.json, results.csv, summary), ``delegated`` (the
feature sections as subprocesses), ``runner`` and ``cli``. Feature sections (``python -m
streamkl_bench.<module> OUT ...``): ``host``, ``first_call``, ``indexer``,
``varlen``, ``context_parallel``, ``nan_check``, ``conformance_peers``; ``bench/compare_trees.py``
is the ``nan_cost`` and ``compare`` sections.
Imports: ``python bench/bench_gpu.py`` has bench/ on ``sys.path`` (the script's folder); the
sections' subprocesses get PYTHONPATH = bench/ and the repository root (``child_env``); the tests
get bench/ from pytest's ``pythonpath`` (pyproject.toml). Nothing here edits ``sys.path``.
"""
import os

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH_DIR)
SCRIPT = os.path.join(BENCH_DIR, "bench_gpu.py")  # the one command


def child_env(extra_paths=(), **variables):
    """The environment of a section's subprocess: PYTHONPATH = extra, bench/, the repository root,
    then whatever PYTHONPATH was (so ``streamkl_bench`` and this tree's ``streamkl_gpu`` import)."""
    env = dict(os.environ, **variables)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*extra_paths, BENCH_DIR, ROOT, env.get("PYTHONPATH", "")]))
    return env
