"""The Gluon names that differ between the triton versions streamkl runs on (the GPU image's 3.6,
CI's 3.9), one home for every Gluon kernel. Importing this module fails where triton has no Gluon;
each kernel module's import is guarded by its dispatcher (``GLUON_IMPORT_ERROR`` and the like)."""
from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from streamkl_gpu._core import triton_keys  # noqa: F401  (kernel keys independent of the process's history)

# TMA load, renamed in triton 3.8 (``async_load``); 3.6/3.7 have only the old name, 3.9 rejects it.
if hasattr(tma, "async_load"):
    tma_load = tma.async_load
else:  # pragma: no cover - triton < 3.8 (the GPU image: 3.6)
    tma_load = tma.async_copy_global_to_shared

# TMA reduce-add from shared memory: ``tma.async_atomic_add`` from triton 3.9; 3.6 has the builder's
# op without its Gluon wrapper, called here the way 3.9's wrapper calls it
if hasattr(tma, "async_atomic_add"):
    tma_reduce_add = tma.async_atomic_add
else:  # pragma: no cover - triton < 3.9 (the GPU image: 3.6)
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

# shared-memory views of another dtype: ``reinterpret`` from triton 3.9, ``_reinterpret`` before
NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

# CTA (here: partition) barrier, renamed in triton 3.7
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
