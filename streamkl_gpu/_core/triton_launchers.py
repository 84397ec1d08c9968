"""Triton's per-kernel C launcher, built while the kernel compiles instead of after it.

Triton 3.6 (the GPU image's) launches each compiled kernel through a C module made for its
signature: ``CudaLauncher`` (its ``driver.py``) writes the source with ``make_launcher`` and builds
it with the host compiler (``compile_module_from_src``, cached in Triton's cache under the source's
hash). It does so when the kernel first launches, after its compile has ended, so with cold caches
every kernel's first launch waits for a host-compiler run (0.27 s of a forward's 3.67 s first call
in a profile on an H200, docs/performance.md) that nothing needed to wait for: the source depends
only on the signature and constants, which are known when the compile starts. :func:`install`
wraps ``JITFunction._do_compile`` (Triton and Gluon kernels, on a kernel-cache miss in memory) so
that, for streamkl's own kernels, a thread builds the launcher into the same cache while the
kernel compiles; ``CudaLauncher`` then finds it there and loads it. The launch itself is
unchanged (Triton still makes its launcher; only the build came earlier).

Triton 3.9 (CI's) launches every kernel through one C function of its driver and builds nothing
per kernel; there, and wherever the driver's launcher does not build as 3.6's does, nothing is
wrapped (:func:`_builder`, decided once). An error in the early build is dropped:
``CudaLauncher`` builds again and raises it itself. Off, like every compile ahead of its use, with
``STREAMKL_COMPILE_AHEAD=0`` (the launcher is then built at the first launch, as Triton does).
"""
from __future__ import annotations

import os
import threading

from streamkl_gpu._core.triton_patch import wrap_once

OWN_MODULES = ("streamkl_gpu.",)  # kernels defined under these modules get their launcher built early
_BUILDER: list = []  # [the build function, or None where there is nothing to build], decided once
STATS = {"started": 0}  # early builds started (tests read it)


def _builder():
    """``build(src)`` that builds the launcher ``CudaLauncher(src, metadata)`` would build, or None
    where the active Triton builds no per-kernel launcher (or its driver module differs)."""
    if _BUILDER:
        return _BUILDER[0]
    build = None
    try:
        from triton.backends.nvidia import driver as nvidia
        init = getattr(getattr(nvidia, "CudaLauncher", None), "__init__", None)
        needed = ("make_launcher", "compile_module_from_src", "library_dirs", "include_dirs", "libraries")
        if (init is not None and "compile_module_from_src" in init.__code__.co_names
                and all(hasattr(nvidia, name) for name in needed)):
            def build(src):
                # what CudaLauncher.__init__ does before it loads the module
                arg_idx = lambda x: (src.fn.arg_names.index(x),) if isinstance(x, str) else x  # noqa: E731
                constants = {arg_idx(i): v for i, v in getattr(src, "constants", {}).items()}
                signature = dict(src.signature.items())
                nvidia.compile_module_from_src(src=nvidia.make_launcher(constants, signature, _tma_guess(signature)),
                                               name="__triton_launcher", library_dirs=nvidia.library_dirs(),
                                               include_dirs=nvidia.include_dirs, libraries=nvidia.libraries)
    except Exception:  # noqa: BLE001 - no CUDA backend, another layout: nothing to build early
        build = None
    _BUILDER.append(build)
    return build


def _tma_guess(signature):
    """The tensor-descriptor metadata the compile will report, guessed before it: one entry per
    descriptor argument, each lowered to a TMA descriptor (the launcher passes an ``nvTmaDesc``;
    what Hopper's lowering makes of every descriptor of streamkl's kernels, Gluon and Triton:
    ``devtools/launcher_guess``). ``make_launcher`` reads only whether an entry is None. Where the
    compile lowers one otherwise, the guessed launcher is not the one used, and the first launch
    builds its own."""
    count = sum(isinstance(t, str) and t.startswith("tensordesc") for t in signature.values())
    return [{}] * count or None


def _start(fn, signature, constexprs, attrs):
    """A started thread building ``fn``'s launcher for this specialisation, or None."""
    name = getattr(getattr(fn, "fn", None), "__module__", "") or ""
    if not name.startswith(OWN_MODULES) or os.environ.get("STREAMKL_COMPILE_AHEAD", "1") == "0":
        return None  # (read here, not through _core.runtime, which imports this module)
    build = _builder()
    make_source = getattr(fn, "ASTSource", None)  # set by create_binder (Gluon: its own source class)
    if build is None or make_source is None:  # (None: a stand-in JIT function in a test)
        return None

    def body():
        try:
            build(make_source(fn, signature, constexprs, attrs))
        except Exception:  # noqa: BLE001 - CudaLauncher builds again and raises it
            pass

    thread = threading.Thread(target=body, name="streamkl-launcher-build")
    thread.start()
    STATS["started"] += 1
    return thread


def install() -> bool:
    """Wrap ``JITFunction._do_compile`` (idempotent). False, and nothing wrapped, where the active
    Triton builds no per-kernel launcher (:func:`_builder`) or has no such method."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    if _builder() is None:
        return False

    def launcher_early(original):
        def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
            building = _start(self, signature, constexprs, attrs)
            kernel = original(self, key, signature, device, constexprs, options, attrs, warmup)
            # the launch that follows loads what it built; an asynchronous compile's future (triton's
            # AsyncCompileMode) returns at once, and the build goes on beside it
            if building is not None and not hasattr(kernel, "result"):
                building.join()
            return kernel
        return _do_compile

    return wrap_once(JITFunction, "_do_compile", "_streamkl_launcher_early", launcher_early)


install()
