"""The environment variables, in one vocabulary: their names, defaults and meanings (docs/api.md's
table is checked against ``VARIABLES`` by tests/test_layout.py), the backend choice
``STREAMKL_<OP>_BACKEND=auto|triton|gluon``, and the old names that still work.

A variable that went away is still read while its replacement is unset, and warns once (a
``FutureWarning`` naming the replacement); ``DEPRECATED`` maps each old name to its new one.
None is needed for normal use.
"""
from __future__ import annotations

import warnings

from streamkl_gpu._core.runtime import env

# name -> (default, effect). The one list of the variables the library reads.
VARIABLES = {
    "STREAMKL_FWD_BACKEND": ("auto", "attention forward: auto, triton, gluon"),
    "STREAMKL_BWD_BACKEND": ("auto", "attention backward: auto (the Hopper Gluon kernel for one trained side where it applies), triton, gluon"),
    "STREAMKL_INDEXER_BACKEND": ("auto", "indexer forwards: auto (Gluon for wide MQA teachers on Hopper, else Triton), triton, gluon"),
    "STREAMKL_INDEXER_TRAINING": ("auto", "indexer training design: auto, plain, accumulate, store, chunk"),
    "STREAMKL_INDEXER_BWD": ("separate", "indexer backward kernels: separate, fused, dqk"),
    "STREAMKL_INDEXER_TMA": ("1", "0: the indexer kernels read through pointers"),
    "STREAMKL_BWD_VARIANT": (None, "one attention backward kernel variant only"),
    "STREAMKL_BWD_STREAMS": (None, "1: the separate backward's dQ kernel on a second stream"),
    "STREAMKL_AUTOTUNE": ("auto", "auto: the attention kernels' shape-rule configs untimed (packed sequences' too), the indexer's and the decode key splits' timed; 1: time every pick; 0: none"),
    "STREAMKL_CACHE_DIR": (None, "where tuned launch choices persist"),
    "STREAMKL_TUNING_CACHE": ("1", "0: tuned choices in memory only"),
    "STREAMKL_FAST_LAUNCH": ("1", "0: every launch through Triton's binder"),
    "STREAMKL_FAST_LAUNCH_CHECK": ("0", "1 (read at import): check every cached launch's specialisation"),
    "STREAMKL_COMPILE_AHEAD": ("1", "0: nothing compiles ahead (a training forward its backward's kernels, a first call of the indexer losses or packed sequences all of its kernels, the tuner its candidates side by side)"),
}

# old name -> its replacement (docs/api.md, "Old names")
DEPRECATED = {
    "STREAMKL_INDEXER_PACC": "STREAMKL_INDEXER_TRAINING",
    "STREAMKL_INDEXER_PSTORE": "STREAMKL_INDEXER_TRAINING",
    "STREAMKL_INDEXER_GLUON": "STREAMKL_INDEXER_BACKEND",
    "STREAMKL_INDEXER_GLUON_PACC": "STREAMKL_INDEXER_BACKEND",
}

BACKENDS = ("auto", "triton", "gluon")

_WARNED: set = set()


def old(name: str):
    """The value of the old variable ``name`` (``DEPRECATED``), warning once per process when set."""
    value = env(name)
    if value is not None and name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"{name} is deprecated: use {DEPRECATED[name]} (docs/api.md, 'Environment variables')",
                      FutureWarning, stacklevel=3)
    return value


def backend(name: str, override=None) -> str:
    """``auto``, ``triton`` or ``gluon`` from ``override`` (a module setting) or the variable ``name``
    (``STREAMKL_<OP>_BACKEND``); anything else raises a ``ValueError`` naming the variable."""
    value = override if override is not None else env(name)
    if value is None:  # neither set (every call reads this: the usual case returns at once)
        return "auto"
    value = str(value).strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{name} must be one of {BACKENDS}, got {value!r}")
    return value
