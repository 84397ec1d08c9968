"""What a process's first kernel compile waits for that no kernel's shape decides, started on a
background thread at ``import streamkl_gpu`` so that it overlaps the caller's own set-up (building
the model, loading data, initialising CUDA) instead of lengthening the first call.

Two items, both shape-free and both paid once per process (measured in a forward's first call on
an H200 image, bench/results/2026-12-04_h200_c67a99f/fwd_first_call_profile.txt):

- Triton's compiler key (``triton_key``: a sha256 of its compiler sources and its shared library,
  hundreds of MB; 0.37 s), which every kernel-cache lookup needs. :func:`compiler_key` computes
  it once per process: the import-time thread or the first compile thread, the others wait.
- The CUDA backend's helper module (``cuda_utils``, built from C by the host compiler on a cold
  Triton cache: 0.26 s, then cached on disk like every Triton build).

Nothing here touches CUDA: no device query, no context, so a ``CUDA_VISIBLE_DEVICES`` set after
the import still counts. It starts only where an NVIDIA driver is installed
(``/proc/driver/nvidia``), not under the interpreter (``TRITON_INTERPRET=1`` at import) and not
with ``STREAMKL_COMPILE_AHEAD=0``. Any failure ends the thread quietly: the first compile then
does the same work itself. Nothing here imports torch or a kernel module.
"""
from __future__ import annotations

import importlib
import os
import threading

_KEY_LOCK = threading.Lock()
_KEY_READY: list = []  # [True] once Triton's compiler key is computed in this process
_STARTED: list = []  # the import-time thread, once started
NVIDIA_DRIVER = "/proc/driver/nvidia/version"


def compiler_key() -> None:
    """Triton's per-process compiler key, computed by one thread while the others wait for it.
    Unguarded, every compile thread of a process's first call hashes it at once: six threads took
    1.0 s instead of 0.35 s on two cores, and eight processes of ``streamkl verify`` each doing
    so share the host's cores and memory."""
    if _KEY_READY:
        return
    with _KEY_LOCK:
        if _KEY_READY:
            return
        for module in ("triton.runtime.cache", "triton.compiler.compiler"):  # (its home moved)
            try:
                key = getattr(importlib.import_module(module), "triton_key", None)
            except ImportError:  # pragma: no cover - a Triton without that module
                key = None
            if key is not None:
                key()
                break
        _KEY_READY.append(True)


def _cuda_helper_module() -> None:
    """Build (or load from Triton's cache) the CUDA backend's C helper module, without the driver
    object around it (which asks torch whether CUDA is available, initialising it)."""
    driver = importlib.import_module("triton.backends.nvidia.driver")
    utils = getattr(driver, "CudaUtils", None)
    if utils is not None:
        utils()


def warm() -> None:
    """The thread's work (see the module): the compiler key, then the CUDA helper module."""
    try:
        compiler_key()
        _cuda_helper_module()
    except Exception:  # noqa: BLE001 - the first compile does it itself and reports any error
        pass


def should_start() -> bool:
    """Only where a first compile for an NVIDIA GPU will come (see the module)."""
    return (os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and os.environ.get("STREAMKL_COMPILE_AHEAD", "1") != "0"
            and os.path.exists(NVIDIA_DRIVER))


def start() -> bool:
    """Start the import-time thread once per process where :func:`should_start`; True if started."""
    if _STARTED or not should_start():
        return False
    thread = threading.Thread(target=warm, name="streamkl-warm-compiler", daemon=True)
    _STARTED.append(thread)
    thread.start()
    return True


def _after_fork_in_child() -> None:
    # a fork while the thread held the lock would leave it held in the child, whose thread is gone
    global _KEY_LOCK
    _KEY_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

start()  # at import (``streamkl_gpu/__init__.py`` imports this module)
