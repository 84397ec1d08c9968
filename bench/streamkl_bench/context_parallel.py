"""Section ``cp``: context parallel attention KL (streamkl_gpu.distributed) at a world of one.

    python bench/bench_gpu.py --sections cp
    PYTHONPATH=bench:. python -m streamkl_bench.context_parallel OUT_DIR --device cpu --tiny   # CPU smoke (gloo)

It starts a 1-rank group itself (NCCL on the GPU, gloo on CPU; MASTER_ADDR=127.0.0.1, a free port)
and checks distributed.attention_kl with W = 1 against streamkl_gpu.attention_kl (bf16, causal and
not, both layouts, forward and all four gradients at 8K, H=8, H_K1=2, D1=128, D2=64: max relative
difference of the KL <= 1e-3, of the gradients <= 1e-2), then times both at 32K (setting 1,
causal: the distributed path's overhead at W = 1; slowest rank, CUDA events, median of --reps
after a warm-up step; peak extra memory; bytes handed to the collectives from
``distributed.comm_log()``). The program on W GPUs under torchrun (correctness at 32K against one
GPU, scaling to 1M tokens) was removed from the suite before its multi-GPU run was made (see
docs/distributed.md); restore it with ``git show b7066de:bench/context_parallel_gpu.py``.
Outputs in OUT_DIR: context_parallel_check.csv, context_parallel_scaling.csv,
context_parallel_summary.txt (the table printed last), context_parallel.log.
Exit status: 0 all checks pass; 1 otherwise.

NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set here before torch.distributed initialises.
"""
from __future__ import annotations

import os
import sys

for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_var] = _val
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import streamkl_gpu  # noqa: E402
from streamkl_gpu import distributed  # noqa: E402

from .timing import event_ms, time_ms  # noqa: E402

KL_TOL = 1e-3  # max relative difference of the fp32 KL, distributed vs one GPU (summation order)
GRAD_TOL = 1e-2  # the same for bf16 gradients
GRADS = ("dq1", "dk1", "dq2", "dk2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=os.environ.get("OUT") or "cp_out", help="output directory")
    p.add_argument("--reps", type=int, default=3, help="timed steps per point (after one warm-up step)")
    p.add_argument("--budget-s", type=float, default=540.0, help="accepted for the suite's time limit (unused)")
    p.add_argument("--autotune", action="store_true",
                   help="let streamkl_gpu time its launch candidates (default off: the first candidate per "
                        "shape class, the same rule for the single-GPU baseline; tuning at 512K costs minutes)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo + the Triton interpreter (smoke test of the script; use --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    a = p.parse_args(argv)
    a.out = a.out or "cp_out"  # an unset $OUT arrives as ""
    return a


# Process group

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(args):
    if "WORLD_SIZE" not in os.environ:  # a world of one, started here
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 eager reference is strict fp32
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=15), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=15))
    return device, dist.get_rank(), dist.get_world_size()


class Ctx:
    def __init__(self, args, device, rank, world):
        self.args, self.device, self.rank, self.world = args, device, rank, world
        self.t0 = time.monotonic()
        self.check_rows, self.scale_rows, self.failures = [], [], []
        os.makedirs(args.out, exist_ok=True)
        self.logf = open(os.path.join(args.out, "context_parallel.log"), "a") if rank == 0 else None
        self.meta = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
                     "ranks": world, "torch": torch.__version__, "date": datetime.datetime.now(
                         datetime.timezone.utc).isoformat(timespec="seconds")}
        import triton
        self.meta["triton"] = triton.__version__

    def log(self, msg):
        if self.rank == 0:
            line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
            print(line, flush=True)
            self.logf.write(line + "\n")
            self.logf.flush()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def all_max(self, values):
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def all_sum(self, values):
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()



# Inputs

def full_inputs(ctx, shape, dtype, seed):
    """Whole-sequence inputs and upstream gradient, identical on every rank (same seed)."""
    B, H, HK1, HK2, N, D1, D2 = shape
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    shapes = [(B, H, N, D1), (B, HK1, N, D1), (B, H, N, D2), (B, HK2, N, D2)]
    xs = [torch.randn(s, generator=gen, device=ctx.device, dtype=torch.float32).to(dtype) for s in shapes]
    g = torch.rand((B, H, N), generator=gen, device=ctx.device)
    return xs, g


def leaves(xs, train):
    return [x.detach().clone().requires_grad_(t) for x, t in zip(xs, train)]


# Section: world of one (one GPU)

