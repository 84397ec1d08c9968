"""`streamkl verify`'s GPU battery (which case runs in which dtype) and its compile clock, on CPU."""
import re
from pathlib import Path

import pytest

from streamkl_gpu import verify
from streamkl_gpu._core.compile_clock import CompileClock
from streamkl_ref.testing import attention_cases
from _compiler_env import compiler_env

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ["float32", "float16", "bfloat16"]


def _gpu_battery():
    """(name, head dims, dtypes it runs in on a GPU) of each case of verify's GPU battery (its unit
    list), but the indexer's mean reduction (float32 alone on every device)."""
    return [(u.name, u.head_dims, list(u.dtypes)) for u in verify.own_units("cuda")
            if not u.name.startswith("indexer(mean):")]


def test_every_gpu_case_runs_and_every_dtype_is_checked():
    rows = _gpu_battery()
    assert all(dts for _, _, dts in rows)
    for _, dims, dts in rows:
        if max(dims) > verify.GPU_SMALL_HEAD_DIM:  # no fp32 compile at large heads
            assert dts == ["bfloat16"]
    attention = [dts for name, _, dts in rows[:len(attention_cases("cuda", planted=False))]]
    assert {d for dts in attention for d in dts} == set(DTYPES)


def test_the_docs_list_exactly_the_pairs_left_out():
    text = (ROOT / "docs/verify.md").read_text()
    section = text.split("## On the GPU", 1)[1].split("\n## ", 1)[0]
    listed = {m.group(1): set(m.group(2).split(", ")) for m in re.finditer(r"^\| `([^`]+)` \| ([^|]+?) \|", section, re.M)}
    dropped = {name: set(DTYPES) - set(dts) for name, _, dts in _gpu_battery() if set(DTYPES) - set(dts)}
    assert listed == dropped


def test_the_compile_clock_counts_calls_into_the_compiler_and_restores_it():
    triton_compiler = pytest.importorskip("triton.compiler")
    import triton.compiler.compiler as module

    original = module.compile
    with CompileClock() as clock:
        assert clock.available and module.compile is not original and triton_compiler.compile is module.compile
        snap = clock.snapshot()
        with pytest.raises(Exception):
            triton_compiler.compile(None)  # not a source: the compiler raises, the call still counts
        seconds, calls = clock.since(snap)
        assert calls == 1 and seconds >= 0.0
    assert module.compile is original and triton_compiler.compile is original


def test_the_compile_clock_keeps_each_compiles_kernel_thread_and_window():
    """The first-call timeline (bench first_call's compile_window_s rows): which kernel compiled on
    which thread, from when to when."""
    import threading
    from types import SimpleNamespace

    triton_compiler = pytest.importorskip("triton.compiler")
    source = SimpleNamespace(fn=SimpleNamespace(__name__="_some_kernel"))  # an ASTSource's JIT function

    def compile_it():
        with pytest.raises(Exception):
            triton_compiler.compile(source)  # not a real source: the compiler raises, the call still counts

    with CompileClock() as clock:
        worker = threading.Thread(target=compile_it, name="compile-worker")
        worker.start()
        worker.join()
        compile_it()
    assert [(k, t) for k, t, *_ in clock.events] == [("_some_kernel", "compile-worker"),
                                                          ("_some_kernel", threading.current_thread().name)]
    assert all(0 <= end - start <= clock.seconds for _, _, start, end, *_ in clock.events)
    assert clock.events[0][3] <= clock.events[1][2]  # one after the other here
    assert all(e[5:] == ("", "") for e in clock.events)  # a failed compile: no Triton keys, no error


def test_a_compile_records_the_keys_triton_cached_it_under(tmp_path):
    """Each event holds Triton's source hash and on-disk cache key of the compile (what
    devtools.warm_compiles reads to tell a cache miss from a changed key): a real compile for sm_90,
    which runs on a CPU machine, in its own process (the suite's interpreter makes no JIT source)."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = tmp_path / "compile_once.py"
    script.write_text("""
import triton, triton.language as tl
import triton.compiler.compiler as module
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from streamkl_gpu._core.compile_clock import CompileClock

@triton.jit
def _copy(src, dst):
    tl.store(dst + tl.arange(0, 16), tl.load(src + tl.arange(0, 16)))

