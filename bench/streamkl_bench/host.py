"""Section ``host``: the host cost per call of streamkl_gpu.attention_kl, against SDPA's.

    python bench/bench_gpu.py --sections host       # default args: --profile
    PYTHONPATH=bench:. python -m streamkl_bench.host OUT_DIR [--profile] [--rounds 151] [--calls 25] [--device cpu]

B=1, H=1, N_Q=1, N_K=64, D=64, bf16. Each case runs ``--calls`` times back to back in each of ``--rounds`` rounds,
the order rotated every round (``devtools.rotated_timing``): a figure is the median of its round means, a ratio
to SDPA the median of the per-round ratios. Short blocks and many rounds put a host's slow spells on both steps
alike (bench/results/2026-12-07_h100_7c05c1e/ and its env.json). Cases, ours and SDPA's: the forward, with
grad-requiring inputs too; the step ``loss.sum().backward()``, gradients accumulating or set to None first, or with
autograd's multithreading off (the backward on the calling thread); the backward alone (``retain_graph``); the
engine's floors (a one-op graph; a Python Function of our form that only allocates). Then the forward and step
through Triton's binder (``STREAMKL_FAST_LAUNCH=0``; the forward must be bitwise the same). Rows:
OUT_DIR/host_cost.csv; ``--profile``: cProfile to host_profile.txt; ``--device cpu``: smoke.
"""

import argparse
import csv
import os
import statistics
from unittest import mock

SHAPE = "B1 H1 NQ1 NK64 D64 bf16"
STEP_NONE, STEP_ONE = "forward+backward [grads set to None]", "forward+backward [backward on the calling thread]"
PAIRS = (("forward", "sdpa_forward"), ("forward [grad inputs]", "sdpa_forward [grad inputs]"),  # (ours, SDPA's)
         ("forward+backward", "sdpa_forward+backward"), (STEP_NONE, "sdpa_" + STEP_NONE),
         (STEP_ONE, "sdpa_" + STEP_ONE), ("backward [one graph]", "sdpa_backward [one graph]"))


def _cases(device):
    """The timed cases in their order, ``{name: fn}``."""
    import torch
    import torch.nn.functional as F

    from streamkl_gpu import attention_kl

    q = torch.randn(1, 1, 1, 64, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 1, 64, 64, device=device, dtype=torch.bfloat16)
    q2, k2, qs, ks, x = (t.clone().requires_grad_() for t in (q, k, q, k, q))
    four = [t.clone().requires_grad_(i >= 2) for i, t in enumerate((q, k, q, k))]
    fresh = [t.detach().requires_grad_() for t in (q2, k2, qs, ks)]
    kl_graph = attention_kl(q, k, fresh[0], fresh[1]).sum()  # differentiated again and again
    sdpa_graph = F.scaled_dot_product_attention(fresh[2], fresh[3], fresh[3]).sum()

    class _FourInTwoOut(torch.autograd.Function):  # attention_kl's form; launches nothing, allocates
        @staticmethod
        def forward(ctx, a, b, c, d, opts):
            out = a.new_empty(a.shape[:3], dtype=torch.float32)
            ctx.save_for_backward(a, b, c, d, out)
            return out

        @staticmethod
        def backward(ctx, g):
            return None, None, *(torch.empty_like(t) for t in ctx.saved_tensors[2:4]), None

    grads_none = lambda *ts: [setattr(t, "grad", None) for t in ts]  # noqa: E731
    kl_step = lambda: attention_kl(q, k, q2, k2).sum().backward()  # noqa: E731
    sdpa_step = lambda: F.scaled_dot_product_attention(qs, ks, ks).sum().backward()  # noqa: E731

    def one_thread(step):  # the engine runs a CUDA graph's backward on its device thread; here on the caller's
        def call():
            with torch.autograd.set_multithreading_enabled(False):
                step()
        return call
    return {
        "forward": lambda: attention_kl(q, k, q, k),
        "sdpa_forward": lambda: F.scaled_dot_product_attention(q, k, k),
        "forward [grad inputs]": lambda: attention_kl(q, k, q2, k2),
        "sdpa_forward [grad inputs]": lambda: F.scaled_dot_product_attention(qs, ks, ks),
        "forward+backward": kl_step,
        "sdpa_forward+backward": sdpa_step,
        STEP_NONE: lambda: (grads_none(q2, k2), kl_step()),
        "sdpa_" + STEP_NONE: lambda: (grads_none(qs, ks), sdpa_step()),
        STEP_ONE: one_thread(kl_step), "sdpa_" + STEP_ONE: one_thread(sdpa_step),
        "backward [one graph]": lambda: kl_graph.backward(retain_graph=True),
        "sdpa_backward [one graph]": lambda: sdpa_graph.backward(retain_graph=True),
        "engine_floor_one_op_fwd+bwd": lambda: (x * 2.0).sum().backward(),
        "engine_floor_python_function_4in_2grads_fwd+bwd": lambda: _FourInTwoOut.apply(*four, None).sum().backward(),
    }


