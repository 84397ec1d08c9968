"""`streamkl verify --jobs N`: the own-kernel battery as units (one per case), checked in worker
processes, gives the rows of a run in one process; a unit's inputs are its own whatever runs
before it; a unit that raises, or whose worker process dies, fails the gate by name (on CPU,
under the Triton interpreter: the smallest cases only)."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from streamkl_gpu import verify
from streamkl_ref.testing import Row

ROOT = Path(__file__).resolve().parents[1]
# cheap cases with non-zero errors; indexer:gqa costs the most, so with --jobs 2 it starts first
CHEAP = ["causal_nq<nk", "nan_keys", "indexer:gqa"]


def _cli(out, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "streamkl_ref", "verify", "--device", "cpu", *args, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_jobs_2_gives_the_rows_of_one_process(tmp_path):
    one, one_report = _cli(tmp_path / "one.json", "--only", ",".join(CHEAP), "--jobs", "1")
    two, two_report = _cli(tmp_path / "two.json", "--only", ",".join(CHEAP), "--jobs", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-3000:] + two.stderr[-3000:]
    assert (one_report["jobs"], two_report["jobs"]) == (1, 2)
    # every row, bit for bit (errors, tolerances, status, and the interpreter's summed launch counts)
    assert two_report["rows"] == one_report["rows"]
    assert any(r["error"] > 0 for r in one_report["rows"])  # not only exact zeros compared
    assert [r["case"] for r in one_report["rows"]][-1] == "interpreter"
    assert list(two_report["cases"]) == list(one_report["cases"]) == CHEAP  # the battery's order
    assert list(two_report["case_seconds"]) == list(one_report["case_seconds"])
    for label in one_report["case_seconds"]:  # each worker prints its progress lines
        assert f"   {label}: compile" in two.stderr


def _cpu_run(seed=0):
    return verify.RunSettings(device="cpu", seed=seed, quiet=True, t_start=0.0)


def _unit(name, dtypes=("float32",)):
    unit = next(u for u in verify.own_units("cpu") if u.name == name)
    return dataclasses.replace(unit, dtypes=dtypes)


def test_a_units_rows_do_not_depend_on_the_units_before_it():
    a, b = _unit("causal_nq<nk"), _unit("causal_nq>nk")
    ab, ba = verify.run_units([a, b], _cpu_run(), 1), verify.run_units([b, a], _cpu_run(), 1)
    assert ab[0].rows == ba[1].rows and ab[1].rows == ba[0].rows
    assert ab[1].rows == verify.run_units([b], _cpu_run(), 1)[0].rows
    other_seed = verify.run_units([b], _cpu_run(seed=1), 1)[0].rows
    assert [r.error for r in other_seed] != [r.error for r in ab[1].rows]  # the seed does reach the inputs


def _raises_in_float16(case, dname, seed, device, report):
    if dname == "float16":
        raise RuntimeError(f"planted failure in {case}")
    # what the worker process sees of the environment main() set up
    report.rows.append(Row(case, dname, "env", 0.0, 0.0, "pass", os.environ.get("STREAMKL_AUTOTUNE", "unset")))


def _kills_its_process(case, dname, seed, device, report):
    os._exit(3)


def test_a_unit_that_raises_fails_verify_by_name(tmp_path, monkeypatch, capfd):
    bad = verify.Unit("raising_unit", _raises_in_float16, "raising_unit", ("float32", "float16"), (16,))
    units = [bad, _unit("causal_nq<nk")]
    monkeypatch.setattr(verify, "own_units", lambda *a, **k: units)
    monkeypatch.setenv("STREAMKL_AUTOTUNE", "0")
    out = tmp_path / "r.json"
    assert verify.main(["--device", "cpu", "--jobs", "2", "--autotune", "--json", str(out)]) == 1
    captured = capfd.readouterr()
    assert "streamkl verify: FAIL, raising_unit float16 raised:" in captured.err
    assert "RuntimeError: planted failure in raising_unit" in captured.err and "Traceback" in captured.err
    rows = json.loads(out.read_text())["rows"]
    failed = [r for r in rows if not r["pass"]]
    assert [(r["case"], r["dtype"], r["quantity"]) for r in failed] == [("raising_unit", "float16", "(check)")]
    assert "RuntimeError: planted failure" in failed[0]["why"]
    assert ("raising_unit", "float32", "env", "1") in {(r["case"], r["dtype"], r["quantity"], r["why"]) for r in rows}
    assert any(r["case"] == "causal_nq<nk" and r["quantity"] == "kl" and r["pass"] for r in rows)
    assert os.environ["STREAMKL_AUTOTUNE"] == "0"  # main() restores it


def test_a_dead_worker_fails_verify_and_does_not_hang(tmp_path, monkeypatch, capfd):
    dying = verify.Unit("dying_unit", _kills_its_process, "dying_unit", ("float32",), (16,))
    units = [_unit("n=1"), dying]
    monkeypatch.setattr(verify, "own_units", lambda *a, **k: units)
    out = tmp_path / "r.json"
    assert verify.main(["--device", "cpu", "--jobs", "2", "-q", "--json", str(out)]) == 1
    assert "streamkl verify: FAIL, dying_unit float32: not checked: BrokenProcessPool" in capfd.readouterr().err
    rows = {(r["case"], r["dtype"]): r for r in json.loads(out.read_text())["rows"]}
    assert not rows["dying_unit", "float32"]["pass"] and "not checked" in rows["dying_unit", "float32"]["why"]


def test_workers_get_the_most_expensive_units_first():
    units = [_unit(name) for name in CHEAP] + [_unit("tiles_300")]
    order = [(units[i].name, d) for i, d in verify.hand_out_order(units)]
    assert order == [("indexer:gqa", "float32"), ("causal_nq<nk", "float32"), ("nan_keys", "float32"),
                     ("tiles_300", "float32")]  # ties: in battery order
    gpu = verify.own_units("cuda")
    pairs = [(gpu[i].name, d) for i, d in verify.hand_out_order(gpu)]
    assert pairs[:3] == [("indexer:big_mla_576", "bfloat16"), ("wide_heads_d256_d192", "bfloat16"),
                         ("big_d128_d64", "bfloat16")]
    # one dtype of one case at a time: every pair of the battery exactly once, float32 before
    # the 16-bit dtypes of the same case
    assert sorted(pairs) == sorted((u.name, d) for u in gpu for d in u.dtypes)
    ragged = [d for name, d in pairs if name == "ragged"]
    assert ragged[0] == "float32" and set(ragged) == {"float32", "float16", "bfloat16"}


def test_jobs_defaults_and_usage_errors(capsys):
    assert verify.default_jobs("cpu") == 1 and 1 <= verify.default_jobs("cuda") <= verify.MAX_DEFAULT_JOBS
    assert verify.main(["--jobs", "0"]) == 2
    assert verify.main(["--impl", "x:y", "--jobs", "2"]) == 2
    assert verify.main(["--seed", "-1"]) == 2
    assert verify.main(["--device", "cpu", "--only", "no_such_case"]) == 2
    err = capsys.readouterr().err
    assert "--jobs must be at least 1" in err and "do not go with --impl" in err and "no case no_such_case" in err


def test_workers_start_before_torch_where_the_device_is_known_without_it(monkeypatch):
    """`start_workers_early`: a pool only where the run will use one and the device needs no torch
    to know (an explicit device, or auto with a GPU's device nodes); never for a run in one process."""
    started = []

    class Pool:
        def __init__(self, jobs, **kw):
            started.append(jobs)
            self.submitted = 0

        def submit(self, fn, *args):
            self.submitted += 1

    import concurrent.futures

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = lambda *argv: verify._parse(list(argv))  # noqa: E731
    cheap = ",".join(CHEAP)
    early = verify.start_workers_early(args("--device", "cpu", "--jobs", "2", "--only", cheap))
    assert (early.device, early.jobs, early.pool.submitted, started) == ("cpu", 2, 2, [2])
    assert os.environ["TRITON_INTERPRET"] == "1"  # set before the workers import the kernels
    # one unit: one worker, in this process; no --jobs on CPU; --impl; a device torch must tell
    assert verify.start_workers_early(args("--device", "cpu", "--jobs", "2", "--only", "n=1")) is None
    assert verify.start_workers_early(args("--device", "cpu")) is None
    assert verify.start_workers_early(args("--impl", "x:y")) is None
    monkeypatch.setattr(verify, "_gpu_visible", lambda: False)
    assert verify.start_workers_early(args("--device", "auto")) is None
    monkeypatch.setattr(verify, "_gpu_visible", lambda: True)
    monkeypatch.setattr(verify, "default_jobs", lambda device: 8)
    early = verify.start_workers_early(args("--device", "auto", "--only", cheap))
    assert (early.device, early.jobs, started[1:]) == ("cuda", 3, [3])  # at most one per case
