"""The headline rows of a results folder (``docs/gen_performance.py --derive``) from its own CSVs:
each ratio is of the two medians it names, a measurement that did not finish gives a row without a
value, and what the folder did not measure gives no row. The generator reads each attention table
from the newest folder that has its rows."""
import csv
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("gen_performance", os.path.join(ROOT, "docs", "gen_performance.py"))
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

BENCH_COLUMNS = ["kernel", "provider", "mode", "causal", "n_q", "n_k", "b", "h", "d1", "d2", "dtype", "p20_ms",
                 "p50_ms", "p80_ms", "peak_extra_gib", "status"]


def _bench_row(kernel, provider, mode, causal, n, p50, n_k=None, h=32, status="ok"):
    return dict(kernel=kernel, provider=provider, mode=mode, causal=causal, n_q=n, n_k=n if n_k is None else n_k, b=1,
                h=h, d1=128, d2=128, dtype="bf16", p20_ms="", p50_ms="" if p50 is None else p50, p80_ms="",
                peak_extra_gib="", status=status)


def _write(path, columns, rows):
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


@pytest.fixture
def folder(tmp_path):
    n = 8192
    rows = [_bench_row("fwd", "ours", "fwd", 0, n, 3.0), _bench_row("fwd", "sdpa", "fwd", 0, n, 2.0),
            _bench_row("fwd_bwd", "ours_auto", "fwd_bwd_s1", 0, n, 9.0),
            _bench_row("fwd_bwd", "ours_auto", "fwd_bwd_s2", 0, n, 10.0),
            _bench_row("fwd_bwd", "sdpa", "fwd_bwd_sdpa", 0, n, 7.0),
            _bench_row("fwd", "compile", "fwd", 0, n, 12.0),
            _bench_row("fwd_bwd", "compile", "fwd_bwd_s1", 0, n, None, status="skipped(budget)"),
            _bench_row("fwd", "ours", "fwd", 1, n, 2.0), _bench_row("fwd", "sdpa", "fwd", 1, n, None, status="OOM"),
            _bench_row("fwd", "ours", "fwd", 0, 2048, 1.0), _bench_row("fwd", "sdpa", "fwd", 0, 2048, 0.5),
            _bench_row("decode", "ours", "fwd", 0, 1, 0.5, n_k=131072),
            _bench_row("decode", "floor", "fwd", 0, 1, 0.25, n_k=131072),
            _bench_row("long", "ours", "fwd", 1, 1 << 19, 1250.0, h=8),
            _bench_row("long", "ours_auto", "fwd_bwd_s1", 1, 1 << 19, None, h=8, status="OOM"),
            _bench_row("long", "ours", "fwd", 1, 1 << 18, 310.0, h=8),
            _bench_row("long", "ours", "fwd", 1, 1 << 12, 0.2, h=8)]
    _write(tmp_path / "bench.csv", BENCH_COLUMNS, rows)
    host = [dict(measure="host_us_per_call", provider=p, shape="B1 H1 NQ1 NK64 D64 bf16", value=v, unit="us", note="",
                 run_status="ok")
            for p, v in (("forward", "30.5"), ("sdpa_forward", "20.0"), ("forward+backward", "250.0"),
                         ("sdpa_forward+backward", "200.0"), ("backward [one graph]", "120.0"))]
    _write(tmp_path / "host_cost.csv", list(host[0]), host)
    return tmp_path


