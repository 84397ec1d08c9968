"""Issue 14's Must table in one run: the automatic backward against SDPA and torch.compile, and the
no-regression grid against the old kernels.

    python bench/bwd_musts_gpu.py OUT [--budget-s S] [--no-grid]

``bench/bwd_gpu.py`` with its variant lists cut to what the issue's targets are stated against:
- the main shapes (B=1, H=32, D=128, bf16; N = 8K, 16K; causal and not; settings 1 and 2): SDPA's
  forward and forward+backward (default dispatch), ours (``attention_kl`` as the API runs it: the
  tuned forward, ``bwd_mode="auto"``), backward = fwd+bwd - fwd for both;
- torch.compile of the materialised loss, forward+backward, setting 1, 8K non-causal, against ours
  (the best forward available, i.e. the API's);
- the grid (both settings, GQA, D1 != D2, small N_Q at N_K = 32K): auto against the old fused and
  separate kernels ("ptr", tuned as when the issue was filed).
Outputs as bwd_gpu.py's (bwd_gpu.csv, bwd_gpu.log, bwd_gpu_table.txt); the table is printed last.

``--fb-only`` (the short re-check once the backward's plan is the one a full run measured): only
setting 1 at 8K non-causal, ours (the API's forward+backward) against torch.compile's, in ``--rounds``
interleaved rounds (medians; each round's ratio logged), and the grid's points nq512 nk32K both
(not reached in s6r1) and nq512 nk32K s2 (its plan changed since).
The prewarm workers see the same lists through ``BWD_MUSTS_FB_ONLY=1`` in their environment.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bwd_gpu  # noqa: E402

AUTO = ("auto", "auto", None, True)


def configure(no_grid: bool) -> None:
    """bwd_gpu.py's lists restricted to the auto path (its prewarm workers re-run this file, so
    they see the same lists)."""
    bwd_gpu.OLD = []
    bwd_gpu.NEW_QUICK = [AUTO]
    bwd_gpu.EXTRA_QUICK = []
    bwd_gpu.Run.GRID_VARIANTS = [("old-fused", "fused", "ptr", True), ("old-separate", "separate", "ptr", True), AUTO]
    bwd_gpu.__file__ = os.path.abspath(__file__)  # prewarm() starts workers from this file


class FBRun(bwd_gpu.Run):
    """Setting 1 at 8K non-causal against torch.compile, interleaved rounds (``--fb-only``)."""
    ROUNDS = 5

    def __init__(self, a):
        super().__init__(a)
        self.ns, self.settings = [8 * bwd_gpu.K], ["s1"]

    def timed_shapes(self):
        return [(8 * bwd_gpu.K, False, "s1")]

    def run_timing(self):
        import statistics
        torch = self.torch
        n = 64 if self.a.tiny else 8 * bwd_gpu.K
        shape = "N=8K s1"
        d = self.inputs(self.H, n, n, self.D, self.D, torch.bfloat16, seed=8 * bwd_gpu.K)
        os.environ["STREAMKL_AUTOTUNE"] = "1"
        bwd = {}
        calls = {"ours fwd": lambda: self.ak(d["q1"], d["k1"], d["q2"], d["k2"]),
                 "ours fwd+bwd": lambda: self.ours_fb(d, False, "s1", "auto", None, True)}
        if not self.a.no_compile:
            try:
                comp = self.prov.compiled_kl()
                d2 = {k: (v.detach().requires_grad_(k in bwd_gpu.SET_TRAIN["s1"]) if k != "g" else v)
                      for k, v in d.items()}
                c_fb, c_f = self.prov.f_eager_fb(False, "s1", comp), self.prov.f_eager_fwd(False, comp)
                calls["compile fwd"], calls["compile fwd+bwd"] = (lambda: c_f(d)), (lambda: c_fb(d2))
            except Exception as exc:
                self.log(f"torch.compile: ERROR {type(exc).__name__}: {str(exc)[:300]}")
        for name, fn in list(calls.items()):  # warm: compiles, tunes
            try:
                fn()
                self.sync()
            except Exception as exc:
                self.log(f"{name}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
                calls.pop(name)
        times = {name: [] for name in calls}
        for i in range(1 if self.a.tiny else self.ROUNDS):
            for name, fn in calls.items():
                times[name].append(self.bench(fn, n))
            line = " ".join(f"{k} {v[-1]:.3f}" for k, v in times.items())
            if "compile fwd+bwd" in times and "ours fwd+bwd" in times:
                line += f"  ratio {times['compile fwd+bwd'][-1] / times['ours fwd+bwd'][-1]:.3f}"
            self.log(f"round {i + 1}: {line} ms")
        med = {k: statistics.median(v) for k, v in times.items()}
        note = f"median of {len(next(iter(times.values())))} interleaved rounds"
        for k, v in med.items():
            who, what = k.split(" ")
            self.row(what, "ours" if who == "ours" else "torch.compile", shape if who == "compile" or what != "fwd" else "N=8K",
                     v, "ms", note)
        if "ours fwd" in med and "ours fwd+bwd" in med:
            bwd[(shape, "auto")] = med["ours fwd+bwd"] - med["ours fwd"]
            self.row("bwd", "auto", shape, bwd[(shape, "auto")], "ms", note + ", fwd+bwd - fwd")
        if "compile fwd+bwd" in med:
            bwd[(shape, "torch.compile fwd+bwd")] = med["compile fwd+bwd"]
            if "ours fwd+bwd" in med:
                r = med["compile fwd+bwd"] / med["ours fwd+bwd"]
                self.row("speedup_vs_compile", "ours", shape, r, "x", note)
                self.log(f"fwd+bwd s1 8K: ours {med['ours fwd+bwd']:.3f} ms, torch.compile {med['compile fwd+bwd']:.3f} ms:"
                         f" {r:.3f}x faster ({note}; Must >= 1.6x)")
        return bwd


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    no_grid = "--no-grid" in argv
    argv = [a for a in argv if a != "--no-grid"]
    if "--fb-only" in argv:
        argv = [a for a in argv if a != "--fb-only"]
        os.environ["BWD_MUSTS_FB_ONLY"] = "1"  # inherited by the prewarm workers
    configure(no_grid)
    if os.environ.get("BWD_MUSTS_FB_ONLY") == "1":
        # the grid's last point (s6r1's budget ran out before it) and the one whose plan changed
        # since s6r1 (auto_bwd_mode: separate from one wave of dQ programs, s6-bwd14)
        bwd_gpu.Run.GRID = [g for g in bwd_gpu.Run.GRID if g[0] in ("nq512 nk32K both", "nq512 nk32K s2")]
        bwd_gpu.Run = FBRun
    if "--quick" not in argv:
        argv.append("--quick")  # settings 1 and 2, N = 8K and 16K
    if not no_grid and "--grid" not in argv and "--_worker" not in argv:
        argv.append("--grid")
    if "--budget-s" not in argv and "--_worker" not in argv:
        argv += ["--budget-s", "280"]
    return bwd_gpu.main(argv)


if __name__ == "__main__":
    sys.exit(main())
