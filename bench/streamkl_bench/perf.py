"""The perf sections: env (copy bandwidth, matmul rate), fwd, bwd, decode, smallq, long.

Each section walks its grid (cases.make_config), builds input sets (timing), times every provider
(providers) and writes one bench.csv row per point (report)."""

import os
import time
from unittest import mock

from .cases import SETTINGS, prio
from .providers import chunked_kl


class PerfMixin:
    def sec_env(self):
        torch = self.torch
        bw, t_copy, nbytes = self.measure_copy()
        self.row("env", "copy", "d2d", 0, 0, 0, 0, 0, 0, 0, "uint8", times=t_copy, status="ok",
                 extra=f"bytes={nbytes};tb_s={bw / 1e12:.4g};counts=read+written", echo=False)
        n = 8192 if self.cuda and not self.a.tiny else 512
        dt = torch.bfloat16 if self.cuda else torch.float32
        a = torch.randn(n, n, device=self.dev, dtype=dt)
        b = torch.randn(n, n, device=self.dev, dtype=dt)
        times = self.bench_simple(lambda: a @ b)
        tflops = 2 * n ** 3 / (times[1] * 1e-3) / 1e12
        self.row("env", "matmul", "mm", 0, n, n, 1, 1, n, n, "bf16" if self.cuda else "fp32", times=times,
                 extra=f"tflops={tflops:.4g}", echo=False)
        del a, b
        self.free()
        self.env.update(copy_tb_s=round(bw / 1e12, 4), matmul_tflops=round(tflops, 2), matmul_n=n)
        self.write_env()
        self.log(f"env: {self.env['gpu']} torch {self.env['torch']} triton {self.env['triton']} "
                 f"streamkl {self.env['streamkl_version']}; copy {bw / 1e12:.3f} TB/s (anchor 4.14); "
                 f"{'bf16 ' if self.cuda else ''}matmul {n}^3 {tflops:.1f} TFLOP/s (anchor 756)")

    # ---------------------------------------------------------------- forward
    def sec_fwd(self):
        cfg, H, D = self.cfg, self.cfg["H"], self.cfg["D"]
        elem = 2
        for causal in (False, True):
            for n in prio(cfg["fwd_n"]):
                tp = time.perf_counter()
                per_set = 4 * H * n * D * elem
                sets = self.inputs(1, H, n, n, D, D, "bf16", seed=n + causal, n_sets=self.n_sets_for(per_set), g=False)
                meta = lambda prov: ("fwd", prov, "fwd", causal, n, n, 1, H, D, D, "bf16")
                work = H * n * n
                f = self.f_ours_fwd(causal)
                self.point(meta("ours"), f and self.rotate(sets, f), work=work)
                for prov, be in self.SDPA_PROVIDERS:
                    self.point(meta(prov), self.rotate(sets, self.f_sdpa(causal)), work=work, ctx=self.sdpa_ctx(be),
                               extra=f"sdpa_backend={be}")
                est_eager = 6.5 * H * n * n * 4 / 1e9
                if est_eager > self.a.mem_limit_gb:
                    self.point(meta("eager"), None, pre_status="OOM/skipped", extra=f"est_gb={est_eager:.0f}")
                else:
                    self.point(meta("eager"), self.rotate(sets, self.f_eager_fwd(causal)), work=work)
                ch = cfg["chunk"]
                self.point(meta("chunked"), self.rotate(sets[:1], lambda d: chunked_kl(d["q1"], d["k1"], d["q2"], d["k2"], causal, ch)),
                           work=work, extra=f"chunk={ch}")
                del sets
                self.free()
                self.group_line("fwd", causal, n, n, "fwd", ["ours", "sdpa", "sdpa_flash", "eager", "chunked"], tp)
        self.compile_points("fwd")

    def compile_points(self, which):
        """torch.compile points in priority order (the summary's N first), each with a fresh cache."""
        cfg, H, D = self.cfg, self.cfg["H"], self.cfg["D"]
        if not self.cuda:
            for n in (cfg["compile_fwd_n"] if which == "fwd" else cfg["compile_bwd_n"]):
                for causal in (False, True):
                    modes = ["fwd"] if which == "fwd" else [f"fwd_bwd_{s}" for s in cfg["compile_bwd_settings"]]
                    for m in modes:
                        self.row("fwd" if which == "fwd" else "fwd_bwd", "compile", m, causal, n, n, 1, H, D, D,
                                 "bf16", status="skipped(cpu)")
            return
        ns = cfg["compile_fwd_n"] if which == "fwd" else cfg["compile_bwd_n"]
        settings = [None] if which == "fwd" else cfg["compile_bwd_settings"]
        for n in ns:
            for setting in settings:
                for causal in (False, True):
                    tp = time.perf_counter()
                    kernel = "fwd" if which == "fwd" else "fwd_bwd"
                    mode = "fwd" if setting is None else f"fwd_bwd_{setting}"
                    meta = (kernel, "compile", mode, causal, n, n, 1, H, D, D, "bf16")
                    est = (2.5 if setting is None else 4.5) * H * n * n * 4 / 1e9
                    if est > self.a.mem_limit_gb:
                        self.point(meta, None, pre_status="OOM/skipped", extra=f"est_gb={est:.0f}")
                        continue
                    sets = self.inputs(1, H, n, n, D, D, "bf16", seed=7 * n + causal, req=SETTINGS.get(setting, ()),
                                       n_sets=1)
                    try:
                        comp = self.compiled_kl()
                    except Exception as e:
                        self.point(meta, None, pre_status="error", extra=f"{type(e).__name__}")
                        continue
                    f = self.f_eager_fwd(causal, comp) if setting is None else self.f_eager_fb(causal, setting, comp)
                    r = self.point(meta, self.rotate(sets, f), work=H * n * n,
                                   compile_kind="fwd" if setting is None else "bwd")
                    del sets, comp, f
                    self.free()
                    self.log(f"{kernel} compile {mode} c={int(causal)} N={n}: {r['status']} p50={r['p50_ms'] or '-'} ms "
                             f"({time.perf_counter() - tp:.1f}s; {r['extra']})")

    def group_line(self, kernel, causal, nq, nk, mode, provs, tp):
        parts = []
        for p in provs:
            v = self.get(kernel, p, mode, causal, nq, nk)
            if v is None:
                st = next((r["status"] for r in reversed(self.rows) if r["kernel"] == kernel and r["provider"] == p
                           and r["mode"] == mode and r["n_q"] == nq and r["n_k"] == nk
                           and r["causal"] == int(bool(causal))), "-")
                parts.append(f"{p}={st}")
            else:
                parts.append(f"{p}={v:.4g}")
        self.log(f"{kernel} {mode} c={int(causal)} nq={nq} nk={nk}: " + " ".join(parts) +
                 f" ms ({time.perf_counter() - tp:.1f}s)")

    # ---------------------------------------------------------------- forward + backward
    def sec_bwd(self):
        cfg, H, D = self.cfg, self.cfg["H"], self.cfg["D"]
        for causal in (False, True):
            for n in prio(cfg["bwd_n"]):
                for setting in ("s1", "s2", "both"):
                    tp = time.perf_counter()
                    mode = f"fwd_bwd_{setting}"
                    per_set = 4 * H * n * D * 2 * 2
                    sets = self.inputs(1, H, n, n, D, D, "bf16", seed=3 * n + causal, req=SETTINGS[setting],
                                       n_sets=self.n_sets_for(per_set))
                    meta = lambda prov: ("fwd_bwd", prov, mode, causal, n, n, 1, H, D, D, "bf16")
                    work = H * n * n
                    # "auto" only where the summary reads it (N >= 8K; all N with --tiny): saves ~40 points
                    for bm in ("fused", "separate", "auto"):
                        if bm == "auto" and n < 8 * 1024 and not self.a.tiny:
                            continue
                        f = self.f_ours_fb(causal, setting, bm)
                        self.point(meta(f"ours_{bm}"), f and self.rotate(sets, f), work=work)
                    if setting == "s1":  # SDPA fwd+bwd does not depend on the setting: once per (N, causal)
                        sdpa_sets = self.prep_sdpa_bwd(sets)
                        for prov, be in self.SDPA_PROVIDERS:
                            self.point(("fwd_bwd", prov, "fwd_bwd_sdpa", causal, n, n, 1, H, D, D, "bf16"),
                                       self.rotate(sdpa_sets, self.f_sdpa(causal, backward=True)), work=work,
                                       ctx=self.sdpa_ctx(be), extra=f"sdpa_backend={be}")
                    est = 8.5 * H * n * n * 4 / 1e9
                    if est > self.a.mem_limit_gb:
                        self.point(meta("eager"), None, pre_status="OOM/skipped", extra=f"est_gb={est:.0f}")
                    else:
                        self.point(meta("eager"), self.rotate(sets, self.f_eager_fb(causal, setting)), work=work)
                    del sets
                    self.free()
                    self.group_line("fwd_bwd", causal, n, n, mode, ["ours_fused", "ours_separate", "ours_auto", "eager"], tp)
        self.compile_points("bwd")

    # ---------------------------------------------------------------- decode-like small N_Q, forward
    def sec_decode(self):
        cfg, H, D = self.cfg, self.cfg["H"], self.cfg["D"]
        bw, _, _ = self.measure_copy()
        for nq, nk in cfg["decode"]:
            tp = time.perf_counter()
            per_set = 2 * H * nk * D * 2
            sets = self.inputs(1, H, nq, nk, D, D, "bf16", seed=nq * 7 + nk, n_sets=self.n_sets_for(per_set), g=False)
            meta = lambda prov: ("decode", prov, "fwd", False, nq, nk, 1, H, D, D, "bf16")
            work = H * nq * nk
            f = self.f_ours_fwd(False)
            self.point(meta("ours"), f and self.rotate(sets, f), work=work, extra="split_k=auto")
            f = self.f_ours_fwd(False, split_k=1)
            self.point(meta("ours_split1"), f and self.rotate(sets, f), work=work, extra="split_k=1")
            for prov, be in self.SDPA_PROVIDERS:
                self.point(meta(prov), self.rotate(sets, self.f_sdpa(False)), work=work, ctx=self.sdpa_ctx(be),
                           extra=f"sdpa_backend={be}")
            self.point(meta("eager"), self.rotate(sets, self.f_eager_fwd(False)), work=work)
            kbytes = 2 * H * nk * D * 2  # K1 and K2, bf16, read once
            floor = kbytes / bw * 1e3
            self.row(*meta("floor"), times=[floor] * 3, extra=f"bytes={kbytes};copy_tb_s={bw / 1e12:.4g}")
            del sets
            self.free()
            self.group_line("decode", False, nq, nk, "fwd", ["ours", "ours_split1", "sdpa", "sdpa_flash", "eager", "floor"], tp)

    # ---------------------------------------------------------------- fused vs separate backward at small N_Q
    def sec_smallq(self):
        cfg, H, D = self.cfg, self.cfg["H"], self.cfg["D"]
        nk = cfg["smallq_nk"]
        for nq in cfg["smallq_nq"]:
            for setting in ("s1", "s2", "both"):
                tp = time.perf_counter()
                mode = f"fwd_bwd_{setting}"
                per_set = 2 * H * (nk + nq) * D * 2 * 2
                sets = self.inputs(1, H, nq, nk, D, D, "bf16", seed=11 * nq, req=SETTINGS[setting],
                                   n_sets=self.n_sets_for(per_set))
                for bm in ("fused", "separate", "auto"):
                    f = self.f_ours_fb(False, setting, bm)
                    self.point(("smallq_bwd", f"ours_{bm}", mode, False, nq, nk, 1, H, D, D, "bf16"),
                               f and self.rotate(sets, f), work=H * nq * nk)
                del sets
                self.free()
                self.group_line("smallq_bwd", False, nq, nk, mode, ["ours_fused", "ours_separate", "ours_auto"], tp)

    # ---------------------------------------------------------------- long context + memory vs N
    def sec_long(self):
        # streamkl_gpu tunes per shape bucket by timing every candidate config; at 512K one forward
        # is ~1 s, so tuning would cost minutes: the first candidate config is used here.
        with mock.patch.dict(os.environ, {"STREAMKL_AUTOTUNE": "0"}):
            self._sec_long()

    def _sec_long(self):
        cfg, D, H = self.cfg, self.cfg["D"], self.cfg["long_h"]
        causal = True
        for n in cfg["long_n"]:
            tp = time.perf_counter()
            for setting in (None, "s1"):
                if setting == "s1" and n not in cfg["long_bwd_n"]:
                    continue
                mode = "fwd" if setting is None else "fwd_bwd_s1"
                meta = ("long", "ours" if setting is None else "ours_auto", mode, causal, n, n, 1, H, D, D, "bf16")
                if self.ak is None:
                    self.point(meta, None)
                    continue
                try:
                    sets = self.inputs(1, H, n, n, D, D, "bf16", seed=n, req=SETTINGS.get(setting, ()), n_sets=1,
                                       g=setting is not None)
                except self.torch.cuda.OutOfMemoryError:
                    self.free()
                    self.row(*meta, status="OOM", extra="inputs")
                    continue
                f = self.f_ours_fwd(causal) if setting is None else self.f_ours_fb(causal, setting, "auto")
                inb = 4 * H * n * D * 2
                self.point(meta, self.rotate(sets, f), work=H * n * n, slow_reps=2,
                           extra=f"input_gib={inb / 2 ** 30:.3g};autotune=off")
                del sets
                self.free()
            self.group_line("long", causal, n, n, "fwd", ["ours"], tp)

    # ------------------------------------------------------------------------------------------
    # correctness
