"""The pieces of ``bench/bench_gpu.py`` (the one GPU command), one concern per module.

- ``cases``: section names, the shape grids of the perf sections, the correctness matrix.
- ``providers``: the eager / chunked baselines (``dense_kl``, ``chunked_kl``) and the timed
  closures: ours, eager, ``torch.compile``, chunked, SDPA (default dispatch and flash backend).
- ``timing``: the run's time ``Budget``, input sets and their rotation, ``measure`` (do_bench /
  CUDA events / perf_counter, peak memory, OOM), copy bandwidth.
- ``checks``: the correctness section against the float64 reference and ``streamkl_ref``.
- ``perf``: the perf sections (env, fwd, bwd, decode, smallq, long).
- ``report``: ``bench.csv``, ``check.csv``, ``sections.csv``, ``bench.log``, ``summary.txt``.
- ``prewarm``: the parallel compile workers.
- ``delegated``: the per-feature GPU scripts run as sections (one subprocess each, with a limit).
- ``runner``: the ``Runner`` (the mixins together) and ``main`` (the section loop).
"""
import os

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH_DIR)
SCRIPT = os.path.join(BENCH_DIR, "bench_gpu.py")  # the one command; the prewarm workers re-run it
