#!/usr/bin/env python3
"""Which kernel of the indexer's "store" and "chunk" designs faults on the GPU (issue 10).

    python bench/idx_fault_gpu.py OUT                 # one H200: ~40 s of steps (8 at once), <= 90 s more
                                                      # for memcheck of a fault; section limit 240 s
    TRITON_INTERPRET=1 python bench/idx_fault_gpu.py /tmp/x --tiny   # CPU smoke (interpreter)

Runs s6r3 and s6r4 saw "illegal memory access" from the chunk design (STREAMKL_INDEXER_PSTORE=chunk:
the storing forward ``_indexer_pacc._indexer_fwd_pstore_kernel`` per chunk of tokens, then the
teacher-free dq kernel reading the stored p, ``_indexer_bwd._indexer_bwd_dq_kernel`` with
P_SAVED and DK_SHARE) at N=192, DSA-like, bf16, causal. Neither kernel had run alone on a GPU
before. Under the bounds-checked interpreter the same launch plan (heads, tiles, TMA, chunks)
stays inside its tensors (tests/test_interpreter_bounds.py), so the fault is in something the
interpreter does not model. This script runs each kernel alone and in the design, each step in
its own process with CUDA_LAUNCH_BLOCKING=1 (a fault poisons its process's context, not the
others'), with TMA descriptor loads and with pointer loads (STREAMKL_INDEXER_TMA=0):

  control-fwd           the plain forward on the storing forward's tile (ran on the H200, s6r4)
  control-dqk           the accumulating design's dqk student backward (ran on the H200, s6r4)
  store-fwd-keys[-ptr]  the storing forward alone, keys-major tile (128,128,128,64,4,3, 'keys')
  store-fwd-rows        the storing forward alone, the row-major tile (128,128,128,64,4,3)
  store-bwd[-ptr]       the student backward reading a p made by PyTorch (P_SAVED, no DK_SHARE)
  chunk[-ptr]           the chunk design (idx_chunk._forward_full): both kernels per chunk
  chunk-s2              the chunk design, its storing forward on 2 pipeline stages
  store-fwd-keys-w8, chunk-w8   the storing forward on 8 warps (alone; in the design): triton 3.6+
                        has reports of several-dot wgmma kernels faulting at 4 warps on sm_90
                        (triton-lang/triton#10486, #11366, #10573)

Each step that runs is checked against float64 (streamkl_ref: loss, and p or the gradients;
FlashAttention's rule, error <= 3 x the bf16 form's + 1e-2). If compute-sanitizer is on the
machine, the first faulting step is run again under its memcheck (the kernel, the faulting
address and the instruction). Outputs in OUT: idx_fault.csv (long format: measure, provider,
shape, value, unit, note), idx_fault.log; the short table last.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("STREAMKL_TUNING_CACHE", "0")
os.environ["STREAMKL_AUTOTUNE"] = "0"
os.environ.setdefault("STREAMKL_INDEXER_PACC", "1")

COLUMNS = ["measure", "provider", "shape", "value", "unit", "note"]
DSA = dict(H=128, HK=1, D=576, HI=64, HKI=1, DI=128, scale=192 ** -0.5)
TINY = dict(H=8, HK=1, D=32, HI=4, HKI=1, DI=16, scale=None)
STORE_KEYS = (128, 128, 128, 64, 4, 3, None, 1, "keys")
STORE_ROWS = (128, 128, 128, 64, 4, 3)
STUDENT_BWD = (128, 128, 64, 64, 8, 2)
# step -> (what runs, storing forward's config, TMA loads)
STEPS = {
    # controls: the same sizes through kernels that ran on the H200 (s6r4): the plain forward with
    # the storing forward's tile, and the accumulating design's student backward (dqk: the dq
    # kernel with DK_SHARE, p = 0). If these fault too, the machine or the build is at fault.
    "control-fwd": ("plain-fwd", STORE_KEYS, True),
    "control-dqk": ("dqk-bwd", None, True),
    "store-fwd-keys": ("store-fwd", STORE_KEYS, True),
    "store-fwd-keys-ptr": ("store-fwd", STORE_KEYS, False),
    "store-fwd-rows": ("store-fwd", STORE_ROWS, True),
    "store-bwd": ("store-bwd", None, True),
    "store-bwd-ptr": ("store-bwd", None, False),
    "chunk": ("chunk", STORE_KEYS, True),
    "chunk-ptr": ("chunk", STORE_KEYS, False),
    "chunk-s2": ("chunk", STORE_KEYS[:5] + (2,) + STORE_KEYS[6:], True),
    # 8 warps: triton 3.6+ has reports of wgmma kernels with several dots faulting at 4 warps on
    # sm_90 (triton-lang/triton#10486, #11366, #10573; "Invalid __shared__ read" under memcheck)
    "store-fwd-keys-w8": ("store-fwd", STORE_KEYS[:4] + (8,) + STORE_KEYS[5:], True),
    "chunk-w8": ("chunk", STORE_KEYS[:4] + (8,) + STORE_KEYS[5:], True),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--tiny", action="store_true", help="CPU smoke (TRITON_INTERPRET=1)")
    p.add_argument("--steps", default=",".join(STEPS), help="comma-separated steps (default: all)")
    p.add_argument("--n", type=int, default=None, help="tokens (default 192, the failing size; --tiny 24)")
    p.add_argument("--step-s", type=float, default=75.0, help="seconds per step process at most")
    p.add_argument("--sanitizer-s", type=float, default=90.0, help="seconds for the memcheck rerun at most")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--step", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.n = a.n or (24 if a.tiny else 192)
    return a


# ----------------------------------------------------------------------------------------------
# one step (a child process)
# ----------------------------------------------------------------------------------------------

def run_step(name, tiny, N):
    """Run one step; print ``RESULT quantity err tol`` lines (the parent parses them)."""
    import numpy as np
    import torch

    what, fwd_cfg, tma = STEPS[name]
    if not tma:
        os.environ["STREAMKL_INDEXER_TMA"] = "0"
    import streamkl_ref
    from streamkl_gpu.indexer import api as idx_api
    from streamkl_gpu.indexer.training import chunk as idx_chunk
    from streamkl_gpu.indexer import configs as idx_configs
    from streamkl_gpu.indexer import host as idx_host
    from streamkl_gpu.indexer.training import store as idx_store
    from streamkl_gpu._core import runtime as _runtime
    from streamkl_ref.testing import relative_error as rel_err

    torch.set_num_threads(1)
    if tiny:  # the interpreter: TMA as the step says, every launch bounds-checked
        from streamkl_gpu.devtools import bounds as _interpreter_bounds

        _interpreter_bounds.install()
        _runtime.INTERPRETER_TMA = tma
    orig = idx_configs._candidates
    plans = {"pstore": [fwd_cfg] if fwd_cfg else None, "fwd": [fwd_cfg] if what == "plain-fwd" else None,
             "bwd": [STUDENT_BWD]}
    idx_configs._candidates = lambda kind, ieee, dims=None, n_sm=132, **kw: (
        plans.get(kind) or orig(kind, ieee, dims, n_sm, **kw))
    if tiny:
        idx_chunk.PCHUNK_TOKENS = 8  # several chunks at the smoke's size
    cfg = TINY if tiny else DSA
    device = "cpu" if tiny else "cuda"
    dtype = torch.float16 if tiny else torch.bfloat16  # the interpreter's bf16 dot is wrong
    gen = torch.Generator().manual_seed(2)
    rnd = lambda *s, std=1.0: (std * torch.randn(s, generator=gen)).to(dtype)  # noqa: E731
    xs = [rnd(1, cfg["H"], N, cfg["D"]), rnd(1, cfg["HK"], N, cfg["D"]), rnd(1, cfg["HI"], N, cfg["DI"]),
          rnd(1, cfg["HKI"], N, cfg["DI"]), rnd(1, cfg["HI"], N, std=(cfg["HI"] * cfg["DI"]) ** -0.5)]
    scale = cfg["scale"] if cfg["scale"] is not None else cfg["D"] ** -0.5
    kw = dict(causal=True, scale=scale)
    x64 = [x.double().numpy() for x in xs]
    kl_ref, lse_idx_ref, lse_t = streamkl_ref.indexer_kl(*x64, return_lse=True, **kw)
    grads_ref = streamkl_ref.indexer_kl_grad(*x64, np.ones_like(kl_ref), **kw)
    # the same math at the inputs' precision (the tolerance's scale): the materialised form
    same = [x.clone().requires_grad_(r) for x, r in zip(xs, (False, False, True, True, True))]
    same_kl = idx_api.indexer_kl_naive(*same, compute_dtype=dtype, **kw)
    same_grads = torch.autograd.grad(same_kl.sum(), same[2:])

    def report(quantity, got, ref, base):
        tol = 3.0 * (base if math.isfinite(base) else 0.0) + 1e-2
        print(f"RESULT {quantity} {rel_err(got, ref):.3e} {tol:.3e}", flush=True)

    dev = [x.to(device) for x in xs]
    lse = torch.from_numpy(lse_t).float().to(device)
    if what == "plain-fwd":
        kl, lse_idx = idx_host._forward(*dev, lse, True, scale, True)[:2]
        torch.cuda.synchronize() if device == "cuda" else None
        report("loss", kl.sum(), kl_ref.sum(), rel_err(same_kl.sum(), kl_ref.sum()))
        report("lse_idx", lse_idx, lse_idx_ref, 0.0)
    elif what == "dqk-bwd":  # the student's share alone (p = 0): g softmax(I)'s contractions
        os.environ["STREAMKL_INDEXER_BWD"] = "dqk"
        g = torch.ones(1, N, device=device)
        lse_idx = torch.from_numpy(lse_idx_ref).float().to(device)
        zero = torch.zeros((), device=device)
        parts = (zero, torch.zeros(1, cfg["HI"], N, cfg["DI"], device=device),
                 torch.zeros(1, cfg["HKI"], N, cfg["DI"], device=device), torch.zeros(1, cfg["HI"], N, device=device))
        grads = idx_host._backward(g, *dev, lse_idx, lse_idx, True, scale, True, target_part=parts)
        torch.cuda.synchronize() if device == "cuda" else None
        for gname, got, want, s in zip(("dq_idx", "dk_idx", "dweights"), grads, _student_share(x64), same_grads):
            report(gname, got, want, rel_err(s, grads_ref[gname]))
    elif what == "store-fwd":
        total, lse_idx, p = idx_store._forward_pstore(*dev, lse, True, scale, True)
        torch.cuda.synchronize() if device == "cuda" else None
        report("loss", total, kl_ref.sum(), rel_err(same_kl.sum(), kl_ref.sum()))
        report("lse_idx", lse_idx, lse_idx_ref, 0.0)
        p64 = _target(x64, scale)
        visible = np.tril(np.ones((N, N), dtype=bool))[None]
        report("p (visible)", p.cpu().double().numpy()[visible], p64[visible], 0.0)
    elif what == "store-bwd":
        p = torch.from_numpy(_target(x64, scale)).float().to(device)
        g = torch.ones(1, N, device=device)
        lse_idx = torch.from_numpy(lse_idx_ref).float().to(device)
        grads = idx_host._backward(g, *dev, None, lse_idx, True, scale, True, p_saved=p)
        torch.cuda.synchronize() if device == "cuda" else None
        for gname, got, s in zip(("dq_idx", "dk_idx", "dweights"), grads, same_grads):
            report(gname, got, grads_ref[gname], rel_err(s, grads_ref[gname]))
    else:  # the chunk design: the forward with the gradient of the sum (g = 1)
        total, lse_idx, dq1, dk1, dw1 = idx_chunk._forward_full(*dev, lse, True, scale, True)
        torch.cuda.synchronize() if device == "cuda" else None
        report("loss", total, kl_ref.sum(), rel_err(same_kl.sum(), kl_ref.sum()))
        for gname, got, s in zip(("dq_idx", "dk_idx", "dweights"), (dq1, dk1, dw1), same_grads):
            report(gname, got, grads_ref[gname], rel_err(s, grads_ref[gname]))
    print("DONE", flush=True)


def _student_share(x64):
    """float64 gradients of sum_t LSE_I[t] (causal, relu): the student's share g softmax(I) of the
    indexer loss's gradient (what the dqk backward forms when the target part is zero)."""
    import torch

    qi, ki, w = (torch.from_numpy(x).requires_grad_(True) for x in x64[2:5])
    N = qi.shape[2]
    a = torch.einsum("bjtd,bsd->bjts", qi, ki[:, 0])  # one indexer key head
    logits = (w[..., None] * torch.relu(a)).sum(1)
    visible = torch.ones(N, N, dtype=torch.bool).tril()
    torch.logsumexp(logits.masked_fill(~visible, float("-inf")), -1).sum().backward()
    return qi.grad.numpy(), ki.grad.numpy(), w.grad.numpy()


