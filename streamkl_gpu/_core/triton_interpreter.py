"""The Triton interpreter's scalar-to-index conversion under recent NumPy. Triton 3.6's interpreter
turns a scalar tensor into a Python int by ``int(data)``, where ``data`` may be a one-element array
of shape (1,); recent NumPy refuses that (only 0-dimensional arrays convert; seen with 2.4.6 on
the CPU machine), so every kernel loop whose bounds are computed (``range(lo, hi, BLOCK_N)``)
raised under the interpreter and ``streamkl verify --device cpu`` failed every case. Triton 3.9
converts ``data.squeeze()``; :func:`install` makes the interpreter's per-launch tensor patch do
the same on every version. ``_core/jit.py`` installs it on import when the kernels are about to be
defined for the interpreter."""
from __future__ import annotations

from streamkl_gpu._core.triton_patch import wrap_once


def install() -> bool:
    """The interpreter's scalar tensors index through ``int(data.squeeze())`` (idempotent). False
    where the interpreter has no such per-launch patch step (another layout of Triton)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False

    def squeezed_index(original):
        def _patch_lang_tensor(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
        return _patch_lang_tensor

    return wrap_once(interpreter, "_patch_lang_tensor", "_streamkl_squeezed_index", squeezed_index)
