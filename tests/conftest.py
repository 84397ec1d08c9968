"""tests/: fixtures for the streamkl_gpu tests. (Hypothesis profiles and TRITON_INTERPRET: ../conftest.py)"""
import pytest


@pytest.fixture
def poison():
    """Fresh kernel outputs start as NaN, so an element a kernel fails to write cannot pass."""
    yield from _override_api("POISON_FRESH", True)


def _override_api(name, value):
    """Set the runtime setting ``streamkl_gpu._core.runtime.<name>`` for one test; yields the value, restores the old one."""
    from streamkl_gpu._core import runtime as _runtime

    old = getattr(_runtime, name)
    setattr(_runtime, name, value)
    try:
        yield value
    finally:
        setattr(_runtime, name, old)


@pytest.fixture
def block(request):
    """Run the interpreter with another fixed tile shape (BLOCK_M, BLOCK_N)."""
    yield from _override_api("INTERPRETER_BLOCK", request.param)


@pytest.fixture
def tma(request):
    """Under the interpreter, read the forward's key tiles through TMA descriptors (param True)."""
    yield from _override_api("INTERPRETER_TMA", request.param)


@pytest.fixture(autouse=True, scope="session")
def _bounds_checked_interpreter():
    """Under the interpreter every launch of the suite is bounds-checked: a load, store or atomic
    outside the launch's tensors raises (streamkl_gpu.devtools.bounds), as the GPU would fault;
    and race-checked: an address two programs of one launch touch, one with a plain store, raises
    (``STREAMKL_INTERPRETER_RACES=0`` turns that part off)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from streamkl_gpu.devtools import bounds as _interpreter_bounds

    _interpreter_bounds.install(races=os.environ.get("STREAMKL_INTERPRETER_RACES", "1") == "1")
    yield
    _interpreter_bounds.uninstall()


@pytest.fixture(autouse=True, scope="session")
def _helper_calls_patch_once():
    """Under the interpreter a ``@triton.jit`` helper called inside a launch skips patching
    triton.language again (streamkl_gpu.devtools.interpreter_calls: a third of an interpreted
    test's time, the same results; tests/test_interpreter_calls.py)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from streamkl_gpu.devtools import interpreter_calls as _interpreter_calls

    _interpreter_calls.install()
    yield
    _interpreter_calls.uninstall()


@pytest.fixture(autouse=True, scope="session")
def _poisoned_fresh_buffers():
    """Every fresh kernel output of the suite starts as NaN (``_runtime.POISON_FRESH``), so an
    element a kernel fails to write cannot pass anywhere (``STREAMKL_TEST_POISON=0``: off)."""
    import os

    if os.environ.get("STREAMKL_TEST_POISON", "1") != "1":
        yield
        return
    yield from _override_api("POISON_FRESH", True)
