"""streamkl_gpu._core.triton_launchers: Triton 3.6 builds each kernel's C launcher with the host
compiler at its first launch, after the compile; streamkl builds it while the kernel compiles.
CI's Triton (3.9) builds no per-kernel launcher, so nothing is wrapped there; the wrapper's own
logic is checked with stand-ins (the GPU image's Triton 3.6 runs it for real: ``streamkl verify``
and the first-call section)."""
import threading
import time
import types

import pytest

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402

from streamkl_gpu._core import triton_launchers  # noqa: E402


def _builds_per_kernel() -> bool:
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return False
    init = getattr(getattr(driver, "CudaLauncher", None), "__init__", None)
    return init is not None and "compile_module_from_src" in init.__code__.co_names


def test_wrapped_exactly_where_the_launcher_is_built_per_kernel():
    wrapped = getattr(JITFunction._do_compile, "_streamkl_launcher_early", False)
    assert triton_launchers.install() == wrapped == _builds_per_kernel()


class _StandIn:
    """A JIT function as ``_start`` reads it: ``fn.fn.__module__`` and ``ASTSource``."""

    def __init__(self, module, with_source=True):
        self.fn = types.SimpleNamespace(__module__=module)
        if with_source:
            self.ASTSource = lambda fn, signature, constexprs, attrs: ("source", fn, signature, constexprs, attrs)


@pytest.fixture
def recorder(monkeypatch):
    built = []

    def build(src):
        time.sleep(0.05)  # slower than the stand-in compile: the wrapper must wait for it
        built.append((src, threading.current_thread().name))

    monkeypatch.setattr(triton_launchers, "_BUILDER", [build])
    return built


def test_own_kernels_get_their_launcher_built_from_the_compile_arguments(recorder):
    fn = _StandIn("streamkl_gpu.attention.triton.fwd")
    thread = triton_launchers._start(fn, {"q": "*bf16"}, {"BLOCK": 64}, {"align": 16})
    assert thread is not None
    thread.join()
    assert recorder == [(("source", fn, {"q": "*bf16"}, {"BLOCK": 64}, {"align": 16}), "streamkl-launcher-build")]


@pytest.mark.parametrize("fn", [_StandIn("user_kernels"), _StandIn("streamkl_gpu.x", with_source=False)],
                         ids=["another package's kernel", "no source class"])
def test_nothing_is_built_for_other_kernels(recorder, fn):
    assert triton_launchers._start(fn, {}, {}, {}) is None
    assert recorder == []


def test_nothing_is_built_where_triton_builds_no_launcher(monkeypatch):
    monkeypatch.setattr(triton_launchers, "_BUILDER", [None])
    assert triton_launchers._start(_StandIn("streamkl_gpu.x"), {}, {}, {}) is None


def test_the_compile_returns_after_the_build_and_errors_in_it_are_dropped(recorder, monkeypatch):
    order = []

    def compile_(self, key, signature, device, constexprs, options, attrs, warmup):
        order.append("compiled")
        return "kernel"

    monkeypatch.setattr(JITFunction, "_do_compile", compile_)  # (restored after the test)
    assert triton_launchers.install()
    fn = _StandIn("streamkl_gpu.attention.triton.fwd")
    assert JITFunction._do_compile(fn, "key", {"q": "*bf16"}, 0, {}, None, {}, False) == "kernel"
    assert order == ["compiled"] and len(recorder) == 1  # the build had ended when the compile returned

    def failing(src):
        raise RuntimeError("no host compiler")

    monkeypatch.setattr(triton_launchers, "_BUILDER", [failing])
    assert JITFunction._do_compile(fn, "key", {}, 0, {}, None, {}, False) == "kernel"


def test_an_asynchronous_compile_returns_without_waiting_for_the_build(monkeypatch):
    release, built = threading.Event(), []

    def slow_build(src):
        release.wait(5)
        built.append(src)

    future = types.SimpleNamespace(result=lambda: "kernel")  # what AsyncCompileMode's _do_compile returns
    monkeypatch.setattr(triton_launchers, "_BUILDER", [slow_build])
    monkeypatch.setattr(JITFunction, "_do_compile", lambda self, *args: future)
    assert triton_launchers.install()
    assert JITFunction._do_compile(_StandIn("streamkl_gpu.x"), "key", {}, 0, {}, None, {}, False) is future
    assert built == []  # returned while the build still waited
    release.set()


def test_descriptors_are_guessed_as_tma_descriptors():
    """Triton's launcher passes an ``nvTmaDesc`` for a descriptor whose metadata entry is not None
    (what the Gluon kernels' descriptors all are on sm_90) and pointer, shape and strides otherwise."""
    sig = {"q": "tensordesc<bf16[128, 128]>", "n": "i32", "k": "tensordesc<bf16[64, 128]>", "B": "constexpr"}
    guess = triton_launchers._tma_guess(sig)
    assert len(guess) == 2 and all(m is not None for m in guess)
    assert triton_launchers._tma_guess({"x": "*fp32", "n": "i32"}) is None


def test_off_with_compile_ahead_off(recorder, monkeypatch):
    monkeypatch.setenv("STREAMKL_COMPILE_AHEAD", "0")
    assert triton_launchers._start(_StandIn("streamkl_gpu.attention.triton.fwd"), {}, {}, {}) is None
    assert recorder == []
