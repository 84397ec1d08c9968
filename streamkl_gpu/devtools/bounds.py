"""Memory checks for the Triton interpreter: every load, store and atomic a kernel makes under
``TRITON_INTERPRET=1`` must fall inside one of the tensors the launch was given (bounds), and
optionally no two programs of a launch may share an address with a plain store among them (races).

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

Races (``races=True``): programs of one launch run one after another under the interpreter, so an
address that two programs touch, at least one of them with a plain store (or one with an atomic
and another with a plain load), gives the same answer on CPU every time and an order-dependent one
on the GPU, where the programs run at once. With the race check on, each launch records which
program touched which address how (load / store / atomic) and raises :class:`DataRace` at its end
for such an address. Atomic adds from many programs to one address are not a race. Not seen:
races between launches on concurrent streams, between the warps of one program (shared memory),
and anything in Gluon kernels (they do not run under the interpreter).

Use :func:`checked` (a context manager; public as ``streamkl_gpu.bounds_checked``, e.g. around a
conformance check of your own Triton kernel) or :func:`install` (for a whole test session:
``tests/conftest.py`` turns it on for every interpreted launch). The tool patches the installed
Triton's interpreter (``triton.runtime.interpreter``); it is a testing aid, not a runtime path.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

__all__ = ["DataRace", "OutOfBoundsAccess", "bounds_checked", "check", "checked", "install", "uninstall", "installed", "stats"]


class OutOfBoundsAccess(RuntimeError):
    """A kernel under the interpreter touched memory outside every tensor of its launch."""


class DataRace(RuntimeError):
    """Two programs of one launch touched one address, one of them with a plain store (or one with
    an atomic and another with a plain load): the result depends on the GPU's program order."""


_state = threading.local()
_lock = threading.Lock()
_saved: dict | None = None  # the interpreter's original methods while installed
_counts = {"launches": 0, "checked_accesses": 0, "race_checked_launches": 0}
_races_on = False  # install(races=True)


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
    if base is not None and hasattr(base, "data_ptr") and (
            hasattr(arg, "block_shape") or not hasattr(arg, "untyped_storage")):
        _collect(name, base, out)  # a TMA descriptor, or triton.reinterpret's TensorWrapper: its tensor
        return
    if not hasattr(arg, "data_ptr") or not hasattr(arg, "untyped_storage"):
        return
    ext = _extent(arg)
    if ext is not None:
        out.append((name, ext[0], ext[1], f"{tuple(arg.shape)} {str(arg.dtype).replace('torch.', '')}"))


class _Launch:
    """The tensors of one interpreted launch: merged, sorted byte ranges for the check, and the
    named ones for the error message."""

    def __init__(self, kernel, named, races=False):
        self.kernel = kernel
        self.named = named
        self.races = _RaceLog() if races else None
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
                dist, where = 0, f"at byte {addr - s} of"
            elif addr < s:
                dist, where = s - addr, f"{s - addr} bytes before the start of"
            else:
                dist, where = addr - e + 1, f"at byte {addr - s} (its view spans {e - s}) of"
            if best is None or dist < best[0]:
                best = (dist, f"{where} {name} ({desc})")
        return best[1] if best else "no tensor argument"


_KIND = {"load": 0, "store": 1}  # everything else (atomic, atomic_cas, tma reduce): 2
_KIND_NAMES = ("load", "store", "atomic")


