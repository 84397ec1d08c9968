"""The first use of the API: Triton's per-process compiler set-up, started before the kernel modules
import. Imported by ``streamkl_gpu.__getattr__`` on the first public name it resolves; it imports
nothing of Triton or the kernels itself until it runs, so that the interpreter can still be chosen
after ``import streamkl_gpu``."""
from __future__ import annotations

_STARTED: list = []


def warm_compiler() -> None:
    """Import Triton whole on this thread, then start its compiler key and CUDA driver set-up on
    background threads (``launcher.warm_compiler``) while the caller goes on to import the kernel
    modules. Once per process; where it starts nothing (the interpreter, ``STREAMKL_COMPILE_AHEAD=0``,
    no GPU) ``launcher.warm_compiler`` decides."""
    if _STARTED:
        return
    _STARTED.append(True)
    import triton  # noqa: F401 - whole, on this thread, before the warm-up threads walk its packages

    from streamkl_gpu._core.launcher import warm_compiler as start

    start()