def sec_world1(ctx):
    a = ctx.args
    shape = (1, 2, 1, 2, 48, 16, 16) if a.tiny else (1, 8, 2, 8, 8192, 128, 64)
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    for layout in distributed.LAYOUTS:
        for causal in (True, False):
            xs, g = full_inputs(ctx, shape, dtype, seed=11)
            ref_in = leaves(xs, (True,) * 4)
            ref = streamkl_gpu.attention_kl(*ref_in, causal=causal)
            (ref * g).sum().backward()
            ours_in = leaves(xs, (True,) * 4)
            ours = distributed.attention_kl(*ours_in, causal=causal, layout=layout)
            (ours * g).sum().backward()
            ctx.sync()
            case = f"world1 {layout} {'causal' if causal else 'full'} N={shape[4]}"
            record_max_rel(ctx, case, "kl", ours, ref, KL_TOL, dtype)
            for name, x, r in zip(GRADS, ours_in, ref_in):
                record_max_rel(ctx, case, name, x.grad, r.grad, GRAD_TOL, dtype)
            del xs, g, ref_in, ours_in, ref, ours
    # the distributed path's overhead at W = 1 (metadata check, key copies), setting 1, causal
    shape = (1, 2, 2, 2, 64, 16, 16) if a.tiny else (1, 32, 32, 32, 32768, 128, 128)
    xs, _ = full_inputs(ctx, shape, dtype, seed=12)
    for name, f in (("single", lambda ins: streamkl_gpu.attention_kl(*ins, causal=True)),
                    ("cp zigzag", lambda ins: distributed.attention_kl(*ins, causal=True, layout="zigzag")),
                    ("cp contiguous", lambda ins: distributed.attention_kl(*ins, causal=True, layout="contiguous"))):
        res = time_steps(ctx, f, xs, (False, False, True, True))
        scale_row(ctx, shape, dtype, "world1-overhead", name, res, None, None)


def record_max_rel(ctx, case, name, ours, ref, tol, dtype):
    """Max relative difference, max |ours - ref| / max |ref|, over the whole tensor (all ranks)."""
    d = ours.detach().double() - ref.detach().double()
    diff, scale = ctx.all_max([d.abs().max().item(), ref.detach().double().abs().max().item()])
    sq = ctx.all_sum([d.square().sum().item(), ref.detach().double().square().sum().item()])
    err = diff / max(scale, 1e-30)
    ok = err <= tol  # (NaN fails)
    ctx.check_rows.append(dict(case=case, dtype=str(dtype).replace("torch.", ""), quantity=name,
                               metric="max_rel_diff_vs_single_gpu", error=err, tolerance=tol, ok=ok,
                               rel_frobenius=math.sqrt(sq[0]) / max(math.sqrt(sq[1]), 1e-300)))
    if not ok:
        ctx.failures.append(f"{case} {name}: {err:.2e} > {tol:.0e}")
    ctx.log(f"  {case:<34} {name:<4} max rel diff {err:.2e} (tol {tol:.0e}) {'ok' if ok else 'FAIL'}")


# Section: scaling

def time_steps(ctx, f, xs, train, reps=None, with_bwd=True):
    """Forward and forward+backward time per step (slowest rank; median over reps), peak memory
    per rank (max over ranks), and the collectives' bytes of one forward+backward."""
    reps = reps or ctx.args.reps
    res = {}
    for mode in ("fwd", "fwd+bwd") if with_bwd else ("fwd",):
        times = []
        for it in range(reps + 2):  # step 0 warms up (compiles); 1..reps are timed; the last measures memory
            ins = leaves(xs, train)
            dist.barrier()
            ctx.sync()
            if it == reps + 1:
                if ctx.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                base = torch.cuda.memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
                distributed.reset_comm_log()

            def step():
                kl = f(ins)
                if mode == "fwd+bwd":
                    kl.backward(torch.ones_like(kl))
            ms = event_ms(step, 1)[0] if ctx.device.type == "cuda" else time_ms(step, cuda=False)
            ms = ctx.all_max([ms])[0]
            if it == reps + 1:  # a separate step for memory: peak and bytes of exactly one step
                peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
                res[mode + " peak_extra_gib"], res[mode + " peak_gib"] = ctx.all_max(
                    [max(peak - base, 0) / 2**30, peak / 2**30])
                log = distributed.comm_log()
                res[mode + " bytes_sent"] = sum(b for op, _, b in log if not op.startswith("check"))
                res[mode + " check_bytes"] = sum(b for op, _, b in log if op.startswith("check"))
            elif it > 0:
                times.append(ms)
            del ins
        res[mode + " ms"] = statistics.median(times)
    return res


