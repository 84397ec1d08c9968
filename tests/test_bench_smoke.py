"""CPU smoke test of bench/bench_gpu.py: the tiny end-to-end run under the Triton interpreter.

Runs ``bench/bench_gpu.py --device cpu --tiny --sections env,check,fwd`` in a subprocess (the script
sets TRITON_INTERPRET=1 before importing streamkl_gpu; it is set here too) and checks the CSVs:
the columns, that every correctness row passed, that the forward rows include our kernel and both
SDPA providers (default dispatch and flash backend), and what the summary says about them.
About 50 s in the suite on a 2-core machine (the check section, ~38 s). torch, triton and streamkl_gpu are plain imports: a missing
install step fails this test, it is never skipped.
"""
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch  # noqa: F401  (a missing install must fail, not skip)
import triton  # noqa: F401

import streamkl_gpu  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_gpu.py"

BENCH_COLUMNS = ["kernel", "provider", "mode", "causal", "n_q", "n_k", "b", "h", "d1", "d2", "dtype",
                 "p20_ms", "p50_ms", "p80_ms", "peak_extra_gib", "status", "gpu", "torch", "triton",
                 "date", "streamkl_version", "extra"]
CHECK_COLUMNS = ["case", "dtype", "setting", "err", "tol", "pass", "tensor", "eager_err", "detail"]


def _read(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_bench_tiny_cpu(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--sections", "env,check,fwd", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail

    env_json = json.loads((tmp_path / "env.json").read_text())
    assert {"gpu", "driver", "torch", "triton", "commit", "command"} <= set(env_json), env_json
    cols, results = _read(tmp_path / "results.csv")  # every CSV of the run, one long format
    assert cols[:4] == ["gpu_name", "timestamp", "version", "commit"]
    assert {r["file"] for r in results} >= {"bench.csv", "check.csv", "sections.csv"}
    cols, checks = _read(tmp_path / "check.csv")
    assert cols == CHECK_COLUMNS
    assert len(checks) >= 50, tail
    failed = [r for r in checks if r["pass"] != "True"]
    assert not failed, failed[:5]
    for r in checks:
        if r["err"] and r["tol"]:
            assert float(r["err"]) <= float(r["tol"])
    settings = {r["setting"] for r in checks}
    assert {"fwd", "s1", "s2", "both"} <= settings
    assert {"fp32", "fp16", "bf16"} <= {r["dtype"] for r in checks}
    assert any("split" in r["tensor"] for r in checks)
    assert any("bitwise" in r["tensor"] for r in checks)

    cols, rows = _read(tmp_path / "bench.csv")
    assert cols == BENCH_COLUMNS
    fwd = [r for r in rows if r["kernel"] == "fwd"]
    providers = {r["provider"] for r in fwd if r["status"] == "ok"}
    assert {"ours", "sdpa", "sdpa_flash", "eager", "chunked"} <= providers, providers
    for r in fwd:
        if r["status"] == "ok":
            assert 0 < float(r["p20_ms"]) <= float(r["p50_ms"]) <= float(r["p80_ms"])
        if r["provider"] == "sdpa":
            assert "sdpa_backend=default" in r["extra"], r
        if r["provider"] == "sdpa_flash":
            assert "sdpa_backend=flash" in r["extra"], r
    assert {r["causal"] for r in fwd} == {"0", "1"}

    summary = (tmp_path / "summary.txt").read_text()
    assert summary.count("\n") <= 60
    # ours/SDPA lines: against the faster SDPA provider, named per N (d = default dispatch, f = flash)
    sdpa_lines = [ln for ln in summary.splitlines() if ln.startswith("fwd ours/SDPA")]
    assert len(sdpa_lines) == 2, summary
    for ln in sdpa_lines:
        assert re.search(r":\d+\.\d\d[df] ", ln), ln
        assert ln.rstrip().endswith(("PASS", "MISS")), ln
    assert "faster of the two" in summary
    # ... and the ratio and letter are ours / min(sdpa, sdpa_flash) at each N, from bench.csv itself
    p50 = {(r["provider"], r["causal"], r["n_q"]): float(r["p50_ms"]) for r in fwd if r["status"] == "ok"}
    for ln, c in zip(sdpa_lines, ("0", "1")):
        assert ln.startswith("fwd ours/SDPA " + ("causal " if c == "1" else "non-causal ")), ln
        for n in sorted({k[2] for k in p50 if k[1] == c}, key=int):
            d, f = p50[("sdpa", c, n)], p50[("sdpa_flash", c, n)]
            want = f"{n}:{p50[('ours', c, n)] / min(d, f):.2f}{'d' if d <= f else 'f'}"
            assert want in ln, (want, ln)
    # the matmul rate vs the anchors' 756 TFLOP/s (on CPU: labelled as not comparable)
    assert re.search(r"^env: fp32 matmul 512\^3 .* TFLOP/s on CPU \(not comparable .*756", summary, re.M), summary
    assert re.search(r"^env: copy .* the anchors' 4.14", summary, re.M), summary
