"""The GQA-like indexer forward (API default, lse given, causal, bf16) timed two ways in one
process, with the matmul floor's bf16 rate measured the same two ways: triton.testing.do_bench
(L2 flushed before each call, the host enqueueing ahead of the GPU: the host's per-call work hides
under the GPU's) and one call at a time (an event pair around each call, synchronised after it:
the host's work before the first kernel counts). N = 8192 (default) and more.

    python bench/idx_gqa_dobench.py [N ...]
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import streamkl_gpu  # noqa: E402

H, HK, D, HI, DI = 32, 8, 128, 16, 64


def one_at_a_time(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


n = 8192
x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
rate_db = 2 * n ** 3 / (do_bench(lambda: x @ y, warmup=50, rep=300) * 1e-3)
rate_1 = 2 * n ** 3 / (one_at_a_time(lambda: x @ y) * 1e-3)
print(f"bf16 8192^3 matmul: do_bench {rate_db / 1e12:.0f} TFLOP/s, one at a time {rate_1 / 1e12:.0f} TFLOP/s")
del x, y
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
for N in [int(a) for a in sys.argv[1:]] or [8192]:
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, std=1.0: (std * torch.randn(s, generator=g, device="cuda")).to(torch.bfloat16)  # noqa: E731
    xs = [r(1, H, N, D), r(1, HK, N, D), r(1, HI, N, DI), r(1, 1, N, DI), r(1, HI, N, std=(HI * DI) ** -0.5)]
    # real teacher LSEs (PyTorch, per head chunk)
    lse = torch.empty(1, H, N, device="cuda")
    mask = torch.ones(N, N, dtype=torch.bool, device="cuda").tril()
    for h in range(H):
        s = (xs[0][:, h].float() @ xs[1][:, h // (H // HK)].float().transpose(-1, -2)) * D ** -0.5
        lse[:, h] = s.masked_fill(~mask, float("-inf")).logsumexp(-1)
    del s, mask
    fn = lambda: streamkl_gpu.indexer_kl(*xs, lse=lse, causal=True)  # noqa: E731
    flops = 2 * (H * D + HI * DI) * N * N * 0.5
    t_db = do_bench(fn, warmup=25, rep=200)
    t_1 = one_at_a_time(fn)
    print(f"gqa N={N}: do_bench {t_db:.3f} ms = {t_db / (flops / rate_db * 1e3):.2f}x the floor "
          f"(do_bench rate); one at a time {t_1:.3f} ms = {t_1 / (flops / rate_1 * 1e3):.2f}x (its rate)")
