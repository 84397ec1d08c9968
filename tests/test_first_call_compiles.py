"""A first call at a new signature compiles every kernel of the call at once
(streamkl_gpu/_core/launcher.compile_first_call): the entry points whose one call launches several
kernels one after another run the whole call, forward and backward, in a compile-ahead thread
first. Here, on CPU: that thread reaches exactly the kernels the real call launches (the
backward's through custom_ops.call's stand-in gradients), launches none, records no autograd
graph, touches no ``.grad``, decides no timed pick; and the real call after it is bitwise the
same. Kernels under the Triton interpreter (tests/conftest); the compile itself is the GPU's."""
from __future__ import annotations

import os
import threading

import pytest
import torch
from triton.runtime import interpreter

from streamkl_gpu import attention_kl_varlen, indexer_kl, indexer_kl_topk
from streamkl_gpu._core import custom_ops, launcher, tuning
from streamkl_gpu.attention import varlen
from streamkl_gpu.indexer import api, topk

from test_custom_ops_eager import _indexer_leaves as _indexer, _lse
from test_nn_losses import topk_sets


@pytest.fixture
def kernels(monkeypatch):
    """Records ``(thread, kernel)`` of every real launch and every compile-only one."""
    log = {"run": [], "compile": []}
    original = interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        if not kwargs.get("warmup", False):
            log["run"].append((threading.current_thread().name, self.fn.__name__))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    monkeypatch.setattr(launcher, "_compile_only",
                        lambda fn, grid, args, kw: log["compile"].append((threading.current_thread().name,
                                                                          fn.fn.__name__)))
    return log


def _varlen_inputs():
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    xs = [torch.randn(14, 2, 8, generator=gen) for _ in range(4)]
    return xs[:2], [xs[2].requires_grad_(True), xs[3].requires_grad_(True)], cu


# name -> (inputs, the public call, the work the first call runs ahead: the same call's internals)
CASES = {
    # no lse, a scalar: the teacher-LSE pass, the chunk design's storing forward and gradient kernel
    "step_no_lse": (_indexer, lambda t, s: indexer_kl(*t, *s, causal=True, reduction="sum"),
                    lambda t, s: api._indexer_kl(*t, *s, True, None, True, None, "sum", None)),
    "step_lse": (_indexer, lambda t, s: indexer_kl(*t, *s, causal=True, lse=_lse(*t), reduction="mean"),
                 lambda t, s: api._indexer_kl(*t, *s, True, None, True, _lse(*t), "mean", None)),
    # per-row losses: the plain forward and the recomputing backward's two kernels
    "rows": (_indexer, lambda t, s: indexer_kl(*t, *s, causal=True),
             lambda t, s: api._indexer_kl(*t, *s, True, None, True, None, "none", None)),
    "topk": (_indexer, lambda t, s: indexer_kl_topk(*t, *s, topk_sets(9, 9, 4, 1), causal=True),
             lambda t, s: topk._indexer_kl_topk(*t, *s, topk_sets(9, 9, 4, 1), True, None, True, None, "none", None)),
    "varlen": (_varlen_inputs,
               lambda t, s, cu: attention_kl_varlen(*t, *s, cu, cu, 9, 9, causal=True),
               lambda t, s, cu: varlen._call(*t, *s, cu, cu, 9, 9, True, None, None, None, "auto", False, True)),
}


