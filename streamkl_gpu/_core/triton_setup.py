"""Triton's once-per-process set-up, on a thread beside the first import of the kernel modules.

A process's first kernel launch pays, before its compile: the CUDA driver's C helper module
(``triton.runtime.driver.active``: built by the host C compiler into Triton's cache on first use,
loaded from it later) and the hash of Triton's own sources and library that keys its cache
(``triton.runtime.cache.triton_key``). On an H200 with empty caches they took 0.26 s and 0.37 s of
a 3.67 s first forward under cProfile (bench/results/2026-12-04_h200_02748e6/fwd_first_call_profile.txt),
and the same first call spends about 0.4 s importing the kernel modules (``streamkl_gpu``
imports them on first use). :func:`beside` runs the two on a thread while the calling thread
imports, and waits for it before the import returns, so nothing else in the process meets a
half-made driver. The thread's work is the same the launch would do itself (both are cached for
the process), so an error there is left for the launch to meet. Off under the interpreter, where
no CUDA device is visible, and with ``STREAMKL_TRITON_SETUP_AHEAD=0``.
"""
from __future__ import annotations

import contextlib
import os
import threading

_DONE = False


def _setup():
    try:
        from triton.runtime import driver

        driver.active.get_current_target()  # the driver and its C module (built or loaded)
        from triton.runtime import cache

        key = getattr(cache, "triton_key", None)
        if key is not None:
            key()  # functools.cache'd: the first compile reads it
    except Exception:  # noqa: BLE001 - the first launch does the same and raises it there
        pass


def _wanted() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("STREAMKL_TRITON_SETUP_AHEAD", "1") == "0":
        return False
    import torch

    return torch.cuda.is_available()


@contextlib.contextmanager
def beside():
    """Inside: the caller's work (an import); beside it, once per process, Triton's set-up."""
    global _DONE
    thread = None
    if not _DONE:
        _DONE = True
        if _wanted():
            thread = threading.Thread(target=_setup, name="streamkl-triton-setup", daemon=True)
            thread.start()
    try:
        yield
    finally:
        if thread is not None:
            thread.join()
