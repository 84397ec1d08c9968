"""The float64 references of the conformance checks, kept on disk between runs.

Each case's reference (``streamkl_ref``'s dense NumPy code in float64: ``attention_kl``,
``attention_kl_grad``, ``indexer_kl``, ...) is most of a warm GPU gate's time: with warm Triton
caches the kernels load in milliseconds while the references of the large cases take seconds
each (the packed-sequence case ``varlen_big``: 7.6 s forward + 6.0 s gradients on a 2-core CPU,
of its 15 s check). A reference depends only on its inputs and on ``streamkl_ref``'s code, so
with a directory set (:func:`use`; ``streamkl verify`` sets one on a GPU) each result is stored
under a key that hashes exactly those: the sha256 of every ``streamkl_ref`` source file, the
function's name, each argument (arrays by dtype, shape and bytes) and the keyword arguments.
Changing the reference code, the inputs (seed, case, dtype) or the options makes a new key; an
unreadable or damaged entry is computed again; a directory that cannot be written only loses
the saving. Off by default: a direct caller of the checks computes every reference.

The same-precision dense results that set each tolerance scale (PyTorch at the inputs' dtype,
``streamkl_ref._testing.same_precision``) go through the same cache, their keys adding the
running torch's version (its CPU kernels make those numbers).

Entries are pickles written atomically (a temporary file, then ``os.replace``); the directory
is the user's own cache, read as trusted as Triton's.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import tempfile

import numpy as np

_DIR = None  # the cache directory while on (use)
STATS = {"hits": 0, "misses": 0}


def use(directory) -> None:
    """Keep references under ``directory`` (created if needed); ``None`` turns the cache off."""
    global _DIR
    _DIR = None if directory is None else os.fspath(directory)


def directory():
    return _DIR


@contextlib.contextmanager
def kept_in(directory):
    """:func:`use` ``directory`` inside the block; the setting before it afterwards."""
    saved = _DIR
    use(directory)
    try:
        yield
    finally:
        use(saved)


@functools.lru_cache(maxsize=1)
def _code_hash() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # streamkl_ref/
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


def _feed(h, value) -> None:
    if isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        h.update(f"array {a.dtype.str} {a.shape}".encode())
        h.update(a.tobytes())
    elif isinstance(value, (tuple, list)):
        h.update(f"{type(value).__name__} {len(value)}".encode())
        for v in value:
            _feed(h, v)
    elif value is None or isinstance(value, (bool, int, float, str, np.generic)):
        h.update(f"{type(value).__name__} {value!r}".encode())
    else:
        raise TypeError(f"reference_cache: cannot key an argument of type {type(value).__name__}")


def key(fn, args, kwargs) -> str:
    h = hashlib.sha256(_code_hash().encode())
    h.update(f"{fn.__module__}.{fn.__qualname__}".encode())
    _feed(h, tuple(args))
    for name in sorted(kwargs):
        h.update(name.encode())
        _feed(h, kwargs[name])
    return h.hexdigest()


def call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, from the cache where this exact call was computed before."""
    if _DIR is None:
        return fn(*args, **kwargs)
    path = os.path.join(_DIR, key(fn, args, kwargs)[:40] + ".pkl")
    try:
        with open(path, "rb") as fh:
            out = pickle.load(fh)
        STATS["hits"] += 1
        return out
    except Exception:  # noqa: BLE001 - absent, unreadable or damaged: compute it again
        pass
    out = fn(*args, **kwargs)
    STATS["misses"] += 1
    try:
        os.makedirs(_DIR, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=_DIR, suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            pickle.dump(out, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError:  # a read-only or full cache directory: the result is still right
        pass
    return out
