"""CPU smoke run of the ``host`` benchmark section (bench/streamkl_bench/host.py) under the Triton
interpreter: every case is timed in rotated rounds and written as a row, every ours/SDPA pair gets
the median of its per-round ratios, and the binder comparison is left out where the direct launch
is off (the interpreter). The times themselves are the interpreter's and are not checked."""
import csv
import math
import statistics

import torch  # noqa: F401  (a missing install must fail, not skip)

from streamkl_bench import host  # bench/ is on pytest's pythonpath (pyproject.toml)


def test_host_section_times_every_case_and_ratio(tmp_path):
    got = host.host_cost(str(tmp_path), rounds=2, calls=2, warmup=1, device="cpu")
    with open(tmp_path / "host_cost.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and set(rows[0]) == {"measure", "provider", "shape", "value", "unit", "note", "run_status"}
    assert {r["run_status"] for r in rows} == {"ok"}
    timed = {r["provider"]: r for r in rows if r["measure"] == "host_us_per_call"}
    names = set(host._cases("cpu"))
    assert set(timed) == names  # no binder rows: the interpreter launches through Triton's binder

    def rounds(name):
        return [float(x) for x in timed[name]["note"].split("the rounds: ")[1].split(";")]

    for name, r in timed.items():
        assert r["unit"] == "us" and math.isfinite(float(r["value"])) and float(r["value"]) > 0, r
        assert len(rounds(name)) == 2, r["note"]
    ratios = {r["provider"]: r for r in rows if r["measure"] == "host_ratio_to_sdpa"}
    assert set(ratios) == {ours for ours, _ in host.PAIRS}
    for ours, sdpa in host.PAIRS:
        assert {ours, sdpa} <= names
        # the median of the per-round ratios (from the rounded round means in the notes)
        want = statistics.median(a / b for a, b in zip(rounds(ours), rounds(sdpa)))
        assert math.isclose(float(ratios[ours]["value"]), want, rel_tol=0.02), (ours, ratios[ours], want)
        assert math.isclose(got[("host_ratio_to_sdpa", ours)], float(ratios[ours]["value"]), rel_tol=1e-3)
    assert not any(r["measure"] == "check" for r in rows)
