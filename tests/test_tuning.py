"""The launch tuner's rules and its on-disk cache, on CPU.

The timing itself needs a GPU; here ``_time_candidates`` is replaced by a recorder, so the tests
check what is timed, on which problem, what is stored where, and what a second process reads.
"""
import json
import os
import subprocess
import sys
from dataclasses import replace
from unittest import mock

import pytest

from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu.attention import configs as attn_configs
from streamkl_gpu.attention.configs import BwdConfig, FwdConfig
from streamkl_ref._checks import check_inputs

from _gpu_helpers import make_inputs


@pytest.fixture
def tuner(tmp_path, monkeypatch):
    """Tuning on (as on a GPU), the cache in a temporary directory, timing recorded, not run."""
    monkeypatch.setenv("STREAMKL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("STREAMKL_TUNING_CACHE", raising=False)
    monkeypatch.setattr(_tuning, "autotune_enabled", lambda *a, **k: True)
    monkeypatch.setattr(_tuning, "_TUNED", {})
    timed = []

    def fake_time(key, candidates, launch):
        timed.append((key, tuple(candidates), launch))
        return candidates[-1]  # "the last one was fastest"

    monkeypatch.setattr(_tuning, "_time_candidates", fake_time)
    return tmp_path, timed


CANDS = [FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
         FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True)]


def test_first_pick_times_and_stores_then_disk_answers(tuner):
    cache, timed = tuner
    key = ("fwd", 128, 128, "bf16", "causal", 8192)
    assert _tuning.pick(key, CANDS, launch="real") == CANDS[-1]
    assert len(timed) == 1 and timed[0][2] == "real"
    files = [p for p in cache.rglob("*.json")]
    assert len(files) == 1
    entry = json.loads(files[0].read_text())
    assert entry["key"] == repr(key) and entry["config"] == repr(CANDS[-1])
    assert set(entry["env"]) == {"gpu", "torch", "triton", "streamkl", "format"}
    _tuning._TUNED.clear()  # a second process: empty memory, the same disk
    assert _tuning.pick(key, CANDS, launch="real") == CANDS[-1]
    assert len(timed) == 1  # no second timing


def test_proxy_is_what_gets_timed(tuner):
    _, timed = tuner
    _tuning.pick(("k",), CANDS, launch="real", proxy="slice")
    assert timed[0][2] == "slice"


def test_cached_choice_outside_the_candidates_is_retuned(tuner):
    _, timed = tuner
    _tuning.pick(("k2",), CANDS, launch="real")
    _tuning._TUNED.clear()
    other = [FwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),
             FwdConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)]
    assert _tuning.pick(("k2",), other, launch="real") == other[-1]
    assert len(timed) == 2


def test_an_entry_of_the_positional_format_is_ignored_not_misread(tuner):
    """An entry written with configs as JSON lists (the positional tuples' format) names no
    candidate: the key is timed again and the entry rewritten in the current format."""
    cache, timed = tuner
    key = ("old",)
    _tuning._disk_store(None, key, CANDS[0])
    (path,) = cache.rglob("*.json")
    entry = json.loads(path.read_text())
    entry["config"] = [128, 64, 8, 3, True, 1]  # CANDS[-1] as the positional format stored it
    path.write_text(json.dumps(entry))
    assert _tuning._disk_load(None, key, CANDS) is None
    assert _tuning.pick(key, CANDS, launch="real") == CANDS[-1] and len(timed) == 1
    assert json.loads(path.read_text())["config"] == repr(CANDS[-1])


def test_cache_can_be_disabled(tuner, monkeypatch):
    cache, timed = tuner
    monkeypatch.setenv("STREAMKL_TUNING_CACHE", "0")
    _tuning.pick(("k3",), CANDS, launch="real")
    assert not list(cache.rglob("*.json"))


_WRITER = """
import sys
from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu.attention.configs import FwdConfig
i = int(sys.argv[1])
for _ in range(100):
    _tuning._disk_store(None, ("shared",), FwdConfig(block_m=i, block_n=i, num_warps=4, num_stages=2))
"""


