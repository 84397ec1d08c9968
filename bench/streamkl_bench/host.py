"""Section ``host``: the host cost per call of streamkl_gpu.attention_kl.

    python bench/bench_gpu.py --sections host                  # default args: --profile
    PYTHONPATH=bench:. python -m streamkl_bench.host OUT_DIR [--profile]

Wall time of 1000 back-to-back calls at B=1, H=1, N_Q=1, N_K=64, D=64, bf16 (GPU time negligible),
per call, custom-op dispatch and autograd included: forward and forward+backward (setting 1), SDPA
at the same shape for scale, the autograd engine's floors, and the same calls through Triton's own
binder (``STREAMKL_FAST_LAUNCH=0``: what the direct launch saves; its forward must be bitwise the
same). ``--profile``: cProfile of 300 forward and 300 forward+backward calls, to
OUT_DIR/host_profile.txt. Rows: OUT_DIR/host_cost.csv (long format). (First calls: ``first_call``.)
"""

import contextlib
import csv
import os
import sys

from .timing import wall_us_per_call


def _rows_writer(out_dir, name):
    path = os.path.join(out_dir, name)
    new = not os.path.exists(path)
    f = open(path, "a", newline="")
    w = csv.DictWriter(f, fieldnames=["measure", "provider", "shape", "value", "unit", "note"])
    if new:
        w.writeheader()
    return f, w


@contextlib.contextmanager
def binder_launches():
    """Every launch inside goes through Triton's own ``kernel[grid]`` binder (no direct launch)."""
    saved = os.environ.get("STREAMKL_FAST_LAUNCH")
    os.environ["STREAMKL_FAST_LAUNCH"] = "0"
    try:
        yield
    finally:
        os.environ.pop("STREAMKL_FAST_LAUNCH") if saved is None else os.environ.update(STREAMKL_FAST_LAUNCH=saved)


def host_cost(out_dir, n_calls=1000, profile=False):
    import torch
    import torch.nn.functional as F

    import streamkl_gpu

    dev = "cuda"
    q = torch.randn(1, 1, 1, 64, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 1, 64, 64, device=dev, dtype=torch.bfloat16)
    q2 = q.clone().requires_grad_()
    k2 = k.clone().requires_grad_()

    def fwd():
        return streamkl_gpu.attention_kl(q, k, q, k)

    def fwd_bwd():
        streamkl_gpu.attention_kl(q, k, q2, k2).sum().backward()

    def sdpa():
        return F.scaled_dot_product_attention(q, k, k)

    qs, ks = q.clone().requires_grad_(), k.clone().requires_grad_()

    def sdpa_fwd_bwd():
        F.scaled_dot_product_attention(qs, ks, ks).sum().backward()

    # floors of the autograd engine on this host: a one-op C++ graph, and a Python Function
    # that does no work (what any custom-kernel loss pays for .sum().backward())
    x = q.clone().requires_grad_()

    def engine_floor():
        (x * 2.0).sum().backward()

    class _Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    def python_function_floor():
        _Identity.apply(x).sum().backward()

    def timed(fn, n):
        return wall_us_per_call(fn, n, cuda=True)

    results = {}
    for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd), ("sdpa_forward", sdpa),
                     ("sdpa_forward+backward", sdpa_fwd_bwd), ("engine_floor_one_op_fwd+bwd", engine_floor),
                     ("engine_floor_python_function_fwd+bwd", python_function_floor)):
        results[name] = timed(fn, n_calls)
    # the same calls through Triton's own launcher (no direct launch): what _fast_launch saves
    from streamkl_gpu._core import launcher as _fast_launch
    if _fast_launch.enabled():
        with binder_launches():
            results["forward [binder launch]"] = timed(fwd, n_calls)
            results["forward+backward [binder launch]"] = timed(fwd_bwd, n_calls)
        # the direct path must give the very same numbers as the binder path
        ref = fwd()
        with binder_launches():
            ref_binder = fwd()
        same = bool(torch.equal(ref, ref_binder))
        print(f"direct launch equals binder launch: {same}  (launches so far: {_fast_launch.STATS})", flush=True)
        results["direct_equals_binder"] = float(same)
    f, w = _rows_writer(out_dir, "host_cost.csv")
    for name, us in results.items():
        if name == "direct_equals_binder":
            w.writerow({"measure": "check", "provider": name, "shape": "B1 H1 NQ1 NK64 D64 bf16",
                        "value": int(us), "unit": "bool", "note": "torch.equal of the two forwards"})
            continue
        w.writerow({"measure": "host_us_per_call", "provider": name, "shape": "B1 H1 NQ1 NK64 D64 bf16",
                    "value": f"{us:.1f}", "unit": "us", "note": f"{n_calls} back-to-back calls"})
    f.close()
    for name, us in results.items():
        print(f"host cost {name:30s} {us:8.1f} us/call", flush=True)
    if profile:
        import cProfile
        import io
        import pstats

        buf = io.StringIO()
        for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(300):
                fn()
            torch.cuda.synchronize()
            pr.disable()
            for sort in ("tottime", "cumulative"):
                buf.write(f"\n===== {name}: 300 calls, sorted by {sort} =====\n")
                pstats.Stats(pr, stream=buf).sort_stats(sort).print_stats(35)
        with open(os.path.join(out_dir, "host_profile.txt"), "w") as fh:
            fh.write(buf.getvalue())
    return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out_dir = argv[0] if argv else "."
    os.makedirs(out_dir, exist_ok=True)
    host_cost(out_dir, profile="--profile" in argv)


if __name__ == "__main__":
    main()
