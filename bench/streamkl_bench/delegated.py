"""Delegated sections: the per-feature GPU scripts, each run as one section of bench_gpu.py.

Every script takes an output directory as its first argument. A delegated section runs it as a
subprocess (``python bench/<script> OUT/<section> ...``) in its own process group, with stdout and
stderr in ``OUT/<section>/stdout.log``, under a time limit: past it the group gets SIGINT, then
SIGKILL after KILL_GRACE_S. A subprocess per section isolates failures (a crash, a hang, a CUDA
error that poisons the context) and frees the section's GPU memory before the next one starts.
The scripts themselves are not changed here; their owners keep them runnable on their own.
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

from . import BENCH_DIR, ROOT

KILL_GRACE_S = 10.0  # between SIGINT (a script may flush its CSV) and SIGKILL
BUDGET_MARGIN_S = 30.0  # a script with its own budget option gets the limit minus this


@dataclass(frozen=True)
class Delegate:
    script: str  # file under bench/ (or an absolute path)
    doc: str
    budget_s: float  # the section's time limit in a full run
    quick_budget_s: float | None = None  # ... with --quick (default: budget_s)
    args: tuple = ()  # after OUT_DIR, unless --section-args replaces them
    quick_args: tuple = ()  # added with --quick
    tiny_args: tuple = ()  # added with --tiny
    cpu_args: tuple = ()  # added with --device cpu (TRITON_INTERPRET=1 is set for every section then)
    budget_flag: str | None = None  # the script's own time-budget option, given limit - BUDGET_MARGIN_S
    optional: bool = False  # a missing script is 'skipped(absent)', not a failure

    def path(self):
        return self.script if os.path.isabs(self.script) else os.path.join(BENCH_DIR, self.script)


# In the order `--sections extra` runs them. Limits are estimates for an H200 (not measured as sections yet).
DELEGATED = {
    "host": Delegate("host_cost.py", "host cost per call (1000 tiny calls, fwd and fwd+bwd), cProfile, "
                     "first call at 512K / 16K in fresh processes", 240, args=("--profile", "--first-call")),
    "decode_sweep": Delegate("decode_sweep.py", "decode grid N_Q {1,16,64} x N_K {32K,128K} x B {1,8}: auto "
                             "split_k vs every power of two, copy floor", 180),
    "gluon": Delegate("gluon_gpu.py", "Gluon forward: check vs Triton and float64, SASS, targets, grid", 300,
                      quick_budget_s=200, quick_args=("--quick",), budget_flag="--budget"),
    "indexer": Delegate("indexer_gpu.py", "indexer loss: checks vs float64, timings dsa/gqa configs", 360,
                        quick_budget_s=200, quick_args=("--quick",), tiny_args=("--tiny",)),
    "varlen": Delegate("varlen_gpu.py", "packed variable-length sequences: checks, packed vs per-sequence "
                       "vs padded", 180, quick_budget_s=120, quick_args=("--quick",), cpu_args=("--device", "cpu")),
    "cp": Delegate("context_parallel_gpu.py", "context parallel, world of 1 (a 1-rank group): vs "
                   "attention_kl, overhead at 32K", 240, tiny_args=("--tiny",), cpu_args=("--device", "cpu"),
                   budget_flag="--budget-s"),
    "bwd_variants": Delegate("bwd_gpu.py", "Triton backward variants: checks vs float64 and the previous "
                             "kernels, backward vs SDPA's at 8K/16K, torch.compile 8K", 600, quick_budget_s=240,
                             quick_args=("--quick",), tiny_args=("--tiny",), budget_flag="--budget-s"),
    "gluon_bwd": Delegate("gluon_bwd_gpu.py", "Gluon backward (forced): checks vs Triton and float64, SASS, "
                          "backward vs SDPA's", 450, quick_budget_s=130, quick_args=("--quick",),
                          budget_flag="--budget"),
    "indexer_perf": Delegate("indexer_perf_gpu.py", "indexer loss: every launch candidate forced, vs float64, "
                             "the floor and torch.compile", 600, quick_budget_s=150, quick_args=("--quick",),
                             tiny_args=("--tiny",), budget_flag="--budget"),
    # the indexer's forward candidate sweeps and its training designs (each compiles its variants in
    # parallel children, then times them at 8K+; every one has a --tiny CPU smoke)
    "idx_dsa": Delegate("idx_dsa_gpu.py", "indexer DSA-like forward candidates, 8K-64K, vs the floor", 400,
                        quick_budget_s=115, quick_args=("--quick",), tiny_args=("--tiny",), budget_flag="--deadline"),
    "idx_gqa": Delegate("idx_gqa_gpu.py", "indexer GQA-like forward candidates, 8K-64K, vs the floor", 400,
                        quick_budget_s=90, quick_args=("--quick",), tiny_args=("--tiny",), budget_flag="--deadline"),
    "idx_pacc": Delegate("idx_pacc_gpu.py", "indexer fwd+bwd designs (accumulating, chunk) at 8K DSA-like, "
                         "forward and backward alone, vs float64", 400, quick_budget_s=170, quick_args=("--quick",),
                         tiny_args=("--tiny",), budget_flag="--deadline"),
    "nan": Delegate("nan_check.py", "NaN/inf isolation through the public API (bitwise vs the clean run)", 150,
                    tiny_args=("--tiny",), optional=True),
    "nan_cost": Delegate("nan_cost.py", "what the NaN-isolation guards cost at 8K: this tree vs the legacy "
                         "tree (.legacy/fec3a94, carry it), interleaved", 180, optional=True),
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
    return [sys.executable, spec.path(), out_dir] + args


def run(name, a, out_dir, limit_s, log):
    """Run one delegated section; never raises. Returns dict(status, rc, seconds, command, note)."""
    spec = DELEGATED[name]
    t0 = time.perf_counter()
    res = dict(status="ok", rc="", seconds=0.0, command="", note="")
    if not os.path.exists(spec.path()):
        res["status"] = "skipped(absent)" if spec.optional else "error"
        res["note"] = f"{spec.path()} not found"
        return res
    cmd = command(name, a, out_dir, limit_s)
    res["command"] = " ".join(shlex.quote(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c) for c in cmd)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
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
