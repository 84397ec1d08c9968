"""The indexer's shape rules (streamkl_gpu/indexer/configs.py, SHAPE_RULES): on the GPU's candidate
lists each rule's config exists, goes first and makes the pick untimed by default; picks without a
rule stay timed; the record the rules cite is committed and names every rule's winner."""
import csv
import os
import re

import pytest
import torch

from streamkl_ref._checks import check_indexer_inputs
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu.indexer import configs as idx_configs
from streamkl_gpu.indexer.plan import IndexerConfig
from streamkl_gpu.indexer.triton import fwd_gqa as _indexer_fwd_gqa
from streamkl_gpu.indexer import topk as idx_topk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "bench", "results", "2026-12-04_h200_19ad57e", "tuning_log.csv")

# (H, HK, D, HI, DI) of the record's teachers, and a family without rules (one key head, 16 heads)
TEACHERS = {"dsa": (128, 1, 576, 64, 128), "mqa": (64, 1, 576, 64, 128), "gqa": (32, 8, 128, 16, 64),
            None: (16, 1, 128, 8, 64)}
KINDS = ("lse", "fwd", "pacc", "bwd_dq", "bwd_dk")


def _dims(family, n=8192):
    h, hk, d, hi, di = TEACHERS[family]
    xs = [torch.empty(s, device="meta") for s in ((1, h, n, d), (1, hk, n, d), (1, hi, n, di), (1, 1, n, di), (1, hi, n))]
    return check_indexer_inputs(*xs, scale=d ** -0.5)


@pytest.fixture
def gpu_lists(monkeypatch):
    """The GPU's candidate lists (formed on CPU: they only plan)."""
    monkeypatch.setattr(_runtime, "interpreting", lambda: False)
    memoised = (idx_configs._gpu_candidates, idx_configs._ruled_candidates, idx_configs._storing_forward_rule_order,
                idx_configs._gpu_chunk_gradient_candidates)
    for f in memoised:
        f.cache_clear()
    yield
    for f in memoised:
        f.cache_clear()


@pytest.mark.parametrize("family", ["dsa", "mqa", "gqa", None])
@pytest.mark.parametrize("n", [4096, 8192, 16384, 65536])
def test_each_rule_config_exists_and_goes_first(gpu_lists, family, n):
    dims = _dims(family, n)
    assert idx_configs.teacher_family(dims) == family
    for kind in KINDS:
        cands = idx_configs._candidates(kind, False, dims)
        rule = idx_configs.SHAPE_RULES.get((family, kind))
        assert idx_configs.ruled(kind, dims, cands) == (rule is not None), (family, kind)
        if rule is not None:
            assert idx_configs._matches(cands[0], rule), (family, kind, cands[0])
            assert len(set(cands)) == len(cands)  # moved, not copied
    topk = idx_topk._fwd_candidates(False, dims)
    assert idx_configs.ruled("topk", dims, topk) == (family in ("dsa", "mqa"))
    assert sorted(map(repr, topk)) == sorted(map(repr, idx_topk._fwd_candidates(False)))  # the same three


def test_the_chunk_design_keeps_its_tiles(gpu_lists):
    """The rules reorder the recomputing backward's kernels (bwd_dq, bwd_dk) and the plain forward;
    the lists the chunk design takes first ("pstore", "bwd") are not theirs to change."""
    for family in ("dsa", "mqa", "gqa"):
        dims = _dims(family)
        assert idx_configs._candidates("pstore", False, dims) == list(idx_configs._gpu_candidates("fwd", dims, 132, True))
        assert idx_configs._candidates("bwd", False, dims, teacher=False) == list(
            idx_configs._gpu_candidates("bwd", dims, 132, False))


def _chunk_asks(monkeypatch, lister, hook, forced, default):
    """The chunk design asks ``configs.<lister>`` for the order the innermost forcing block's
    ``hook`` names (``forced``), and for ``default`` outside one."""
    from streamkl_gpu._core.forcing import forcing
    from streamkl_gpu.indexer.training import chunk

    class Asked(Exception):
        pass

    def ask(*args):
        raise Asked(next(a for a in args if isinstance(a, str)))  # the order: its one string argument
    monkeypatch.setattr(idx_configs, lister, ask)
    xs = [torch.zeros(s) for s in ((1, 64, 8, 16), (1, 1, 8, 16), (1, 4, 8, 8), (1, 1, 8, 8), (1, 4, 8))]
    lse = torch.zeros(1, 64, 8)
    with forcing(**{hook: forced}), pytest.raises(Asked, match=f"^{forced}$"):
        chunk._forward_full(*xs, lse, True, 0.25, True)
    with pytest.raises(Asked, match=f"^{default}$"):
        chunk._forward_full(*xs, lse, True, 0.25, True)


