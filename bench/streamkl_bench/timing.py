"""The one timing helper of the benchmark suite: every section and ``compare_trees.py`` time with it
(it imports no streamkl_gpu: ``compare_trees.py`` runs it against another tree's package).

``time_ms`` (do_bench on the GPU, a few CUDA-event-timed calls past ``long_call_ms``, wall-clock
calls on CPU under the interpreter), ``event_ms``, ``wall_us_per_call`` (host cost),
``extra_memory_gib``, ``is_oom``, ``sync``, ``copy_bandwidth``, ``matmul_tflops``; for
``bench_gpu.py``'s in-process sections the run's ``Budget`` and ``TimingMixin`` (input sets and
their rotation, ``measure``: warm-up, one call for peak memory, then ``time_ms``)."""
from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
import traceback


def _cuda():
    import torch
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def sync(cuda=None):
    import torch
    if _cuda() if cuda is None else cuda:
        torch.cuda.synchronize()


def event_ms(fn, reps=3):
    """Times of ``reps`` calls of ``fn`` in ms, each between two CUDA events (no warm-up)."""
    import torch
    out = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        out.append(e0.elapsed_time(e1))
    return out


def _settle():  # a first call's background compiles (streamkl_gpu._core.launcher.settle): time what stays
    getattr(sys.modules.get("streamkl_gpu._core.launcher"), "settle", lambda: None)()


def time_ms(fn, cuda=None, warmup=25, rep=100, grad_to_none=None, quantiles=None, long_call_ms=None, cpu_reps=1):
    """Median ms of ``fn`` (a list of ``quantiles`` if given). GPU: ``do_bench(warmup, rep)``, or,
    when one warm call takes longer than ``long_call_ms``, the median of 3 event-timed calls.
    CPU: the median of ``cpu_reps`` wall-clock calls."""
    cuda = _cuda() if cuda is None else cuda
    if not cuda:
        samples = []
        for _ in range(cpu_reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return quantiles_of(samples, quantiles) if quantiles else sorted(samples)[len(samples) // 2]
    fn()
    _settle()
    if long_call_ms is not None:
        one = event_ms(fn, 1)[0]
        if one > long_call_ms:
            samples = [one] + event_ms(fn, 2)
            return quantiles_of(samples, quantiles) if quantiles else sorted(samples)[1]
    from triton.testing import do_bench
    if quantiles:
        return list(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, quantiles=list(quantiles)))
    return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def wall_us_per_call(fn, n, cuda=None, warm=50):
    """Host cost: wall microseconds per call of ``n`` back-to-back calls (after ``warm`` calls)."""
    for _ in range(warm):
        fn()
    _settle()
    sync(cuda)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(cuda)
    return (time.perf_counter() - t0) / n * 1e6


def extra_memory_gib(fn, cuda=None):
    """Peak allocated during one call of ``fn`` minus what was allocated before it (GiB); NaN on CPU."""
    import torch
    if not (_cuda() if cuda is None else cuda):
        fn()
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def is_oom(exc) -> bool:
    import torch
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def copy_bandwidth(nbytes=1 << 30, device="cuda"):
    """Device copy bandwidth, bytes read + written per second (a ``copy_`` of ``nbytes``)."""
    import torch
    x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), cuda=device == "cuda", warmup=10, rep=50, cpu_reps=3)
    return 2 * nbytes / (ms * 1e-3)


def matmul_tflops(n=8192, device="cuda"):
    """bf16 TFLOP/s of one n^3 matmul (the floors' rate)."""
    import torch
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, cuda=device == "cuda", warmup=10, rep=50)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def quantiles_of(samples, ps=(0.2, 0.5, 0.8)):
    """Quantiles ``ps`` of ``samples``, linear between the two nearest."""
    s, last = sorted(samples), len(samples) - 1
    at = [(p * last, int(math.floor(p * last))) for p in ps]
    return [s[lo] + (s[min(lo + 1, last)] - s[lo]) * (x - lo) for x, lo in at]