def test_concurrent_writers_leave_one_whole_entry(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, STREAMKL_CACHE_DIR=str(tmp_path), TRITON_INTERPRET="1")
    env.pop("STREAMKL_TUNING_CACHE", None)
    # three writers (CI time: each process imports torch), twice the stores each: the writes still overlap
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(i)], cwd=root, env=env) for i in range(3)]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    files = list(tmp_path.rglob("*.json"))
    assert len(files) == 1, files  # no temporary file left behind, one entry per key
    entry = json.loads(files[0].read_text())
    assert entry["key"] == repr(("shared",))
    assert entry["config"] in [repr(FwdConfig(block_m=i, block_n=i, num_warps=4, num_stages=2)) for i in range(3)]


def test_small_problems_are_tuned_on_themselves():
    dims = check_inputs(*make_inputs(1, 32, 32, 32, 8, 8, 16, 16))
    assert attn_configs.tuning_slice(replace(dims, NQ=16384, NK=16384, D1=128, D2=128), causal=False) is None


@pytest.mark.parametrize("causal", [False, True])
def test_long_problems_are_tuned_on_a_bounded_slice(causal):
    dims = check_inputs(*make_inputs(1, 8, 8, 8, 8, 8, 16, 16))
    long = replace(dims, NQ=524288, NK=524288, D1=128, D2=128)
    nq, nk = attn_configs.tuning_slice(long, causal)
    pairs = nq * nk / 2 if causal else nq * nk
    assert long.B * long.H * pairs * 256 <= attn_configs.TUNING_WORK_LIMIT
    assert 1024 <= nq < long.NQ
    if causal:
        assert nk == nq  # the first nq rows see the first nq keys (bottom-right, N_Q = N_K)
    offset = replace(long, NQ=4096 * 64, NK=4096 * 64 + 1000)
    nq, nk = attn_configs.tuning_slice(offset, True)
    assert nk == nq + 1000  # the rows' visible keys, the diagonal's offset kept


def test_split_choices(monkeypatch):
    dims = check_inputs(*make_inputs(1, 32, 32, 32, 1, 8, 16, 16))
    decode = replace(dims, NK=131072, D1=128, D2=128)
    monkeypatch.setattr(_tuning, "autotune_enabled", lambda *a, **k: False)
    rule = attn_configs.auto_split_k(decode, 16, 128, 132)
    wave = attn_configs.wave_split_k(decode, 16, 128, 132)  # decoding's measured rule, untimed
    assert wave is not None and wave * decode.B * decode.H <= 132 < 2 * wave * decode.B * decode.H
    assert attn_configs.split_choices(decode, False, 128, 132) == (wave,)
    wide = replace(decode, H=64)  # half the SMs busy with query blocks: no measured rule, auto_split_k
    assert attn_configs.wave_split_k(wide, 16, 128, 132) is None
    assert attn_configs.split_choices(wide, False, 128, 132) == (attn_configs.auto_split_k(wide, 16, 128, 132),)
    monkeypatch.setattr(_tuning, "autotune_enabled", lambda *a, **k: True)
    opts = attn_configs.split_choices(decode, False, 128, 132)
    assert 1 in opts and 8 in opts and rule in opts and max(opts) <= 64
    many = replace(decode, B=8, NQ=512)  # enough query blocks: one pass only
    assert attn_configs.split_choices(many, False, 128, 132) == (1,)


def _scripted_timing(monkeypatch, first_pass, retimes):
    """do_bench replaced by a script: the first pass's medians, then each re-timing's per config."""
    import torch
    import triton.testing

    calls = []
    queue = {cfg: list(v) for cfg, v in retimes.items()}

    def fake_do_bench(fn, warmup=None, rep=None, return_mode=None):
        cfg = fn()
        calls.append(cfg)
        if calls.count(cfg) == 1:
            return first_pass[cfg]
        return queue[cfg].pop(0)

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return calls