def test_the_storing_forward_order_a_benchmark_may_force(gpu_lists, monkeypatch):
    """The chunk design's storing forward takes the forward's candidates in the plain forward's
    rule order ("forward_rule", the default: the 64-head MQA's keys-major tile first, the same list
    elsewhere); "candidates", forcible, is the list as it stands; the chunk design asks for the
    order the innermost forcing block names."""
    for family in ("dsa", "mqa", "gqa"):
        dims = _dims(family)
        ruled = idx_configs.storing_forward_candidates(False, dims, 132)
        listed = idx_configs.storing_forward_candidates(False, dims, 132, "candidates")
        assert listed == idx_configs._candidates("pstore", False, dims)
        if family == "gqa":  # the default order gives the GQA kernel its flags (STORING_FORWARD_GQA_FLAGS)
            rule_variant = idx_configs.SHAPE_RULES[(family, "fwd")]["variant"]
            flagged = _indexer_fwd_gqa.with_flags(rule_variant, idx_configs.STORING_FORWARD_GQA_FLAGS)
            assert ruled[0].variant == flagged and ruled[1:] == [c for c in listed if c.variant != rule_variant]
            assert idx_configs.storing_forward_candidates(False, dims, 132, "forward_rule+wm")[0].variant == \
                _indexer_fwd_gqa.with_flags(rule_variant, ("wm",))  # explicit flags: only those
            continue
        assert sorted(map(repr, ruled)) == sorted(map(repr, listed))
        assert idx_configs._matches(ruled[0], idx_configs.SHAPE_RULES[(family, "fwd")]), (family, ruled[0])
        assert (ruled == listed) == (family != "mqa"), family  # of the others, only the 64-head MQA's order differs
    with pytest.raises(ValueError, match="forward_rule"):
        idx_configs.storing_forward_candidates(False, _dims("mqa"), 132, "fastest")
    _chunk_asks(monkeypatch, "storing_forward_candidates", "indexer_storing_forward_order", "candidates", "forward_rule")


def test_the_chunk_gradient_tiles_and_the_orders_a_benchmark_may_force(gpu_lists, monkeypatch):
    """The chunk design's gradient tiles: by default ("rule") the family's CHUNK_GRADIENT_RULES tile
    (keys-major) first, then the student backward's row-major list, then the other keys-major
    tiles; "rows_first" the row-major list first (the order before the rule), "keys_first" the
    keys-major tiles first, the same configs in each; a forced config goes before all; the
    chunk design asks for the innermost order."""

    for family in ("dsa", "mqa", "gqa", None):
        dims = _dims(family)
        rows = idx_configs._candidates("bwd", False, dims, teacher=False)
        ruled = idx_configs.chunk_gradient_candidates(False, dims)
        first_rows = idx_configs.chunk_gradient_candidates(False, dims, "rows_first")
        first_keys = idx_configs.chunk_gradient_candidates(False, dims, "keys_first")
        assert first_rows[:len(rows)] == rows and all(c.variant == "keys" for c in first_rows[len(rows):]), family
        assert first_keys == first_rows[len(rows):] + rows, family
        assert sorted(map(repr, ruled)) == sorted(map(repr, first_rows)) and len(set(ruled)) == len(ruled), family
        rule = idx_configs.CHUNK_GRADIENT_RULES.get(family)
        if rule is None:
            assert ruled == first_rows, family
        else:
            assert idx_configs._matches(ruled[0], rule) and ruled[0].variant == "keys", family
    with pytest.raises(ValueError, match="rows_first"):
        idx_configs.chunk_gradient_candidates(False, _dims("gqa"), "fastest")
    one = IndexerConfig(teacher_rows=64, indexer_rows=64, block_n=128, block_d=64, num_warps=8, num_stages=2,
                        variant="keys")  # the forcing hook's indexer_chunk_gradient_config: tried first
    listed = idx_configs.chunk_gradient_candidates(False, _dims("dsa"))
    firsted = idx_configs.chunk_gradient_candidates(False, _dims("dsa"), "rule", one)
    assert firsted[0] == one and firsted[1:] == [c for c in listed if c != one]
    with pytest.raises(ValueError, match="IndexerConfig"):
        idx_configs.chunk_gradient_candidates(False, _dims("dsa"), "rule", (64, 64))

    _chunk_asks(monkeypatch, "chunk_gradient_candidates", "indexer_chunk_gradient_order", "rows_first", "rule")


def test_a_ruled_pick_is_untimed_by_default_and_timed_when_asked(gpu_lists, monkeypatch):
    dims = _dims("gqa")
    cands = idx_configs._candidates("pacc", False, dims)
    timed = []
    monkeypatch.setattr(_tuning, "_time_candidates", lambda key, c, launch: timed.append(key) or c[-1])
    monkeypatch.setattr(_tuning, "_disk_load", lambda *a: None)
    monkeypatch.setattr(_tuning, "_disk_store", lambda *a: None)
    monkeypatch.setattr(_tuning, "interpreting", lambda: False)  # (the tuner never times in the interpreter)
    monkeypatch.setenv("STREAMKL_AUTOTUNE", "auto")
    assert _tuning.pick(("t", 1), cands, None, ruled=idx_configs.ruled("pacc", dims, cands)) == cands[0]
    assert not timed
    monkeypatch.setenv("STREAMKL_AUTOTUNE", "1")
    assert _tuning.pick(("t", 2), cands, None, ruled=True) == cands[-1] and timed == [("t", 2)]
    mqa = _dims("mqa")  # no pacc rule for one key head: timed by default
    assert not idx_configs.ruled("pacc", mqa, idx_configs._candidates("pacc", False, mqa))


