"""Timing several callables against each other with the order rotated every round.

A harness that times the same candidates in one fixed order each round can bias the slots: in one
H100 run the same Gluon forward kernel, timed first and last in each round, read up to 10 % apart
(bench/results/2026-12-06_h100_9b54a15/fwd_variants.csv, its env.json). Rotating the order spreads
whatever a slot costs (the call before it, clocks settling) over every candidate.

    from streamkl_gpu.devtools.rotated_timing import rotated_medians  # rotated_samples: every round's value
    from streamkl_gpu._core.forcing import forcing

    def under(**force):
        def call():
            with forcing(**force):
                streamkl_gpu.attention_kl(q1, k1, q2, k2)
        return call

    ms = rotated_medians({"default": under(), "eager_max": under(attention_fwd_variant="eager_max")})
"""
from __future__ import annotations

import statistics
import time


def _do_bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def timer_for(cuda: bool):
    """One measurement in ms for the command-line tools: ``do_bench``'s median on a GPU (5 ms warm-up,
    30 ms of repetitions), one call's wall-clock time on a CPU (the interpreter; tests)."""
    if cuda:
        from triton.testing import do_bench
        return lambda fn: do_bench(fn, warmup=5, rep=30, return_mode="median")

    def wall(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return wall


def rotation(names, rounds: int) -> list:
    """The order of each round: round r starts at the r-th name (mod the count)."""
    names = list(names)
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


def rotated_samples(fns: dict, rounds: int = 7, timer=None) -> dict:
    """``{name: [one measurement per round]}`` of each callable over ``rounds`` rounds, each round
    in the order of :func:`rotation`; ``timer(fn)`` is one measurement (default:
    ``triton.testing.do_bench`` median in ms, 10 ms warm-up, 40 ms of repetitions). Every callable
    runs once before the first round (compiles, tuning). Per-round values let a caller take
    per-round ratios, which a host or clock that drifts during the run moves alike."""
    if rounds < 1 or not fns:
        raise ValueError(f"need at least one callable and one round, got {len(fns)} and {rounds}")
    timer = timer or _do_bench
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    for order in rotation(fns, rounds):
        for name in order:
            samples[name].append(timer(fns[name]))
    return samples


def rotated_medians(fns: dict, rounds: int = 7, timer=None) -> dict:
    """``{name: median}`` of :func:`rotated_samples`."""
    return {name: statistics.median(values) for name, values in rotated_samples(fns, rounds, timer).items()}
