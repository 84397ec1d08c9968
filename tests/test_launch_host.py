"""Host-side launch helpers of streamkl_gpu.attention.launch: the checked-once TMA descriptors and the
backward's rows pre-pass through the plan-keyed fast launcher."""
import pytest
import torch

from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu.attention import launch as _launch

from _gpu_helpers import make_inputs


@pytest.mark.skipif(_runtime.TensorDescriptor is None, reason="this triton has no host TensorDescriptor")
def test_a_descriptor_from_the_template_equals_a_fresh_one():
    a, b = torch.randn(2, 3, 40, 64), torch.randn(2, 3, 40, 64)
    first = _launch._desc(a, 32, 64)
    second = _launch._desc(b, 32, 64)  # from the template
    fresh = _runtime.TensorDescriptor(b, list(b.shape), list(b.stride()), [1, 1, 32, 64])
    assert type(second) is type(fresh)
    assert {k: v for k, v in vars(second).items() if k != "base"} == {k: v for k, v in vars(fresh).items() if k != "base"}
    assert second.base is b and first.base is a
    key = (tuple(b.shape), tuple(b.stride()), b.dtype, (1, 1, 32, 64))
    assert _launch._DESC_TEMPLATES[key].base is None  # the cache keeps no tensor alive
    unaligned = torch.randn(2 * 3 * 40 * 64 + 1)[1:].view(2, 3, 40, 64)
    with pytest.raises(AssertionError, match="16-byte"):  # checked per call, as the constructor does
        _launch._desc(unaligned, 32, 64)


def test_the_rows_pre_pass_launches_through_the_plan_keyed_launcher(monkeypatch):
    import streamkl_gpu

    monkeypatch.setenv("STREAMKL_BWD_VARIANT", "tma+trans+fold+rows")
    monkeypatch.setattr(_runtime, "INTERPRETER_TMA", True)
    seen = []
    real = _launch.fast_launch

    def recording(kernel, grid, args, constexprs, warps, stages, key=None, *rest, **kw):
        seen.append((kernel.__name__, key))
        return real(kernel, grid, args, constexprs, warps, stages, key, *rest, **kw)

    monkeypatch.setattr(_launch, "fast_launch", recording)
    xs = [x.requires_grad_(i >= 2) for i, x in enumerate(make_inputs(1, 2, 2, 2, 24, 40, 16, 16))]
    for _ in range(2):
        streamkl_gpu.attention_kl(*xs, causal=True, bwd_mode="separate").sum().backward()
    rows = [key for name, key in seen if name == "_kl_bwd_rows_kernel"]
    assert len(rows) == 2 and rows[0] is not None and rows[0] == rows[1]  # one plan, its key both times


def test_a_training_call_binds_its_backward_plan_once(monkeypatch):
    """The forward's training binding carries the backward's plan: the second call's backward
    launches without forming its signature, with the same gradients; a changed backward setting
    is a new binding."""
    import streamkl_gpu

    xs = [x.requires_grad_(i >= 2) for i, x in enumerate(make_inputs(1, 2, 1, 2, 24, 40, 16, 8, seed=3))]
    g = torch.randn(1, 2, 24)

    def grads():
        kl = streamkl_gpu.attention_kl(*xs, causal=True, bwd_mode="separate")
        return torch.autograd.grad(kl, xs[2:], g)

    first = grads()
    bound = [b for b in _launch._BINDINGS.values() if b.plan is not None]
    assert bound, "the first backward binds its plan"
    signatures = []
    real = _launch._backward_signature
    monkeypatch.setattr(_launch, "_backward_signature", lambda *a: signatures.append(a) or real(*a))
    second = grads()
    assert signatures == []  # the bound plan ran: no signature formed, forward or backward
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    monkeypatch.setenv("STREAMKL_BWD_STREAMS", "0")
    third = grads()
    assert len(signatures) == 1  # a new setting: a new binding, its signature formed once
    for a, b in zip(first, third):
        torch.testing.assert_close(a, b)


