"""Running ``streamkl verify``'s units: in this process or in worker processes, timed per case.

A unit is one case of the battery and its dtypes (``verify.Unit``); :func:`run_units` checks each
here one after another, or hands one dtype of one unit at a time to spawned worker processes, the
most expensive first, and merges their outcomes back in battery order: the rows of a run in one
process. :class:`_CaseClock` splits each case's seconds into compiling and checking; on CPU,
:func:`_interpreter_checks` bounds- and race-checks every interpreted launch.
"""
from __future__ import annotations

import collections
import contextlib
import math
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Any

from streamkl_ref._testing import reference_cache
from streamkl_ref.testing import Report, Row


class _CaseClock:
    """Seconds per case and dtype: compiling (the wall time during which a kernel compiled, read
    from Triton's compiler entry point; on a GPU) and the rest (the check); the two add up to the
    case's wall time. ``timed(label, seconds)``
    times a block into ``seconds[label]`` and prints its progress lines, stamped with the time
    since ``t_start`` (the start of the whole run, in whichever process the block runs)."""

    def __init__(self, device, quiet, t_start):
        from streamkl_gpu._core.compile_clock import CompileClock

        self.clock = CompileClock().install() if device == "cuda" else CompileClock()  # before any launch
        self.quiet, self.t_start = quiet, t_start

    def say(self, text):
        if not self.quiet:
            print(f"[{time.time() - self.t_start:6.1f}s] {text}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def timed(self, label, seconds):
        self.say(label)  # the first GPU run compiles each kernel variant: show progress
        t0, snap = time.perf_counter(), self.clock.snapshot()
        yield
        t1 = time.perf_counter()
        _, kernels = self.clock.since(snap)
        compile_s = self.clock.wall_since(t0, t1)  # wall time with a compile running (several run side by side)
        check_s = t1 - t0 - compile_s
        seconds[label] = {"compile_s": round(compile_s, 3), "kernels": kernels, "check_s": round(check_s, 3),
                          "compiles": self.clock.within(t0, t1)}  # [kernel, seconds, fingerprint, source, key]
        self.say(f"  {label}: compile {compile_s:.1f} s ({kernels} kernels), check {check_s:.1f} s")


@contextlib.contextmanager
def _interpreter_checks():
    """On CPU every interpreted launch is bounds- and race-checked: an access outside the launch's
    tensors (an illegal memory access on a GPU), or an address two programs touch with a plain
    store (an order-dependent result there), fails the gate; with --impl, a user's Triton kernel
    that does either fails its case (the conformance suite reports the exception)."""
    from streamkl_gpu.devtools import bounds as _interpreter_bounds

    with contextlib.ExitStack() as stack:
        # the interpreter runs kernels in NumPy, masked lanes included: its RuntimeWarnings
        # (0 * inf, log2(0) in lanes a mask discards) say nothing about the results the rows judge
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
        try:
            stack.enter_context(_interpreter_bounds.checked(races=True))
        except ImportError:  # no Triton (a pure-PyTorch --impl): nothing to check
            pass
        yield


@dataclass(frozen=True)
class RunSettings:
    """What every unit of a run shares."""

    device: str
    seed: int
    quiet: bool
    t_start: float  # time.time() at the start of the run: every process's progress lines count from it
    reference_cache: str | None = None  # where the float64 references persist (reference_directory)


@dataclass
class UnitOutcome:
    """What running a unit hands back (plain data: it comes back from a worker process)."""

    rows: list
    cases: dict
    seconds: dict  # "case dtype" -> {"compile_s", "kernels", "check_s"}
    bounds: dict  # on CPU: the interpreter's bounds-check counts of the unit's launches
    errors: list  # what to print for each dtype whose check raised


def _run_unit(unit: Unit, run: RunSettings, laps: _CaseClock) -> UnitOutcome:
    """Check ``unit`` in each of its dtypes. A dtype whose check raises gets a failing row (its
    traceback goes to ``errors``) and the other dtypes still run: nothing is dropped silently."""
    report, seconds, errors = Report(), {}, []
    before = _bounds_counts(run.device)
    for dname in unit.dtypes:
        label = f"{unit.name} {dname}"
        try:
            with laps.timed(label, seconds):
                unit.check(unit.case, dname, run.seed, run.device, report)
        except Exception as exc:  # noqa: BLE001 (fails the gate: a failing row, the traceback on stderr)
            report.rows.append(Row(unit.name, dname, "(check)", math.nan, math.nan, "fail",
                                   f"raised {type(exc).__name__}: {str(exc)[:300]}"))
            errors.append(f"{label} raised:\n{traceback.format_exc()}")
    after = _bounds_counts(run.device)
    return UnitOutcome(report.rows, report.cases, seconds, {k: after[k] - before[k] for k in after}, errors)


def _bounds_counts(device: str) -> dict:
    if device != "cpu":
        return {}
    from streamkl_gpu.devtools import bounds as _interpreter_bounds

    return _interpreter_bounds.stats()


_worker = {}  # in a worker process: its run settings, clock and checks (set up by its first unit)


def _warm_worker(device: str) -> None:
    """A worker process's start: import what every check needs (torch, Triton, the kernels'
    modules; seconds) and, on a GPU, create the CUDA context and Triton's driver, so that the
    process is ready when its first unit comes. os.environ, STREAMKL_AUTOTUNE and
    TRITON_INTERPRET included, is the parent's, copied at the spawn. A failure here is left to
    the first unit, which meets it again and fails by name."""
    try:
        import torch

        import streamkl_gpu.api  # noqa: F401  (the attention, packed-sequence and indexer entry points)

        if device == "cuda":
            torch.empty(1, device="cuda")  # the CUDA context
            from triton.runtime import driver

            driver.active.get_current_target()  # Triton's driver (its C utilities loaded or built)
    except Exception:  # noqa: BLE001
        pass


def _set_up_worker(run: RunSettings) -> None:
    """The checks and the clock of a run, in a worker process (once: every unit of a run brings
    the same settings)."""
    if _worker.get("run") == run:
        return
    checks = contextlib.ExitStack()  # held open for the life of the process
    if run.device == "cpu":
        checks.enter_context(_interpreter_checks())
    _worker.update(run=run, laps=_CaseClock(run.device, run.quiet, run.t_start), checks=checks)
    reference_cache.use(run.reference_cache)


def _run_unit_in_worker(unit: Unit, run: RunSettings) -> UnitOutcome:
    _set_up_worker(run)
    return _run_unit(unit, _worker["run"], _worker["laps"])


def _worker_ready() -> bool:
    return True


@dataclass
class EarlyWorkers:
    """Worker processes started before the parent imports torch (:func:`start_workers_early`)."""

    pool: Any  # a ProcessPoolExecutor
    device: str
    jobs: int


def run_units(units: list, run: RunSettings, jobs: int, pool=None) -> list:
    """Each unit's :class:`UnitOutcome`, in the order of ``units``: checked here one after another
    (``jobs`` 1), or by ``jobs`` worker processes (spawned: CUDA cannot be forked), handed out one
    dtype of one unit at a time, the most expensive first, so that a case's dtypes compile side by
    side rather than one after another in one worker. A unit that raises, or whose worker process
    dies, comes back as failing rows with its traceback or cause printed: the run neither hangs
    nor drops it. ``pool``: worker processes already started (:func:`start_workers_early`), which
    this call shuts down when it is done."""
    if jobs <= 1:
        laps = _CaseClock(run.device, run.quiet, run.t_start)
        try:
            with reference_cache.kept_in(run.reference_cache):
                return [_print_errors(_run_unit(u, run, laps)) for u in units]
        finally:
            laps.clock.uninstall()
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    parts = {}  # (unit index, dtype) -> its outcome
    if pool is None:
        pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_warm_worker,
                                   initargs=(run.device,))
    with pool:
        futures = {pool.submit(_run_unit_in_worker, replace(units[i], dtypes=(d,)), run): (i, d)
                   for i, d in hand_out_order(units)}
        for future in as_completed(futures):
            i, dname = futures[future]
            try:
                outcome = future.result()
            except Exception as exc:  # noqa: BLE001 (its worker died, or the outcome could not come back)
                why = f"not checked: {type(exc).__name__}: {exc}"
                outcome = UnitOutcome([Row(units[i].name, dname, "(check)", math.nan, math.nan, "fail", why)],
                                      {}, {}, {}, [f"{units[i].name} {dname}: {why}"])
            parts[i, dname] = _print_errors(outcome)
    return [_merged([parts[i, d] for d in unit.dtypes]) for i, unit in enumerate(units)]


def _merged(outcomes: list) -> UnitOutcome:
    """One unit's outcome from those of its dtypes, in the unit's dtype order (the rows of a run
    in one process)."""
    merged = UnitOutcome([], {}, {}, collections.Counter(), [])
    for o in outcomes:
        merged.rows += o.rows
        merged.cases.update(o.cases)
        merged.seconds.update(o.seconds)
        merged.bounds.update(o.bounds)
        merged.errors += o.errors
    merged.bounds = dict(merged.bounds)
    return merged


def hand_out_order(units: list) -> list:
    """The ``(unit index, dtype)`` pairs of ``units`` in the order workers get them: the most
    expensive first (by :meth:`Unit.cost`; ties in battery order), so the long compiles do not
    come last."""
    pairs = [(i, d) for i, u in enumerate(units) for d in u.dtypes]
    return sorted(pairs, key=lambda p: -units[p[0]].cost(p[1]))


def _print_errors(outcome: UnitOutcome) -> UnitOutcome:
    for text in outcome.errors:
        print(f"streamkl verify: FAIL, {text}", file=sys.stderr, flush=True)
    return outcome


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished child processes (worker processes, and the
    compilers Triton starts)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
