"""Reports: bench.csv (one row per measurement), check.csv (one row per compared tensor),
sections.csv (one row per section), bench.log, env.json (GPU, driver, torch, triton, commit, the
exact command), results.csv (every CSV of the run in one long format, with gpu_name, timestamp,
version, commit and each row's section and run status), and summary.txt (the ratios against the
anchors' targets, at most 60 lines, printed last)."""
from __future__ import annotations

import csv
import datetime as _dt
import math
import os
import glob
import json
import platform
import shlex
import subprocess
import sys
import time

from . import ROOT
from .cases import fmt_n

COLUMNS = ["kernel", "provider", "mode", "causal", "n_q", "n_k", "b", "h", "d1", "d2", "dtype",
           "p20_ms", "p50_ms", "p80_ms", "peak_extra_gib", "status", "gpu", "torch", "triton",
           "date", "streamkl_version", "extra"]
CHECK_COLUMNS = ["case", "dtype", "setting", "err", "tol", "pass", "tensor", "eager_err", "detail"]
# one row per section run: kind core (in-process) or delegated (a script, output under out/)
SECTION_COLUMNS = ["section", "kind", "status", "rc", "seconds", "limit_s", "out", "command", "note"]

RESULTS_LEAD = ["gpu_name", "timestamp", "version", "commit", "section", "file", "run_status"]


def git_commit(short=True):
    """The commit of the code measured (with ``-dirty`` when tracked files differ), or ``unknown``."""
    try:
        sha = subprocess.run(["git", "-C", ROOT, "rev-parse"] + (["--short"] if short else []) + ["HEAD"],
                             capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:
        return "unknown"
    return (sha + ("-dirty" if dirty else "")) if sha else "unknown"


def gpu_word(device):
    """``h200`` from "NVIDIA H200" (the results folder's <gpu>); ``cpu`` for the interpreter."""
    if device != "cuda":
        return "cpu"
    import torch
    return torch.cuda.get_device_name(0).split()[-1].lower().replace("/", "-")


def resolve_out(path, device):
    """``--out`` with ``{date}``, ``{gpu}``, ``{commit}`` filled: bench/results/{date}_{gpu}_{commit}."""
    if "{" not in path:
        return path
    return path.format(date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), gpu=gpu_word(device),
                       commit=git_commit())


def driver_version():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except Exception:
        return None


def write_results_csv(out_dir, env, sections):
    """Every CSV under out_dir (but results.csv) as one long-format file: the lead columns, then the
    union of the files' own columns. ``run_status``: the status of the section that wrote it."""
    status = {rec["section"]: rec["status"] for rec in sections}
    rows, fields = [], []
    for path in sorted(glob.glob(os.path.join(out_dir, "**", "*.csv"), recursive=True)):
        rel = os.path.relpath(path, out_dir)
        if rel == "results.csv":
            continue
        section = rel.split(os.sep)[0] if os.sep in rel else ("run" if rel == "sections.csv" else "core")
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                fields += [k for k in r if k and k not in fields and k not in RESULTS_LEAD]
                rows.append(dict(r, gpu_name=env["gpu"], timestamp=env["date"], version=env.get("streamkl_version", ""),
                                 commit=env.get("commit", ""), section=section, file=rel,
                                 run_status=status.get(section, r.get("status", "ok") if section == "run" else "ok")))
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULTS_LEAD + fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return len(rows)


# Anchors (h200-2026-11-29.md): used for the summary's "measured vs anchor" lines and as a
# labelled fallback when a baseline was skipped in this run.
ANCHOR = {
    "copy_tb_s": 4.14, "matmul_tflops": 756.0,
    ("fwd", "eager", False, 8192): 64.15, ("fwd", "compile", False, 8192): 8.04,
    ("fwd", "sdpa", False, 8192): 1.70, ("fwd", "eager", True, 8192): 78.33,
    ("fwd", "compile", True, 8192): 13.06, ("fwd", "sdpa", True, 8192): 0.97,
    ("s1", "eager", False, 8192): 91.72, ("s1", "compile", False, 8192): 14.47,
    ("s2", "eager", False, 8192): 105.37, ("s2", "compile", False, 8192): 16.28,
    ("s1", "eager", True, 8192): 113.62, ("s1", "compile", True, 8192): 22.20,
    ("s2", "eager", True, 8192): 127.34, ("s2", "compile", True, 8192): 22.79,
    ("sdpa_fb", False, 8192): 6.55, ("sdpa_fb", True, 8192): 3.75,
}


