"""The custom ops' eager calls, without the dispatcher.

Every entry point is a ``torch.library`` custom op with a fake implementation, so that
``torch.compile(fullgraph=True)`` traces it. Outside a compiled region the dispatcher adds nothing
but cost: its first eager call of any custom op runs the implementation under
``torch._disable_dynamo``, whose first use imports ``torch._dynamo`` (and with it sympy, the fake
tensors and ``torch.distributed.fsdp``: 1.1 s on a CPU machine with cached bytecode, about 10 s on
an H200 image without: bench/results/2026-12-04_h200_cd11444/first_call_profile.txt), and every
call pays the schema binding. :func:`call` runs the op's own function, and its registered autograd
as a plain ``torch.autograd.Function``, when not compiling; ``attention_kl`` does the same with its
own Function (``attention/ops.py``). Both paths run the same function with the same arguments.
In a compile-ahead thread (``_core.launcher``) :func:`call` also runs the op's backward, on zero
stand-in gradients, so that a first call's backward kernels compile beside its forward's.
"""
from __future__ import annotations

import functools
import inspect

import torch

from streamkl_gpu._core.launcher import compiling_ahead

# op -> [function, backward, setup_context] (backward and setup_context None: no autograd registered)
_REGISTRY: dict = {}


def custom_op(name: str, *, mutates_args=()):
    """``torch.library.custom_op(name, mutates_args=...)`` that keeps the function for :func:`call`."""
    def wrap(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        _REGISTRY[op] = [fn, None, None]
        return op
    return wrap


def register_autograd(op, backward, setup_context):
    """``op.register_autograd(backward, setup_context=setup_context)``, kept for :func:`call` too."""
    op.register_autograd(backward, setup_context=setup_context)
    _REGISTRY[op][1:] = [backward, setup_context]


@functools.lru_cache(maxsize=None)
def _eager_function(op):
    fn, backward, setup_context = _REGISTRY[op]

    class EagerOp(torch.autograd.Function):
        # as torch's own wrapper of a custom op's autograd: setup_context sees every argument
        # (defaults filled in), backward gets the gradients of every output (zeros where unused)
        @staticmethod
        def forward(ctx, *args):
            out = fn(*args)
            setup_context(ctx, args, out)
            return out

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    EagerOp.__name__ = EagerOp.__qualname__ = f"Eager_{fn.__name__}"
    return EagerOp


@functools.lru_cache(maxsize=None)
def _arity(fn):
    return len(inspect.signature(fn).parameters)


class _StandInContext:
    """What ``setup_context`` and ``backward`` use of an autograd context, for a compile-ahead
    thread's backward (:func:`call`): saved tensors, the gradient flags, attributes."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


def _compile_ahead_call(fn, backward, setup_context, args, train):
    """In a compile-ahead thread (``_core.launcher``): the forward, then, where a gradient is
    wanted, the registered backward on zero gradients, so that both reach their kernels (which
    only compile there). Returns the forward's outputs (garbage: no kernel ran)."""
    with torch.no_grad():
        out = fn(*args)
        if train and backward is not None:
            ctx = _StandInContext(tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args))
            setup_context(ctx, args, out)
            outs = out if isinstance(out, tuple) else (out,)
            backward(ctx, *(torch.zeros_like(o) if isinstance(o, torch.Tensor) else None for o in outs))
    return out


def call(op, *args):
    """``op(*args)``: the custom op under ``torch.compile``; in eager mode its function directly, with
    its registered autograd where an input requires a gradient."""
    if torch.compiler.is_compiling():
        return op(*args)
    fn, backward, setup_context = _REGISTRY[op]
    if len(args) < _arity(fn):  # defaults filled in, as the dispatcher does for setup_context
        bound = inspect.signature(fn).bind(*args)
        bound.apply_defaults()
        args = bound.args
    train = backward is not None and torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    if compiling_ahead():
        return _compile_ahead_call(fn, backward, setup_context, args, train)
    if not train:
        with torch.no_grad():  # as below the dispatcher's autograd: nothing recorded
            return fn(*args)
    return _eager_function(op).apply(*args)
