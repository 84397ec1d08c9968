"""Where a first call's time goes: seconds inside Triton's compiler, counted per call site.

``CompileClock`` wraps ``triton.compiler.compile`` (what every ``JITFunction`` — Triton and
Gluon — calls on a kernel-cache miss in memory, once per specialisation per process; it reads
Triton's on-disk cache first, so with warm caches a call is a load of milliseconds). The
wrapper must be installed before a kernel's first launch in the process: a ``JITFunction`` binds
``compile`` when it first runs (``JITFunction.create_binder``). ``streamkl verify`` and
``bench/streamkl_bench/first_call.py`` (the ``first_call`` section) read it; nothing else
installs it. Compiles on several threads at once (compiling ahead, ``_core.launcher``) each add
their own seconds, so ``seconds`` can exceed the wall time they took; ``events`` keeps each compile's
kernel, thread and start and end (``time.perf_counter``), the timeline that shows which ran side by side,
and its specialisation's fingerprint (:func:`fingerprint`: two compiles of one kernel with the same
fingerprint asked Triton for the same binary, so with warm caches the second should be a load),
and the two hashes Triton itself keyed it by (:func:`cache_keys`): the source's (the kernel's text
and every function it calls) and the on-disk cache key (that, the options after parsing, the
backend and the cache-invalidating environment variables), which tell why a compile the fingerprint
calls a repeat was not served from the cache;
``wall_since`` the wall seconds during which at least one compile ran (the union of those windows).
"""
from __future__ import annotations

import hashlib
import threading
import time


def fingerprint(src, options=None) -> str:
    """A short hash of what a compile asks for: the source's signature, constants and
    specialisation attributes (an ``ASTSource``'s, or a Gluon one's) and the options (warps,
    stages). Equal for two compiles of the same kernel that Triton keys alike; any part it cannot
    read counts as missing, never an error."""
    parts = [repr(getattr(src, name, None)) for name in ("signature", "constants", "attrs")]
    parts.append(repr(sorted(options.items())) if isinstance(options, dict) else repr(options))
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def cache_keys(src, result) -> tuple:
    """(source hash, cache key), 12 hex digits each, of a finished compile: ``src.hash()`` and the
    ``hash`` of the kernel ``compile`` returned (the directory name in Triton's cache). ``""`` for a
    part that cannot be read (another Triton, a failed compile)."""
    try:
        source = str(src.hash())[:12]
    except Exception:
        source = ""
    return source, str(getattr(result, "hash", "") or "")[:12]


class CompileClock:
    """``seconds`` and ``calls`` spent in ``triton.compiler.compile`` while installed;
    ``snapshot()`` / ``since(snap)`` for per-case deltas; ``events``: (kernel, thread, start, end,
    fingerprint, source hash, cache key) per compile. ``available`` is False where the compiler entry point could not be wrapped (no
    Triton): the figures then stay 0."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self.events = []
        self.available = False
        self._restore = []

    def install(self):
        try:
            import triton.compiler as package
            import triton.compiler.compiler as module
        except ImportError:
            return self
        original = module.compile
        if getattr(original, "_streamkl_clock", None) is not None:  # already wrapped: count there too
            original = original._streamkl_original

        def compile(*args, **kwargs):
            t0 = time.perf_counter()
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                t1 = time.perf_counter()
                self.seconds += t1 - t0
                self.calls += 1
                src = args[0] if args else kwargs.get("src")
                fn = getattr(src, "fn", None)  # an ASTSource's JIT function
                name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "?")
                options = kwargs.get("options", args[2] if len(args) > 2 else None)
                self.events.append((name, threading.current_thread().name, t0, t1, fingerprint(src, options),
                                    *cache_keys(src, result)))

        compile._streamkl_clock = self
        compile._streamkl_original = original
        import triton.runtime.jit as jit  # older Triton imported compile into jit's namespace

        current = module.compile  # read once: the loop replaces module.compile before the package's
        for owner in (module, package, jit):
            if getattr(owner, "compile", None) in (original, current):
                self._restore.append((owner, owner.compile))
                owner.compile = compile
        self.available = True
        return self

    def uninstall(self):
        for owner, value in reversed(self._restore):
            owner.compile = value
        self._restore.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()

    def snapshot(self):
        return self.seconds, self.calls

    def since(self, snap):
        """``(seconds, calls)`` since ``snap``."""
        return self.seconds - snap[0], self.calls - snap[1]

    def within(self, start, end):
        """(kernel, seconds, fingerprint, source hash, cache key) of each compile that started in
        ``[start, end)``."""
        return [(name, round(t1 - t0, 3), *keys) for name, _, t0, t1, *keys in list(self.events) if start <= t0 < end]

    def wall_since(self, start, end=None):
        """Wall seconds between ``start`` and ``end`` (``time.perf_counter``; default now) during
        which at least one compile ran: the union of the compile windows, clipped to the span.
        Never more than ``end - start``, where ``since`` counts two side-by-side compiles twice."""
        end = time.perf_counter() if end is None else end
        spans = sorted((max(t0, start), min(t1, end)) for _, _, t0, t1, *_ in list(self.events) if t1 > start and t0 < end)
        total, covered = 0.0, start
        for t0, t1 in spans:
            if t1 > covered:
                total += t1 - max(t0, covered)
                covered = t1
        return total
