"""A bounds-checked Triton interpreter: every load, store and atomic a kernel makes under
``TRITON_INTERPRET=1`` must fall inside one of the tensors the launch was given.

On the GPU an access past an allocation is an "illegal memory access" (or, inside the caching
allocator's slab, silent corruption); under the interpreter on CPU the same access reads or
writes whatever lies next to the tensor and the test usually passes. With this check on, the
interpreter raises :class:`OutOfBoundsAccess` at the first such access, naming the kernel, the
program, the operation and the nearest argument.

What counts as inside: the *view extent* of each tensor argument (and of each TMA descriptor's
base), ``[data_ptr, data_ptr + (sum_i (size_i - 1) * stride_i + 1) * itemsize)``, so a kernel
that strays past a view into the rest of its storage is caught too. Masked-off lanes are not
accessed and are not checked. Only host (CPU) tensors can be checked: a launch given a device
tensor runs unchecked.

Use :func:`checked` (a context manager; public as ``streamkl_gpu.bounds_checked``, e.g. around a
conformance check of your own Triton kernel) or :func:`install` (for a whole test session:
``tests/conftest.py`` turns it on for every interpreted launch). The tool patches the installed
Triton's interpreter (``triton.runtime.interpreter``); it is a testing aid, not a runtime path.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

__all__ = ["OutOfBoundsAccess", "bounds_checked", "check", "checked", "install", "uninstall", "installed", "stats"]


class OutOfBoundsAccess(RuntimeError):
    """A kernel under the interpreter touched memory outside every tensor of its launch."""


_state = threading.local()
_lock = threading.Lock()
_saved: dict | None = None  # the interpreter's original methods while installed
_counts = {"launches": 0, "checked_accesses": 0}


def stats() -> dict:
    """Launches and (unmasked) element accesses checked since install (a test's evidence that
    the checker actually ran)."""
    return dict(_counts)


def _extent(t):
    """(start, end) byte range of a host tensor's view, or None (empty, or not on the host)."""
    if t.device.type != "cpu":
        raise _DeviceTensor
    if t.numel() == 0:
        return None
    span = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
    start = t.data_ptr()
    return start, start + span * t.element_size()


class _DeviceTensor(Exception):
    pass


def _collect(name, arg, out):
    """Append (name, start, end, description) for every tensor reachable from a launch argument."""
    if isinstance(arg, (tuple, list)):
        for i, a in enumerate(arg):
            _collect(f"{name}[{i}]", a, out)
        return
    base = getattr(arg, "base", None)
    if base is not None and hasattr(base, "data_ptr") and hasattr(arg, "block_shape"):  # a TMA descriptor
        _collect(f"{name}.base", base, out)
        return
    if not hasattr(arg, "data_ptr") or not hasattr(arg, "untyped_storage"):
        return
    ext = _extent(arg)
    if ext is not None:
        out.append((name, ext[0], ext[1], f"{tuple(arg.shape)} {str(arg.dtype).replace('torch.', '')}"))


class _Launch:
    """The tensors of one interpreted launch: merged, sorted byte ranges for the check, and the
    named ones for the error message."""

    def __init__(self, kernel, named):
        self.kernel = kernel
        self.named = named
        spans = sorted((s, e) for _, s, e, _ in named)
        merged = []
        for s, e in spans:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        self.starts = np.array([s for s, _ in merged], dtype=np.uint64)
        self.ends = np.array([e for _, e in merged], dtype=np.uint64)

    def nearest(self, addr: int) -> str:
        best = None
        for name, s, e, desc in self.named:
            if s <= addr < e:
                dist, where = 0, "inside"
            elif addr < s:
                dist, where = s - addr, f"{s - addr} bytes before the start of"
            else:
                dist, where = addr - e + 1, f"at byte {addr - s} (its view spans {e - s}) of"
            if best is None or dist < best[0]:
                best = (dist, f"{where} {name} ({desc})")
        return best[1] if best else "no tensor argument"


def _current():
    return getattr(_state, "launch", None)


