"""Sections ``first_call`` and ``first_call_big``: the first call of each entry point at a new shape
with empty caches; the 2^31-element cases against their heads alone.

    python bench/bench_gpu.py --sections first_call [--section-args first_call="--entries fwd --n 8192"]
    python bench/bench_gpu.py --sections first_call_big [--section-args first_call_big="--case big --only varlen_s1_causal"]

``first_call``: per entry point (forward; forward + backward in each backward mode and setting;
packed sequences; the indexer loss: per-row losses summed, the mean training step, top-k; split-K decode) a fresh
process with empty caches (new ``TRITON_CACHE_DIR`` and ``STREAMKL_CACHE_DIR``) makes the call
twice: the first call's wall time, the kernels it compiled (and the C launchers built beside them,
``_core.triton_launchers``), the seconds in Triton's compiler
(``streamkl_gpu._core.compile_clock``) and a ``compile_window_s`` row per compile (kernel, thread, start:
what compiled side by side), the tuner's timing seconds (``TUNING_STATS`` of ``streamkl_gpu._core.tuning``,
read only; 0 where nothing is timed), the second call's time.
``--case big``: N = 1M (H = 16, D = 128; settings 1, 2, both causal, setting 1 non-causal), N = 2M
(H = 8), a packed batch past 2^31 elements, the indexer at 128K DSA-like: forward and forward +
backward times, and the first and last heads (sequences, batch entries) alone against the whole
call (forward bitwise or within 1e-6, gradients within 2e-3; the indexer's extra memory vs 16 GiB).
``--imported``: the API name resolved before the inputs are made, as by ``from streamkl_gpu import
...`` at a script's top (default: first inside the timed call, the worst case; the notes say which).
``--tiny``: tiny shapes on CPU under the interpreter (tests/test_first_call_smoke.py; compiles 0).
Writes OUT/first_call.csv or first_call_big.csv (long format, GPU and version columns).
"""
from __future__ import annotations

import argparse, csv, datetime, itertools, json, os, subprocess, sys, tempfile, time

from . import ROOT, child_env
from .timing import sync as _sync  # (on the GPU once CUDA is up)

# entry name -> what it runs (see _entry); every one a new shape class in a fresh process
ENTRIES = ("fwd", "fwd_bwd_auto_s1", "fwd_bwd_fused_s1", "fwd_bwd_separate_s1", "fwd_bwd_auto_s2", "fwd_bwd_auto_both",
           "varlen_fwd_bwd_s1", "varlen_fwd_bwd_both", "indexer_dense_step", "indexer_mean_step", "indexer_topk_step",
           "decode_splitk")
BIG = ("fwd_bwd_s1_causal", "fwd_bwd_s2_causal", "fwd_bwd_both_causal", "fwd_bwd_s1_full", "fwd_bwd_s1_causal_2m",
       "varlen_s1_causal", "indexer_128k_dsa")
FIELDS = ("gpu_name", "timestamp", "version", "torch", "triton", "autotune", "entry", "shape", "measure", "value",
          "unit", "note", "run_status")


def _device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _randn(*shape, std=1.0, seed=0):
    """Seeded inputs: bf16 on the GPU, fp32 under the interpreter (its bf16 products are wrong)."""
    import torch
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return (std * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype).to(_device())


