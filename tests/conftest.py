"""tests/: fixtures for the streamkl_gpu tests. (Hypothesis profiles and TRITON_INTERPRET: ../conftest.py)"""
import pytest


@pytest.fixture
def poison():
    """Fresh kernel outputs start as NaN, so an element a kernel fails to write cannot pass."""
    from streamkl_gpu import api

    old = api.POISON_FRESH
    api.POISON_FRESH = True
    yield
    api.POISON_FRESH = old


@pytest.fixture
def block(request):
    """Run the interpreter with another fixed tile shape (BLOCK_M, BLOCK_N)."""
    from streamkl_gpu import api

    old = api.INTERPRETER_BLOCK
    api.INTERPRETER_BLOCK = request.param
    yield request.param
    api.INTERPRETER_BLOCK = old


@pytest.fixture
def tma(request):
    """Under the interpreter, read the forward's key tiles through TMA descriptors (param True)."""
    from streamkl_gpu import api

    old = api.INTERPRETER_TMA
    api.INTERPRETER_TMA = request.param
    yield request.param
    api.INTERPRETER_TMA = old