class ReportMixin:
    def log(self, msg, stdout=True):
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        self.log_f.write(line + "\n")
        self.log_f.flush()
        if stdout:
            print(line, flush=True)

    def _env(self):
        torch, triton = self.torch, self.triton
        gpu = torch.cuda.get_device_name(0) if self.cuda else f"cpu:{platform.processor() or platform.machine()}"
        return {
            "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "python": sys.version.split()[0], "cuda": getattr(torch.version, "cuda", None),
            "triton_interpret": os.environ.get("TRITON_INTERPRET", ""), "host": platform.node(),
            "driver": driver_version() if self.cuda else None, "commit": git_commit(),
            "command": " ".join(shlex.quote(x) for x in ["python"] + sys.argv), "argv": sys.argv,
        }

    def write_env(self):
        with open(os.path.join(self.a.out, "env.json"), "w") as f:
            json.dump(self.env, f, indent=1)

    def _version(self):
        """The package version plus +g<commit> (.dirty when tracked files differ)."""
        try:
            from importlib.metadata import version
            v = version("streamkl")
        except Exception:
            v = getattr(__import__("streamkl_ref"), "__version__", "unknown")
        sha = git_commit()
        return str(v) + (f"+g{sha}".replace("-dirty", ".dirty") if sha != "unknown" else "")

    def row(self, kernel, provider, mode, causal, nq, nk, b, h, d1, d2, dtype, times=None, peak=None,
            status="ok", extra="", echo=None):
        r = {k: "" for k in COLUMNS}
        r.update(kernel=kernel, provider=provider, mode=mode, causal=int(bool(causal)), n_q=nq, n_k=nk, b=b, h=h,
                 d1=d1, d2=d2, dtype=dtype, status=status, extra=extra,
                 gpu=self.env["gpu"], torch=self.env["torch"], triton=self.env["triton"], date=self.env["date"],
                 streamkl_version=self.env["streamkl_version"])
        if times is not None:
            r["p20_ms"], r["p50_ms"], r["p80_ms"] = (f"{t:.6g}" for t in times)
        if peak is not None and not (isinstance(peak, float) and math.isnan(peak)):
            r["peak_extra_gib"] = f"{peak:.4g}"
        self.rows.append(r)
        self.bench_w.writerow(r)
        self.bench_f.flush()
        p50 = r["p50_ms"] or "-"
        self.log(f"  {kernel:<10} {provider:<14} {mode:<12} c={int(bool(causal))} nq={nq} nk={nk} "
                 f"p50={p50} ms peak={r['peak_extra_gib'] or '-'} GiB {status} {extra}",
                 stdout=self.a.verbose if echo is None else echo)
        return r

    def get(self, kernel, provider, mode, causal, nq, nk=None):
        nk = nq if nk is None else nk
        for r in self.rows:
            if (r["kernel"] == kernel and r["provider"] == provider and r["mode"] == mode
                    and r["causal"] == int(bool(causal)) and r["n_q"] == nq and r["n_k"] == nk
                    and r["status"] == "ok" and r["p50_ms"]):
                return float(r["p50_ms"])
        return None

    def crow(self, case, dtype, setting, err, tol, ok, tensor, eager_err="", detail=""):
        r = dict(case=case, dtype=dtype, setting=setting, err=f"{err:.4g}" if isinstance(err, float) else err,
                 tol=f"{tol:.4g}" if isinstance(tol, float) else tol, **{"pass": bool(ok)}, tensor=tensor,
                 eager_err=f"{eager_err:.4g}" if isinstance(eager_err, float) else eager_err,
                 detail=str(detail).replace("\n", " ")[:200])
        self.checks.append(r)
        if self.check_f is None:
            self.check_f = open(os.path.join(self.a.out, "check.csv"), "w", newline="")
            self.check_w = csv.DictWriter(self.check_f, fieldnames=CHECK_COLUMNS)
            self.check_w.writeheader()
        self.check_w.writerow(r)
        self.check_f.flush()
        self.log(f"  check {'PASS' if ok else 'FAIL'} {case} {dtype} {setting} {tensor} err={r['err']} tol={r['tol']} {r['detail']}",
                 stdout=not ok or self.a.verbose)

    def section_row(self, rec):
        self.sections_done.append(rec)
        row = dict(rec, seconds=f"{rec['seconds']:.1f}", note=str(rec.get("note", "")).replace("\n", " ")[:200])
        self.sections_w.writerow({k: row.get(k, "") for k in SECTION_COLUMNS})
        self.sections_f.flush()

    def summary(self):
        L = []
        cfg = self.cfg
        K = 1024
        big = 8 * K if not self.a.tiny else cfg["fwd_n"][-1]
        L.append(f"== streamkl summary: {self.env['gpu']} | torch {self.env['torch']} | triton {self.env['triton']} | "
                 f"{self.env['streamkl_version']} | {self.env['date']} ==")
        if self.a.tiny:
            L.append("(tiny shapes: ratios below are NOT comparable with the anchors' targets)")

        def mark(ok):
            return "----" if ok is None else ("PASS" if ok else "MISS")

        def line(text, ok):
            L.append(f"{text:<86} {mark(ok)}")

        if self.checks:
            nf = sum(not r["pass"] for r in self.checks)
            line(f"correctness: {len(self.checks) - nf}/{len(self.checks)} check rows pass (check.csv)", nf == 0)
        for rec in self.sections_done:  # delegated sections: their own tables are in <section>/
            if rec["kind"] == "delegated":
                st = rec["status"]
                line(f"section {rec['section']}: {st} in {float(rec['seconds']):.0f}s (limit {rec['limit_s'] or '-'}s)"
                     + (f" -> {rec['out']}/" if rec["out"] else ""), None if st == "skipped(absent)" else st == "ok")
        # machine-to-machine variation: the anchors were measured on another H200 (756 TFLOP/s bf16)
        if "copy_tb_s" in self.env:
            cp = self.env["copy_tb_s"]
            L.append(f"env: copy {cp:.3g} TB/s = {cp / ANCHOR['copy_tb_s']:.2f}x the anchors' {ANCHOR['copy_tb_s']} "
                     f"(bytes read + written)" + ("" if self.cuda else " (CPU: not comparable)"))
        if "matmul_tflops" in self.env:
            mm, mn = self.env["matmul_tflops"], self.env.get("matmul_n")
            if self.cuda:
                L.append(f"env: bf16 matmul {mn}^3 {mm:.1f} TFLOP/s = {mm / ANCHOR['matmul_tflops']:.2f}x the anchors' "
                         f"{ANCHOR['matmul_tflops']:.0f} (machines differ: compare ratios within one run)")
            else:
                L.append(f"env: fp32 matmul {mn}^3 {mm:.3g} TFLOP/s on CPU (not comparable with the anchors' bf16 "
                         f"{ANCHOR['matmul_tflops']:.0f} TFLOP/s on the H200)")
        else:
            L.append(f"env: bf16 matmul not measured in this run (no env section); the anchors' machine: "
                     f"{ANCHOR['matmul_tflops']:.0f} TFLOP/s")

        def base(kernel, prov, mode, causal, n, akey):
            v = self.get(kernel, prov, mode, causal, n)
            if v is not None:
                return v, ""
            a = ANCHOR.get(akey) if not self.a.tiny else None
            return (a, " [anchor value]") if a is not None else (None, "")

        sdpa_key = "(d = SDPA default dispatch, f = SDPA flash backend: the faster of the two in this run, per N)"
        # forward vs compile / eager
        for c, tgt in ((False, 2.4), (True, 4.2)):
            o = self.get("fwd", "ours", "fwd", c, big)
            cb, note = base("fwd", "compile", "fwd", c, big, ("fwd", "compile", c, big))
            if o and cb:
                line(f"fwd N={big} {'causal    ' if c else 'non-causal'} ours vs compile: x{cb / o:.2f} (target >= {tgt}){note}",
                     cb / o >= tgt)
            eb, note = base("fwd", "eager", "fwd", c, big, ("fwd", "eager", c, big))
            if o and eb:
                line(f"fwd N={big} {'causal    ' if c else 'non-causal'} ours vs eager: x{eb / o:.1f} (paper {'26-43' if c else '13-18'}x){note}", None)
        # ours vs SDPA forward at N >= 8K
        # against the FASTER of sdpa (default dispatch) and sdpa_flash, per N; which one is in the line
        fwd_sdpa_lines = False
        for c in (False, True):
            ratios, notes = [], set()
            for n in cfg["fwd_n"]:
                if n < (8 * K if not self.a.tiny else 0):
                    continue
                o = self.get("fwd", "ours", "fwd", c, n)
                s, which, note = self.sdpa_best("fwd", "fwd", c, n)
                if o and s:
                    ratios.append((n, o / s, which[0]))
                    if note:
                        notes.add(note.lstrip("; "))
            if ratios:
                fwd_sdpa_lines = True
                worst = max(r for _, r, _ in ratios)
                txt = " ".join(f"{fmt_n(n)}:{r:.2f}{w}" for n, r, w in ratios)
                nt = f" [{'; '.join(sorted(notes))}]" if notes else ""
                line(f"fwd ours/SDPA {'causal    ' if c else 'non-causal'} {txt} (must <= 1.6){nt}", worst <= 1.6)
                line(f"      ... same, goal <= 1.1 (worst {worst:.2f})", worst <= 1.1)
        if fwd_sdpa_lines:
            L.append("      " + sdpa_key)
        # decode / split-K
        for nq, nk in cfg["decode"]:
            o = self.get("decode", "ours", "fwd", False, nq, nk)
            f = self.get("decode", "floor", "fwd", False, nq, nk)
            o1 = self.get("decode", "ours_split1", "fwd", False, nq, nk)
            s, which, _ = self.sdpa_best("decode", "fwd", False, nq, nk)
            if o and f:
                tgt = nq == 1 and nk == cfg["decode"][0][1]
                extra = (f"; split-K x{o1 / o:.1f} vs split_k=1" if o1 else "") + (f"; SDPA {s:.3g} ({which})" if s else "")
                line(f"decode NQ={nq} NK={fmt_n(nk)} ours {o:.3g} ms = {o / f:.2f}x floor"
                     + (" (target <= 1.4)" if tgt else "") + extra, (o / f <= 1.4) if tgt else None)
        # fwd+bwd vs eager / compile / SDPA
        bigb = 8 * K if not self.a.tiny else cfg["bwd_n"][-1]
        targets = {("s1", False): 2.6, ("s1", True): 5.3, ("s2", False): 3.8, ("s2", True): 9.1}
        for st in ("s1", "s2", "both"):
            for c in (False, True):
                mode = f"fwd_bwd_{st}"
                o = self.get("fwd_bwd", "ours_auto", mode, c, bigb)
                if not o:
                    continue
                cs = "causal    " if c else "non-causal"
                e, note = base("fwd_bwd", "eager", mode, c, bigb, (st, "eager", c, bigb))
                if e:
                    tgt = targets.get((st, c))
                    line(f"fwd+bwd {st:<4} N={bigb} {cs} ours(auto) vs eager: x{e / o:.2f}" +
                         (f" (target >= {tgt})" if tgt else "") + note, (e / o >= tgt) if tgt else None)
                cb, note = base("fwd_bwd", "compile", mode, c, bigb, (st, "compile", c, bigb))
                if cb:
                    line(f"fwd+bwd {st:<4} N={bigb} {cs} ours(auto) vs compile: x{cb / o:.2f} (>= 1.0 'competitive'){note}",
                         cb / o >= 1.0)
        # fused vs separate
        nk = cfg["smallq_nk"]
        for st in ("s1", "s2", "both"):
            parts, auto_ok = [], True
            for nq in cfg["smallq_nq"]:
                fu = self.get("smallq_bwd", "ours_fused", f"fwd_bwd_{st}", False, nq, nk)
                se = self.get("smallq_bwd", "ours_separate", f"fwd_bwd_{st}", False, nq, nk)
                au = self.get("smallq_bwd", "ours_auto", f"fwd_bwd_{st}", False, nq, nk)
                if fu and se:
                    parts.append(f"{nq}:{se / fu:.2f}")
                    if au:
                        auto_ok = auto_ok and au <= 1.1 * min(fu, se)
            if parts:
                line(f"separate/fused {st:<4} NK={fmt_n(nk)} by NQ: " + " ".join(parts) + " (paper: up to 2.0)", None)
                line(f"      ... auto within 10% of the faster mode at every NQ ({st})", auto_ok)
        # long
        for r in self.rows:
            if r["kernel"] == "long" and r["n_q"] == max(cfg["long_n"]):
                ok = r["status"] == "ok"
                line(f"long N={fmt_n(r['n_q'])} H={r['h']} causal {r['mode']}: {r['status']} p50={r['p50_ms'] or '-'} ms "
                     f"peak_extra={r['peak_extra_gib'] or '-'} GiB (fits)", ok)
        mem = [(r["n_q"], float(r["peak_extra_gib"])) for r in self.rows if r["kernel"] == "long" and r["mode"] == "fwd"
               and r["status"] == "ok" and r["peak_extra_gib"]]
        if mem:
            L.append("ours fwd peak extra GiB vs N: " + " ".join(f"{fmt_n(n)}:{g:.3g}" for n, g in mem)
                     + "  (O(N_Q) outputs only: KL + saved LSEs)")
        if self.section_errors:
            L.append("SECTION ERRORS: " + "; ".join(self.section_errors))
        L = L[:60]
        txt = "\n".join(L)
        with open(os.path.join(self.a.out, "summary.txt"), "w") as f:
            f.write(txt + "\n")
        print(txt, flush=True)
        self.log_f.write(txt + "\n")