class _RaceLog:
    """Which program touched which address how, within one launch: each program's addresses are
    made unique per kind when the next program starts (the interpreter runs them in order)."""

    def __init__(self):
        self.pid = None
        self.pending = ([], [], [])  # this program's addresses per kind
        self.addrs, self.pids, self.kinds = [], [], []
        self.labels = {}  # linear program index -> grid coordinates

    def add(self, op, addr):
        from triton.runtime.interpreter import interpreter_builder

        x, y, z = (int(v) for v in interpreter_builder.grid_idx)
        gx, gy, _ = (int(v) for v in interpreter_builder.grid_dim)
        pid = x + gx * (y + gy * z)  # the program's linear index (its grid coordinates: labels)
        if pid != self.pid:
            self.labels[pid] = (x, y, z)
            self.flush()
            self.pid = pid
        self.pending[_KIND.get(op, 2)].append(addr)

    def flush(self):
        if self.pid is None:
            return
        for kind, chunks in enumerate(self.pending):
            if chunks:
                u = np.unique(np.concatenate(chunks))
                self.addrs.append(u)
                self.pids.append(np.full(u.shape, self.pid, dtype=np.int64))
                self.kinds.append(np.full(u.shape, kind, dtype=np.int8))
        self.pending = ([], [], [])

    def check(self, launch):
        self.flush()
        if not self.addrs:
            return
        A, P, K = np.concatenate(self.addrs), np.concatenate(self.pids), np.concatenate(self.kinds)
        order = np.lexsort((K, P, A))
        A, P, K = A[order], P[order], K[order]
        starts = np.ones(A.shape, dtype=bool)
        starts[1:] = A[1:] != A[:-1]
        group = np.cumsum(starts) - 1
        new_pid = starts.copy()
        new_pid[1:] |= P[1:] != P[:-1]
        n = int(group[-1]) + 1
        programs = np.bincount(group, weights=new_pid, minlength=n)
        stores = np.bincount(group, weights=K == 1, minlength=n) > 0
        atomics = np.bincount(group, weights=K == 2, minlength=n) > 0
        plain = np.bincount(group, weights=K != 2, minlength=n) > 0
        racy = (programs >= 2) & (stores | (atomics & plain))
        if racy.any():
            g0 = int(np.flatnonzero(racy)[0])
            rows = group == g0
            addr = int(A[rows][0])
            who = sorted({(self.labels.get(int(p), int(p)), _KIND_NAMES[int(k)]) for p, k in zip(P[rows], K[rows])})
            shown = ", ".join(f"program {p} {k}" for p, k in who[:6]) + (" ..." if len(who) > 6 else "")
            raise DataRace(f"{launch.kernel}: {int(racy.sum())} address(es) touched by several programs, one with "
                           f"a plain store (or an atomic beside a plain load); the first at {addr:#x}, "
                           f"{launch.nearest(addr)}: {shown}")


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
    if launch.races is not None and not bad.any():
        launch.races.add(op, addr)
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


def install(races: bool | None = None) -> None:
    """Patch the interpreter (idempotent) so every launch checks its accesses; ``races``: also
    check each launch for data races between its programs (None: leave the setting as it is)."""
    global _saved, _races_on
    from triton.runtime import interpreter as ti

    with _lock:
        if races is not None:
            _races_on = bool(races)
        if _saved is not None:
            return
        B, G = ti.InterpreterBuilder, ti.GridExecutor
        saved = {"load": B.create_masked_load, "store": B.create_masked_store, "rmw": B.create_atomic_rmw,
                 "cas": B.create_atomic_cas, "call": G.__call__}

        # the cache arguments after the mask differ by version (triton 3.6: a cache modifier and an
        # eviction policy, passed by position or by name; 3.9: one cache policy), so they pass
        # through as they come
        def create_masked_load(self, ptrs, mask, other, *cache_args, **cache_kwargs):
            _check("load", ptrs, mask, _itemsize(ptrs))
            return saved["load"](self, ptrs, mask, other, *cache_args, **cache_kwargs)

        def create_masked_store(self, ptrs, value, mask, *cache_args, **cache_kwargs):
            _check("store", ptrs, mask, _itemsize(ptrs))
            return saved["store"](self, ptrs, value, mask, *cache_args, **cache_kwargs)

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
                launch = _Launch(getattr(self.fn, "__name__", "kernel"), named, races=_races_on)
            except _DeviceTensor:
                launch = None  # device tensors: the interpreter copies them, addresses differ
            outer = _current()
            _state.launch = launch
            _counts["launches"] += launch is not None
            try:
                result = saved["call"](self, *args, **kwargs)
                if launch is not None and launch.races is not None:
                    _counts["race_checked_launches"] += 1
                    launch.races.check(launch)
                return result
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
def checked(races: bool | None = None):
    """Bounds-check every interpreted launch inside the block; ``races``: check each for data
    races between its programs too (True), or not (False: e.g. a test that feeds overlapping
    sequences on purpose), or as outside the block (None). Restores the previous state."""
    global _races_on
    was, was_races = installed(), _races_on
    install(races=was_races if races is None else races)
    try:
        yield
    finally:
        _races_on = was_races
        if not was:
            uninstall()


bounds_checked = checked  # the public name (streamkl_gpu.bounds_checked)
