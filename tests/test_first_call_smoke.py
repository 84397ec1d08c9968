"""The benchmark's ``first_call`` section (bench/streamkl_bench/first_call.py) on CPU under the
interpreter, tiny shapes: the fresh-process first calls (four entry points) and the 2^31-element
cases' head/sequence checks at toy size."""
import csv

import pytest

# the interpreter evaluates masked-off lanes too (their NaN is selected away, never used)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _module():
    from streamkl_bench import first_call  # bench/ is on pytest's pythonpath (pyproject.toml)
    return first_call


def _rows(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_first_calls_in_fresh_processes(tmp_path):
    mod = _module()
    assert mod.main(["--out", str(tmp_path), "--tiny", "--entries", "fwd,fwd_bwd_auto_s1,varlen_fwd_bwd_both,indexer_mean_step"]) == 0
    rows = _rows(tmp_path / "first_call.csv")
    by = {(r["entry"], r["measure"]): r for r in rows}
    for entry in ("fwd", "fwd_bwd_auto_s1", "varlen_fwd_bwd_both", "indexer_mean_step"):  # the last: the documented step
        assert float(by[entry, "first_call_s"]["value"]) > 0
        assert float(by[entry, "second_call_s"]["value"]) > 0
        assert int(by[entry, "kernels_compiled"]["value"]) == 0  # the interpreter compiles nothing
        assert 0.0 == float(by[entry, "compile_wall_s"]["value"]) <= float(by[entry, "first_call_s"]["value"])
        assert float(by[entry, "tuning_s"]["value"]) == 0.0  # nothing timed by default
        assert by[entry, "first_call_s"]["gpu_name"] and by[entry, "first_call_s"]["version"]
    assert not any(r["measure"] == "error" for r in rows) and {r["run_status"] for r in rows} == {"ok"}


def test_first_call_with_the_api_name_imported_first(tmp_path):
    """--imported resolves the API name before the inputs (``from streamkl_gpu import ...`` at a
    script's top); its rows say so."""
    mod = _module()
    assert mod.main(["--out", str(tmp_path), "--tiny", "--entries", "fwd", "--imported"]) == 0
    rows = [r for r in _rows(tmp_path / "first_call.csv") if r["measure"] == "first_call_s"]
    assert len(rows) == 1 and float(rows[0]["value"]) > 0 and "imported before the inputs" in rows[0]["note"]


def test_big_cases_match_their_heads_alone(tmp_path):
    mod = _module()
    only = "fwd_bwd_s1_causal,fwd_bwd_both_causal,varlen_s1_causal,indexer_128k_dsa"
    assert mod.main(["--out", str(tmp_path), "--tiny", "--case", "big", "--only", only]) == 0
    rows = _rows(tmp_path / "first_call_big.csv")
    entries = {r["entry"] for r in rows}
    assert entries == set(only.split(","))
    errs = [r for r in rows if r["unit"] == "rel"]
    # both settings: kl and four gradients, for the first and the last head
    assert sum(r["entry"] == "fwd_bwd_both_causal" for r in errs) == 2 * 5
    assert all(float(r["value"]) <= (1e-6 if "_kl_" in r["measure"] else 2e-3) for r in errs)
    assert all(float(r["value"]) > 0 for r in rows if r["measure"] in ("fwd_s", "fwd_bwd_s"))
    assert {r["run_status"] for r in rows} == {"ok"}
    # the compile seconds inside the timed forward + backward: 0 under the interpreter
    compiled = [r for r in rows if r["measure"] == "fwd_bwd_compile_s"]
    assert {r["entry"] for r in compiled} == {"fwd_bwd_s1_causal", "fwd_bwd_both_causal", "varlen_s1_causal"}
    assert all(float(r["value"]) == 0 for r in compiled)


def test_relative_error_over_slices_equals_the_whole_tensor_formula():
    """The big cases' ``_rel`` sums float64 slices (one float64 copy of a 2^31-element gradient
    would not fit beside it): the same value as the formula on whole tensors, 0 exactly when equal."""
    import torch

    mod = _module()
    gen = torch.Generator().manual_seed(0)
    b = torch.randn(5, 37, 3, generator=gen).to(torch.bfloat16)
    a = (b.float() + 1e-3 * torch.randn(5, 37, 3, generator=gen)).to(torch.bfloat16)
    whole = float((a.double() - b.double()).norm() / b.double().norm())
    assert abs(mod._rel(a, b, chunk=4) - whole) <= 1e-12 * whole and whole > 0
    assert mod._rel(a.transpose(0, 1), b.transpose(0, 1), chunk=3) == pytest.approx(whole, rel=1e-12)
    assert mod._rel(b, b.clone(), chunk=2) == 0.0