def test_close_candidates_are_retimed_interleaved_and_the_retimed_best_wins(monkeypatch):
    a, b, c = ("a",), ("b",), ("c",)
    # first pass: a looks best by a hair, c is far behind (not re-timed)
    calls = _scripted_timing(monkeypatch, {a: 0.100, b: 0.105, c: 0.200},
                             {a: [0.110, 0.111, 0.112], b: [0.101, 0.102, 0.099]})
    monkeypatch.setattr(_tuning, "TUNING_RETIMED", {})
    best = _tuning._time_candidates(("decode",), [a, b, c], launch=lambda cfg: cfg)
    assert best == b
    # launches: a, b, c twice each (compiling, one timed call; not do_bench), their first-pass do_bench, then a b a b a b
    timed_after_first_pass = [x for x in calls[3:]]
    assert timed_after_first_pass == [a, b] * _tuning.RETIME_ROUNDS
    assert set(_tuning.TUNING_RETIMED[("decode",)]) == {a, b}


def test_a_clear_winner_is_not_retimed(monkeypatch):
    a, b = ("a",), ("b",)
    calls = _scripted_timing(monkeypatch, {a: 0.100, b: 0.300}, {})
    assert _tuning._time_candidates(("k2",), [a, b], launch=lambda cfg: cfg) == a
    assert len(calls) == 2


def test_a_long_call_is_its_own_measurement(monkeypatch):
    import time as _time
    a, b = ("slow",), ("fast",)
    calls = _scripted_timing(monkeypatch, {b: 0.01}, {})

    def launch(cfg):
        if cfg == a:
            _time.sleep(_tuning.LONG_CALL_S * 1.5)  # a long call: timed once, never handed to do_bench
        return cfg

    assert _tuning._time_candidates(("long",), [a, b], launch=launch) == b
    assert calls == [b]


def test_a_pick_stops_timing_past_its_budget_and_keeps_the_best_so_far(monkeypatch):
    """Each candidate costs two real calls; once they have taken KEY_BUDGET_S the rest are not
    launched at all (a 2^31-element problem would time each for seconds) and the best so far wins."""
    import time as _time
    a, b, c, d = ("a",), ("b",), ("c",), ("d",)
    _scripted_timing(monkeypatch, {}, {})
    monkeypatch.setattr(_tuning, "KEY_BUDGET_S", 0.3)
    monkeypatch.setattr(_tuning, "TUNING_STATS", dict(_tuning.TUNING_STATS, cut_keys=0))
    seconds = {a: 0.1, b: 0.06, c: 0.001, d: 0.001}  # per call: a and b long calls, c and d would win
    launched = []

    def launch(cfg):
        launched.append(cfg)
        _time.sleep(seconds[cfg])
        return cfg

    assert _tuning._time_candidates(("budget",), [a, b, c, d], launch=launch) == b
    assert set(launched) == {a, b} and _tuning.TUNING_STATS["cut_keys"] == 1
    monkeypatch.setattr(_tuning, "KEY_BUDGET_S", 60.0)  # within budget: every candidate is timed
    calls = _scripted_timing(monkeypatch, {c: 0.001, d: 0.002}, {c: [0.001] * 3, d: [0.002] * 3})
    launched.clear()
    assert _tuning._time_candidates(("budget2",), [a, b, c, d], launch=launch) == c
    assert set(launched) == {a, b, c, d} and _tuning.TUNING_STATS["cut_keys"] == 1


# ----------------------------------------------------------------------------------------------
# Measured tuning is opt-in; the shape rule picks without timing; the cache's key and a
# read-only cache directory.
# ----------------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("value, ruled_on, unruled_on", [
    (None, False, True), ("auto", False, True), ("", False, True), ("0", False, False), ("1", True, True)])
