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
"""
from __future__ import annotations

import functools
import inspect

import torch

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


def call(op, *args):
    """``op(*args)``: the custom op under ``torch.compile``; in eager mode its function directly, with
    its registered autograd where an input requires a gradient."""
    if torch.compiler.is_compiling():
        return op(*args)
    fn, backward, _ = _REGISTRY[op]
    if len(args) < _arity(fn):  # defaults filled in, as the dispatcher does for setup_context
        bound = inspect.signature(fn).bind(*args)
        bound.apply_defaults()
        args = bound.args
    if backward is None or not torch.is_grad_enabled() or not any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        with torch.no_grad():  # as below the dispatcher's autograd: nothing recorded
            return fn(*args)
    return _eager_function(op).apply(*args)
