"""The Runner (the mixins of the other modules on one object) and main: the section loop.

Sections run in the order given. The in-process ones (cases.CORE_SECTIONS) are methods
``sec_<name>``; delegated ones (delegated.DELEGATED) are scripts run as subprocesses. One Budget
plans them all: a section's budget is its share of the run, unused time carries forward, and a
delegated section's subprocess is stopped at min(its own limit, what the plan leaves it). A
section that raises, fails or times out is recorded (sections.csv, bench.log, the summary) and
the run goes on.
"""
from __future__ import annotations

import csv
import os
import time
import traceback

from . import delegated
from .cases import SECTION_DOC, make_config
from .checks import ChecksMixin
from .cli import parse_args
from .perf import PerfMixin
from .providers import ProvidersMixin
from .report import COLUMNS, SECTION_COLUMNS, ReportMixin, resolve_out, write_results_csv
from .timing import Budget, TimingMixin


class Runner(ReportMixin, TimingMixin, ProvidersMixin, ChecksMixin, PerfMixin):
    def __init__(self, args, cfg):
        self.a, self.cfg = args, cfg
        self.t0 = time.perf_counter()
        os.makedirs(args.out, exist_ok=True)
        self.log_f = open(os.path.join(args.out, "bench.log"), "w")
        import torch
        import triton
        self.torch, self.triton = torch, triton
        self.dev = torch.device(args.device)
        self.cuda = args.device == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch.cuda.is_available() is False (use --device cpu --tiny)")
        self.rows = []
        self.checks = []
        self.section_errors = []
        self.hist = {}  # (kernel, provider, mode, causal) -> (work, seconds per call)
        self.compile_est = {"fwd": 25.0, "bwd": 45.0}
        self.copy_bw = None  # bytes/s, read + written
        self.env = self._env()
        self.bench_f = open(os.path.join(args.out, "bench.csv"), "w", newline="")
        self.bench_w = csv.DictWriter(self.bench_f, fieldnames=COLUMNS)
        self.bench_w.writeheader()
        self.check_f = None
        self.sections_f = open(os.path.join(args.out, "sections.csv"), "w", newline="")
        self.sections_w = csv.DictWriter(self.sections_f, fieldnames=SECTION_COLUMNS)
        self.sections_w.writeheader()
        self.sections_done = []  # one dict per section run (sections.csv rows)
        self.budget = Budget(self.t0, cfg["total"], cfg["budgets"], args.sections)
        self.ak = None
        self.ak_error = None
        try:
            import streamkl_gpu
            self.ak = streamkl_gpu.attention_kl
            self.env["streamkl_gpu_file"] = getattr(streamkl_gpu, "__file__", None) or str(getattr(streamkl_gpu, "__path__", ""))
        except Exception as e:  # the module may not exist yet; baselines still run
            self.ak_error = f"{type(e).__name__}: {e}"
            self.log(f"WARNING: streamkl_gpu.attention_kl unavailable ({self.ak_error}); 'ours' rows will be errors")
        self.env["streamkl_version"] = self._version()
        self.write_env()