def test_which_picks_are_timed(monkeypatch, value, ruled_on, unruled_on):
    """auto (the default): the picks with a shape rule untimed, the others (indexer kernels, the
    decode key splits) timed; 0 none; 1 all."""
    monkeypatch.setattr(_tuning, "interpreting", lambda: False)  # as on a GPU
    if value is None:
        monkeypatch.delenv("STREAMKL_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("STREAMKL_AUTOTUNE", value)
    assert _tuning.autotune_enabled() is ruled_on
    assert _tuning.autotune_enabled(ruled=False) is unruled_on


def test_bad_autotune_value_names_the_variable(monkeypatch):
    monkeypatch.setattr(_tuning, "interpreting", lambda: False)
    monkeypatch.setenv("STREAMKL_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match="STREAMKL_AUTOTUNE must be one of"):
        _tuning.autotune_enabled()


def test_never_timed_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(_tuning, "interpreting", lambda: True)
    monkeypatch.setenv("STREAMKL_AUTOTUNE", "1")
    assert not _tuning.autotune_enabled() and not _tuning.autotune_enabled(ruled=False)


def test_untuned_pick_times_nothing(monkeypatch):
    monkeypatch.setattr(_tuning, "autotune_enabled", lambda *a, **k: False)
    monkeypatch.setattr(_tuning, "_time_candidates", lambda *a: pytest.fail("timed without STREAMKL_AUTOTUNE=1"))
    assert _tuning.pick(("k",), CANDS, launch=lambda c: pytest.fail("launched")) == CANDS[0]


def _cited_row(csv, prefix):
    path = os.path.join(ROOT, csv)
    assert os.path.isfile(path), f"{csv} is not committed"
    with open(path) as fh:
        rows = [line for line in fh if line.startswith(prefix)]
    assert rows, f"{csv} has no row starting {prefix!r}"
    return rows[0]


@pytest.mark.parametrize("rule", attn_configs.SHAPE_RULES, ids=lambda r: f"{r.kernel}:{'/'.join(r.shape_class)}")
def test_each_shape_rule_cites_a_committed_row_naming_its_config(rule):
    cfg = rule.config
    row = _cited_row(rule.csv, rule.row_prefix)
    tile = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
    if rule.kernel == "fwd":  # bench rows name a forward config as cfg=BM/BN/warps/stages/tma
        assert cfg.splits == 1
        assert "cfg=" + "/".join(str(x) for x in tile + (cfg.use_tma,)) + "," in row
    else:  # the backward bench prints the plan the API picked: mode/(dK cfg)/(dQ cfg), cfg as a tuple
        assert "(" + ",".join(repr(x) for x in tile + (cfg.variant,)) + ")" in row, row
        mode = rule.shape_class[2]
        assert f"plan={mode}/" in row


@pytest.fixture
def on_gpu(monkeypatch):
    """Candidate lists as on a Hopper GPU (the interpreter has one candidate per kernel)."""
    monkeypatch.setattr(attn_configs, "interpreting", lambda: False)
    monkeypatch.setattr(_tuning, "interpreting", lambda: False)
    monkeypatch.delenv("STREAMKL_BWD_VARIANT", raising=False)


def _rule(kernel, cls):
    return next(r.config for r in attn_configs.SHAPE_RULES if r.kernel == kernel and r.shape_class == cls)


@pytest.mark.parametrize("few", [False, True])
@pytest.mark.parametrize("both", [False, True])
def test_the_separate_backward_runs_the_rules_configs_untimed(on_gpu, both, few):
    side = "both sides" if both else "one side"
    for kind in ("dk", "dq"):
        cands = attn_configs.bwd_variant_candidates(128, both, kind, tma=True, few=few, n_q=8192)
        assert cands[0] == _rule("bwd_" + kind, ("d<=128", "tma", "separate", side))
        assert len(set(cands)) == len(cands)
        if few:  # long problems: the rule's config and the old ones
            assert len(cands) <= 3


@pytest.mark.parametrize("few", [False, True])
@pytest.mark.parametrize("both", [False, True])
def test_a_rule_drops_only_the_config_it_replaces(on_gpu, both, few):
    """The rule's config leads; the candidate it replaces (the same tile, another variant) is gone
    and every other candidate of the list built without a rule stays, whatever its position. Long
    problems (``few``) time the old configs and one new one, here the rule's."""
    side = "both sides" if both else "one side"
    for kind in ("dk", "dq"):
        rule = next(r for r in attn_configs.SHAPE_RULES
                    if r.kernel == "bwd_" + kind and r.shape_class == ("d<=128", "tma", "separate", side))
        cands = attn_configs.bwd_variant_candidates(128, both, kind, tma=True, few=few, n_q=8192)
        with mock.patch.dict(attn_configs._RULES, clear=True):
            plain = attn_configs.bwd_variant_candidates(128, both, kind, tma=True, few=few, n_q=8192)
        assert cands[0] == rule.config and rule.replaces not in cands
        if few:
            plain = attn_configs.bwd_candidates(128, both, kind)
        assert [c for c in plain if c not in (rule.config, rule.replaces)] == cands[1:]
        if rule.replaces is not None:
            assert rule.replaces.variant != rule.config.variant
            assert (rule.replaces.block_m, rule.replaces.block_n, rule.replaces.num_warps, rule.replaces.num_stages) == (
                rule.config.block_m, rule.config.block_n, rule.config.num_warps, rule.config.num_stages)


def test_the_fused_backward_rule_depends_on_the_query_rows(on_gpu):
    short = attn_configs.bwd_variant_candidates(128, False, "dk", tma=True, fused=True, n_q=16)
    long = attn_configs.bwd_variant_candidates(128, False, "dk", tma=True, fused=True, n_q=8192)
    assert short[0] == BwdConfig(block_m=32, block_n=128, num_warps=8, num_stages=3, variant="ptr")
    assert long[0] == BwdConfig(block_m=64, block_n=128, num_warps=8, num_stages=2, variant="tma+trans+fold+rows+reduce")


def test_classes_without_a_rule_keep_their_order(on_gpu):
    assert attn_configs.bwd_variant_candidates(128, False, "dk", ieee=True, tma=True)[0].variant == "ptr"
    no_tma = attn_configs.bwd_variant_candidates(128, False, "dk", tma=False)
    assert no_tma == attn_configs.rule_first(no_tma, "bwd_dk", ("no", "such", "class"))


@pytest.mark.parametrize("causal, packed, cfg", [
    (False, False, FwdConfig(block_m=128, block_n=32, num_warps=8, num_stages=3, use_tma=True)),
    (True, False, FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True)),
    (False, True, FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True)),
    (True, True, FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, use_tma=True))])
