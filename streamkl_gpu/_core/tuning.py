"""Launch configurations: a few candidates per shape class, timed once per key on the GPU.

A small hand-rolled tuner (``triton.autotune`` cannot run in the interpreter, and pruning by shape
keeps the tuning cost to a handful of compiles). By default (``STREAMKL_AUTOTUNE=auto``) the
attention kernels run their first candidate untimed (the shape rule's config,
``attention.configs.SHAPE_RULES``) and the kernels without a derived rule are timed
(:func:`autotune_enabled`). The tuner and its disk cache only: the attention kernels' candidate lists and automatic
rules are in ``streamkl_gpu/attention/configs.py``, the indexer's in ``streamkl_gpu/indexer/configs.py``.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core.launcher import compiling_ahead
from streamkl_gpu._core.runtime import bucket, interpreting  # bucket: the tuner's shape classes

# Tuned choices: in memory for this process, and on disk for the next one (see _disk_cache_dir).
_TUNED: dict = {}




AUTOTUNE_MODES = ("auto", "0", "1")


def autotune_enabled(ruled: bool = True) -> bool:
    """Is this pick timed? ``STREAMKL_AUTOTUNE``: ``auto`` (default) times only the picks with no
    derived shape rule yet (``ruled=False``: the indexer's kernels and the forward's key splits for
    short query blocks, whose first candidates were measured up to 2x slower than the tuned choice:
    H200, bench/results/2026-12-03_h200_37a1792/); the attention kernels' picks (``ruled=True``) run
    the shape rule's config untimed (measured equal to the tuned choice there). ``1`` times every
    pick, ``0`` none. Never under the interpreter."""
    if interpreting():
        return False
    value = (_runtime.env("STREAMKL_AUTOTUNE", "auto") or "auto").strip().lower()
    if value not in AUTOTUNE_MODES:
        raise ValueError(f"STREAMKL_AUTOTUNE must be one of {AUTOTUNE_MODES}, got {value!r}")
    return value == "1" or (value == "auto" and not ruled)


# ----------------------------------------------------------------------------------------------
# The on-disk cache: one small JSON file per tuned key, under
#   $STREAMKL_CACHE_DIR (default: $XDG_CACHE_HOME/streamkl, else ~/.cache/streamkl)
#   / tuning-<hash of GPU name, torch, triton and streamkl versions, the entry format> / <hash of the key>.json
# An entry holds the key's and the chosen config's repr (configs are frozen dataclasses, their
# repr names every field); a load takes the candidate with that repr, so an entry of an older
# format (the directory's hash differs anyway) or of a changed candidate list is never misread.
# written to a temporary file and renamed into place (atomic on POSIX), so any number of ranks
# starting at once can write the same entry: each rename is whole, the last one wins, and all
# of them hold a choice measured on this machine. STREAMKL_TUNING_CACHE=0 disables it.
# ----------------------------------------------------------------------------------------------

CACHE_FORMAT = 2  # 2: configs stored by repr (1: positional tuples stored as JSON lists)


def cache_root() -> str:
    """streamkl's cache directory: ``$STREAMKL_CACHE_DIR``, else ``$XDG_CACHE_HOME/streamkl``, else
    ``~/.cache/streamkl`` (tuned choices here; ``streamkl verify``'s references beside them)."""
    root = os.environ.get("STREAMKL_CACHE_DIR")
    if root:
        return root
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "streamkl")


