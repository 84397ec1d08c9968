"""Delegated sections: the feature modules (and ``compare_trees.py``), each run by bench_gpu.py as
``python -m streamkl_bench.<module> OUT/<section> ...`` (PYTHONPATH = bench/ and the repository
root) in its own process group, stdout and stderr in ``OUT/<section>/stdout.log``, under a time
limit (SIGINT, then SIGKILL after KILL_GRACE_S). A subprocess per section isolates failures (a
crash, a hang, a poisoned CUDA context) and frees its GPU memory before the next one starts.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass

from . import BENCH_DIR, ROOT, child_env

KILL_GRACE_S = 10.0  # between SIGINT (a script may flush its CSV) and SIGKILL
BUDGET_MARGIN_S = 30.0  # a script with its own budget option gets the limit minus this


@dataclass(frozen=True)
class Delegate:
    module: str  # streamkl_bench.<module>, or a script file under bench/ (ends in .py)
    doc: str
    budget_s: float  # the section's time limit in a full run
    quick_budget_s: float | None = None  # ... with --quick (default: budget_s)
    args: tuple = ()  # after OUT_DIR, unless --section-args replaces them
    quick_args: tuple = ()  # added with --quick
    tiny_args: tuple = ()  # added with --tiny
    cpu_args: tuple = ()  # added with --device cpu (TRITON_INTERPRET=1 is set for every section then)
    budget_flag: str | None = None  # the module's own time-budget option, given limit - BUDGET_MARGIN_S
    out_flag: str | None = None  # the output directory as this option's value (default: first argument)
    requires: str | None = None  # a path (from the repository root) without which it is 'skipped(absent)'
    env: tuple = ()  # (NAME, VALUE) pairs for its environment
    pythonpath: tuple = ()  # extra PYTHONPATH entries (from the repository root), where they exist

    def argv0(self):
        if self.module.endswith(".py"):
            return [os.path.join(BENCH_DIR, self.module)]
        return ["-m", self.module]


# the no-regression points of the NaN guards' cost (forward and setting 1's step at 8K)
NAN_COST_POINTS = "fwd_8k_nc,fwd_8k_c,step1_8k_nc,step1_8k_c"

# In the order `--sections extra` runs them. Limits are estimates for an H200 (not measured as sections yet).
DELEGATED = {
    "host": Delegate("streamkl_bench.host", "host cost per call at a tiny shape against SDPA's (forward, training "
                     "step, backward alone, engine floors; rotated rounds), cProfile", 240, args=("--profile",),
                     cpu_args=("--device", "cpu"), tiny_args=("--rounds", "1", "--calls", "2")),
    "first_call": Delegate("streamkl_bench.first_call", "first call per entry point in fresh processes with "
                           "empty caches: wall, kernels compiled, compile and tuning seconds", 480,
                           out_flag="--out", tiny_args=("--tiny",)),
    "first_call_big": Delegate("streamkl_bench.first_call", "the 2^31-element problems, each against its first "
                               "and last heads alone", 600, args=("--case", "big"), out_flag="--out",
                               tiny_args=("--tiny",)),
    "indexer": Delegate("streamkl_bench.indexer", "indexer loss, dense and top-k: checks vs float64, the training "
                        "step on every path vs torch.compile and the matmul floor", 480, quick_budget_s=300,
                        quick_args=("--quick",), tiny_args=("--tiny",), out_flag="--out"),
    "varlen": Delegate("streamkl_bench.varlen", "packed variable-length sequences: checks, packed vs per-sequence "
                       "vs padded", 180, quick_budget_s=120, quick_args=("--quick",), cpu_args=("--device", "cpu")),
    "cp": Delegate("streamkl_bench.context_parallel", "context parallel, world of 1 (a 1-rank group): vs "
                   "attention_kl, overhead at 32K", 240, tiny_args=("--tiny",), cpu_args=("--device", "cpu"),
                   budget_flag="--budget-s"),
    "nan": Delegate("streamkl_bench.nan_check", "NaN/inf isolation through the public API (bitwise vs the clean "
                    "run)", 150, tiny_args=("--tiny",)),
    "nan_cost": Delegate("compare_trees.py", "what the NaN-isolation guards cost at 8K: this tree vs the tree "
                         "before them (.legacy/fec3a94, carry it), alternating rounds", 240,
                         args=("--tree", "before=.legacy/fec3a94@fec3a94", "--tree", "after=.", "--points",
                               NAN_COST_POINTS, "--rounds", "3"), out_flag="--out", requires=".legacy/fec3a94",
                         env=(("STREAMKL_FWD_BACKEND", "triton"),)),
    "peers": Delegate("streamkl_bench.conformance_peers", "the conformance suite against public kernels "
                      "(F.kl_div, fla, Liger) and ours", 600, args=("--device", "cuda"), quick_args=("--quick",),
                      cpu_args=("--device", "cpu"), pythonpath=(".device/peers",)),
    "compare": Delegate("compare_trees.py", "no-regression: the tree in .legacy/before vs this one, alternating "
                        "rounds (or --section-args compare=\"--tree before=PATH --tree after=.\")", 570,
                        args=("--tree", "before=.legacy/before", "--tree", "after=."), out_flag="--out",
                        requires=".legacy/before"),
}


def parse_overrides(items, what, convert=str):
    """['name=value', ...] -> {name: convert(value)}; a ValueError names the bad item."""
    out = {}
    for it in items or []:
        name, sep, value = it.partition("=")
        if not sep or name not in DELEGATED:
            raise ValueError(f"{what}: expected NAME=VALUE with NAME one of {sorted(DELEGATED)}, got {it!r}")
        out[name] = convert(value)
    return out


def limit_for(name, a):
    """The section's own time limit in seconds (--section-budget wins, then --quick's, then the default)."""
    spec = DELEGATED[name]
    if name in a.section_budget:
        return a.section_budget[name]
    if a.quick and spec.quick_budget_s is not None:
        return spec.quick_budget_s
    return spec.budget_s


def command(name, a, out_dir, limit_s):
    spec = DELEGATED[name]
    args = list(shlex.split(a.section_args[name])) if name in a.section_args else list(spec.args)
    if a.quick:
        args += spec.quick_args
    if a.tiny:
        args += spec.tiny_args
    if a.device == "cpu":
        args += spec.cpu_args
    if spec.budget_flag and spec.budget_flag not in args:
        args += [spec.budget_flag, f"{max(10.0, limit_s - BUDGET_MARGIN_S):.0f}"]
    out = [spec.out_flag, out_dir] if spec.out_flag else [out_dir]
    return [sys.executable] + spec.argv0() + out + args


def run(name, a, out_dir, limit_s, log):
    """Run one delegated section; never raises. Returns dict(status, rc, seconds, command, note)."""
    spec = DELEGATED[name]
    t0 = time.perf_counter()
    res = dict(status="ok", rc="", seconds=0.0, command="", note="")
    needed = spec.requires and name not in a.section_args and os.path.join(ROOT, spec.requires)
    if needed and not os.path.exists(needed):
        res["status"], res["note"] = "skipped(absent)", f"{spec.requires} not found"
        return res
    cmd = command(name, a, out_dir, limit_s)
    res["command"] = " ".join(shlex.quote(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c) for c in cmd)
    extra = [os.path.join(ROOT, p) for p in spec.pythonpath if os.path.isdir(os.path.join(ROOT, p))]
    env = child_env(extra, PYTHONUNBUFFERED="1", **dict(spec.env))
    if a.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "stdout.log"), "w") as f, _stop_with_us() as group:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                    start_new_session=True)  # its own process group: children stop with it
            group.append(proc.pid)
            try:
                rc = proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                log(f"  {name}: past its limit of {limit_s:.0f}s: SIGINT to its process group {proc.pid}")
                _signal_group(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=KILL_GRACE_S)
                except subprocess.TimeoutExpired:
                    _signal_group(proc.pid, signal.SIGKILL)
                    proc.wait()
                res["status"], rc = "timeout", proc.returncode
            res["rc"] = rc
            if res["status"] == "ok" and rc != 0:
                res["status"] = f"failed(rc={rc})" if rc > 0 else f"failed(signal {-rc})"
    except Exception as e:  # could not start it (or the output dir): recorded, the run goes on
        res["status"], res["note"] = "error", f"{type(e).__name__}: {e}"
    res["seconds"] = time.perf_counter() - t0
    return res


@contextlib.contextmanager
def _stop_with_us():
    """The section's process group is not ours, so a signal that stops this process would not
    reach it: on SIGTERM / SIGHUP (a wall-clock limit) or Ctrl-C, kill the group first."""
    group = []

    def kill_group():
        for pgid in group:
            _signal_group(pgid, signal.SIGKILL)

    def on_signal(signum, frame):
        kill_group()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, on_signal)
        except ValueError:  # not the main thread: no handlers, the group may outlive us
            pass
    try:
        yield group
    except BaseException:
        kill_group()
        raise
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _signal_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def tail(path, n_lines, width=200):
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        return [f"({type(e).__name__}: {e})"]
    return [ln[:width] for ln in lines[-n_lines:]]


def pack(out_dir, name="results.tgz"):
    """Everything under out_dir (but the archive itself) into out_dir/name; returns (path, n_files)."""
    final = os.path.join(out_dir, name)
    tmp = final + ".tmp"
    n = 0
    with tarfile.open(tmp, "w:gz") as tar:
        for dirpath, dirnames, filenames in os.walk(out_dir):
            dirnames.sort()
            for fn in sorted(filenames):
                p = os.path.join(dirpath, fn)
                if os.path.abspath(p) in (os.path.abspath(final), os.path.abspath(tmp)):
                    continue
                tar.add(p, arcname=os.path.relpath(p, out_dir))
                n += 1
    os.replace(tmp, final)
    return final, n
