"""The first use of the API: Triton's per-process compiler set-up, started before the kernel modules
import. Imported by ``streamkl_gpu.__getattr__`` on the first public name it resolves; it imports
nothing of Triton or the kernels itself until it runs, so that the interpreter can still be chosen
after ``import streamkl_gpu``."""
from __future__ import annotations

import os

_STARTED: list = []


def warm_compiler() -> None:
    """Import Triton whole on this thread, then start its compiler key and CUDA driver set-up on
    background threads (``launcher.warm_compiler``) while the caller goes on to import the kernel
    modules. Once per process; not under the interpreter (nothing compiles) nor with
    ``STREAMKL_COMPILE_AHEAD=0``."""
    if _STARTED:
        return
    _STARTED.append(True)
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or os.environ.get("STREAMKL_COMPILE_AHEAD", "1") == "0":
        return
    import triton  # noqa: F401 - whole, on this thread, before the warm-up threads walk its packages

    from streamkl_gpu._core.launcher import warm_compiler as start

    start()
