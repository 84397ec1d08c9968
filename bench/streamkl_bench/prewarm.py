"""Prewarm: the same calls in parallel worker processes, to fill the on-disk compile caches
(Triton: ~/.triton/cache; Inductor: /tmp/torchinductor_*) before the serial, timed run.
A worker is ``bench_gpu.py --_worker JOBS.json``; its log lines are ``JOB ok ...`` / ``JOB fail ...``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from . import ROOT, SCRIPT, child_env
from .cases import SETTINGS


def prewarm_jobs(r):
    cfg, secs, H, D = r.cfg, r.a.sections, r.cfg["H"], r.cfg["D"]
    jobs = []  # (estimated seconds, job)
    if "check" in secs and r.ak is not None:
        for i, _ in enumerate(r.check_cases()):
            jobs.append((8, {"t": "case", "i": i}))
        jobs += [(8, {"t": "splitk"}), (6, {"t": "determinism"})]
    if r.ak is not None:
        if "fwd" in secs or "bwd" in secs:
            n = 1024 if not r.a.tiny else cfg["fwd_n"][0]
            for c in (False, True):  # H=16, N=1K: same int specialisations as H=32, N=1K..64K (all % 16 == 0)
                jobs.append((6, {"t": "fwd", "H": max(16, H // 2) if not r.a.tiny else H, "NQ": n, "NK": n,
                                 "causal": c, "split_k": 1}))
        if "bwd" in secs or "smallq" in secs:
            n = 1024 if not r.a.tiny else cfg["bwd_n"][0]
            for st in ("s1", "s2", "both"):
                for m in ("fused", "separate"):
                    for c in ((False, True) if "bwd" in secs else (False,)):
                        jobs.append((20 if m == "separate" else 12,
                                     {"t": "fb", "H": max(16, H // 2) if not r.a.tiny else H, "N": n,
                                      "setting": st, "mode": m, "causal": c}))
        if "decode" in secs:
            for nq, nk in cfg["decode"]:
                for sk in (None, 1):
                    jobs.append((4, {"t": "fwd", "H": H, "NQ": nq, "NK": nk, "causal": False, "split_k": sk}))
        if "smallq" in secs:
            for nq in cfg["smallq_nq"]:
                jobs.append((4, {"t": "fwd", "H": H, "NQ": nq, "NK": cfg["smallq_nk"], "causal": False, "split_k": None}))
        if "long" in secs:
            n = cfg["long_n"][0]
            jobs.append((5, {"t": "fwd", "H": cfg["long_h"], "NQ": n, "NK": n, "causal": True, "split_k": None,
                             "autotune": "0"}))
            jobs.append((8, {"t": "fb", "H": cfg["long_h"], "N": n, "setting": "s1", "mode": "auto", "causal": True,
                             "autotune": "0"}))
    compile_jobs = []  # in priority order: the summary's N = 8K first
    if r.cuda:
        if "bwd" in secs and cfg["compile_bwd_n"]:
            n = cfg["compile_bwd_n"][0]
            for st in cfg["compile_bwd_settings"]:
                for c in (False, True):
                    compile_jobs.append((45, {"t": "compile", "n": n, "setting": st, "causal": c}))
        if "fwd" in secs:
            for n in cfg["compile_fwd_n"]:
                for c in (False, True):
                    compile_jobs.insert(0 if n == 8192 else len(compile_jobs),
                                        (25, {"t": "compile", "n": n, "setting": None, "causal": c}))
    return jobs, compile_jobs


def assign(jobs, compile_jobs, n_workers, n_compile_workers):
    """Longest-first greedy; torch.compile jobs (GPU memory: up to ~20 GB each at 8K) on at most
    n_compile_workers workers."""
    loads = [0.0] * n_workers
    plan = [[] for _ in range(n_workers)]
    for est, j in compile_jobs:  # kept in priority order
        w = min(range(max(1, n_compile_workers)), key=lambda i: loads[i])
        plan[w].append(j)
        loads[w] += est
    for est, j in sorted(jobs, key=lambda x: -x[0]):
        w = min(range(n_workers), key=lambda i: loads[i])
        plan[w].append(j)
        loads[w] += est
    return [p for p in plan if p], max(loads) if loads else 0.0


def run_prewarm(r):
    import tempfile
    jobs, compile_jobs = prewarm_jobs(r)
    if not jobs and not compile_jobs:
        r.log("prewarm: nothing to do")
        return
    nw = r.a.prewarm_workers or max(1, min(12, (os.cpu_count() or 4) - 2))
    plan, est = assign(jobs, compile_jobs, nw, min(4, nw))
    tmp = tempfile.mkdtemp(prefix="streamkl_prewarm_")  # the workers' own CSVs (discarded)
    logs = os.path.join(r.a.out, "prewarm_logs")  # their logs come back with the results
    os.makedirs(logs, exist_ok=True)
    procs = []
    for i, p in enumerate(plan):
        jf = os.path.join(tmp, f"jobs{i}.json")
        with open(jf, "w") as f:
            json.dump(p, f)
        cmd = [sys.executable, SCRIPT, "--_worker", jf, "--device", r.a.device,
               "--out", os.path.join(tmp, f"w{i}"), "--seed", str(r.a.seed)]
        if r.a.tiny:
            cmd.append("--tiny")
        if r.a.quick:
            cmd.append("--quick")
        if r.a.full_check:
            cmd.append("--full-check")
        logf = open(os.path.join(logs, f"w{i}.log"), "w")
        procs.append((subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT,
                                       env=child_env()), logf, i))
    r.log(f"prewarm: {len(jobs) + len(compile_jobs)} jobs on {len(procs)} worker processes "
          f"(longest worker ~{est:.0f}s of work by the static estimates; logs in {logs})")
    deadline = time.perf_counter() + max(10.0, r.budget.remaining())
    while time.perf_counter() < deadline and any(p.poll() is None for p, _, _ in procs):
        time.sleep(0.5)
    killed = 0
    for p, logf, i in procs:
        if p.poll() is None:  # past the budget: stop this worker (only processes started here)
            p.kill()
            p.wait()
            killed += 1
        logf.close()
    done = fails = 0
    for _, _, i in procs:
        try:
            with open(os.path.join(logs, f"w{i}.log")) as f:
                for line in f:
                    if line.startswith("JOB ok"):
                        done += 1
                    elif line.startswith("JOB fail"):
                        fails += 1
                        r.log(f"  prewarm worker {i}: {line.strip()[:200]}", stdout=False)
        except OSError:
            pass
    r.log(f"prewarm: {done} jobs done, {fails} failed, {killed} workers stopped at the budget")
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)


def worker_main(r, jobfile):
    torch = r.torch
    with open(jobfile) as f:
        jobs = json.load(f)
    cases = r.check_cases() if any(j["t"] == "case" for j in jobs) else []
    for j in jobs:
        t = time.perf_counter()
        old = os.environ.get("STREAMKL_AUTOTUNE")
        try:
            if j["t"] in ("case", "splitk", "determinism"):
                os.environ["STREAMKL_AUTOTUNE"] = "0"
                if j["t"] == "case":
                    r.run_case(cases[j["i"]])
                elif j["t"] == "splitk":
                    r.check_splitk()
                else:
                    r.check_determinism()
            elif j["t"] == "fwd":
                if "autotune" in j:
                    os.environ["STREAMKL_AUTOTUNE"] = j["autotune"]
                d = r.inputs(1, j["H"], j["NQ"], j["NK"], r.cfg["D"], r.cfg["D"], "bf16", g=False)[0]
                r.f_ours_fwd(j["causal"], j["split_k"])(d)
            elif j["t"] == "fb":
                if "autotune" in j:
                    os.environ["STREAMKL_AUTOTUNE"] = j["autotune"]
                d = r.inputs(1, j["H"], j["N"], j["N"], r.cfg["D"], r.cfg["D"], "bf16", req=SETTINGS[j["setting"]])[0]
                r.f_ours_fb(j["causal"], j["setting"], j["mode"])(d)
            elif j["t"] == "compile":
                n, st, c = j["n"], j["setting"], j["causal"]
                d = r.inputs(1, r.cfg["H"], n, n, r.cfg["D"], r.cfg["D"], "bf16", req=SETTINGS.get(st, ()))[0]
                comp = r.compiled_kl()
                (r.f_eager_fwd(c, comp) if st is None else r.f_eager_fb(c, st, comp))(d)
            r.sync()
            print(f"JOB ok {json.dumps(j)} {time.perf_counter() - t:.1f}s", flush=True)
        except Exception as e:
            print(f"JOB fail {json.dumps(j)} {type(e).__name__}: {str(e)[:200]}", flush=True)
        finally:
            if old is None:
                os.environ.pop("STREAMKL_AUTOTUNE", None)
            else:
                os.environ["STREAMKL_AUTOTUNE"] = old
            r.free()
    return 0