source = ASTSource(_copy, signature={"src": "*fp32", "dst": "*fp32"}, constexprs={})
with CompileClock() as clock:
    kernel = module.compile(source, target=GPUTarget("cuda", 90, 32))
(event,) = clock.events
assert event[0] == "_copy" and event[5] == source.hash()[:12] and event[6] == kernel.hash[:12], event
assert len(event[5]) == len(event[6]) == 12, event
print("keys", event[5], event[6])
""")
    env = compiler_env(TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0 and "keys " in proc.stdout, proc.stderr[-2000:]


def test_each_compile_keeps_a_fingerprint_of_what_it_asked_for():
    """verify's per-case ``compiles`` (docs/verify.md): a compile's fingerprint is the same for the
    same signature, constants, specialisation and options, and differs when any of them does (a
    warm run's compile is then told apart: the same binary asked again, or a new specialisation)."""
    from types import SimpleNamespace

    from streamkl_gpu._core.compile_clock import fingerprint

    def source(**changes):
        parts = dict(signature={"q": "*bf16", "n": "i32"}, constants={(3,): 1, (4,): 128},
                     attrs={(0,): [["tt.divisibility", 16]]}) | changes
        return SimpleNamespace(fn=SimpleNamespace(__name__="_k"), **parts)

    opts = {"num_warps": 4, "num_stages": 2}
    same = fingerprint(source(), opts)
    assert same == fingerprint(source(), dict(reversed(list(opts.items())))) and len(same) == 12
    others = [fingerprint(source(attrs={}), opts), fingerprint(source(constants={(3,): 1, (4,): 64}), opts),
              fingerprint(source(signature={"q": "*fp16", "n": "i32"}), opts), fingerprint(source(), {"num_warps": 8}),
              fingerprint(object(), None)]  # (no parts to read: still a fingerprint, no error)
    assert len({same, *others}) == 6
    clock = CompileClock()
    clock.events = [("_a", "t", 1.0, 2.5, "f1", "s1", "k1"), ("_b", "t", 3.0, 3.5, "f2", "s2", "k2"),
                    ("_c", "t", 0.5, 1.5, "f3", "s3", "k3")]
    assert clock.within(1.0, 3.0) == [("_a", 1.5, "f1", "s1", "k1")]  # started in the span
    assert [c[0] for c in clock.within(0.0, 4.0)] == ["_a", "_b", "_c"]


def test_warm_compiles_are_told_apart_from_the_cold_runs(tmp_path, capsys):
    """devtools.warm_compiles: a slow warm compile under a cache key the cold run made is a load (the
    binary was in the cache); the same request (kernel, fingerprint) under another source hash or
    another key is told apart; one with a fingerprint never met is new; loads (fast compiles) are not
    listed; a report without Triton's keys still tells a repeat from a new one."""
    import json

    from streamkl_gpu.devtools import warm_compiles

    cold = {"case_seconds": {"a bfloat16": {"compiles": [["_k", 2.0, "f1", "s1", "k1"], ["_k", 1.5, "f2", "s1", "k2"],
                                                         ["_k", 1.5, "f4", "s1", "k4"], ["_k", 1.4, "f5", "s1", "k5"]]}}}
    warm = {"case_seconds": {"a bfloat16": {"compiles": [["_k", 0.01, "f1", "s1", "k1"], ["_k", 1.2, "f2", "s1", "k2"],
                                                         ["_k", 1.1, "f4", "s9", "k9"], ["_k", 1.3, "f5", "s1", "k8"]]},
                             "b float32": {"compiles": [["_k", 3.0, "f3", "s1", "k3"], ["_j", 0.9, "f1", "s7", "k7"]]}}}
    assert warm_compiles.classify(cold, warm) == [
        ("a bfloat16", "_k", 1.2, "loaded"), ("a bfloat16", "_k", 1.1, "source"), ("a bfloat16", "_k", 1.3, "rekeyed"),
        ("b float32", "_k", 3.0, "new"), ("b float32", "_j", 0.9, "new")]  # (another kernel: not the same binary)
    strip = lambda r: {"case_seconds": {c: {"compiles": [x[:3] for x in f["compiles"]]} for c, f in r["case_seconds"].items()}}
    assert [k for *_, k in warm_compiles.classify(strip(cold), strip(warm))] == ["repeat"] * 3 + ["new"] * 2
    cold, warm = strip(cold), strip(warm)  # the printed summary, on reports without keys
    paths = []
    for name, report in (("cold", cold), ("warm", warm)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    assert warm_compiles.main([str(p) for p in paths] + ["--slow-s", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "4 warm compiles over 1.0 s: 3 repeat, 1 new" in out and "_j" not in out


def test_the_compile_wall_counts_side_by_side_compiles_once_and_stays_in_its_span():
    """verify's per-case compile seconds (``wall_since``): overlapping compile windows count once,
    windows are clipped to the case's span, and compile + check never exceeds the case's wall time
    (summed thread seconds made the check time negative when compiles ran side by side)."""
    clock = CompileClock()
    clock.events = [("a", "t1", 1.0, 4.0, ""), ("b", "t2", 2.0, 5.0, ""),  # side by side: 1..5 is 4 s, not 6
                    ("c", "t1", 7.0, 8.0, ""), ("d", "t3", 7.5, 7.6, ""),  # one inside another
                    ("e", "t1", 9.0, 12.0, "")]                            # runs past the span's end
    assert clock.wall_since(0.0, 10.0) == pytest.approx(4.0 + 1.0 + 1.0)
    assert clock.wall_since(3.0, 7.8) == pytest.approx(2.0 + 0.8)  # clipped at both ends
    assert clock.wall_since(5.0, 7.0) == 0.0
    assert sum(t1 - t0 for _, _, t0, t1, _ in clock.events) > clock.wall_since(0.0, 12.0) == pytest.approx(8.0)


def test_a_clock_installed_over_another_wraps_every_owner_and_restores_the_first():
    """A second clock over one still installed (verify inside a benchmark process) replaces the
    compiler entry point in the module and the package alike, and its exit puts the first back."""
    triton_compiler = pytest.importorskip("triton.compiler")
    import triton.compiler.compiler as module

    original = module.compile
    outer = CompileClock().install()
    try:
        with CompileClock() as inner:
            assert inner.available and triton_compiler.compile is module.compile
            with pytest.raises(Exception):
                triton_compiler.compile(None)
            assert inner.calls == 1
        assert module.compile is triton_compiler.compile is not original
    finally:
        outer.uninstall()
    assert module.compile is original and triton_compiler.compile is original


def test_long_cases_check_settings_1_and_2_with_the_default_backward(monkeypatch):
    """From SETTINGS_MIN_KEYS keys (the GPU battery's long cases) the trained side's gradients of
    settings 1 and 2 in the default mode are rows of their own, and a wrong one fails. Here the
    threshold is lowered onto a small case (the interpreter)."""
    from streamkl_gpu import api
    from streamkl_ref._testing.report import Report

    from streamkl_gpu.attention.gluon import bwd_dispatch

    # verify keeps torch out of its import, so the threshold is its own constant: kept in step here
    assert verify.SETTINGS_MIN_KEYS == bwd_dispatch.GLUON_BWD_MIN_KEYS
    assert any(c.NK >= verify.SETTINGS_MIN_KEYS and c.D1 == c.D2 and c.NQ >= bwd_dispatch.GLUON_BWD_MIN_QUERIES
               for c in attention_cases("cuda"))  # a GPU case where Hopper's Gluon backward can run
    case = next(c for c in attention_cases("cpu") if c.name == "ragged")
    monkeypatch.setattr(verify, "SETTINGS_MIN_KEYS", 0)
    report = Report(options={})
    verify._check_attention_case(case, "float32", 0, "cpu", report)
    rows = {r.quantity: r.status for r in report.rows}
    settings = {q: s for q, s in rows.items() if "setting" in q}
    assert settings == {"dq2 (setting 1)": "pass", "dk2 (setting 1)": "pass",
                        "dq1 (setting 2)": "pass", "dk1 (setting 2)": "pass"}

    real = api.attention_kl

    def off_with_one_side(q1, k1, q2, k2, **kw):  # 1 % off whenever exactly one side is trained
        kl = real(q1, k1, q2, k2, **kw)
        return kl * 1.01 if q1.requires_grad != q2.requires_grad else kl

    monkeypatch.setattr(api, "attention_kl", off_with_one_side)
    report = Report(options={})
    verify._check_attention_case(case, "float32", 0, "cpu", report)
    failed = {r.quantity for r in report.failed}
    assert failed == set(settings), failed
