"""Timing: the run's time budget, input sets and their rotation, and ``measure`` (warm-up, one call
for peak memory, then do_bench, CUDA events for slow calls, perf_counter on CPU)."""
from __future__ import annotations

import contextlib
import gc
import math
import time
import traceback


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


def quantiles(samples):
    s = sorted(samples)
    if len(s) == 1:
        return [s[0]] * 3

    def q(p):
        x = p * (len(s) - 1)
        lo = int(math.floor(x))
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (x - lo)
    return [q(0.2), q(0.5), q(0.8)]


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
                    times = quantiles(samples)
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
                    times = quantiles(samples)
                    extra.append(f"reps={len(samples)};timer=cuda_events" + (";no_warmup" if slow else ""))
                else:
                    from triton.testing import do_bench
                    times = do_bench(fn, warmup=self.cfg["warmup_ms"], rep=self.cfg["rep_ms"],
                                     quantiles=[0.2, 0.5, 0.8])
                    extra.append("timer=do_bench")
            return list(times), peak, "ok", ";".join(extra)
        except torch.cuda.OutOfMemoryError as e:
            self.free()
            return None, None, "OOM", str(e).split("\n")[0][:120].replace(",", ";")
        except RuntimeError as e:
            if "out of memory" in str(e).lower():
                self.free()
                return None, None, "OOM", ""
            self.free()
            self.log(f"ERROR in measurement: {type(e).__name__}: {str(e)[:300]}")
            self.log(traceback.format_exc(), stdout=False)
            return None, None, "error", f"{type(e).__name__}: {str(e)[:100]}".replace(",", ";").replace("\n", " ")
        except Exception as e:
            self.free()
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
        if self.cuda:
            from triton.testing import do_bench
            return list(do_bench(fn, warmup=self.cfg["warmup_ms"], rep=self.cfg["rep_ms"], quantiles=[0.2, 0.5, 0.8]))
        fn()
        s = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            s.append((time.perf_counter() - t) * 1e3)
        return quantiles(s)

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
