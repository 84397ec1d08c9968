"""Section ``decode_sweep``: the decode-like forward, the automatic split_k against every power of two.

    python bench/bench_gpu.py --sections decode_sweep

Grid N_Q in {1, 16, 64} x N_K in {32K, 128K} x B in {1, 8}; H = 32, D = 128, bf16, non-causal.
Every point times split_k in {1, 2, 4, ..., 64} and the automatic choice (do_bench medians),
and the copy floor (bytes of K1 and K2 read once over the measured device-copy bandwidth).
Rows to OUT_DIR/decode_sweep.csv; a short table last.
"""
from __future__ import annotations

import csv
import os
import sys

from .timing import copy_bandwidth, time_ms

SPLITS = (1, 2, 4, 8, 16, 32, 64)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out_dir = argv[0] if argv else "."
    os.makedirs(out_dir, exist_ok=True)
    import torch

    import streamkl_gpu

    bw = copy_bandwidth()
    path = os.path.join(out_dir, "decode_sweep.csv")
    f = open(path, "w", newline="")
    w = csv.DictWriter(f, fieldnames=["b", "n_q", "n_k", "h", "d", "dtype", "split_k", "ms", "floor_ms", "note"])
    w.writeheader()
    H, D = 32, 128
    table = []
    for B in (1, 8):
        for NK in (32768, 131072):
            g = torch.Generator(device="cuda").manual_seed(1)
            k1 = torch.randn(B, H, NK, D, device="cuda", dtype=torch.bfloat16, generator=g)
            k2 = torch.randn(B, H, NK, D, device="cuda", dtype=torch.bfloat16, generator=g)
            floor = 2 * k1.numel() * k1.element_size() / bw * 1e3  # K1 and K2 read once, at the copy rate (read + written bytes/s)
            for NQ in (1, 16, 64):
                q1 = torch.randn(B, H, NQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
                q2 = torch.randn(B, H, NQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
                times = {}
                for s in (None,) + SPLITS:
                    fn = lambda s=s: streamkl_gpu.attention_kl(q1, k1, q2, k2, split_k=s)
                    fn()
                    times[s] = time_ms(fn, cuda=True, warmup=10, rep=40)
                    w.writerow({"b": B, "n_q": NQ, "n_k": NK, "h": H, "d": D, "dtype": "bfloat16",
                                "split_k": "auto" if s is None else s, "ms": f"{times[s]:.4f}",
                                "floor_ms": f"{floor:.4f}", "note": ""})
                best = min(SPLITS, key=lambda s: times[s])
                table.append((B, NQ, NK, times[None], best, times[best], floor))
                f.flush()
            del k1, k2
            torch.cuda.empty_cache()
    f.close()
    from streamkl_gpu._core import tuning as _tuning
    with open(os.path.join(out_dir, "decode_tuning.txt"), "w") as fh:  # what the tuner measured per key
        for key, measured in getattr(_tuning, "TUNING_LOG", {}).items():
            fh.write(f"{key}\n" + "".join(f"    {cfg}  {ms:.4f} ms\n" for cfg, ms in sorted(measured, key=lambda x: x[1])))
            retimed = getattr(_tuning, "TUNING_RETIMED", {}).get(key)
            if retimed:
                fh.write("  re-timed (interleaved, median):\n" + "".join(
                    f"    {cfg}  {ms:.4f} ms\n" for cfg, ms in sorted(retimed.items(), key=lambda x: x[1])))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + written)")
    print(f"{'B':>2} {'N_Q':>4} {'N_K':>7} {'auto ms':>8} {'best split':>10} {'best ms':>8} {'auto/best':>9} {'auto/floor':>10}")
    for B, NQ, NK, ta, best, tb, floor in table:
        print(f"{B:>2} {NQ:>4} {NK:>7} {ta:8.3f} {best:>10} {tb:8.3f} {ta / tb:9.3f} {ta / floor:10.3f}")


if __name__ == "__main__":
    main()