def _find(rows, **match):
    found = [r for r in rows if all(r[k] == str(v) for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def test_each_ratio_is_of_the_two_medians_it_names(folder):
    rows = gen.derive(str(folder))
    assert _find(rows, **{"pass": "fwd", "n_q": 8192, "causal": 0, "baseline": "sdpa_fwd"})["value"] == "1.50"
    assert _find(rows, **{"pass": "fwd_bwd", "n_q": 8192, "causal": 0})["value"] == f"{9 / 7:.2f}"
    # the backward alone: the step less the forward, the worse of the two settings
    assert _find(rows, **{"pass": "bwd", "n_q": 8192, "causal": 0})["value"] == f"{(10 - 3) / (7 - 2):.2f}"
    assert _find(rows, baseline="torch_compile_fwd", causal=0)["value"] == "4.00"
    assert _find(rows, baseline="copy_floor", n_q=1)["value"] == "2.00"
    assert _find(rows, metric="seconds_per_call", n_q=1 << 19, **{"pass": "fwd"})["value"] == "1.25"
    assert _find(rows, operation="attention_kl", metric="us_per_call", **{"pass": "host_fwd"})["value"] == "30.5"
    assert _find(rows, operation="sdpa", metric="us_per_call", **{"pass": "host_fwd_bwd"})["value"] == "200.0"


def test_what_did_not_finish_has_no_value_and_what_was_not_run_no_row(folder):
    rows = gen.derive(str(folder))
    oom = _find(rows, **{"pass": "fwd", "n_q": 8192, "causal": 1, "baseline": "sdpa_fwd"})
    assert (oom["value"], oom["run_status"]) == ("", "OOM")
    assert _find(rows, metric="seconds_per_call", **{"pass": "fwd_bwd"})["run_status"] == "OOM"
    assert not [r for r in rows if r["baseline"] == "torch_compile_fwd_bwd"]  # skipped by the budget
    assert not [r for r in rows if r["n_q"] == "2048"]  # below the headline's range
    assert not [r for r in rows if r["n_q"] == str(1 << 12) and r["metric"] == "seconds_per_call"]  # the 2 longest only
    assert not [r for r in rows if r["pass"] == "backward [one graph]"]


def test_the_cli_writes_attention_csv_and_refuses_an_empty_folder(folder, tmp_path_factory):
    gen.main(["--derive", str(folder)])
    with open(folder / "attention.csv", newline="") as fh:
        written = list(csv.DictReader(fh))
    assert written == gen.derive(str(folder)) and list(written[0]) == gen.DERIVED_COLUMNS
    with pytest.raises(SystemExit):
        gen.main(["--derive", str(tmp_path_factory.mktemp("empty"))])


def test_the_docs_generator_takes_each_table_from_the_newest_folder_that_has_its_rows(monkeypatch, tmp_path):
    base = {c: "" for c in gen.DERIVED_COLUMNS}
    older = [dict(base, operation="attention_kl", metric="ratio_to_baseline", value="1.50", baseline="sdpa_fwd",
                  n_q="8192", causal="0", run_status="ok", **{"pass": "fwd"}),
             dict(base, operation="attention_kl", metric="us_per_call", value="40.0", n_q="1", run_status="ok",
                  **{"pass": "host_fwd"})]
    newer = [dict(base, operation="attention_kl", metric="us_per_call", value="30.0", n_q="1", run_status="ok",
                  **{"pass": "host_fwd"})]
    for name, rs in (("2026-01-01_gpu_aaaaaaa", older), ("2026-01-02_gpu_bbbbbbb", newer)):
        (tmp_path / name).mkdir()
        _write(tmp_path / name / "attention.csv", gen.DERIVED_COLUMNS, rs)
        (tmp_path / name / "env.json").write_text('{"runs": []}')
    monkeypatch.setattr(gen, "RESULTS", str(tmp_path))
    assert gen.newest_attention("fwd")[0].endswith(os.path.join("2026-01-01_gpu_aaaaaaa", "attention.csv"))
    path, rs = gen.newest_attention("host")
    assert path.endswith(os.path.join("2026-01-02_gpu_bbbbbbb", "attention.csv")) and rs[0]["value"] == "30.0"
    assert gen.newest_attention("compile") == (None, [])


def test_first_use_tables_read_the_newest_gpu_run(monkeypatch, tmp_path):
    """The first-use tables come from the newest GPU folder with the file, never an interpreter run."""
    for name, gpu in (("2026-01-01_h100_aaaaaaa", "NVIDIA H100"), ("2026-01-02_cpu-2core_bbbbbbb", "cpu (Triton interpreter)")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "env.json").write_text(
            '{"gpu": "%s", "torch": "t", "triton": "tr", "commit": "%s", "runs": []}' % (gpu, name[-7:]))
        rs = [dict(entry="fwd", shape="B=1", measure=m, value=v, run_status="ok")
              for m, v in (("first_call_s", "2.5" if "h100" in name else "99"), ("compile_s", "2.0"),
                           ("kernels_compiled", "1"))]
        _write(tmp_path / name / "first_call.csv", list(rs[0]), rs)
    monkeypatch.setattr(gen, "RESULTS", str(tmp_path))
    page = "\n".join(gen.first_use())
    assert "| forward | 2.50 s | 2.00 | 1 |" in page and "99" not in page
    assert "2026-01-01_h100_aaaaaaa/first_call.csv" in page and "streamkl verify" not in page  # no verify JSON filed


def test_first_use_on_every_start_lists_whole_batteries_and_names_the_bounds_missed(monkeypatch, tmp_path):
    """One row per GPU run of the whole battery, the bounds each missed; a partial file, an A/B file
    of two trees and an interpreter run give no row."""
    def battery(fwd, step):
        seconds = dict.fromkeys(gen.FIRST_CALL_NEEDED, 1.0)
        seconds.update(fwd=fwd, fwd_bwd_auto_both=step)
        return [dict(entry=e, measure="first_call_s", value=str(v), run_status="ok") for e, v in seconds.items()]

    files = {("2026-01-01_h100_aaaaaaa", "NVIDIA H100", "first_call.csv"): battery(3.5, 5.5),
             ("2026-01-02_h200_bbbbbbb", "NVIDIA H200", "first_call_all.csv"): battery(2.5, 4.0),
             ("2026-01-03_h100_ccccccc", "NVIDIA H100", "first_call.csv"): battery(2.0, 3.0)[:3],  # partial
             ("2026-01-04_h100_ddddddd", "NVIDIA H100", "first_call_ab.csv"): battery(9.0, 9.0) * 2,  # two trees
             ("2026-01-05_cpu-2core_eeeeeee", "cpu (Triton interpreter)", "first_call.csv"): battery(99.0, 99.0)}
    for (name, gpu, file), rs in files.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "env.json").write_text('{"gpu": "%s", "runs": []}' % gpu)
        _write(tmp_path / name / file, list(rs[0]), rs)
    monkeypatch.setattr(gen, "RESULTS", str(tmp_path))
    lines = [l for l in gen.first_call_starts() if l.startswith("| 2026-")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("| 2026-01-02, H200, bbbbbbb (`first_call_all.csv`) | 2.50 s |") and lines[0].endswith("| both met |")
    assert lines[1].startswith("| 2026-01-01, H100, aaaaaaa") and "forward over 3 s; a step over 5 s" in lines[1]
    assert "| 1.00-5.50 s |" in lines[1]  # the attention steps' range


def test_host_cost_on_every_run_takes_the_rotated_rounds_files_of_the_folders_own_tree(monkeypatch, tmp_path):
    def host(fwd, step, sdpa_step, method="median of 151 rotated rounds of 25 calls"):
        us = dict(forward=fwd, sdpa_forward=20.0, **{"forward+backward": step, "sdpa_forward+backward": sdpa_step})
        return [dict(measure="host_us_per_call", provider=p, value=str(v), note=method, run_status="ok")
                for p, v in us.items()]

    files = {("2026-01-02_h100_bbbbbbb", "host_cost_2.csv"): host(45.0, 210.0, 200.0),
             ("2026-01-02_h100_bbbbbbb", "host_cost_1.csv"): host(30.0, 190.0, 200.0),
             ("2026-01-02_h100_bbbbbbb", "host_cost_aaaaaaa.csv"): host(99.0, 990.0, 200.0),  # another tree
             ("2026-01-01_h200_aaaaaaa", "host_cost.csv"): host(88.0, 880.0, 200.0, "1000 back-to-back calls")}
    for (name, file), rs in files.items():
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "env.json").write_text('{"gpu": "g", "runs": []}')
        _write(tmp_path / name / file, list(rs[0]), rs)
    monkeypatch.setattr(gen, "RESULTS", str(tmp_path))
    lines = [l for l in gen.host_runs() if l.startswith("| 2026-")]
    assert lines == ["| 2026-01-02, H100, bbbbbbb (`host_cost_1.csv`) | 30.0 / 20.0 µs | 190 / 200 µs | 0.950× | both met |",
                     "| 2026-01-02, H100, bbbbbbb (`host_cost_2.csv`) | 45.0 / 20.0 µs | 210 / 200 µs | 1.05× | "
                     "forward not under 40 µs; step slower than SDPA's |"], lines


def test_past_2_31_shows_each_case_from_its_newest_passing_run_and_lists_failed_checks(monkeypatch, tmp_path):
    def case(entry, fwd, step, err=0.0, status="ok"):
        m = dict(fwd_s=fwd, fwd_bwd_s=step, fwd_bwd_compile_s=1.5, head0_dq2_rel_err=err)
        return [dict(entry=entry, measure=k, value=str(v), run_status=status if k.endswith("_rel_err") else "ok")
                for k, v in m.items()]

    files = {("2026-01-01_h200_aaaaaaa", "first_call_big.csv"): case("fwd_bwd_both_causal", 9.0, 44.0)
             + case("fwd_bwd_s1_causal", 9.0, 36.0, 2e-5),
             ("2026-01-02_h100_bbbbbbb", "first_call_big.csv"): case("fwd_bwd_both_causal", 9.0, 46.0, 0.01,
                                                                      "failed(bound)"),
             ("2026-01-03_h100_ccccccc", "first_call_big_before.csv"): case("fwd_bwd_s1_causal", 1.0, 2.0)}
    for (name, file), rs in files.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "env.json").write_text('{"gpu": "g", "runs": []}')
        _write(tmp_path / name / file, list(rs[0]), rs)
    monkeypatch.setattr(gen, "RESULTS", str(tmp_path))
    page = "\n".join(gen.big_cases())
    assert "| N = 1M, H = 16, D = 128, setting 1 | 9.00 s | 36.0 s | 4.00× | 1.50 s | 2.0e-05 | 2026-01-01, H200, aaaaaaa" in page
    assert "| N = 1M, H = 16, both settings | 9.00 s | 44.0 s | 4.89× | 1.50 s | bitwise | 2026-01-01, H200, aaaaaaa" in page
    assert "a run with a failed check, 2026-01-02, H100, bbbbbbb" in page and "0.01 (failed(bound))" in page
    assert "ccccccc" not in page  # another tree's file
    newer = tmp_path / "2026-01-04_h100_ddddddd"  # a newer passing run over the ratio's bound replaces it
    newer.mkdir()
    (newer / "env.json").write_text('{"gpu": "g", "runs": []}')
    rs = case("fwd_bwd_both_causal", 9.0, 46.0)
    _write(newer / "first_call_big.csv", list(rs[0]), rs)
    assert "| 5.11× (over 5×) | 1.50 s | bitwise | 2026-01-04, H100, ddddddd" in "\n".join(gen.big_cases())


