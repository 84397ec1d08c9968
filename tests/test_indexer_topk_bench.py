"""CPU smoke of bench/indexer_topk_gpu.py --tiny (the Triton interpreter): the script runs its
checks and (tiny) timing sections end to end, writes its CSV and reports no failed check."""
import csv
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_run_writes_checks(tmp_path):
    spec = importlib.util.spec_from_file_location("indexer_topk_gpu", os.path.join(ROOT, "bench", "indexer_topk_gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path), "--tiny"]) == 0
    with open(tmp_path / "topk_bench.csv") as f:
        rows = list(csv.DictReader(f))
    names = {r["note"].split()[0] for r in rows if r["measure"] == "check_err"}
    assert names == {"kl", "dq_idx", "dk_idx", "dweights"}
    providers = {r["provider"] for r in rows if r["measure"] == "check_err"}
    assert providers == {"ours", "ours_lse", "ours cfg=(16, 16, 16, 1, 1, True)"}  # the variant vs the default
    assert all(r["note"].endswith("ok") for r in rows if r["measure"] == "check_err")
    timed = {(r["measure"], r["provider"]) for r in rows if r["measure"].endswith("_ms")}
    for provider in ("ours", "ours_lse", "torch_gather_eager"):
        assert {("fwd_ms", provider), ("fwd_bwd_ms", provider)} <= timed, provider
    assert all(r["value"] != "nan" for r in rows if r["measure"].endswith("_ms"))