def _real_step(case, inputs):
    out = CASES[case][1](*inputs)
    out = out if out.ndim == 0 else out.sum()
    out.backward()
    leaves = inputs[1]
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return out.detach().clone(), grads


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="records the interpreter's launches (on a GPU the first_call bench section measures this)")
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_thread_reaches_the_kernels_of_the_call_and_runs_none(case, kernels):
    inputs = CASES[case][0]()
    before = _real_step(case, inputs)
    launched = {name for _, name in kernels["run"]}
    kernels["run"].clear()

    thread = launcher.compile_ahead(lambda: CASES[case][2](*inputs), None)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert kernels["run"] == []  # nothing launched there
    reached = {name for _, name in kernels["compile"]}
    assert reached == launched, case
    assert {where for where, _ in kernels["compile"]} == {"streamkl-compile-ahead"}
    assert all(t.grad is None for t in inputs[1])  # the stand-in backward gave .grad nothing

    after = _real_step(case, inputs)  # what the first call runs next: the same numbers
    assert torch.equal(before[0], after[0]), case
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1])), case


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="takes the backward's CPU plan (the interpreter's one tile, no descriptors); on a GPU "
                           "the first_call bench section measures compiling ahead")
def test_the_attention_backward_compiled_ahead_allocates_only_stand_ins(monkeypatch):
    """What a training forward compiles ahead for its backward (attention/launch.compile_backward_ahead)
    reaches the same kernels with 16-element stand-ins for the row inputs and the gradient buffers,
    so a forward at 2^31 elements allocates nothing the size of its inputs for it."""
    from streamkl_gpu.attention import launch

    numels = []
    monkeypatch.setattr(launcher, "_compile_only", lambda fn, grid, args, kw: numels.append(
        (fn.fn.__name__, sorted(a.numel() for a in args if isinstance(a, torch.Tensor)))))
    gen = torch.Generator().manual_seed(3)
    q1, k1, q2, k2 = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(4))
    rows = [torch.zeros(16) for _ in range(4)]  # g, kl, lse1_bits, lse2_bits: the function's stand-ins
    out = []
    launcher.compile_ahead(lambda: out.append(launch.backward(rows[0], q1, k1, q2, k2, *rows[1:], True, 0.25, 0.25,
                                                               False, True, "separate", False)), None).join(timeout=60)
    assert out == [(None, None, None, None)]
    assert {name for name, _ in numels} == {"_kl_bwd_dk_kernel", "_kl_bwd_dq_kernel"}
    for name, sizes in numels:  # the four inputs whole, every other tensor a stand-in
        assert sizes.count(q1.numel()) == 4 and set(sizes) == {16, q1.numel()}, (name, sizes)


def test_the_backward_runs_on_stand_in_gradients_and_records_nothing(monkeypatch):
    seen = []

    def fwd(x, scale):
        return x * scale, x.sum()

    def setup(ctx, args, out):
        ctx.save_for_backward(args[0])
        ctx.scale = args[1]

    def bwd(ctx, g_out, g_sum):
        seen.append((ctx.needs_input_grad, ctx.saved_tensors[0].shape, ctx.scale, g_out.abs().sum().item(),
                     g_sum.item()))
        return g_out * ctx.scale, None

    op = object()
    monkeypatch.setitem(custom_ops._REGISTRY, op, [fwd, bwd, setup])
    x = torch.randn(3, requires_grad=True)
    out = []

    def work():
        out.append(custom_ops.call(op, x, 2.0))
        with torch.no_grad():
            out.append(custom_ops.call(op, x, 3.0))  # no gradient wanted: the forward alone

    launcher.compile_ahead(work, None).join(timeout=30)
    assert seen == [((True, False), torch.Size([3]), 2.0, 0.0, 0.0)]
    assert not out[0][0].requires_grad and x.grad is None


def test_a_pick_not_yet_decided_compiles_every_candidate_and_decides_nothing(monkeypatch):
    monkeypatch.setattr(tuning, "autotune_enabled", lambda ruled=True: True)
    monkeypatch.setattr(tuning, "_disk_load", lambda device, key, cands: None)
    monkeypatch.setattr(tuning, "_TUNED", {})
    timed, launched, picked = [], [], []
    monkeypatch.setattr(tuning, "_time_candidates", lambda key, cands, launch: timed.append(key) or cands[-1])

    def work():
        picked.append(tuning.pick("key", ["a", "b", "c"], launched.append, ruled=False))

    launcher.compile_ahead(work, None).join(timeout=30)
    assert picked == ["a"] and launched == ["b", "c"] and timed == [] and tuning._TUNED == {}
    assert tuning.pick("key", ["a", "b", "c"], launched.append, ruled=False) == "c"  # the real call times
    assert timed == ["key"]


