"""Kernel times of one GQA-like indexer forward (the API's default, lse given, causal, bf16) at N
tokens on the GPU: torch.profiler's device time per kernel, after a warm call.

    python bench/idx_gqa_profile.py [N]      # default 8192
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import streamkl_gpu  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
H, HK, D, HI, DI = 32, 8, 128, 16, 64
g = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s, std=1.0: (std * torch.randn(s, generator=g, device="cuda")).to(torch.bfloat16)  # noqa: E731
xs = [r(1, H, N, D), r(1, HK, N, D), r(1, HI, N, DI), r(1, 1, N, DI), r(1, HI, N, std=(HI * DI) ** -0.5)]
lse = torch.zeros(1, H, N, device="cuda")
for _ in range(3):
    streamkl_gpu.indexer_kl(*xs, lse=lse, causal=True)
torch.cuda.synchronize()
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
for _ in range(20):
    streamkl_gpu.indexer_kl(*xs, lse=lse, causal=True)
b.record()
torch.cuda.synchronize()
print(f"back-to-back: {a.elapsed_time(b) / 20:.3f} ms/call (N={N}, warm L2)")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        streamkl_gpu.indexer_kl(*xs, lse=lse, causal=True)
    torch.cuda.synchronize()
rows = []
for ev in prof.key_averages():
    us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
    if us and ev.count:
        rows.append((us / 5e3, ev.count // 5, ev.key))
for ms, count, key in sorted(rows, reverse=True)[:10]:
    print(f"{ms:8.3f} ms/call  x{count}  {key[:100]}")
print(f"sum {sum(r[0] for r in rows):.3f} ms/call (N={N})")
