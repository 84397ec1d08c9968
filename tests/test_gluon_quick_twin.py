"""The Gluon forward's first call at a new specialisation (CPU: the kernel's compile stood in by a
function that sleeps). The default's compile runs on a background thread; until it has finished
the call launches the default's quick twin (``fwd_sm90_launch.quick_twin``: the same fold with
both consumer warpgroups in one partition, half the code to compile); then the default, directly.
That the twin's outputs are bitwise the default's is checked on the GPU (the forward's GPU script,
bench/results/); its SASS in tests/test_gluon_compile.py."""
import pathlib
import subprocess
import sys
import threading
import types

import pytest

from streamkl_gpu._core import launcher as _fast_launch
from streamkl_gpu.attention.gluon import fwd_sm90_launch as L


def test_quick_twin_is_the_default_in_one_partition():
    cfg = L.kernel_config(128, 128)
    twin = L.quick_twin(cfg)
    assert twin.unite == 1 and twin.sched != cfg.sched
    assert {f: getattr(twin, f) for f in L.KNOB_FIELDS if f != "unite"} == \
        {f: getattr(cfg, f) for f in L.KNOB_FIELDS if f != "unite"}
    assert (twin.block_n, twin.num_stages, twin.maxnreg) == (cfg.block_n, cfg.num_stages, cfg.maxnreg)
    # the turnstile and the two-tile loop order two warpgroups: no twin
    assert L.quick_twin(L.make_config(128, 128, 128, 168, pingpong=1, **L.DEFAULT_KNOBS)) is None
    assert L.quick_twin(twin) is None


class _Device:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeKernel:
    """Stands in for the JIT kernel: ``warmup`` (the background compile) waits for ``release``;
    ``kernel[grid](...)`` (a compile on the calling thread) returns at once; both log the SCHED."""

    arg_names = ["a", "SCHED"]
    params = [types.SimpleNamespace(name="a", default=None), types.SimpleNamespace(name="SCHED", default=None)]

    def __init__(self):
        self.release = threading.Event()
        self.background, self.calling, self.direct = [], [], []

    def warmup(self, *args, grid, **kwargs):
        self.background.append(kwargs["SCHED"])
        assert self.release.wait(10)
        return self._compiled(kwargs["SCHED"])

    def _compiled(self, sched):
        return types.SimpleNamespace(_init_handles=lambda: None, sched=sched, function=None, packed_metadata=None,
                                     run=lambda *args: self.direct.append(sched))

    def __getitem__(self, grid):
        def compile_and_launch(*args, **kwargs):
            self.calling.append(kwargs["SCHED"])
            return self._compiled(kwargs["SCHED"])
        return compile_and_launch


@pytest.fixture
def fake(monkeypatch):
    kernel = _FakeKernel()
    monkeypatch.setattr(L._kernel, "_gluon_kl_fwd_kernel", kernel)
    monkeypatch.setattr(_fast_launch, "enabled", lambda: True)
    monkeypatch.setattr(_fast_launch, "ahead_allowed", lambda: True)
    monkeypatch.setattr(L.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(L.torch.cuda, "device", lambda d: _Device())
    monkeypatch.setattr(_fast_launch, "_raw_stream", lambda device: 0)
    monkeypatch.setattr(L, "_COMPILED", {})
    monkeypatch.setattr(L, "_COMPILING", {})
    yield kernel
    kernel.release.set()
    _fast_launch.settle()


DEFAULT, TWIN = 1, 2


def _twin():
    return (1, 1), (0,), dict(SCHED=TWIN), {}


def test_the_twin_runs_until_the_background_compile_is_kept(fake):
    first, used = L._launch((1, 1), (0,), dict(SCHED=DEFAULT), {}, _twin)
    assert first.sched == TWIN and used == dict(SCHED=TWIN)
    again, _ = L._launch((1, 1), (0,), dict(SCHED=DEFAULT), {}, _twin)  # still compiling
    assert again.sched == TWIN and fake.direct == [TWIN]
    assert fake.background == [DEFAULT], "one background compile per specialisation"
    assert fake.calling == [TWIN], "the twin compiles once, on the calling thread"
    fake.release.set()
    _fast_launch.settle()
    kept, used = L._launch((1, 1), (0,), dict(SCHED=DEFAULT), {}, _twin)
    assert kept.sched == DEFAULT and used == dict(SCHED=DEFAULT) and fake.direct == [TWIN, DEFAULT]
    assert fake.background == [DEFAULT] and fake.calling == [TWIN]


def test_without_a_twin_the_calling_thread_compiles(fake):
    kernel, _ = L._launch((1, 1), (0,), dict(SCHED=DEFAULT), {}, None)
    assert kernel.sched == DEFAULT and fake.calling == [DEFAULT] and fake.background == []
    other, _ = L._launch((1, 1), (5,), dict(SCHED=DEFAULT), {}, lambda: None)  # quick_twin had none
    assert other.sched == DEFAULT and fake.background == []


def test_a_failed_background_compile_falls_back_to_the_calling_thread(fake, monkeypatch):
    def broken(*args, grid, **kwargs):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(fake, "warmup", broken)
    assert L._launch((1, 1), (0,), dict(SCHED=DEFAULT), {}, _twin)[0].sched == TWIN
    _fast_launch.settle()
    # not kept and not compiling: this launch compiles on the calling thread (and would raise there)
    assert L._launch((1, 1), (0,), dict(SCHED=DEFAULT), {}, _twin)[0].sched == DEFAULT


def test_no_twin_where_compiling_ahead_is_off(fake, monkeypatch):
    monkeypatch.setattr(_fast_launch, "ahead_allowed", lambda: False)
    assert L._launch((1, 1), (0,), dict(SCHED=DEFAULT), {}, _twin)[0].sched == DEFAULT
    assert fake.background == []


def test_unite_refuses_the_schedules_that_order_two_warpgroups():
    with pytest.raises(ValueError, match="UNITE"):
        L.sched_of({"UNITE": 1, "PINGPONG": 1})
    with pytest.raises(ValueError, match="UNITE"):
        L.sched_of({"UNITE": 1, "LOOK": 1, "ORDER": 1})
    assert L.sched_of({"UNITE": 1, **{k.upper(): v for k, v in L.DEFAULT_KNOBS.items()}}) > 0


def test_a_process_ending_during_a_background_compile_waits_for_it(tmp_path):
    """The compile threads are non-daemon threads: a process that ends while one runs waits for
    it (a daemon thread inside Triton's compiler at interpreter exit aborts the process)."""
    done = tmp_path / "done"
    code = ("import time\nfrom streamkl_gpu._core import launcher\n"
            f"launcher.compile_in_background(lambda: (time.sleep(0.5), open({str(done)!r}, 'w').close()), 'test')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(pathlib.Path(__file__).resolve().parents[1]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert done.exists(), "the process ended before its background compile"