def run_section(r, s):
    """Run section s; a failure is recorded, never raised."""
    ts = time.perf_counter()
    own = r.budget.start(s)
    spec = delegated.DELEGATED.get(s)
    doc = spec.doc if spec else SECTION_DOC[s]
    r.log(f"== {s}: {doc} (budget ~{own:.0f}s, deadline in {r.budget.remaining():.0f}s)")
    rec = dict(section=s, kind="delegated" if spec else "core", status="ok", rc="", limit_s="", out="",
               command="", note="")
    if spec is not None:
        r.free()  # the GPU memory this process cached goes back before the subprocess starts
        limit = min(own, max(r.budget.remaining(), 0.5 * own))  # late: still half its own limit (as Budget)
        res = delegated.run(s, r.a, os.path.join(r.a.out, s), limit, r.log)
        has_out = os.path.isdir(os.path.join(r.a.out, s))
        rec.update(res, limit_s=f"{limit:.0f}", out=s if has_out else "")
        if res["status"] not in ("ok", "skipped(absent)"):
            r.section_errors.append(f"{s}: {res['status']}" + (f" {res['note'][:100]}" if res["note"] else ""))
        r.log(f"   {s}: {res['status']}" + (f", exit {res['rc']}" if res["status"] == "timeout" else "")
              + (f"; {res['note']}" if res["note"] else "")
              + (f"; output in {s}/ (stdout.log)" if has_out else "")
              + (f"; command: {res['command']}" if res["command"] else ""))
    else:
        try:
            getattr(r, f"sec_{s}")()
        except Exception as e:
            r.section_errors.append(f"{s}: {type(e).__name__}: {str(e)[:120]}")
            rec.update(status="error", note=f"{type(e).__name__}: {str(e)[:200]}")
            r.log(f"SECTION {s} FAILED: {type(e).__name__}: {e}")
            r.log(traceback.format_exc(), stdout=False)
            r.free()
    rec["seconds"] = time.perf_counter() - ts
    r.section_row(rec)
    r.log(f"== {s} done in {rec['seconds']:.1f}s (elapsed {time.perf_counter() - r.t0:.1f}s)")


def print_tails(r):
    """The last lines of each delegated section's stdout (each script prints its short table last)."""
    for rec in r.sections_done:
        if rec["kind"] != "delegated" or r.a.tail_lines <= 0:
            continue
        path = os.path.join(r.a.out, rec["section"], "stdout.log")
        if not os.path.exists(path):
            continue
        print(f"=================== {rec['section']}: {rec['status']}, {rec['seconds']:.0f}s "
              f"(last {r.a.tail_lines} lines of {rec['section']}/stdout.log)", flush=True)
        for ln in delegated.tail(path, r.a.tail_lines):
            print(ln, flush=True)


def main(argv=None, doc=None):
    args = parse_args(argv, doc)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before torch/triton/streamkl_gpu are imported
    args.out = resolve_out(args.out, args.device)
    cfg = make_config(args)
    limits = {s: delegated.limit_for(s, args) for s in args.sections if s in delegated.DELEGATED}
    cfg["budgets"].update(limits)
    if args.budget_s is None:
        cfg["total"] += sum(limits.values())
    r = Runner(args, cfg)
    torch = r.torch
    torch.manual_seed(args.seed)
    est = {s: cfg["budgets"][s] for s in args.sections}
    r.log(f"streamkl bench: sections {','.join(args.sections)}; device {args.device}; "
          f"{'tiny' if args.tiny else 'quick' if args.quick else 'full'}; out {os.path.abspath(args.out)}; "
          f"budget {cfg['total']:.0f}s; section budgets (s) " + " ".join(f"{k}={v:g}" for k, v in est.items()))
    if r.cuda and not args.tiny and cfg["total"] > 570:
        r.log(f"WARNING: the plan is {cfg['total']:.0f}s, more than one GPU call (at most 600s): "
              f"split the sections over several calls or pass --budget-s")
    for s in args.sections:
        run_section(r, s)
        if args.pack:  # after every section: a run stopped at the call's limit still returns its archive
            try:
                delegated.pack(args.out)
            except Exception as e:
                r.log(f"WARNING: packing {args.out} failed: {type(e).__name__}: {e}")
    print_tails(r)
    r.summary()
    r.write_env()
    r.bench_f.close()
    r.sections_f.close()
    if r.check_f:
        r.check_f.close()
    nfail = sum(not c["pass"] for c in r.checks)
    rc = 1 if nfail else (3 if r.section_errors else 0)
    r.log(f"done in {time.perf_counter() - r.t0:.1f}s; {nfail} failed checks; exit {rc}")
    r.log_f.close()
    n_rows = write_results_csv(args.out, r.env, r.sections_done)
    print(f"results.csv: {n_rows} rows (every CSV of the run, long format) in {args.out}", flush=True)
    if args.pack:
        path, n = delegated.pack(args.out)
        print(f"packed {n} files into {path} ({os.path.getsize(path) / 2 ** 20:.1f} MiB)", flush=True)
    return rc
