"""CPU smoke test of bench/bench_gpu.py's section dispatch (no kernels run).

Fake delegated sections (tiny scripts written here) fail, hang past their limit, are absent, and
succeed; an in-process section raises. Each is recorded in sections.csv and the summary, the run
goes on to the next, the hung script's process is gone afterwards, a section's arguments reach
its script, and --pack puts every output into results.tgz. torch, triton and streamkl_gpu are plain
imports: a missing install fails this test, it is never skipped.
"""
import csv
import json
import os
import tarfile
import time

import torch  # noqa: F401  (a missing install must fail, not skip)
import triton  # noqa: F401

import streamkl_gpu  # noqa: F401

from streamkl_bench import delegated, runner  # bench/ is on pytest's pythonpath (pyproject.toml)


def _script(tmp_path, name, body):
    p = tmp_path / "scripts" / name
    p.parent.mkdir(exist_ok=True)
    p.write_text(body)
    return str(p)


def test_section_dispatch_records_failures_and_goes_on(tmp_path, monkeypatch, capsys):
    pid_file = tmp_path / "slow.pid"
    fail = _script(tmp_path, "fail.py", "import sys\nprint('fake failure')\nsys.exit(2)\n")
    slow = _script(tmp_path, "slow.py", f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                                        "print('sleeping', flush=True)\ntime.sleep(120)\n")
    ok = _script(tmp_path, "ok.py", "import os, sys\nopen(os.path.join(sys.argv[1], 'result.txt'), 'w')"
                                    ".write(' '.join(sys.argv[2:]))\nprint('fake ok table')\n")
    D = delegated.Delegate
    monkeypatch.setitem(delegated.DELEGATED, "fake_fail", D(fail, "exits 2", 30))
    monkeypatch.setitem(delegated.DELEGATED, "fake_slow", D(slow, "hangs", 60))
    monkeypatch.setitem(delegated.DELEGATED, "fake_absent", D(ok, "absent", 30, requires=str(tmp_path / "nope")))
    monkeypatch.setitem(delegated.DELEGATED, "fake_ok", D(ok, "writes a file", 60, args=("--a",), tiny_args=("--tiny",),
                                                          budget_flag="--budget"))

    def sec_env_raises(self):
        raise RuntimeError("fake in-process failure")
    monkeypatch.setattr(runner.Runner, "sec_env", sec_env_raises)
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    out = tmp_path / "out"
    t0 = time.monotonic()
    rc = runner.main(["--device", "cpu", "--tiny", "--out", str(out), "--pack",
                      "--sections", "env,fake_fail,fake_slow,fake_absent,fake_ok",
                      "--section-budget", "fake_slow=2", "--section-args", "fake_ok=--b"])
    took = time.monotonic() - t0
    printed = capsys.readouterr().out
    assert rc == 3, printed[-3000:]
    assert took < 60, took

    with open(out / "sections.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["section", "kind", "status", "rc", "seconds", "limit_s", "out", "command", "note"]
        rows = {r["section"]: r for r in reader}
    assert list(rows) == ["env", "fake_fail", "fake_slow", "fake_absent", "fake_ok"]
    assert rows["env"]["kind"] == "core" and rows["env"]["status"] == "error"
    assert "fake in-process failure" in rows["env"]["note"]
    assert rows["fake_fail"]["status"] == "failed(rc=2)" and rows["fake_fail"]["rc"] == "2"
    assert rows["fake_slow"]["status"] == "timeout" and rows["fake_slow"]["limit_s"] == "2"
    assert float(rows["fake_slow"]["seconds"]) < 2 + delegated.KILL_GRACE_S + 5
    assert rows["fake_absent"]["status"] == "skipped(absent)"
    assert rows["fake_ok"]["status"] == "ok" and rows["fake_ok"]["rc"] == "0"

    # the hung script (its process group) was stopped
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, pid
    # each section writes under out/<section>/; the arguments: --section-args, then --tiny's, then the budget
    assert "fake failure" in (out / "fake_fail" / "stdout.log").read_text()
    assert (out / "fake_ok" / "result.txt").read_text() == "--b --tiny --budget 30"

    summary = (out / "summary.txt").read_text()
    assert summary.count("\n") <= 60
    lines = summary.splitlines()
    assert any(ln.startswith("section fake_fail: failed(rc=2)") and ln.endswith("MISS") for ln in lines), summary
    assert any(ln.startswith("section fake_slow: timeout") and ln.endswith("MISS") for ln in lines), summary
    assert any(ln.startswith("section fake_ok: ok") and ln.endswith("PASS") for ln in lines), summary
    err = next(ln for ln in lines if ln.startswith("SECTION ERRORS"))
    assert "env: RuntimeError" in err and "fake_fail: failed(rc=2)" in err and "fake_slow: timeout" in err
    assert "fake_ok" not in err and "fake_absent" not in err
    # the delegated sections' stdout tails, then the summary last
    assert "fake ok table" in printed
    assert printed.index("fake ok table") < printed.index("== streamkl summary")

    with tarfile.open(out / "results.tgz") as tar:
        names = set(tar.getnames())
    assert {"sections.csv", "summary.txt", "bench.csv", "bench.log", "fake_ok/result.txt",
            "fake_fail/stdout.log"} <= names, names
    assert not any(n.startswith("results.tgz") for n in names)
    # the results layout: env.json names the commit and the exact command; results.csv holds every
    # CSV of the run in one long format, each row with its section's run status
    env = json.loads((out / "env.json").read_text())
    assert env["commit"] and env["command"].startswith("python ") and env["gpu"] and env["torch"] and env["triton"]
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames[:7] == ["gpu_name", "timestamp", "version", "commit", "section", "file", "run_status"]
        rows = list(reader)
    by_file = {r["file"] for r in rows}
    assert "sections.csv" in by_file
    assert {r["run_status"] for r in rows if r["file"] == "sections.csv" and r["section"] == "run"} >= {"timeout"}
