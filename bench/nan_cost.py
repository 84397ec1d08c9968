#!/usr/bin/env python3
"""What the NaN-isolation guards cost (issue 9 §1: at most 3 % at 8K), before/after in one run.

    python bench/nan_cost.py OUT_DIR [--legacy PATH]

Times the Triton kernels of two trees, each in its own process on the same GPU: this checkout
and a tree from before the guards (default ``.legacy/fec3a94``: ``git archive fec3a94
streamkl_gpu streamkl_ref``). B=1, H=32, N=8K, D=128, bf16: forward non-causal and causal, and
forward+backward of setting 1 (fused, the auto mode at this shape). The forward is forced to
the Triton kernels (``STREAMKL_FWD_BACKEND=triton``) so both trees run the same kernel family.
Each tree is timed once (do_bench medians over 200 ms per case).
Rows to OUT_DIR/nan_cost.csv; a short table last.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys
sys.path.insert(0, os.environ["TREE"])
import torch
from triton.testing import do_bench
import streamkl_gpu
g = torch.Generator(device="cuda").manual_seed(0)
N, H, D = 8192, 32, 128
x = [torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
out = {}
for causal in (False, True):
    f = lambda: streamkl_gpu.attention_kl(*x, causal=causal)
    f()
    out[f"fwd causal={causal}"] = do_bench(f, warmup=25, rep=200, return_mode="median")
    q2 = x[2].clone().requires_grad_(); k2 = x[3].clone().requires_grad_()
    gr = torch.randn(1, H, N, device="cuda", generator=g)
    def fb():
        q2.grad = k2.grad = None
        streamkl_gpu.attention_kl(x[0], x[1], q2, k2, causal=causal).backward(gr)
    fb()
    out[f"fwd+bwd s1 causal={causal}"] = do_bench(fb, warmup=25, rep=200, return_mode="median")
print(json.dumps(out))
"""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out_dir = argv[0] if argv else "."
    legacy = os.path.join(ROOT, ".legacy", "fec3a94")
    if "--legacy" in argv:
        legacy = argv[argv.index("--legacy") + 1]
    os.makedirs(out_dir, exist_ok=True)
    trees = [("before (fec3a94)", legacy), ("after", ROOT)]
    results = []
    for label, tree in trees:
        env = dict(os.environ, TREE=tree, STREAMKL_FWD_BACKEND="triton", STREAMKL_TUNING_CACHE="0")
        proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            print(label, "FAILED", proc.stderr[-3000:], flush=True)
            continue
        results.append((label, json.loads(proc.stdout.strip().splitlines()[-1])))
        print(label, results[-1][1], flush=True)
    with open(os.path.join(out_dir, "nan_cost.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["tree", "run", "case", "ms", "shape"])
        for i, (label, res) in enumerate(results):
            for case, ms in res.items():
                w.writerow([label, i, case, f"{ms:.4f}", "B1 H32 N8192 D128 bf16"])
    cases = list(results[0][1]) if results else []
    print(f"{'case':24s} {'before ms':>10s} {'after ms':>10s} {'after/before':>12s}  ")
    for c in cases:
        b = min(r[c] for lbl, r in results if lbl.startswith("before"))
        a = min(r[c] for lbl, r in results if lbl == "after")
        print(f"{c:24s} {b:10.3f} {a:10.3f} {a / b:12.3f}")


if __name__ == "__main__":
    main()
