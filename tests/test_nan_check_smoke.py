"""CPU smoke run of the benchmark's ``nan`` section (bench/streamkl_bench/nan_check.py, the GPU NaN-isolation check) under the Triton interpreter:
its tiny shapes pass, every path compared unreached entries (and had reached ones), and the table ends
with ALL PASS.
(That the check can fail was seen by running it on the unfixed kernels: every path FAILed.)"""
import csv

import pytest
import torch  # noqa: F401  (a missing install must fail, not skip)

import streamkl_gpu  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN arithmetic is the point


def test_nan_check_tiny_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STREAMKL_AUTOTUNE", "0")  # restored after the test (the script sets it)
    from streamkl_bench import nan_check  # bench/ is on pytest's pythonpath (pyproject.toml)

    assert nan_check.main(str(tmp_path), tiny=True)
    with open(tmp_path / "nan_check.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    checked = [r for r in rows if r["pass"] != ""]  # "": n/a (the forced Gluon forward needs sm_90)
    assert checked and all(r["pass"] == "1" for r in checked)
    assert {r["path"] for r in rows if r["pass"] == ""} == {"fwd gluon"}
    assert all("sm_90" in r["detail"] or "gluon" in r["detail"].lower() for r in rows if r["pass"] == "")
    assert {r["path"] for r in checked} == {"fwd triton", "fwd triton split=auto", "bwd deterministic",
                                            "bwd fused", "bwd separate"}
    assert {r["poison"] for r in checked} == {"keys", "rows"}
    for path in {r["path"] for r in checked}:  # every path compared unreached entries and had reached ones
        assert sum(int(r["compared"]) for r in checked if r["path"] == path) > 0, path
        assert sum(int(r["reached"]) for r in checked if r["path"] == path) > 0, path
    # the "rows" poisons leave most keys unreached: their dk was compared
    assert all(int(r["compared"]) > 0 for r in checked if r["poison"] == "rows" and r["tensor"].startswith("dk"))
    assert capsys.readouterr().out.rstrip().endswith("ALL PASS")