def host_cost(out_dir, rounds=151, calls=25, warmup=250, profile=False, device=None):
    import torch

    from streamkl_gpu._core import launcher
    from streamkl_gpu.devtools.rotated_timing import rotated_samples

    from .timing import wall_us_per_call

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cases = _cases(device)
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    timer = lambda fn: wall_us_per_call(fn, calls, cuda=device == "cuda", warm=0)  # noqa: E731
    per_round = rotated_samples(cases, rounds, timer)
    binder_same = None  # the direct launch's forward equals the binder's (not under the interpreter)
    if launcher.enabled():  # what the direct launch saves
        ref = cases["forward"]()
        with mock.patch.dict(os.environ, STREAMKL_FAST_LAUNCH="0"):  # Triton's own binder
            per_round.update({n + " [binder launch]": v for n, v in rotated_samples(
                {n: cases[n] for n in ("forward", "forward+backward")}, rounds, timer).items()})
            binder_same = bool(torch.equal(ref, cases["forward"]()))
    note = f"median of {rounds} rotated rounds of {calls} calls"
    rows = [("host_us_per_call", n, statistics.median(v), "us", f"{note}; the rounds: " + ";".join(f"{t:.1f}" for t in v))
            for n, v in per_round.items()]
    for ours, sdpa in PAIRS:
        r = [a / b for a, b in zip(per_round[ours], per_round[sdpa])]
        rows.append(("host_ratio_to_sdpa", ours, statistics.median(r), "x",
                     f"median of the per-round ratios {ours} / {sdpa}; " + ";".join(f"{v:.3f}" for v in r)))
    if binder_same is not None:
        rows.append(("check", "direct_equals_binder", int(binder_same), "bool", "torch.equal of the two forwards"))
    path = os.path.join(out_dir, "host_cost.csv")
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["measure", "provider", "shape", "value", "unit", "note", "run_status"])
        for measure, provider, value, unit, row_note in rows:
            shown = value if unit == "bool" else f"{value:.4g}" if unit == "x" else f"{value:.1f}"
            w.writerow([measure, provider, SHAPE, shown, unit, row_note, "failed(check)" if unit == "bool" and not value else "ok"])
            print(f"host {measure:18s} {provider:50s} {value:9.3f} {unit}", flush=True)
    if profile:
        import cProfile
        import io
        import pstats

        buf = io.StringIO()
        for name in ("forward", STEP_NONE):
            with cProfile.Profile() as pr:
                for _ in range(300):
                    cases[name]()
                sync()
            for sort in ("tottime", "cumulative"):
                buf.write(f"\n===== {name}: 300 calls, sorted by {sort} =====\n")
                pstats.Stats(pr, stream=buf).sort_stats(sort).print_stats(35)
        open(os.path.join(out_dir, "host_profile.txt"), "w").write(buf.getvalue())
    return {(measure, provider): value for measure, provider, value, _, _ in rows}


def main(argv=None):
    p = argparse.ArgumentParser(description="host cost per call against SDPA's")
    p.add_argument("out_dir", nargs="?", default=".")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rounds", type=int, default=151)
    p.add_argument("--calls", type=int, default=25, help="calls of each case per round")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    a = p.parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before streamkl_gpu is imported
    os.makedirs(a.out_dir, exist_ok=True)
    host_cost(a.out_dir, a.rounds, a.calls, min(300, 10 * a.calls), a.profile, a.device)  # warm-up: 10 rounds' calls


if __name__ == "__main__":
    main()