def test_bounds_at_a_glance_read_the_newest_runs_and_count_the_runs_that_met_each(monkeypatch, tmp_path):
    def first_calls(fwd):
        return [dict(entry=e, measure="first_call_s", value="4.0" if e == "fwd_bwd_auto_s1" else str(fwd),
                     run_status="ok") for e in gen.FIRST_CALL_NEEDED]

    def host(fwd, step):
        us = dict(forward=fwd, sdpa_forward=20.0, **{"forward+backward": step, "sdpa_forward+backward": 200.0})
        return [dict(measure="host_us_per_call", provider=p, value=str(v), note="median of rotated rounds",
                     run_status="ok") for p, v in us.items()]

    big = [dict(entry="fwd_bwd_both_causal", measure=m, value=v, run_status="ok")
           for m, v in (("fwd_s", "9.0"), ("fwd_bwd_s", "44.0"), ("head0_dq1_rel_err", "0.0"))]
    files = {("2026-01-01_h100_aaaaaaa", "first_call.csv"): first_calls(2.0),
             ("2026-01-01_h100_aaaaaaa", "host_cost.csv"): host(30.0, 190.0),
             ("2026-01-02_h200_bbbbbbb", "first_call.csv"): first_calls(3.5),
             ("2026-01-02_h200_bbbbbbb", "host_cost_1.csv"): host(30.0, 220.0),
             ("2026-01-02_h200_bbbbbbb", "first_call_big.csv"): big}
    for (name, file), rs in files.items():
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "env.json").write_text('{"gpu": "g", "runs": []}')
        _write(tmp_path / name / file, list(rs[0]), rs)
    monkeypatch.setattr(gen, "RESULTS", str(tmp_path))
    rows = {l.split(" | ")[0].lstrip("| "): l for l in gen.bounds_at_a_glance() if l.startswith("| ")}
    assert "| 3.50 s | **no** | 1 of 2 | 2026-01-02, H200, bbbbbbb" in rows["first call, forward: within 3 s"]
    assert "| the slowest 4.00 s | yes | 2 of 2 |" in rows["first call, every training step: within 5 s"]
    assert "| 1.10× SDPA's | **no** | 1 of 2 |" in rows["host cost, training step: no slower than SDPA's forward + backward"]
    assert "| the worst 4.89× (N = 1M, H = 16, both settings) | yes |" in rows[
        "2^31 elements: forward + backward within 5× the forward"]
    assert "| 1 of 7 | **no** |" in rows["2^31 elements: every case finishes, its heads equal separate calls (7 cases)"]
    assert not any(k.startswith("`streamkl verify`") for k in rows)  # no verify JSON filed


