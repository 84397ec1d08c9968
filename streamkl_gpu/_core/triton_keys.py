"""Triton kernel keys that do not depend on what the process compiled before.

Triton keys a kernel's binary by its source key (``JITFunction.cache_key``): its text, its callees'
keys, and the constexpr globals it and its callees read. Triton 3.6 (the GPU image's) merges a
callee's globals into the caller's before it computes the callee's key
(``DependenciesFinder._update_hash``); a callee whose key nothing had computed yet has no globals
then, and adds none. A kernel's key thus depends on which other kernels sharing its helpers had
their keys computed first in the process, and two processes that meet kernels in different orders
key one binary two ways: with warm caches ``streamkl verify``'s workers compiled kernels again for
1.3-4.4 s each (docs/verify.md, "Why warm runs compiled again"). Triton 3.9 computes the callee's key first.
:func:`install` makes older versions do the same (the callee's key, then Triton's own merge): the
keys are then the same whatever ran before, on every version. ``_core/jit.py`` installs it on
import (``_core/runtime.py``, which every host and the launcher import, imports it, before any
kernel is launched and keyed), and so does ``_core/gluon_compat.py`` (a Gluon kernel compiled
offline, without a host).
"""
from __future__ import annotations

from streamkl_gpu._core.triton_patch import wrap_once


def install() -> bool:
    """Compute each callee's key before its globals are merged into the caller's (idempotent).
    False where Triton has no such step to wrap (another layout of its JIT module)."""
    try:
        from triton.runtime import jit as triton_jit
    except ImportError:
        return False

    def callee_key_first(original):
        def _update_hash(self, func):
            getattr(func, "cache_key", None)  # the callee's key, and with it its globals, complete first
            return original(self, func)
        return _update_hash

    finder = getattr(triton_jit, "DependenciesFinder", None)
    return finder is not None and wrap_once(finder, "_update_hash", "_streamkl_callee_key_first", callee_key_first)


install()
