"""The Triton interpreter has no TMA reduce (``desc.atomic_add``): this adds it, for tests only.

Semantics of the hardware's ``cp.reduce.async.bulk.tensor`` add: every element of the block
inside the tensor's bounds is added (here as a relaxed fp32 atomic add, like ``tl.atomic_add``);
elements outside the bounds are dropped. Built from the interpreter's own descriptor pointer
materialisation (the one ``desc.store`` uses), so bounds are handled as for stores.
"""
from triton._C.libtriton import interpreter as _interpreter
from triton._C.libtriton import ir as _ir
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle


def _create_descriptor_reduce(self, kind, desc, value, indices):
    if kind != _ir.DESCRIPTOR_REDUCE_KIND.ADD:
        raise NotImplementedError(f"descriptor reduce {kind} in the interpreter shim")
    ptrs, mask = desc.materialize_pointers(indices)
    from streamkl_gpu.devtools import bounds as _interpreter_bounds

    _interpreter_bounds.check("tma reduce", ptrs, mask)  # the suite's bounds check covers the shim too
    _interpreter.atomic_rmw(_interpreter.RMW_OP.FADD, ptrs.data, value.data, mask.data,
                            _interpreter.MEM_SEMANTIC.RELAXED)
    return TensorHandle(value.data, value.dtype.scalar)


def install():
    """Add the shim to the interpreter's builder (idempotent); returns whether it was missing."""
    if hasattr(InterpreterBuilder, "create_descriptor_reduce"):
        return False
    InterpreterBuilder.create_descriptor_reduce = _create_descriptor_reduce
    return True
