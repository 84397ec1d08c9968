"""Host cost of one indexer forward call (the API's default, lse given, causal, bf16): the wall
time per call at a size where the GPU's work is negligible (the host is the bottleneck), and a
cProfile of those calls (the top functions by own time), for the DSA-like or GQA-like config.

    python bench/idx_host_cost.py [gqa|dsa] [N] [calls]     # default gqa 256 300
"""
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import streamkl_gpu  # noqa: E402

cfg = sys.argv[1] if len(sys.argv) > 1 else "gqa"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 256
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 300
H, HK, D, HI, DI = (32, 8, 128, 16, 64) if cfg == "gqa" else (128, 1, 576, 64, 128)
g = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s, std=1.0: (std * torch.randn(s, generator=g, device="cuda")).to(torch.bfloat16)  # noqa: E731
xs = [r(1, H, N, D), r(1, HK, N, D), r(1, HI, N, DI), r(1, 1, N, DI), r(1, HI, N, std=(HI * DI) ** -0.5)]
lse = torch.zeros(1, H, N, device="cuda")
fn = lambda: streamkl_gpu.indexer_kl(*xs, lse=lse, causal=True)  # noqa: E731
for _ in range(10):
    fn()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(calls):
    fn()
host = (time.perf_counter() - t) / calls
torch.cuda.synchronize()
total = (time.perf_counter() - t) / calls
print(f"{cfg} N={N}: host {host * 1e6:.1f} us/call (enqueue), {total * 1e6:.1f} us/call with the GPU's drain")
prof = cProfile.Profile()
prof.enable()
for _ in range(calls):
    fn()
prof.disable()
torch.cuda.synchronize()
out = io.StringIO()
pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
print("\n".join(ln[:150] for ln in out.getvalue().splitlines()[:45]))
