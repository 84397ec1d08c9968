"""The launch tuner's rules and its on-disk cache, on CPU.

The timing itself needs a GPU; here ``_time_candidates`` is replaced by a recorder, so the tests
check what is timed, on which problem, what is stored where, and what a second process reads.
"""
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu.attention import configs as attn_configs
from streamkl_ref._checks import check_inputs

from _gpu_helpers import make_inputs


@pytest.fixture
def tuner(tmp_path, monkeypatch):
    """Tuning on (as on a GPU), the cache in a temporary directory, timing recorded, not run."""
    monkeypatch.setenv("STREAMKL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("STREAMKL_TUNING_CACHE", raising=False)
    monkeypatch.setattr(_tuning, "autotune_enabled", lambda: True)
    monkeypatch.setattr(_tuning, "_TUNED", {})
    timed = []

    def fake_time(key, candidates, launch):
        timed.append((key, tuple(candidates), launch))
        return candidates[-1]  # "the last one was fastest"

    monkeypatch.setattr(_tuning, "_time_candidates", fake_time)
    return tmp_path, timed


CANDS = [(64, 64, 4, 2, False, 1), (128, 64, 8, 3, True, 1)]


def test_first_pick_times_and_stores_then_disk_answers(tuner):
    cache, timed = tuner
    key = ("fwd", 128, 128, "bf16", "causal", 8192)
    assert _tuning.pick(key, CANDS, launch="real") == CANDS[-1]
    assert len(timed) == 1 and timed[0][2] == "real"
    files = [p for p in cache.rglob("*.json")]
    assert len(files) == 1
    entry = json.loads(files[0].read_text())
    assert entry["key"] == repr(key) and tuple(entry["config"]) == CANDS[-1]
    assert set(entry["env"]) == {"gpu", "torch", "triton", "streamkl"}
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
    other = [(32, 32, 4, 2, False, 1), (16, 16, 4, 2, False, 1)]
    assert _tuning.pick(("k2",), other, launch="real") == other[-1]
    assert len(timed) == 2


def test_cache_can_be_disabled(tuner, monkeypatch):
    cache, timed = tuner
    monkeypatch.setenv("STREAMKL_TUNING_CACHE", "0")
    _tuning.pick(("k3",), CANDS, launch="real")
    assert not list(cache.rglob("*.json"))


_WRITER = """
import sys
from streamkl_gpu._core import tuning as _tuning
i = int(sys.argv[1])
for _ in range(100):
    _tuning._disk_store(None, ("shared",), (i, i, 4, 2, False, 1))
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
    assert entry["key"] == repr(("shared",)) and entry["config"][0] in range(3)


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
    monkeypatch.setattr(_tuning, "autotune_enabled", lambda: False)
    rule = attn_configs.auto_split_k(decode, 16, 128, 132)
    assert attn_configs.split_choices(decode, False, 128, 132) == (rule,)
    monkeypatch.setattr(_tuning, "autotune_enabled", lambda: True)
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
