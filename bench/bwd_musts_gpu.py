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


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    no_grid = "--no-grid" in argv
    argv = [a for a in argv if a != "--no-grid"]
    configure(no_grid)
    if "--quick" not in argv:
        argv.append("--quick")  # settings 1 and 2, N = 8K and 16K
    if not no_grid and "--grid" not in argv and "--_worker" not in argv:
        argv.append("--grid")
    if "--budget-s" not in argv and "--_worker" not in argv:
        argv += ["--budget-s", "280"]
    return bwd_gpu.main(argv)


if __name__ == "__main__":
    sys.exit(main())