def _disk_cache_dir(device):
    if os.environ.get("STREAMKL_TUNING_CACHE", "1") == "0":
        return None
    root = cache_root()
    import torch
    import triton

    from streamkl_ref import __version__

    env = {"gpu": _runtime.device_name(device), "torch": torch.__version__, "triton": triton.__version__,
           "streamkl": __version__, "format": CACHE_FORMAT}
    tag = hashlib.sha1(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(root, f"tuning-{tag}"), env


def _key_file(cache, key):
    return os.path.join(cache, hashlib.sha1(repr(key).encode()).hexdigest()[:24] + ".json")


def _disk_load(device, key, candidates):
    where = _disk_cache_dir(device)
    if where is None:
        return None
    try:
        with open(_key_file(where[0], key)) as fh:
            entry = json.load(fh)
    except (OSError, ValueError):
        return None
    if entry.get("key") != repr(key):  # a hash collision, or a file from elsewhere
        return None
    stored = entry.get("config")
    # candidates changed since (or an entry of another format): tune again
    return next((c for c in candidates if repr(c) == stored), None)


def _disk_store(device, key, cfg):
    where = _disk_cache_dir(device)
    if where is None:
        return
    cache, env = where
    try:
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": repr(key), "config": repr(cfg), "env": env}, fh)
        os.replace(tmp, _key_file(cache, key))
    except OSError:  # a read-only or full cache directory only costs the next process a re-tune
        pass


def pick(key, candidates, launch, proxy=None, device=None, ruled=True):
    """The fastest of ``candidates`` for ``key``: from memory, from the disk cache, or timed once.

    ``launch(cfg)`` runs the real problem with ``cfg``; ``proxy(cfg)``, when given, a bounded slice
    of it with the same kernels (then the candidates are timed on the slice). Nothing else is
    launched. Timing stops after ``KEY_BUDGET_S`` seconds with the best so far. Where the pick is not timed (:func:`autotune_enabled` of ``ruled``; always in the
    interpreter) the first candidate, untimed: the shape rule's choice, the one kernel compiled.
    In a compile-ahead thread (``_core.launcher``) a pick not yet decided compiles every candidate
    and returns the first, recording nothing.
    """
    if len(candidates) == 1 or not autotune_enabled(ruled):
        return candidates[0]
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    cfg = _disk_load(device, key, candidates)
    if cfg is None and compiling_ahead():
        # a compile-ahead thread's launches run nothing, so nothing can be timed here: compile
        # every candidate (each on a thread of its own) for the real call's timing, decide nothing
        for other in candidates[1:]:
            launch(other)
        return candidates[0]
    if cfg is None:
        cfg = _time_candidates(key, candidates, proxy or launch)
        _disk_store(device, key, cfg)
    _TUNED[key] = cfg
    return cfg


# Where first calls spend their time (the first_call section, bench/streamkl_bench/first_call.py,
# reports it): seconds in the first launch of each candidate (compiling it, or loading it from
# Triton's cache) and in timing them.
TUNING_STATS = {"compile_s": 0.0, "timing_s": 0.0, "keys": 0, "cut_keys": 0}
TUNING_LOG: dict = {}  # key -> [(cfg, median ms)], what the tuner measured
# A candidate whose one timed call takes longer than this is not timed again: do_bench would run
# it about 8 more times (its estimate, warm-up and repeat calls), which is what made the first
# fused both-settings backward at N = 32K take 4.9 s in the first H200 bench
# (docs/design/attention_backward.md, "A harness outlier, explained").
LONG_CALL_S = 0.05
# A pick stops timing once its candidates have taken this long (each costs two calls of the real
# problem: its first launch and one timed call) and keeps the best so far; candidates come in the
# order of the shape rule, its choice first. Past this the timing costs more than any choice can
# save in a first call: the indexer loss at 128K tokens (DSA-like, B = 2) runs seconds per call,
# and timing its eight forward candidates and the backward's on the whole problem did not finish
# in 450 s (the first_call_big section, bench/results/2026-12-04_h200_e7f5ad9/). Attention's
# backward picks time a bounded slice instead (``proxy``).
KEY_BUDGET_S = 20.0
TUNING_RETIMED: dict = {}  # key -> {cfg: median of the interleaved re-timings, ms}
RETIME_MARGIN = 0.15  # candidates within 15 % of the first pass's best are timed again
RETIME_ROUNDS = 3
RETIME_BUDGET_S = 2.0  # re-timing only where it costs at most this (short, decode-like calls)


def out_of_resources(exc) -> bool:
    """Is ``exc`` Triton's refusal to launch a config on this device (shared memory, registers,
    threads)? Raised before the kernel runs, so the next candidate can be tried."""
    return "OutOfResources" in type(exc).__name__ or "out of resource" in str(exc).lower()


def first_that_fits(cache: dict, key, choices, run):
    """``run(choice)`` for the first of ``choices`` (any iterable; read only when ``key`` is not in
    ``cache``) that this device launches: a launch Triton refuses before the kernel runs
    (:func:`out_of_resources`: shared memory, registers) moves on to the next; any other error
    raises. The choice that ran is remembered in ``cache[key]`` and run directly by later calls,
    except in a compile-ahead thread, where nothing runs and so nothing is refused. Raises the
    last refusal when no choice fits."""
    if key in cache:
        return run(cache[key])
    last = None
    for choice in choices:
        try:
            out = run(choice)
        except Exception as exc:  # noqa: BLE001 - only a launch that does not fit moves on
            if not out_of_resources(exc):
                raise
            last = exc
            continue
        if not compiling_ahead():
            if len(cache) >= 4096:
                cache.clear()
            cache[key] = choice
        return out
    if last is None:
        raise ValueError(f"no launch configuration to try for {key}")
    raise last


def _compile_side_by_side(candidates, launch):
    """Compile the candidates' kernels on up to ``os.cpu_count()`` threads at once (compile-ahead
    threads: their launches only compile, ``_core.launcher``), so that the timing loop below finds
    them compiled: a timed pick over n candidates waits about n/cores compiles, not n. A candidate
    that fails to compile here is skipped quietly (the loop compiles it again and decides). On a
    GPU only; ``STREAMKL_COMPILE_AHEAD=0`` turns it off."""
    import torch

    from streamkl_gpu._core.launcher import ahead_allowed, compile_ahead

    if len(candidates) < 2 or not ahead_allowed() or not torch.cuda.is_available():
        return
    device = torch.cuda.current_device()
    width = max(1, min(len(candidates), os.cpu_count() or 1))
    for start in range(0, len(candidates), width):
        threads = [compile_ahead(lambda cfg=cfg: launch(cfg), device) for cfg in candidates[start:start + width]]
        for thread in threads:
            thread.join()


def _time_candidates(key, candidates, launch):
    import time

    import torch
    from triton.testing import do_bench

    best, best_t = None, float("inf")
    TUNING_STATS["keys"] += 1
    measured = TUNING_LOG.setdefault(key, [])
    t0 = time.perf_counter()
    _compile_side_by_side(candidates, launch)
    TUNING_STATS["compile_s"] += time.perf_counter() - t0
    loop_start = time.perf_counter()
    for cfg in candidates:
        if best is not None and time.perf_counter() - loop_start > KEY_BUDGET_S:
            TUNING_STATS["cut_keys"] += 1  # the rest untimed: the best so far stands
            break
        try:
            t0 = time.perf_counter()
            launch(cfg)  # compiles (or loads) this candidate: not part of the tuning budget
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            launch(cfg)  # one timed call: a long one is its own measurement
            torch.cuda.synchronize()
            once = time.perf_counter() - t1
            if once < LONG_CALL_S:
                t = do_bench(lambda: launch(cfg), warmup=5, rep=20, return_mode="median")
            else:
                t = once * 1e3
            TUNING_STATS["compile_s"] += t1 - t0
            TUNING_STATS["timing_s"] += time.perf_counter() - t1
        except Exception as exc:  # out of shared memory / registers: not a usable config
            if not isinstance(exc, UnusableConfig) and not out_of_resources(exc):
                raise
            continue
        measured.append((cfg, t))
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError(f"no launch configuration fits for {key}")
    # Close calls are decided again, interleaved: one do_bench median per candidate can be off
    # by more than the gap between the leaders (clocks settling during the first candidates, a
    # neighbour's noise), and decode-sized calls are cheap to re-time. Measured reason (H200,
    # 2026-12-01): single-pass tuning chose a split 10-15 % slower than the best at two decode
    # points that the best config led by less than that.
    close = [cfg for cfg, t in measured if t <= best_t * (1 + RETIME_MARGIN)]
    if len(close) > 1 and best_t * 1e-3 * len(close) * RETIME_ROUNDS * 40 <= RETIME_BUDGET_S:
        t1 = time.perf_counter()
        totals = {cfg: [] for cfg in close}
        for _ in range(RETIME_ROUNDS):
            for cfg in close:
                totals[cfg].append(do_bench(lambda: launch(cfg), warmup=2, rep=10, return_mode="median"))
        best = min(close, key=lambda c: sorted(totals[c])[len(totals[c]) // 2])
        TUNING_RETIMED[key] = {c: sorted(v)[len(v) // 2] for c, v in totals.items()}
        TUNING_STATS["timing_s"] += time.perf_counter() - t1
    return best


class UnusableConfig(Exception):
    """A candidate that cannot run here (a new kernel variant failing to compile on this Triton):
    the tuner skips it like one that is out of resources."""