def test_the_forward_rule_at_d128(on_gpu, causal, packed, cfg):
    """The dense forward's rule and the packed one's (its own tiles: documents of 1K-128K tokens)."""
    dims = check_inputs(*make_inputs(1, 8, 8, 8, 8, 8, 16, 16))
    cands = attn_configs.fwd_candidates(dims, 128, False, tma=True, causal=causal, packed=packed)
    assert cands[0] == cfg and len(cands) == len(set(cands)) == 4  # the same four tiles, the rule's first


def test_the_cache_is_keyed_by_gpu_torch_triton_and_streamkl(monkeypatch, tmp_path):
    import torch
    import triton

    import streamkl_ref

    monkeypatch.setenv("STREAMKL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("STREAMKL_TUNING_CACHE", raising=False)
    monkeypatch.setattr(_tuning._runtime, "device_name", lambda device: "GPU A")
    base, env = _tuning._disk_cache_dir(None)
    assert env == {"gpu": "GPU A", "torch": torch.__version__, "triton": triton.__version__,
                   "streamkl": streamkl_ref.__version__, "format": _tuning.CACHE_FORMAT}
    assert os.path.dirname(base) == str(tmp_path)
    seen = {base}
    monkeypatch.setattr(_tuning._runtime, "device_name", lambda device: "GPU B")
    seen.add(_tuning._disk_cache_dir(None)[0])
    for module in (torch, triton, streamkl_ref):
        monkeypatch.setattr(module, "__version__", module.__version__ + ".other")
        seen.add(_tuning._disk_cache_dir(None)[0])
    monkeypatch.setattr(_tuning, "CACHE_FORMAT", _tuning.CACHE_FORMAT + 1)
    seen.add(_tuning._disk_cache_dir(None)[0])
    assert len(seen) == 6  # each of the four, and the entry format, changes the directory


@pytest.mark.parametrize("how", ["under a file", "read-only"])
def test_a_read_only_cache_directory_stores_nothing_and_fails_nothing(tuner, tmp_path, monkeypatch, how):
    _, timed = tuner
    if how == "under a file":  # makedirs fails for any user, root included
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("")
        root = blocker / "streamkl"
    else:
        root = tmp_path / "ro"
        root.mkdir()
        os.chmod(root, 0o555)
        if os.access(root, os.W_OK):  # root ignores the mode bits: make the store itself fail
            monkeypatch.setattr(_tuning.tempfile, "mkstemp",
                                lambda **kw: (_ for _ in ()).throw(PermissionError(13, "read-only", kw["dir"])))
    monkeypatch.setenv("STREAMKL_CACHE_DIR", str(root))
    assert _tuning.pick(("ro",), CANDS, launch="real") == CANDS[-1]
    assert len(timed) == 1
    assert not [p for p in tmp_path.rglob("*.json")]
    _tuning._TUNED.clear()  # the next process tunes again (nothing was stored), and still works
    assert _tuning.pick(("ro",), CANDS, launch="real") == CANDS[-1]
    assert len(timed) == 2


@pytest.mark.parametrize("causal", [False, True])
def test_a_long_backward_is_timed_on_a_bounded_slice(monkeypatch, causal):
    """Measured tuning of a backward past TUNING_WORK_LIMIT launches its candidates on the slice
    ``tuning_slice`` names (the first rows and the keys they see), never on the whole problem,
    and the real call still gets the whole problem's gradients. The limit and the slice are
    scaled down so that the interpreter can run it."""
    import torch

    import streamkl_gpu
    from streamkl_gpu.attention import launch as _launch

    from _gpu_helpers import reference, rel_err

    nq = nk = 48
    xs = make_inputs(1, 2, 2, 2, nq, nk, 16, 16, seed=3)
    g = torch.randn(1, 2, nq, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(_launch, "tuning_slice", lambda dims, c: (16, 16 + dims.NK - dims.NQ))
    monkeypatch.setattr(_launch, "autotune_enabled", lambda *a, **k: True)
    monkeypatch.setattr(_tuning, "autotune_enabled", lambda *a, **k: True)
    monkeypatch.setattr(_tuning, "_TUNED", {})
    monkeypatch.setenv("STREAMKL_TUNING_CACHE", "0")
    monkeypatch.setenv("STREAMKL_AUTOTUNE", "1")  # a signature of its own (no plan from another test)
    real = _launch.bwd_variant_candidates
    monkeypatch.setattr(_launch, "bwd_variant_candidates", lambda *a, **kw: real(*a, **kw) * 2)  # two to "time"
    launches = []
    real_launch = _launch.fast_launch

    def recording(kernel, grid, args, *rest, **kw):
        if "bwd" in kernel.__name__:
            launches.append((kernel.__name__, grid))
        return real_launch(kernel, grid, args, *rest, **kw)

    monkeypatch.setattr(_launch, "fast_launch", recording)
    timed = []

    def fake_time(key, candidates, launch):
        launch(candidates[0])
        timed.append(len(launches))
        return candidates[0]

    monkeypatch.setattr(_tuning, "_time_candidates", fake_time)
    ins = [x.clone().requires_grad_(i >= 2) for i, x in enumerate(xs)]  # setting 1
    streamkl_gpu.attention_kl(*ins, causal=causal, bwd_mode="separate").backward(g)
    assert len(timed) == 2  # dK and dQ picks
    block = _runtime_block()
    tuning, real_call = launches[:timed[-1]], launches[timed[-1]:]
    assert tuning and all(grid[0] == 16 // block for _, grid in tuning), tuning  # 16 rows / keys only
    assert {grid[0] for _, grid in real_call} == {nq // block}
    _, _, _, ref = reference(xs, g, causal=causal)
    for name, x in (("dq2", ins[2]), ("dk2", ins[3])):
        assert rel_err(x.grad, ref[name]) <= 1e-5, name


def _runtime_block():
    from streamkl_gpu._core import runtime as _runtime
    assert _runtime.INTERPRETER_BLOCK[0] == _runtime.INTERPRETER_BLOCK[1]
    return _runtime.INTERPRETER_BLOCK[0]


def test_a_packed_batch_past_the_work_limit_is_not_timed():
    from streamkl_gpu.attention import varlen as _varlen

    dims = check_inputs(*make_inputs(1, 8, 8, 8, 8, 8, 16, 16))
    # 2M packed tokens, 16 heads, D = 128, sequences up to 64K: past the limit; 64 x 1K: under it
    assert not _varlen._timeable(replace(dims, NQ=1 << 21, NK=1 << 21, H=16, D1=128, D2=128), 65536)
    assert _varlen._timeable(replace(dims, NQ=65536, NK=65536, H=16, D1=128, D2=128), 1024)


def test_packed_picks_follow_the_rule(monkeypatch):
    """A packed batch's forward, dK and dQ picks are ruled ones: the first candidate untimed by
    default, every candidate timed under STREAMKL_AUTOTUNE=1 (the forward's packed rule, the dense
    rules' tiles for the backward, each measured against the timed pick: docs/performance.md,
    "First calls")."""
    import torch

    import streamkl_gpu
    from streamkl_gpu.attention import varlen as _varlen

    seen = []
    monkeypatch.setattr(_varlen, "pick", lambda key, cands, *a, ruled=True, **k: seen.append((key[0], ruled)) or cands[0])
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q1, k1, q2, k2 = (torch.randn(8, 2, 16, requires_grad=True) for _ in range(4))
    streamkl_gpu.attention_kl_varlen(q1, k1, q2, k2, cu, cu, 5, 5, causal=True,
                                     bwd_mode="separate").sum().backward()
    assert seen == [("varlen_fwd", True), ("bwd_dk", True), ("bwd_dq", True)], seen
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q1, k1, q2, k2))


def test_several_key_splits_make_the_forward_pick_timed(monkeypatch):
    """Where split_choices offers several key splits (decoding, with the splits timed), the
    forward's pick over the splits x tiles product is a timed one (ruled=False): the untimed first
    candidate would be the one-pass kernel (split 1), measured 6-8x slower at N_Q = 1, N_K = 128K.
    One split: the shape rule's pick (ruled=True)."""
    import torch

    import streamkl_gpu.attention.launch as _launch_mod

    seen = []
    monkeypatch.setattr(_launch_mod, "pick", lambda key, cands, *a, ruled=True, **k: seen.append(
        (sorted({c.splits for c in cands}), ruled)) or cands[0])
    xs = [torch.randn(1, 2, n, 16) for n in (1, 256, 1, 256)]
    dims = check_inputs(*xs)
    monkeypatch.setattr(_launch_mod, "split_choices", lambda *a: (1, 4))
    _launch_mod._forward_config(*xs, dims, False, None, 16, 16)
    assert seen == [([1, 4], False)], seen
    seen.clear()
    monkeypatch.setattr(_launch_mod, "split_choices", lambda *a: (4,))
    _launch_mod._forward_config(*xs, dims, False, None, 16, 16)
    assert all(ruled for _, ruled in seen), seen  # (no pick at all where one candidate is left)


def test_first_that_fits_moves_past_refusals_only_and_remembers_outside_compile_ahead(monkeypatch):
    """A launch Triton refuses (OutOfResources) moves on to the next choice, which is remembered
    for the key and run directly later; another error raises; the choices are not read for a
    remembered key; in a compile-ahead thread nothing is remembered (nothing ran)."""
    class OutOfResources(Exception):
        pass

    ran = []

    def run(choice):
        ran.append(choice)
        if choice == "big":
            raise OutOfResources("out of resource: shared memory")
        if choice == "bug":
            raise ValueError("a bug")
        return choice.upper()

    cache = {}
    assert _tuning.first_that_fits(cache, "k", ["big", "small", "other"], run) == "SMALL"
    assert ran == ["big", "small"] and cache == {"k": "small"}

    def unread():
        raise AssertionError("the choices of a remembered key are read")
        yield  # pragma: no cover

    assert _tuning.first_that_fits(cache, "k", unread(), run) == "SMALL" and ran[-1] == "small"
    with pytest.raises(ValueError, match="a bug"):
        _tuning.first_that_fits({}, "b", ["bug", "small"], run)
    with pytest.raises(OutOfResources):
        _tuning.first_that_fits({}, "n", ["big"], run)  # none fits: the last refusal
    monkeypatch.setattr(_tuning, "compiling_ahead", lambda: True)
    ahead = {}
    assert _tuning.first_that_fits(ahead, "k", ["small"], run) == "SMALL" and ahead == {}