def scale_row(ctx, shape, dtype, section, provider, res, world, formula_by_mode):
    B, H, HK1, HK2, N, D1, D2 = shape
    for mode in ("fwd", "fwd+bwd"):
        if mode + " ms" not in res:
            continue
        row = dict(section=section, provider=provider, world=world or 1, mode=mode, n=N, b=B, h=H, hk1=HK1,
                   hk2=HK2, d1=D1, d2=D2, dtype=str(dtype).replace("torch.", ""), setting=1, causal=1,
                   layout=provider.split()[1] if provider.startswith("cp") else "",
                   ms_per_step=res[mode + " ms"], peak_extra_gib_per_rank=res.get(mode + " peak_extra_gib"),
                   peak_gib_per_rank=res.get(mode + " peak_gib"),
                   bytes_sent_per_rank=res.get(mode + " bytes_sent"),
                   bytes_sent_formula=(formula_by_mode or {}).get(mode), check_bytes=res.get(mode + " check_bytes"),
                   status="ok")
        ctx.scale_rows.append(row)
        ctx.log(f"  {section} {provider:<14} N={N:>8} {mode:<8} {row['ms_per_step']:10.2f} ms/step  "
                f"peak +{row['peak_extra_gib_per_rank'] or 0:6.2f} GiB  sent {row['bytes_sent_per_rank']} B"
                + (f" (formula {row['bytes_sent_formula']})" if formula_by_mode else ""))


# Output

def write_outputs(ctx, final=True):
    """CSVs and the summary (after every section, so a run killed at the time limit keeps them)."""
    if ctx.rank != 0:
        return
    for name, rows in (("context_parallel_check.csv", ctx.check_rows), ("context_parallel_scaling.csv", ctx.scale_rows)):
        if rows:
            keys = list(dict.fromkeys(k for r in rows for k in r)) + list(ctx.meta)
            with open(os.path.join(ctx.args.out, name), "w", newline="") as fh:
                wr = csv.DictWriter(fh, fieldnames=keys)
                wr.writeheader()
                wr.writerows({**r, **ctx.meta} for r in rows)
    lines = [f"context parallel attention_kl: W = {ctx.world} on {ctx.meta['gpu']} (torch {ctx.meta['torch']}, "
             f"triton {ctx.meta['triton']}), {ctx.meta['date']}",
             f"correctness: {sum(r['ok'] for r in ctx.check_rows)}/{len(ctx.check_rows)} ok",
             f"{'section':<16} {'provider':<14} {'N':>8} {'mode':<8} {'ms/step':>10} {'peak+GiB':>8} {'sent MiB':>9}"]
    for r in ctx.scale_rows:
        sent = "" if r["bytes_sent_per_rank"] is None else f"{r['bytes_sent_per_rank'] / 2**20:.1f}"
        lines.append(f"{r['section']:<16} {r['provider']:<14} {r['n']:>8} {r['mode']:<8} {r['ms_per_step']:10.2f} "
                     f"{r['peak_extra_gib_per_rank'] or 0:8.2f} {sent:>9}")
    lines.append("FAILURES: " + "; ".join(ctx.failures) if ctx.failures else "all checks passed")
    with open(os.path.join(ctx.args.out, "context_parallel_summary.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    if final:
        print("\n".join(lines), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.autotune:
        os.environ["STREAMKL_AUTOTUNE"] = "0"
    device, rank, world = init(args)
    ctx = Ctx(args, device, rank, world)
    sections = ["world1"]
    ctx.log(f"W={world} sections={sections} env NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} "
            f"TORCH_SYMM_MEM_DISABLE_MULTICAST={os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST']} "
            f"NVSHMEM_DISABLE_NVLS={os.environ['NVSHMEM_DISABLE_NVLS']} autotune={args.autotune}")
    status = 0
    for sec in sections:
        ctx.log(f"section {sec}")
        try:
            sec_world1(ctx)
        except Exception:  # noqa: BLE001 (recorded; the other ranks raise too or time out)
            ctx.failures.append(f"section {sec} raised: {traceback.format_exc().splitlines()[-1]}")
            ctx.log(traceback.format_exc())
            status = 1
            break
        write_outputs(ctx, final=False)
    write_outputs(ctx)
    dist.destroy_process_group()
    return 1 if (status or ctx.failures) else 0


if __name__ == "__main__":
    sys.exit(main())