def _target(x64, scale):
    """float64 head-mean target p [1, N, N] of the causal teacher (zeros above the diagonal)."""
    import numpy as np

    q, k = x64[0][0], x64[1][0]
    group = q.shape[0] // k.shape[0]
    N = q.shape[1]
    s = np.einsum("htd,hsd->hts", q, np.repeat(k, group, axis=0)) * scale
    s = np.where(np.tril(np.ones((N, N), dtype=bool))[None], s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    e = np.exp(s)
    return (e / e.sum(-1, keepdims=True)).mean(0)[None]


# ----------------------------------------------------------------------------------------------
# the parent: every step in its own process
# ----------------------------------------------------------------------------------------------

class Run:
    def __init__(self, args):
        self.args, self.t0, self.rows = args, time.time(), []
        os.makedirs(args.out_dir, exist_ok=True)
        self.logf = open(os.path.join(args.out_dir, "idx_fault.log"), "a")

    def log(self, msg):
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.logf.write(line + "\n")
        self.logf.flush()

    def record(self, measure, provider, value, unit, note=""):
        shape = f"{'tiny' if self.args.tiny else 'dsa'} N={self.args.n} causal {'fp16' if self.args.tiny else 'bf16'}"
        self.rows.append(dict(measure=measure, provider=provider, shape=shape, value=value, unit=unit, note=note))
        with open(os.path.join(self.args.out_dir, "idx_fault.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(self.rows)

    def command(self, step):
        cmd = [sys.executable, os.path.abspath(__file__), self.args.out_dir, "--step", step, "--n", str(self.args.n)]
        return cmd + (["--tiny"] if self.args.tiny else [])

    def run_all(self, steps):
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        pending, running, status = list(steps), [], {}
        while pending or running:
            while pending and len(running) < self.args.parallel:
                step = pending.pop(0)
                running.append((step, time.time(), subprocess.Popen(
                    self.command(step), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)))
            still = []
            for step, t_start, proc in running:
                if proc.poll() is None:
                    if time.time() - t_start > self.args.step_s:
                        proc.kill()
                        proc.wait()
                        status[step] = ("timeout", f"killed after {self.args.step_s:.0f} s")
                        self.log(f"{step}: killed after {self.args.step_s:.0f} s")
                        self.record("status", step, "timeout", "", f"killed after {self.args.step_s:.0f} s")
                    else:
                        still.append((step, t_start, proc))
                    continue
                status[step] = self.finish(step, proc, time.time() - t_start)
            running = still
            time.sleep(0.1)
        return status

    def finish(self, step, proc, secs):
        out = proc.stdout.read()
        results = [ln.split() for ln in out.splitlines() if ln.startswith("RESULT ")]
        done = proc.returncode == 0 and "DONE" in out.splitlines()
        bad = []
        for _, *quantity, err, tol in results:
            q = " ".join(quantity)
            ok = float(err) <= float(tol)
            bad += [] if ok else [q]
            self.record("rel_err", f"{step} {q}", err, "rel", f"tol {tol} {'ok' if ok else 'FAIL'}")
        if not done:
            tail = [ln for ln in out.splitlines() if ln.strip()][-6:]
            why = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else "no output")
            self.log(f"{step}: FAULT/raise (exit {proc.returncode}, {secs:.0f} s)\n" + out[-2500:])
            self.record("status", step, "error", "", why[:300])
            return ("error", why[:200])
        verdict = "ok" if not bad else "wrong " + ", ".join(bad)
        self.log(f"{step}: ran ({secs:.0f} s), {verdict}")
        self.record("status", step, "ran", "", verdict)
        return ("ran", verdict)

    def sanitize(self, step):
        tool = shutil.which("compute-sanitizer") or next(
            (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
        if tool is None or self.args.tiny:
            self.log("compute-sanitizer: not on this machine" if tool is None else "compute-sanitizer: not on CPU")
            return
        cmd = [tool, "--tool", "memcheck", "--print-limit", "6"] + self.command(step)
        self.log(f"memcheck of {step}: {' '.join(cmd)}")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.args.sanitizer_s)
            text = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            text = f"(timed out after {self.args.sanitizer_s:.0f} s)\n" + str(exc.stdout or "")[-4000:]
        with open(os.path.join(self.args.out_dir, f"idx_fault_memcheck_{step}.txt"), "w") as f:
            f.write(text)
        lines = [ln for ln in text.splitlines() if "Invalid" in ln or "at 0x" in ln or "by thread" in ln][:12]
        self.log(f"memcheck of {step}:\n" + "\n".join(lines))


def main(argv=None):
    args = parse_args(argv)
    if args.step:
        run_step(args.step, args.tiny, args.n)
        return 0
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        print(f"unknown steps {unknown}; known: {list(STEPS)}", file=sys.stderr)
        return 2
    run = Run(args)
    import torch
    import triton

    run.log(f"idx_fault: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, torch "
            f"{torch.__version__}, triton {triton.__version__}, N={args.n}, steps {steps}")
    status = run.run_all(steps)
    faulted = [s for s in steps if status.get(s, ("?",))[0] != "ran"]
    if faulted:
        run.sanitize(faulted[0])
    lines = ["", f"{'step':20s} {'status':8s} verdict"] + [
        f"{s:20s} {status[s][0]:8s} {status[s][1]}" for s in steps if s in status]
    text = "\n".join(lines)
    print(text, flush=True)
    run.logf.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