def test_the_record_names_each_rule_winner(gpu_lists):
    """Every rule's config is, in the committed record, the fastest or within 0.5 % of it at every
    point of its family where the pick was timed."""
    with open(RECORD) as f:
        rows = list(csv.DictReader(f))
    assert rows and {r["run_status"] for r in rows} == {"ok"}
    family_of = {"dsa": "dsa", "mqa64": "mqa", "gqa": "gqa"}
    kind_of = {"idx_lse": "lse", "idx_fwd": "fwd", "idx_pacc": "pacc", "idx_bwd_dq": "bwd_dq",
               "idx_bwd_dk": "bwd_dk", "topk_fwd": "topk"}
    picks = {}
    for r in rows:
        kind = kind_of.get(r["key"].split("'")[1])
        if kind is None or not r["point"].startswith("idx_"):
            continue
        family = family_of[r["point"].split("_")[1]]
        ms = float(r["retimed_ms"] or r["ms"])
        picks.setdefault((family, kind, r["point"], r["key"]), {})[r["config"]] = ms
    covered = _lse_rules_measured()
    for (family, kind, point, _), times in picks.items():
        rule = idx_configs.SHAPE_RULES.get((family, kind))
        if rule is None or kind == "lse":  # the teacher-LSE pass: its own record (_lse_rules_measured)
            continue
        winner = [c for c in times if all(re.search(rf"\b{name}={re.escape(repr(value))}[,)]", c)
                                          for name, value in rule.items())]
        assert winner, (family, kind, point)
        assert min(times[c] for c in winner) <= 1.005 * min(times.values()), (family, kind, point)
        covered.add((family, kind))
    assert covered == set(idx_configs.SHAPE_RULES), set(idx_configs.SHAPE_RULES) - covered  # each one measured


LSE_RECORD = os.path.join(ROOT, "bench", "results", "2026-12-06_h100_6dc1dc9")


def _lse_rules_measured():
    """The teacher-LSE rules against their record (every candidate forced one at a time): at the
    DSA-like and 64-head MQA teachers the rule's form gives the fastest training step without lse
    (dsa_nolse.csv), at the GQA-like one the fastest pass (lse_sweep.csv), each within 0.5 %."""
    with open(os.path.join(LSE_RECORD, "dsa_nolse.csv")) as f:
        steps = list(csv.DictReader(f))
    with open(os.path.join(LSE_RECORD, "lse_sweep.csv")) as f:
        sweep = list(csv.DictReader(f))
    assert {r["run_status"] for r in steps + sweep} == {"ok"}
    forms = {"default": "tiles_128x128_w4s3", "qreg": "qreg_128x64_w8s3", "qreg_lpt": "qreg_lpt_128x64_w8s3"}
    for family, teacher in (("dsa", "dsa"), ("mqa", "mqa64")):
        times = {forms[r["form"]]: float(r["step_ms"]) for r in steps if r["teacher"] == teacher}
        rule = idx_configs.lse_config_name(IndexerConfig(**{**_LSE_NAME_FIELDS, **idx_configs.SHAPE_RULES[(family, "lse")]}))
        assert rule in times and times[rule] <= 1.005 * min(times.values()), (family, rule, times)
    times = {r["config"]: float(r["ms"]) for r in sweep if r["teacher"] == "gqa"}
    rule = idx_configs.lse_config_name(IndexerConfig(**{**_LSE_NAME_FIELDS, **idx_configs.SHAPE_RULES[("gqa", "lse")]}))
    assert rule in times and times[rule] <= 1.005 * min(times.values()), ("gqa", rule, times)
    return {("dsa", "lse"), ("mqa", "lse"), ("gqa", "lse")}


_LSE_NAME_FIELDS = dict(teacher_rows=128, indexer_rows=128, block_n=64, block_d=64, num_warps=8, num_stages=2)


CHUNK_RECORD = os.path.join(ROOT, "bench", "results", "2026-12-06_h100_8fbe1d5", "chunk_gradient_tiles.csv")


def test_the_chunk_gradient_rule_is_the_measured_fastest():
    """CHUNK_GRADIENT_RULES' tile is, in the committed record of the 8K training steps with each
    keys-major tile forced first (rotated rounds), the fastest tile that ran for that teacher
    (DSA-like and GQA-like, lse given), and the record timed at least four tiles of each."""
    with open(CHUNK_RECORD) as f:
        rows = list(csv.DictReader(f))
    assert rows and {r["run_status"] for r in rows} == {"ok"}
    for family in ("dsa", "gqa"):
        rule = idx_configs.CHUNK_GRADIENT_RULES[family]
        assert rule["variant"] == "keys"
        tile = f"keys_{rule['indexer_rows']}x{rule['block_n']}_w{rule['num_warps']}s{rule['num_stages']}"
        times = {r["tile"]: float(r["ms"]) for r in rows if r["teacher"] == family and r["ran"] == "ran"}
        assert tile in times and len(times) >= 4, sorted(times)
        assert times[tile] == min(times.values()), times