def _env_columns():
    import streamkl_ref, torch, triton
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return dict(gpu_name=gpu, torch=torch.__version__, triton=triton.__version__, version=streamkl_ref.__version__,
                autotune=os.environ.get("STREAMKL_AUTOTUNE") or "auto",
                timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _compile_clock():
    from streamkl_gpu._core.compile_clock import CompileClock
    return CompileClock().install()


def _attention_inputs(B, H, N, D, train, seed=0, NK=None):
    """q1, k1, q2, k2 [B, H, N, D]; ``train``: which of the four require grad."""
    NK = N if NK is None else NK
    shapes = [(B, H, N, D), (B, H, NK, D), (B, H, N, D), (B, H, NK, D)]
    return [_randn(*s, seed=seed + i).requires_grad_(t) for i, (s, t) in enumerate(zip(shapes, train))]


SETTING_TRAIN = {"s1": (False, False, True, True), "s2": (True, True, False, False), "both": (True,) * 4}


# default mode: one entry point's first call, in this (fresh) process
def _entry(name, n, tiny):
    """``(shape description, call)`` of an entry point: ``call()`` runs it once (a training step
    for the backward and indexer entries)."""
    import torch
    import streamkl_gpu

    H, D = (2, 16) if tiny else (16, 128)
    if name == "fwd":
        xs = _attention_inputs(1, H, n, D, (False,) * 4)
        return f"B=1 H={H} N={n} D={D} causal", lambda: streamkl_gpu.attention_kl(*xs, causal=True)
    if name.startswith("fwd_bwd_"):
        _, _, mode, setting = name.split("_")
        xs = _attention_inputs(1, H, n, D, SETTING_TRAIN[setting])
        step = lambda: streamkl_gpu.attention_kl(*xs, causal=True, bwd_mode=mode).sum().backward()  # noqa: E731
        return f"B=1 H={H} N={n} D={D} causal {setting} {mode}", step
    if name.startswith("varlen_fwd_bwd_"):  # three packed sequences, setting 1 or both sides trained
        lens, setting = [n // 4, n // 2, n // 4], name.rsplit("_", 1)[1]
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=_device())
        xs = [_randn(sum(lens), H, D, seed=i).requires_grad_(t) for i, t in enumerate(SETTING_TRAIN[setting])]
        step = lambda: streamkl_gpu.attention_kl_varlen(*xs, cu, cu, max(lens), max(lens), causal=True).sum().backward()  # noqa: E731
        return f"seqs={lens} H={H} D={D} causal {setting}", step
    if name in ("indexer_dense_step", "indexer_mean_step", "indexer_topk_step"):
        Hq, Dq, HI, DI = (2, 16, 2, 16) if tiny else (64, 576, 64, 128)  # DSA-like: MQA teacher, MLA heads
        q, k = _randn(1, Hq, n, Dq, seed=1), _randn(1, 1, n, Dq, seed=2)
        q_idx = _randn(1, HI, n, DI, seed=3).requires_grad_(True)
        k_idx = _randn(1, 1, n, DI, seed=4).requires_grad_(True)
        w = _randn(1, HI, n, std=(HI * DI) ** -0.5, seed=5).requires_grad_(True)
        scale = Dq ** -0.5
        if name != "indexer_topk_step":  # dense: per-row losses summed, or the training step as documented
            red = "mean" if name == "indexer_mean_step" else "none"
            step = lambda: streamkl_gpu.indexer_kl(q, k, q_idx, k_idx, w, causal=True, scale=scale, reduction=red).sum().backward()  # noqa: E731
            return f"B=1 H={Hq} HI={HI} N={n} D={Dq} DI={DI} causal" + ("" if red == "none" else f" reduction={red}"), step
        top = min(n, 16 if tiny else 2048)
        rows = torch.arange(n, device=_device())[:, None]
        idx = (rows - torch.arange(top, device=_device())[None, :]).clamp(min=-1).to(torch.int32)[None]  # the last keys
        step = lambda: streamkl_gpu.indexer_kl_topk(q, k, q_idx, k_idx, w, idx, causal=True, scale=scale).sum().backward()  # noqa: E731
        return f"B=1 H={Hq} HI={HI} N={n} D={Dq} DI={DI} K={top} causal", step
    if name == "decode_splitk":
        nk = 256 if tiny else 131072
        xs = [_randn(1, H, 1, D, seed=0), _randn(1, H, nk, D, seed=1), _randn(1, H, 1, D, seed=2),
              _randn(1, H, nk, D, seed=3)]
        return f"B=1 H={H} N_Q=1 N_K={nk} D={D} split auto", lambda: streamkl_gpu.attention_kl(*xs)
    raise ValueError(f"unknown entry {name!r}; entries: {', '.join(ENTRIES)}")


API_NAME = {"varlen_fwd_bwd_s1": "attention_kl_varlen", "varlen_fwd_bwd_both": "attention_kl_varlen",
            "indexer_dense_step": "indexer_kl", "indexer_mean_step": "indexer_kl", "indexer_topk_step": "indexer_kl_topk"}  # else attention_kl


def child(name, n, tiny, out_json, imported=False):
    """Runs in the fresh process: the clock first, then the entry point twice."""
    clock = _compile_clock()  # before any kernel's first launch
    from streamkl_gpu._core import tuning

    if imported:  # the first API use (its compiler set-up starts) before the inputs are made
        getattr(__import__("streamkl_gpu"), API_NAME.get(name, "attention_kl"))

    shape, call = _entry(name, n, tiny)
    _sync()
    t_first = time.perf_counter()
    call()
    _sync()
    first = time.perf_counter() - t_first
    compile_s, kernels = clock.seconds, clock.calls
    launchers_early = getattr(sys.modules.get("streamkl_gpu._core.triton_launchers"), "STATS", {}).get("started", 0)
    compile_wall_s = clock.wall_since(t_first, t_first + first)
    t0 = time.perf_counter()
    call()
    _sync()
    second = time.perf_counter() - t0
    result = dict(entry=name, shape=shape, first_call_s=first, second_call_s=second, compile_s=compile_s,
                  compile_wall_s=compile_wall_s, kernels_compiled=kernels, launchers_early=launchers_early, tuning_s=tuning.TUNING_STATS["timing_s"],
                  clock_available=clock.available, compiles=[(k, th, a - t_first, b - t_first)
                                                             for k, th, a, b, *_ in clock.events[:kernels]])
    with open(out_json, "w") as fh:
        json.dump(result, fh)


def first_calls(entries, n, tiny, out_dir, timeout, imported=False):
    """Each entry in a fresh subprocess with empty caches; the CSV rows."""
    rows = []
    env_cols = _env_columns()
    for name in entries:
        with tempfile.TemporaryDirectory(prefix="streamkl-first-call-") as tmp:
            env = child_env(TRITON_CACHE_DIR=os.path.join(tmp, "triton"), STREAMKL_CACHE_DIR=os.path.join(tmp, "streamkl"))
            out_json = os.path.join(tmp, "result.json")
            cmd = [sys.executable, "-m", "streamkl_bench.first_call", "--child", name, "--n", str(n), "--json", out_json]
            cmd += ["--tiny"] * tiny + ["--imported"] * imported
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            wall = time.perf_counter() - t0
            if proc.returncode != 0 or not os.path.exists(out_json):
                rows.append(dict(entry=name, shape="", measure="error", value=proc.returncode, unit="rc",
                                 note=(proc.stderr or proc.stdout)[-300:].replace("\n", " | "),
                                 run_status=f"failed(rc={proc.returncode})", **env_cols))
                print(f"{name}: FAILED (rc {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            with open(out_json) as fh:
                r = json.load(fh)
        note = "; ".join((["API name imported before the inputs"] * imported
                          + ["compile clock unavailable (compile columns 0)"] * (not r["clock_available"])))
        for measure, unit, about in (("first_call_s", "s", ""), ("compile_s", "s", "summed over compile threads"),
                                     ("compile_wall_s", "s", "wall time with a compile running"),
                                     ("kernels_compiled", "kernels", ""), ("launchers_early", "launchers", "C launchers "
                                     "built beside their kernels' compiles (0 with triton 3.8, 3.9: none per kernel)"),
                                     ("tuning_s", "s", ""), ("second_call_s", "s", "")):
            rows.append(dict(entry=name, shape=r["shape"], measure=measure, value=r[measure], unit=unit,
                             note="; ".join(x for x in (about, note) if x), **env_cols))
        rows.append(dict(entry=name, shape=r["shape"], measure="process_s", value=wall, unit="s",
                         note="the whole fresh process (imports included)", **env_cols))
        rows += [dict(entry=name, shape=r["shape"], measure="compile_window_s", value=end - start, unit="s", **env_cols,
                      note=f"{kernel} on {thread}, from {start:.3f} s into the first call") for kernel, thread, start, end in r["compiles"]]
        print(f"{name:24s} first {r['first_call_s']:7.2f} s  compile {r['compile_s']:7.2f} s "
              f"({r['kernels_compiled']} kernels)  tuning {r['tuning_s']:.2f} s  second {r['second_call_s']:.4f} s",
              flush=True)
    return rows


# --case big: the 2^31-element problems
def _rel(a, b, chunk=1 << 14):
    """||a - b|| / ||b|| in float64 over ``chunk`` slices of the longest dim (one float64 copy of a 2^31-element gradient: 16 GiB)."""
    dim, num, den = max(range(b.dim()), key=lambda d: b.shape[d]), 0.0, 0.0
    for i in range(0, b.shape[dim], chunk):
        x, y = (t.detach().narrow(dim, i, min(chunk, b.shape[dim] - i)).double() for t in (a, b))
        num, den = num + float((x - y).square().sum()), den + float(y.square().sum())
    return num ** 0.5 / max(den ** 0.5, 1e-300)


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def _rows(name, shape):
    """An empty row list and its appender ``row(measure, value, unit, note="")``."""
    rows = []

    def row(measure, value, unit, note=""):
        rows.append(dict(entry=name, shape=shape, measure=measure, value=value, unit=unit, note=note))
    return rows, row


def _fwd_then_step(row, clock, fwd, step):
    """Rows of a forward timed twice (the first compiles; the second is the one the ratio uses) and
    of a forward + backward ``step(g)`` (``g``: a seeded upstream gradient); returns (out, g)."""
    import torch

    with torch.no_grad():
        for measure in ("fwd_first_s", "fwd_s"):
            out, t_fwd = _timed(fwd)
            row(measure, t_fwd, "s", "compiles included" if measure == "fwd_first_s" else "")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    compiled_before = clock.seconds if clock is not None else 0.0
    _, t_fb = _timed(lambda: step(g))
    row("fwd_bwd_s", t_fb, "s")
    row("fwd_bwd_over_fwd", t_fb / t_fwd, "x", "Must: <= 5 (the backward's compiles inside fwd_bwd_s)")
    if clock is not None and clock.available:  # (not subtracted: the backward compiles while the GPU runs the forward)
        row("fwd_bwd_compile_s", clock.seconds - compiled_before, "s", "compiler seconds inside fwd_bwd_s")
    return out, g


def big_case(name, tiny, clock=None):
    """Rows for one 2^31-element problem: timings (``clock``: a CompileClock), the first/last head check."""
    import torch
    import streamkl_gpu

    if name == "indexer_128k_dsa":
        return _big_indexer(name, tiny)
    if name == "varlen_s1_causal":
        return _big_varlen(name, tiny, clock)
    parts = name.split("_")  # fwd_bwd_<setting>_<causal|full>[_2m]
    setting, causal = parts[2], parts[3] == "causal"
    N, H = ((32, 2) if tiny else (1 << 20, 16)) if not name.endswith("2m") else ((48, 2) if tiny else (1 << 21, 8))
    D = 16 if tiny else 128
    shape = f"B=1 H={H} N={N} D={D} {'causal' if causal else 'full'} {setting}"
    rows, row = _rows(name, shape)
    train = SETTING_TRAIN[setting]
    xs = _attention_inputs(1, H, N, D, train)
    kl, g = _fwd_then_step(row, clock, lambda: streamkl_gpu.attention_kl(*[x.detach() for x in xs], causal=causal),
                           lambda g: streamkl_gpu.attention_kl(*xs, causal=causal).backward(g))
    full_grads = [x.grad for x in xs]  # the per-head calls below make new leaves: no copy
    for head in (0, H - 1):  # the head alone, a separate call
        alone = [x.detach()[:, head:head + 1].clone().requires_grad_(t) for x, t in zip(xs, train)]
        kl_h = streamkl_gpu.attention_kl(*alone, causal=causal)
        kl_h.backward(g[:, head:head + 1])
        err = _rel(kl[:, head:head + 1], kl_h)
        row(f"head{head}_kl_rel_err", err, "rel", "Must: 0 or <= 1e-6" + (" (bitwise)" if err == 0 else ""))
        for gname, full, part in zip(("dq1", "dk1", "dq2", "dk2"), full_grads, alone):
            if full is not None:
                row(f"head{head}_{gname}_rel_err", _rel(full[:, head:head + 1], part.grad), "rel", "Must: <= 2e-3")
        del alone, kl_h
    return rows


def _big_varlen(name, tiny, clock=None):
    """A packed batch whose total x H x D passes 2^31 (setting 1, causal): first and last sequence alone."""
    import torch
    import streamkl_gpu

    H, D = (2, 16) if tiny else (16, 128)
    lens = [20, 12, 28] if tiny else [1 << 19, 1 << 20, (1 << 19) + 4096]  # 2^21 + 4096 tokens x 16 x 128 > 2^31
    total = sum(lens)
    shape = f"seqs={lens} H={H} D={D} causal s1 (total x H x D = {total * H * D})"
    rows, row = _rows(name, shape)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=_device())
    xs = [_randn(total, H, D, seed=i).requires_grad_(i >= 2) for i in range(4)]
    kl, g = _fwd_then_step(row, clock, lambda: streamkl_gpu.attention_kl_varlen(
        *[x.detach() for x in xs], cu, cu, max(lens), max(lens), causal=True),
        lambda g: streamkl_gpu.attention_kl_varlen(*xs, cu, cu, max(lens), max(lens), causal=True).backward(g))
    for i in (0, len(lens) - 1):
        lo, hi = int(cu[i]), int(cu[i + 1])
        # the sequence alone through the same entry point (a packed batch of one: the same kernels)
        one = torch.tensor([0, hi - lo], dtype=torch.int32, device=cu.device)
        alone = [x.detach()[lo:hi].clone().requires_grad_(j >= 2) for j, x in enumerate(xs)]
        kl_s = streamkl_gpu.attention_kl_varlen(*alone, one, one, hi - lo, hi - lo, causal=True)  # [n, H]
        kl_s.backward(g[lo:hi])
        err = _rel(kl[lo:hi], kl_s)
        row(f"seq{i}_kl_rel_err", err, "rel", "Must: 0 or <= 1e-6" + (" (bitwise)" if err == 0 else ""))
        for gname, x, part in (("dq2", xs[2], alone[2]), ("dk2", xs[3], alone[3])):
            row(f"seq{i}_{gname}_rel_err", _rel(x.grad[lo:hi], part.grad), "rel", "Must: <= 2e-3")
        with torch.no_grad():  # the dense entry point: other kernels (Gluon on Hopper), no bound
            dense = streamkl_gpu.attention_kl(*[x.detach()[lo:hi][None].transpose(1, 2) for x in xs], causal=True)
        row(f"seq{i}_kl_rel_diff_dense", _rel(kl[lo:hi].T[None], dense), "diff", "attention_kl on the sequence")
        del alone, kl_s, dense
    return rows


def _big_indexer(name, tiny):
    """The indexer loss at 128K, DSA-like (MQA teacher D = 576, 64 indexer heads of 128), two batch
    entries: the step's time and extra memory, and each entry alone against the batched call."""
    import torch
    import streamkl_gpu

    B, N, H, D, HI, DI = (2, 24, 2, 16, 2, 16) if tiny else (2, 131072, 64, 576, 64, 128)
    shape = f"B={B} N={N} H={H} D={D} HI={HI} DI={DI} causal MQA"
    rows, row = _rows(name, shape)

    q, k = _randn(B, H, N, D, seed=1), _randn(B, 1, N, D, seed=2)
    leaves = [_randn(B, HI, N, DI, seed=3), _randn(B, 1, N, DI, seed=4),
              _randn(B, HI, N, std=(HI * DI) ** -0.5, seed=5)]
    leaves = [x.requires_grad_(True) for x in leaves]
    scale = 192 ** -0.5
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss, t = _timed(lambda: streamkl_gpu.indexer_kl(q, k, *leaves, causal=True, scale=scale))
    g = torch.randn(loss.shape, generator=torch.Generator().manual_seed(7)).to(loss.device)
    _, t_b = _timed(lambda: loss.backward(g))
    row("fwd_s", t, "s")
    row("fwd_bwd_s", t + t_b, "s")
    if cuda:
        row("extra_peak_memory", (torch.cuda.max_memory_allocated() - base) / 2 ** 30, "GiB", "Must: <= 16")
    full = [x.grad for x in leaves]
    for b in (0, B - 1):
        alone = [x.detach()[b:b + 1].clone().requires_grad_(True) for x in leaves]
        loss_b = streamkl_gpu.indexer_kl(q[b:b + 1], k[b:b + 1], *alone, causal=True, scale=scale)
        loss_b.backward(g[b:b + 1])
        err = _rel(loss.detach()[b:b + 1], loss_b.detach())
        row(f"batch{b}_kl_rel_err", err, "rel", "Must: 0 or <= 1e-6" + (" (bitwise)" if err == 0 else ""))
        for gname, f, part in zip(("dq_idx", "dk_idx", "dweights"), full, alone):
            row(f"batch{b}_{gname}_rel_err", _rel(f[b:b + 1], part.grad), "rel", "Must: <= 2e-3")
    return rows


def write_csv(rows, out_dir, stem):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}.csv")
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS} | {"run_status": r.get("run_status", "ok")})
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="directory for the CSV (first_call.csv or first_call_big.csv)")
    p.add_argument("--entries", default=",".join(ENTRIES), help=f"comma list of: {', '.join(ENTRIES)}")
    p.add_argument("--n", type=int, default=None, help="tokens per entry (default 8192; --tiny 16)")
    p.add_argument("--case", choices=["first", "big"], default="first")
    p.add_argument("--only", help=f"--case big: comma list of: {', '.join(BIG)}")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke test, the interpreter)")
    p.add_argument("--imported", action="store_true", help="the API name resolved before the inputs are made")
    p.add_argument("--timeout", type=int, default=600, help="seconds per fresh process")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    n = args.n if args.n is not None else (16 if args.tiny else 8192)
    if args.child:
        child(args.child, n, args.tiny, args.json, args.imported)
        return 0
    if not args.out:
        p.error("--out DIR is needed")
    if args.case == "first":
        entries = [e for e in args.entries.split(",") if e]
        if set(entries) - set(ENTRIES):
            p.error(f"unknown entries {sorted(set(entries) - set(ENTRIES))}")
        rows = first_calls(entries, n, args.tiny, args.out, args.timeout, args.imported)
        path = write_csv(rows, args.out, "first_call")
        failed = any(r["measure"] == "error" for r in rows)
    else:
        names = [c for c in (args.only or ",".join(BIG)).split(",") if c]
        if set(names) - set(BIG):
            p.error(f"unknown --only cases {sorted(set(names) - set(BIG))}")
        env_cols = _env_columns()
        clock = _compile_clock()  # before any kernel's first launch
        rows, failed = [], False
        try:  # uninstalled after: main() may run inside another process (the tests)
            for name in names:
                print(f"{name} ...", flush=True)
                got = big_case(name, args.tiny, clock)
                for r in got:
                    r.update(env_cols)
                    print(f"  {r['measure']:24s} {r['value']:.6g} {r['unit']}  {r['note']}", flush=True)
                    if r["unit"] == "rel":
                        bound = 1e-6 if "_kl_" in r["measure"] else 2e-3
                        failed |= not r["value"] <= bound
                        r["run_status"] = "ok" if r["value"] <= bound else "failed(bound)"
                rows += got
                path = write_csv(rows, args.out, "first_call_big")  # after every case: a long run cut short keeps its rows
        finally:
            clock.uninstall()
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