class Budget:
    def __init__(self, t0, total, budgets, sections):
        self.t0, self.total = t0, total
        self.plan = {}
        cum = 0.0
        for s in sections:
            cum += budgets.get(s, 30)
            self.plan[s] = cum
        self.deadline = t0 + total

    def start(self, section):
        now = time.perf_counter()
        names = list(self.plan)
        i = names.index(section)
        prev = self.plan[names[i - 1]] if i else 0.0
        own = self.plan[section] - prev
        later = self.plan[names[-1]] - self.plan[section]  # the budgets of the sections still to come
        # Unused time of earlier sections carries forward. If earlier sections overran, this one still
        # gets half its own budget, and half of every later section's budget stays reserved for it;
        # nothing starts past the global end (+15 s grace).
        end = self.t0 + self.total + 15 - 0.5 * later
        self.deadline = min(max(self.t0 + self.plan[section], now + 0.5 * own), end)
        return own

    def remaining(self):
        return self.deadline - time.perf_counter()

    def allows(self, cost_s):
        return cost_s <= self.remaining()


class TimingMixin:
    """Needs self.torch, self.cuda, self.dev, self.a, self.cfg, self.budget, self.hist,
    self.compile_est, self.copy_bw, self.log and self.row (report)."""

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def free(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def inputs(self, B, H, NQ, NK, D1, D2, dtype, HK1=None, HK2=None, req=(), seed=0, n_sets=1,
               g=True):
        """n_sets independent random input sets (rotated through by the timed closures)."""
        torch = self.torch
        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        HK1, HK2 = HK1 or H, HK2 or H
        sets = []
        for s in range(n_sets):
            gen = torch.Generator(device=self.dev)
            gen.manual_seed(self.a.seed * 1000003 + seed * 101 + s)
            d = {}
            for name, shp in (("q1", (B, H, NQ, D1)), ("k1", (B, HK1, NK, D1)),
                              ("q2", (B, H, NQ, D2)), ("k2", (B, HK2, NK, D2))):
                d[name] = torch.randn(shp, generator=gen, device=self.dev, dtype=dt).requires_grad_(name in req)
            if g:
                d["g"] = torch.randn((B, H, NQ), generator=gen, device=self.dev, dtype=torch.float32)
            sets.append(d)
        return sets

    @staticmethod
    def n_sets_for(nbytes_per_set, cap=1 << 31):
        return max(1, min(4, cap // max(1, nbytes_per_set)))

    def rotate(self, sets, f):
        state = {"i": 0}

        def fn():
            d = sets[state["i"] % len(sets)]
            state["i"] += 1
            return f(d)
        return fn

    def predict(self, key, work):
        h = self.hist.get(key)
        if h is None:
            return None
        return h[1] * work / h[0]

    def measure(self, fn, key=None, work=1.0, ctx=None, compile_kind=None, slow_reps=None):
        """Warm-up (compiles/autotunes), one call for peak memory, then do_bench (or a few
        event-timed calls when one call is slow). Returns (times_ms, peak_gib, status, extra)."""
        torch = self.torch
        ctx = ctx or contextlib.nullcontext
        pred = self.predict(key, work) if key else None
        cost = 0.0
        if compile_kind:
            cost += self.compile_est[compile_kind]
        if pred is not None:
            cost += pred * 2 + (max(0.25, 9 * pred) if pred < 0.3 else pred * (3 if pred < 1.5 else 1))
        if not self.budget.allows(cost):
            return None, None, "skipped(budget)", f"est_s={cost:.1f}"
        slow = pred is not None and pred > 0.3 and not compile_kind
        extra = []
        try:
            with ctx():
                if not slow:  # warm-up: JIT compile, autotune, torch.compile, cuBLAS heuristics
                    tw = time.perf_counter()
                    out = fn()
                    self.sync()
                    del out
                    first = time.perf_counter() - tw
                    extra.append(f"first_call_s={first:.3g}")
                    if compile_kind:
                        self.compile_est[compile_kind] = max(self.compile_est[compile_kind] * 0.5, first * 1.2)
                # one call for peak memory (and a time sample)
                self.sync()
                if self.cuda:
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    out = fn()
                    e1.record()
                    torch.cuda.synchronize()
                    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
                    t_one = e0.elapsed_time(e1)
                else:
                    tc = time.perf_counter()
                    out = fn()
                    t_one = (time.perf_counter() - tc) * 1e3
                    peak = float("nan")
                del out
                if key:
                    self.hist[key] = (work, t_one / 1e3)
                if not self.cuda:
                    samples = [t_one]
                    for _ in range(2):
                        tc = time.perf_counter()
                        fn()
                        samples.append((time.perf_counter() - tc) * 1e3)
                    times = quantiles_of(samples)
                    extra.append(f"reps={len(samples)};timer=perf_counter")
                elif t_one > 300.0:  # slow: a few event-timed calls, no do_bench
                    reps = slow_reps or (3 if t_one < 1500.0 else 1)
                    samples = [t_one]
                    for _ in range(reps - 1):
                        if not self.budget.allows(t_one / 1e3 * 1.2):
                            break
                        e0.record()
                        fn()
                        e1.record()
                        torch.cuda.synchronize()
                        samples.append(e0.elapsed_time(e1))
                    times = quantiles_of(samples)
                    extra.append(f"reps={len(samples)};timer=cuda_events" + (";no_warmup" if slow else ""))
                else:
                    times = time_ms(fn, cuda=True, warmup=self.cfg["warmup_ms"], rep=self.cfg["rep_ms"],
                                    quantiles=(0.2, 0.5, 0.8))
                    extra.append("timer=do_bench")
            return list(times), peak, "ok", ";".join(extra)
        except Exception as e:
            self.free()
            if is_oom(e):
                return None, None, "OOM", str(e).split("\n")[0][:120].replace(",", ";")
            self.log(f"ERROR in measurement: {type(e).__name__}: {str(e)[:300]}")
            self.log(traceback.format_exc(), stdout=False)
            return None, None, "error", f"{type(e).__name__}: {str(e)[:100]}".replace(",", ";").replace("\n", " ")

    def point(self, meta, fn, key_provider=None, work=1.0, ctx=None, compile_kind=None, pre_status=None,
              extra="", slow_reps=None):
        """Measure fn and write one row. meta = (kernel, provider, mode, causal, nq, nk, b, h, d1, d2, dtype)."""
        kernel, provider, mode, causal = meta[:4]
        if pre_status is not None:
            return self.row(*meta, status=pre_status, extra=extra)
        if fn is None:
            return self.row(*meta, status="error", extra=(self.ak_error or "unavailable").replace(",", ";")[:100])
        key = (kernel, key_provider or provider, mode, causal)
        times, peak, status, ex = self.measure(fn, key=key, work=work, ctx=ctx, compile_kind=compile_kind,
                                               slow_reps=slow_reps)
        ex = ";".join(x for x in (extra, ex) if x)
        return self.row(*meta, times=times, peak=peak, status=status, extra=ex)

    def bench_simple(self, fn):
        if not self.cuda:
            fn()  # warm
        return time_ms(fn, cuda=self.cuda, warmup=self.cfg["warmup_ms"], rep=self.cfg["rep_ms"],
                       quantiles=(0.2, 0.5, 0.8), cpu_reps=3)

    def measure_copy(self):
        if self.copy_bw is None:
            torch = self.torch
            nbytes = (1 << 30) if (self.cuda and not self.a.tiny) else (32 << 20)
            x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=self.dev)
            y = torch.empty_like(x)
            times = self.bench_simple(lambda: y.copy_(x))
            self.copy_bw = 2 * nbytes / (times[1] * 1e-3)
            self._copy = (times, nbytes)
            del x, y
            self.free()
        return self.copy_bw, self._copy[0], self._copy[1]