def _check(op, ptrs, mask, itemsize):
    launch = _current()
    if launch is None:
        return
    addr = np.asarray(ptrs.data)
    if mask is not None:
        m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        addr = addr[m]
    else:
        addr = addr.reshape(-1)
    if addr.size == 0:
        return
    addr = addr.astype(np.uint64, copy=False)
    _counts["checked_accesses"] += int(addr.size)
    if launch.starts.size == 0:
        bad = np.ones(addr.shape, dtype=bool)
    else:
        idx = np.searchsorted(launch.starts, addr, side="right").astype(np.int64) - 1
        inside = idx >= 0
        ends = launch.ends[np.clip(idx, 0, None)]
        bad = ~(inside & (addr + np.uint64(itemsize) <= ends))
    if bad.any():
        from triton.runtime.interpreter import interpreter_builder

        first = int(addr[bad][0])
        raise OutOfBoundsAccess(
            f"{launch.kernel}: {op} of {int(bad.sum())} element(s) outside every tensor argument, program "
            f"{tuple(interpreter_builder.grid_idx)}; the first at {first:#x}, {launch.nearest(first)}")


def _itemsize(ptrs) -> int:
    from triton.runtime.interpreter import _get_np_dtype

    try:
        return int(np.dtype(_get_np_dtype(ptrs.get_element_ty())).itemsize)
    except Exception:  # a pointer to pointers, or a type the interpreter does not map: 8 bytes
        return 8


def check(op: str, ptrs, mask=None) -> None:
    """Check one access made outside the interpreter's own load/store/atomic methods (e.g. a
    test's shim for an operation the interpreter lacks): ``ptrs`` and ``mask`` are the
    interpreter's TensorHandles. A no-op when no checked launch is running."""
    _check(op, ptrs, mask, _itemsize(ptrs))


def install() -> None:
    """Patch the interpreter (idempotent) so every launch checks its accesses."""
    global _saved
    from triton.runtime import interpreter as ti

    with _lock:
        if _saved is not None:
            return
        B, G = ti.InterpreterBuilder, ti.GridExecutor
        saved = {"load": B.create_masked_load, "store": B.create_masked_store, "rmw": B.create_atomic_rmw,
                 "cas": B.create_atomic_cas, "call": G.__call__}

        def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
            _check("load", ptrs, mask, _itemsize(ptrs))
            return saved["load"](self, ptrs, mask, other, cache_policy, is_volatile)

        def create_masked_store(self, ptrs, value, mask, cache_policy):
            _check("store", ptrs, mask, _itemsize(ptrs))
            return saved["store"](self, ptrs, value, mask, cache_policy)

        def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
            _check("atomic", ptr, mask, _itemsize(ptr))
            return saved["rmw"](self, rmwOp, ptr, val, mask, sem, scope)

        def create_atomic_cas(self, ptr, cmp, val, sem, scope):
            _check("atomic_cas", ptr, None, _itemsize(ptr))
            return saved["cas"](self, ptr, cmp, val, sem, scope)

        def call(self, *args, **kwargs):
            named = []
            try:
                for i, a in enumerate(args):
                    _collect(self.arg_names[i] if i < len(self.arg_names) else f"arg{i}", a, named)
                for k, a in kwargs.items():
                    _collect(k, a, named)
                launch = _Launch(getattr(self.fn, "__name__", "kernel"), named)
            except _DeviceTensor:
                launch = None  # device tensors: the interpreter copies them, addresses differ
            outer = _current()
            _state.launch = launch
            _counts["launches"] += launch is not None
            try:
                return saved["call"](self, *args, **kwargs)
            except Exception as e:  # the interpreter wraps kernel errors in InterpreterError: unwrap ours
                if isinstance(e.__cause__, OutOfBoundsAccess):
                    raise e.__cause__ from None
                raise
            finally:
                _state.launch = outer

        B.create_masked_load, B.create_masked_store = create_masked_load, create_masked_store
        B.create_atomic_rmw, B.create_atomic_cas = create_atomic_rmw, create_atomic_cas
        G.__call__ = call
        _saved = saved


def uninstall() -> None:
    """Restore the interpreter's own methods."""
    global _saved
    from triton.runtime import interpreter as ti

    with _lock:
        if _saved is None:
            return
        B, G = ti.InterpreterBuilder, ti.GridExecutor
        B.create_masked_load, B.create_masked_store = _saved["load"], _saved["store"]
        B.create_atomic_rmw, B.create_atomic_cas = _saved["rmw"], _saved["cas"]
        G.__call__ = _saved["call"]
        _saved = None


def installed() -> bool:
    return _saved is not None


@contextlib.contextmanager
def checked():
    """Bounds-check every interpreted launch inside the block (restores the previous state)."""
    was = installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


bounds_checked = checked  # the public name (streamkl_gpu.bounds_checked)