def test_indexer_rows_come_from_the_indexer_sections_training_csv(tmp_path):
    def r(measure, teacher, path, provider, value, status="ok"):
        return dict(section="dense", measure=measure, teacher=teacher, path=path, provider=provider, n="8192",
                    value=value, unit="ms", note="", run_status=status)
    training = [r("fwd_ms", "dsa", "lse", "streamkl", "18.4998"), r("fwd_bwd_ms", "dsa", "lse", "streamkl", "18.8761"),
                r("floor_ms", "dsa", "lse", "floor", "8.3062"), r("fwd_bwd_ms", "dsa", "any", "torch_compile", "300.1"),
                r("fwd_ms", "gqa", "no_lse", "streamkl", "", status="cut short"),
                r("fwd_ms", "dsa", "lse", "streamkl_accumulating", "38.2")]
    got = {(x["teacher"], x["lse_given"], x["pass"], x["provider"]): x for x in gen.indexer_rows(training)}
    assert got[("dsa", "1", "fwd_bwd", "ours")]["ms"] == "18.9" and got[("dsa", "1", "fwd", "ours")]["ms"] == "18.5"
    assert got[("dsa", "1", "fwd_bwd", "floor")]["ms"] == "8.31"
    assert got[("dsa", "1", "fwd_bwd", "torch_compile")]["ms"] == "300"  # the dense compile point serves both paths
    assert got[("gqa", "0", "fwd", "ours")]["ms"] == "" and got[("gqa", "0", "fwd", "ours")]["run_status"] == "cut short"
    assert not [k for k in got if k[3] not in ("ours", "floor", "torch_compile")]  # forced variants are not headline
    assert all(list(x) == gen.INDEXER_COLUMNS or set(x) == set(gen.INDEXER_COLUMNS) for x in got.values())
