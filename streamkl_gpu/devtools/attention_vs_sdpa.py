"""``attention_kl`` against SDPA the way the attention-speed bounds are stated: SDPA in the same
process with the cuDNN backend pinned (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``) and its default
dispatch beside it; the forward, and forward + backward in setting 1 (gradients of q2, k2) and
setting 2 (q1, k1) against SDPA's forward + backward (q, k, v); every point's providers timed in
``rounds`` rounds whose order rotates (``rotated_timing.rotated_medians``: a fixed order biased the slots
by up to 10 % on an H100), medians. Forced forward variants (``--variant lazy_max``) are timed
beside the default through the forcing hook.

    python -m streamkl_gpu.devtools.attention_vs_sdpa --out FILE.csv
    python -m streamkl_gpu.devtools.attention_vs_sdpa --out FILE.csv --fwd-n 8192 --step-n 8192 --variant eager_max

One CSV row per (point, provider): gpu, timestamp, torch, triton, point, provider, median_ms,
rounds, over_cudnn (median / the pinned cuDNN's), run_status; the table on stdout. B = 1, H = 32,
D = 128, bf16 unless given. On a CPU (the interpreter; tests) the cuDNN provider is left out.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import sys

from streamkl_gpu.devtools.rotated_timing import rotated_medians, timer_for

SETTINGS = {1: (2, 3), 2: (0, 1)}  # setting -> the trained inputs of (q1, k1, q2, k2)


def _sdpa(q, k, v, causal, backend, grad_out=None):
    """SDPA's forward (``grad_out`` None) or forward + backward, under ``backend`` (None: the
    default dispatch)."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def call():
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return out if grad_out is None else torch.autograd.grad(out, (q, k, v), grad_out)
    return call


def points(fwd_ns, step_ns, variants=(), device="cuda", dtype=None, B=1, H=32, D=128, seed=0):
    """``{point name: {provider: callable}}``: ``fwd n=N causal=C`` (providers ``ours``, one
    ``ours_<variant>`` per forced forward variant, ``sdpa_cudnn``, ``sdpa_default``) and
    ``fwdbwd_sS n=N causal=C`` (``ours`` and the two SDPA providers' forward + backward)."""
    import torch
    from torch.nn.attention import SDPBackend

    import streamkl_gpu
    from streamkl_gpu._core.forcing import forcing

    dtype = dtype or torch.bfloat16
    backends = {"sdpa_default": None}
    if torch.device(device).type == "cuda":
        backends = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, **backends}
    out = {}
    for n in sorted(set(fwd_ns) | set(step_ns)):
        gen = torch.Generator(device=device).manual_seed(seed + n)
        q1, k1, q2, k2, v = (torch.randn(B, H, n, D, device=device, dtype=dtype, generator=gen) for _ in range(5))
        for causal in (False, True):
            if n in fwd_ns:
                group = out[f"fwd n={n} causal={int(causal)}"] = {}
                group["ours"] = lambda c=causal, xs=(q1, k1, q2, k2): streamkl_gpu.attention_kl(*xs, causal=c)

                def forced(name, c=causal, xs=(q1, k1, q2, k2)):
                    def call():
                        with forcing(attention_fwd_variant=name):
                            return streamkl_gpu.attention_kl(*xs, causal=c)
                    return call
                for name in variants:
                    group[f"ours_{name}"] = forced(name)
                for prov, be in backends.items():
                    group[prov] = _sdpa(q1, k1, v, causal, be)
            if n in step_ns:
                leaves = [t.clone().requires_grad_() for t in (q1, k1, v)]
                grad_out = torch.randn_like(q1)
                grad_kl = torch.randn(B, H, n, device=device)
                for setting, trained in SETTINGS.items():
                    xs = [t.clone().requires_grad_(i in trained) for i, t in enumerate((q1, k1, q2, k2))]

                    def step(c=causal, xs=xs, trained=trained, g=grad_kl):
                        kl = streamkl_gpu.attention_kl(*xs, causal=c)
                        return torch.autograd.grad(kl, [xs[i] for i in trained], g)
                    group = out[f"fwdbwd_s{setting} n={n} causal={int(causal)}"] = {"ours": step}
                    for prov, be in backends.items():
                        group[prov] = _sdpa(*leaves, causal, be, grad_out)
    return out


def measure(groups, rounds, timer):
    """``{point: {provider: median ms}}``: each point's providers by
    ``rotated_timing.rotated_medians`` (each once, compiles, then ``rounds`` rotated rounds)."""
    return {name: rotated_medians(fns, rounds, timer) for name, fns in groups.items()}


def rows(medians, rounds, gpu, torch_version, triton_version):
    """The CSV rows (dicts) of :func:`measure`'s medians."""
    ts = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = []
    for name, by_provider in medians.items():
        ref = by_provider.get("sdpa_cudnn")
        for prov, med in by_provider.items():
            out.append(dict(gpu=gpu, timestamp=ts, torch=torch_version, triton=triton_version, point=name,
                            provider=prov, median_ms=f"{med:.4f}", rounds=rounds,
                            over_cudnn=f"{med / ref:.4f}" if ref else "", run_status="ok"))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fwd-n", default="4096,8192,16384,32768,65536")
    ap.add_argument("--step-n", default="4096,8192,16384")
    ap.add_argument("--variant", action="append", default=[], help="a forced forward variant timed beside the default")
    a = ap.parse_args(argv)
    import torch
    import triton

    cuda = torch.cuda.is_available()
    ns = lambda s: tuple(int(x) for x in s.split(",") if x)
    groups = points(ns(a.fwd_n), ns(a.step_n), a.variant, device="cuda" if cuda else "cpu")
    table = rows(measure(groups, a.rounds, timer_for(cuda)), a.rounds, torch.cuda.get_device_name() if cuda else "cpu",
                 torch.__version__, triton.__version__)
    with open(a.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    for r in table:
        print(f"{r['point']:32s} {r['provider']:16s} {r['median_ms']:>10s} ms  {r['over_cudnn'] or '-':>7s}x cuDNN")
    return 0


if __name__ == "__main__":
    sys.exit(main())