def test_a_forward_only_call_leaves_the_backward_modules_unimported():
    """The backward's kernels and dispatch are imported at a training call's first use (``LazyModule``),
    not when ``attention_kl`` is resolved or run without gradients; the first read puts the module
    itself in ``launch``'s globals (nothing added per later call). A fresh process: this pytest
    process has imported everything."""
    import os
    import subprocess
    import sys

    code = """
import sys, torch, streamkl_gpu
from streamkl_gpu.attention import launch
backward = ("streamkl_gpu.attention.triton.bwd", "streamkl_gpu.attention.gluon.bwd_dispatch")
q = torch.randn(1, 1, 4, 16)
kl = streamkl_gpu.attention_kl(q, q, q, q)
assert torch.equal(kl, torch.zeros_like(kl)), kl
assert not any(m in sys.modules for m in backward), [m for m in backward if m in sys.modules]
q2 = q.clone().requires_grad_()
streamkl_gpu.attention_kl(q, q, q2, q2).sum().backward()
assert all(m in sys.modules for m in backward)
assert launch._bwd is sys.modules[backward[0]] and launch._gluon_bwd_dispatch is sys.modules[backward[1]]
assert torch.isfinite(q2.grad).all()
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_training_call_takes_the_c_apply_outside_functorch_transforms(monkeypatch):
    """Outside functorch transforms the eager Function is applied through the C ``apply`` (the same
    graph node and gradients as ``Function.apply``, without its Python wrapper); inside one,
    ``Function.apply`` decides as before (this Function defines no ``setup_context``: it refuses)."""
    import streamkl_gpu
    from streamkl_gpu.attention import ops

    xs = [x.requires_grad_(i >= 2) for i, x in enumerate(make_inputs(1, 2, 1, 2, 12, 20, 16, 8, seed=5))]
    g = torch.randn(1, 2, 12)
    direct = []
    real_c = ops._apply_c
    monkeypatch.setattr(ops, "_apply_c", lambda *a: direct.append(1) or real_c(*a))
    kl = streamkl_gpu.attention_kl(*xs, causal=True)
    assert direct == [1] and type(kl.grad_fn).__name__ == "_EagerAttentionKLBackward"
    fast = torch.autograd.grad(kl, xs[2:], g)
    monkeypatch.setattr(ops, "_transforms_active", lambda: True)  # as if inside a transform: Function.apply
    kl_wrapped = streamkl_gpu.attention_kl(*xs, causal=True)
    assert direct == [1]
    for a, b in zip(fast, torch.autograd.grad(kl_wrapped, xs[2:], g)):
        assert torch.equal(a, b)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda q2: streamkl_gpu.attention_kl(xs[0], xs[1], q2, xs[3]).sum())(xs[2].detach())


def test_a_call_without_gradients_writes_its_lses_to_the_bounded_scratch(monkeypatch):
    """``attention_kl`` without gradients allocates its KL alone; the kernels write the LSEs into
    one scratch pair per shape, laid out as the one-buffer outputs' 2nd and 3rd rows (the same
    pointer alignment, so the same specialisation). The KL is the same as with the LSEs handed
    out; each call's KL is its own tensor; the LSEs handed out by ``attention_kl_with_lse`` are
    fresh. Past the row bound or the entry bound the one buffer is allocated as before."""
    import streamkl_gpu

    monkeypatch.setattr(_launch, "_LSE_SCRATCH", {})
    xs = make_inputs(1, 2, 1, 2, 6, 20, 16, 8, seed=7)
    kl, lse1, lse2 = streamkl_gpu.attention_kl_with_lse(*xs, causal=True)
    assert _launch._LSE_SCRATCH == {}  # the LSEs handed out: the one buffer
    first = streamkl_gpu.attention_kl(*xs, causal=True)
    (shape, device), = _launch._LSE_SCRATCH
    scratch1, scratch2 = _launch._LSE_SCRATCH[(shape, device)]
    assert shape == (1, 2, 6) and device == xs[0].device
    assert scratch1.data_ptr() - scratch1.untyped_storage().data_ptr() == 1 * 12 * 4  # rows 2 and 3 of 3
    assert scratch2.data_ptr() - scratch1.data_ptr() == 12 * 4
    assert torch.equal(scratch1 * _runtime.LN2, lse1) and torch.equal(scratch2 * _runtime.LN2, lse2)
    second = streamkl_gpu.attention_kl(*xs, causal=True)
    assert torch.equal(first, kl) and torch.equal(second, kl)
    assert first.data_ptr() != second.data_ptr()  # the KL is never scratch
    assert len(_launch._LSE_SCRATCH) == 1
    _, again1, _ = streamkl_gpu.attention_kl_with_lse(*xs, causal=True)
    assert again1.data_ptr() not in (scratch1.data_ptr(), scratch2.data_ptr())

    monkeypatch.setattr(_launch, "LSE_SCRATCH_ROWS", 11)  # 12 rows: past the bound
    monkeypatch.setattr(_launch, "_LSE_SCRATCH", {})
    assert torch.equal(streamkl_gpu.attention_kl(*xs, causal=True), kl) and _launch._LSE_SCRATCH == {}
    monkeypatch.setattr(_launch, "LSE_SCRATCH_ROWS", 12)
    monkeypatch.setattr(_launch, "LSE_SCRATCH_ENTRIES", 1)
    streamkl_gpu.attention_kl(*xs, causal=True)
    other = make_inputs(1, 1, 1, 1, 5, 20, 16, 8, seed=8)
    streamkl_gpu.attention_kl(*other)  # a second shape: the bound is reached, nothing added
    assert list(_launch._LSE_SCRATCH) == [((1, 2, 6), device)]