class _Cuda:
    type = "cuda"


def test_the_first_call_of_a_signature_waits_for_its_compiles_once(monkeypatch):
    monkeypatch.setattr(launcher, "ahead_allowed", lambda: True)
    monkeypatch.setattr(launcher, "_FIRST_CALLS", set())
    monkeypatch.setattr(launcher, "compile_ahead", lambda work, device: _Joined(work))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build raises)
    ran = []
    assert launcher.compile_first_call("sig", (1,), lambda: ran.append(1), _Cuda())
    assert ran == [1]  # done before it returns
    assert not launcher.compile_first_call("sig", (1,), lambda: ran.append(2), _Cuda())
    assert launcher.compile_first_call("sig", (2,), lambda: ran.append(3), _Cuda())
    assert not launcher.compile_first_call("sig", (3,), lambda: ran.append(4), torch.device("cpu"))
    assert not launcher.compile_first_call("sig", (4,), lambda: ran.append(5), None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # a CUDA graph capture
    assert not launcher.compile_first_call("sig", (6,), lambda: ran.append(7), _Cuda())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(launcher, "ahead_allowed", lambda: False)  # the interpreter, STREAMKL_COMPILE_AHEAD=0
    assert not launcher.compile_first_call("sig", (5,), lambda: ran.append(6), _Cuda())
    assert ran == [1, 3]


class _Joined:
    def __init__(self, work):
        self.work = work

    def join(self):
        self.work()


def test_signatures_follow_what_the_kernels_specialise_on():
    x = torch.zeros(3, 100, 64)
    base = launcher.call_signature(x, 1.0, None)
    assert launcher.call_signature(torch.zeros(3, 120, 64), 1.0, None) == base  # one size bucket
    for other in (torch.zeros(3, 130, 64), x.half(), x.clone().requires_grad_(True), x.transpose(1, 2)):
        assert launcher.call_signature(other, 1.0, None) != base
    assert launcher.call_signature(x, 2.0, None) != base
    with torch.no_grad():
        assert launcher.call_signature(x, 1.0, None) != base


def test_inside_torch_compile_nothing_runs_and_no_signature_is_formed(monkeypatch):
    """Traced by torch.compile, the entry point's custom ops take over: no signature (its shape
    reads would become guards), no thread."""
    import types

    monkeypatch.setattr(launcher, "ahead_allowed", lambda: True)
    monkeypatch.setattr(launcher, "torch", types.SimpleNamespace(compiler=types.SimpleNamespace(is_compiling=lambda: True),
                                                                 cuda=types.SimpleNamespace(is_current_stream_capturing=lambda: False)))

    def no_signature(*args):
        raise AssertionError("signature formed while compiling")

    monkeypatch.setattr(launcher, "call_signature", no_signature)
    assert not launcher.compile_first_call("sig", (1,), lambda: None, _Cuda())


def test_compile_threads_compute_tritons_compiler_key_once(monkeypatch):
    """Triton's per-process compiler key (a hash of its sources and shared library) is computed
    by one compile thread while the others wait, not by every compile thread of a first call at once."""
    import time

    from triton.runtime import cache

    calls = []

    def slow_key():
        calls.append(threading.current_thread().name)
        time.sleep(0.05)  # long enough for every thread to arrive while the first computes
        return "key"

    monkeypatch.setattr(cache, "triton_key", slow_key)
    monkeypatch.setattr(launcher, "_KEY_READY", [])
    threads = [threading.Thread(target=launcher._compiler_key) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and launcher._KEY_READY == [True]
    launcher._compiler_key()
    assert len(calls) == 1
