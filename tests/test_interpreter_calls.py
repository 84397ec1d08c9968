"""Helper calls under the interpreter without patching triton.language again
(streamkl_gpu.devtools.interpreter_calls): the suite runs with it (tests/conftest.py); kernels give
bitwise the results they give without it, both of its paths run (the skip, and the interpreter's
own call for a helper that sees a module the launch did not patch); a launch leaves the language
modules as it does without it; uninstall puts the interpreter's functions back; a Triton whose helper
call differs is left alone."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="patches the Triton interpreter: needs TRITON_INTERPRET=1 (set on CPU machines)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as ti  # noqa: E402

from streamkl_gpu.devtools import interpreter_calls as calls  # noqa: E402


@triton.jit
def _scaled_row_sum(x, s):  # a helper whose module holds tl only, like the kernel's
    return tl.sum(x, axis=0) * s  # tl.sum: a helper of triton.language.standard (tl and tl.core)


@triton.jit
def _rows(X, Y, N: tl.constexpr):
    i = tl.program_id(0)
    x = tl.load(X + i * N + tl.arange(0, N))
    tl.store(Y + i, _scaled_row_sum(x, 2.0) + tl.max(x, axis=0))


@pytest.fixture
def without():
    """The interpreter's own helper calls for one test; the suite's setting restored after it."""
    was = calls.installed()
    calls.uninstall()
    yield
    if was:
        calls.install()


def _small_runs():
    """Our kernels (forward and both settings' backward, and the indexer loss) and the one above."""
    import streamkl_gpu

    g = torch.Generator().manual_seed(7)
    q1, k1, q2, k2 = (torch.randn(1, 2, 21, 16, generator=g, requires_grad=True) for _ in range(4))
    kl = streamkl_gpu.attention_kl(q1, k1, q2, k2, causal=True)
    grads = torch.autograd.grad(kl.sum(), (q1, k1, q2, k2))
    x = torch.randn(3, 16, generator=g)
    y = torch.empty(3)
    _rows[(3,)](x, y, N=16)
    return [kl.detach(), *grads, y]


def test_the_suite_runs_with_it():
    assert calls.installed()


def test_results_are_bitwise_those_without_it(without):
    mine_off = _small_runs()
    assert calls.install()
    before = calls.stats()
    mine_on = _small_runs()
    after = calls.stats()
    for a, b in zip(mine_off, mine_on):
        assert torch.equal(a, b), (a, b)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    y = torch.empty(3)
    _rows[(3,)](torch.from_numpy(x), y, N=16)
    np.testing.assert_allclose(y.numpy(), 2 * x.sum(1) + x.max(1), rtol=1e-6)
    assert after["skipped"] > before["skipped"]  # the repeated patching skipped ...
    assert after["patched"] > before["patched"]  # ... and tl.sum's first call per launch patched tl.core


def _changed_by_a_launch():
    """The (module, name) pairs of the language modules that one launch leaves different (after a
    first launch: a patched helper's scope is never restored, by the interpreter's own code)."""
    x, y = torch.randn(2, 16), torch.empty(2)
    _rows[(2,)](x, y, N=16)
    mods = {"tl": tl, "tl.core": tl.core, "tl.tensor": tl.tensor, "tl.math": tl.math, "tl.dtype": tl.dtype}
    names = lambda m: {n: getattr(m, n) for n in dir(m) if not n.startswith("__")}  # noqa: E731
    was = {k: names(m) for k, m in mods.items()}
    _rows[(2,)](x, y, N=16)
    return {(k, n) for k, m in mods.items() for n, v in names(m).items() if was[k].get(n) is not v}


def test_a_launch_leaves_the_language_modules_as_without_it(without):
    """A launch restores the kernel's module (tl) with or without this module, and what it leaves
    changed elsewhere (tl.core: tl.sum's patching, never restored) is the same either way."""
    own = _changed_by_a_launch()
    assert calls.install()
    assert _changed_by_a_launch() == own
    assert not {n for k, n in own if k == "tl"}, own


def test_uninstall_restores_the_interpreters_functions(without):
    own = ti._patch_lang, ti.InterpretedFunction.__call__
    assert calls.install() and (ti._patch_lang, ti.InterpretedFunction.__call__) != own
    calls.uninstall()
    assert (ti._patch_lang, ti.InterpretedFunction.__call__) == own and not calls.installed()


def test_another_interpreter_is_left_alone(without, monkeypatch):
    own = ti._patch_lang, ti.InterpretedFunction.__call__
    monkeypatch.setattr(calls, "_EXPECTED_CALL", calls._EXPECTED_CALL.replace("_patch_lang(self.fn)", "pass"))
    assert calls.install() is False
    assert (ti._patch_lang, ti.InterpretedFunction.__call__) == own and not calls.installed()
