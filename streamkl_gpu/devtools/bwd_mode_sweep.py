"""The backward modes against each other where ``auto_bwd_mode`` decides between them: the training
step (forward + backward through ``attention_kl``) with ``bwd_mode`` forced to ``"fused"`` and to
``"separate"``, beside ``"auto"``, timed in rotated rounds (``rotated_timing``) at each N_Q for
fixed N_K, per setting and causal flag.

    python -m streamkl_gpu.devtools.bwd_mode_sweep --out FILE.csv [--nq 64,128,256] [--nk 32768] [--settings both]

One CSV row per (point, mode): gpu, timestamp, torch, triton, setting, causal, n_q, n_k, mode,
median_ms, rounds, over_best (the median over the faster forced mode's), run_status; a table on
stdout. B = 1, H = 32, D = 128, bf16 unless given. On a CPU (the interpreter; tests) the times are
wall-clock and mean nothing.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import sys

from streamkl_gpu.devtools.rotated_timing import rotated_medians, timer_for

TRAINED = {"s1": (2, 3), "s2": (0, 1), "both": (0, 1, 2, 3)}  # setting -> the trained inputs of (q1, k1, q2, k2)
MODES = ("fused", "separate", "auto")


def points(nqs, nks, settings, causals=(False, True), device="cuda", dtype=None, B=1, H=32, D=128, seed=0):
    """``{(setting, causal, n_q, n_k): {mode: step}}``: each step one forward + backward with the
    mode forced, the upstream gradient fixed per point."""
    import torch

    import streamkl_gpu

    dtype = dtype or torch.bfloat16
    out = {}
    for nk in nks:
        for nq in nqs:
            gen = torch.Generator(device=device).manual_seed(seed + nq * 7 + nk)
            shapes = ((B, H, nq, D), (B, H, nk, D), (B, H, nq, D), (B, H, nk, D))
            base = [torch.randn(s, device=device, dtype=dtype, generator=gen) for s in shapes]
            grad_kl = torch.randn(B, H, nq, device=device, generator=gen)
            for setting in settings:
                trained = TRAINED[setting]
                xs = [t.clone().requires_grad_(i in trained) for i, t in enumerate(base)]
                for causal in causals:
                    def step(mode, c=causal, xs=xs, trained=trained, g=grad_kl):
                        def call():
                            kl = streamkl_gpu.attention_kl(*xs, causal=c, bwd_mode=mode)
                            return torch.autograd.grad(kl, [xs[i] for i in trained], g)
                        return call
                    out[(setting, causal, nq, nk)] = {mode: step(mode) for mode in MODES}
    return out


def rows(medians, rounds, gpu, torch_version, triton_version):
    """The CSV rows (dicts) of ``{point: {mode: median ms}}``."""
    ts = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = []
    for (setting, causal, nq, nk), by_mode in medians.items():
        best = min(by_mode["fused"], by_mode["separate"])
        for mode, med in by_mode.items():
            out.append(dict(gpu=gpu, timestamp=ts, torch=torch_version, triton=triton_version, setting=setting,
                            causal=int(causal), n_q=nq, n_k=nk, mode=mode, median_ms=f"{med:.4f}", rounds=rounds,
                            over_best=f"{med / best:.4f}", run_status="ok"))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nq", default="64,128,192,256,384,512")
    ap.add_argument("--nk", default="32768")
    ap.add_argument("--settings", default="both", help=f"comma-separated, of {', '.join(TRAINED)}")
    ap.add_argument("--causal", default="0,1", help="comma-separated causal flags to time: 0, 1 or 0,1")
    a = ap.parse_args(argv)
    unknown = [s for s in a.settings.split(",") if s not in TRAINED]
    if unknown:
        ap.error(f"unknown settings {unknown}: choose from {', '.join(TRAINED)}")
    import torch
    import triton

    cuda = torch.cuda.is_available()
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    groups = points(ints(a.nq), ints(a.nk), a.settings.split(","), tuple(bool(c) for c in ints(a.causal)),
                    device="cuda" if cuda else "cpu")
    timer = timer_for(cuda)
    medians = {}
    for point, fns in groups.items():
        medians[point] = rotated_medians(fns, a.rounds, timer)
        print(f"{point}: " + "  ".join(f"{m} {v:.3f}" for m, v in medians[point].items()), flush=True)
    table = rows(medians, a.rounds, torch.cuda.get_device_name() if cuda else "cpu", torch.__version__,
                 triton.__version__)
    with open(a.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
