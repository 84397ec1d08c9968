"""Runtime facts shared by every launch: interpreter or GPU, SM count, TMA, constants, test settings.

Nothing here depends on a problem's shape. Dependencies run one way (docs/architecture.md): the
public entry points -> host launch code -> ``_core``; kernel modules import ``_core.jit`` and
triton only, and ``_core`` imports no kernel module (tests/test_layout.py).
"""
from __future__ import annotations

import functools
import os

import torch

try:  # host-side TMA descriptors (triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

from streamkl_gpu._core import jit as _jit

LOG2E = 1.4426950408889634  # the scale fold: scores in bits = sigma * log2(e) * q.k
LN2 = 0.6931471805599453

# Tests set this to True: every buffer the kernels must fully write starts as NaN, so an
# unwritten element cannot pass (flash-linear-attention's fixture pattern).
POISON_FRESH = False
INTERPRETER_BLOCK = (16, 16)  # one fixed config under the interpreter (tests may override)
INTERPRETER_TMA = False  # forward keys through TMA descriptors under the interpreter (tests set it)


# Environment reads on the per-call path: ``os.environ.get`` encodes the name and decodes the
# value on every call (about a microsecond each in CPython); the mapping's own dict answers the
# same question (CPython keeps it current on every set/del through os.environ) in tens of ns.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_BYTES = isinstance(_ENV_DATA, dict) and all(isinstance(k, bytes) for k in list(_ENV_DATA)[:1])


_ENV_KEYS: dict = {}


def env(name: str, default=None):
    """``os.environ.get(name, default)``, faster where CPython's layout allows."""
    if _ENV_BYTES:
        key = _ENV_KEYS.get(name)
        if key is None:
            key = _ENV_KEYS[name] = os.fsencode(name)
        value = _ENV_DATA.get(key)
        return default if value is None else os.fsdecode(value)
    return os.environ.get(name, default)


def bucket(n: int) -> int:
    """The shape bucket of a size: the next power of two (tuned choices, and first-call
    signatures, are shared within it)."""
    return 1 << max(0, int(n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code (triton.cdiv is a constexpr function with per-call overhead)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def fresh(shape, dtype, device):
    """An output buffer the kernels must fully write (NaN-filled when tests poison)."""
    if POISON_FRESH:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=1)
def interpreting() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1 (they then run on CPU tensors).

    Fixed once the kernel modules are imported (Triton decides at definition time), so cached.
    The probe is a shared ``@triton.jit`` helper, defined when this module is imported."""
    return not hasattr(_jit._dot, "run") or type(_jit._dot).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=None)
def _device_facts(device_type: str, index) -> tuple[int, int]:
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(index)
        return props.multi_processor_count, props.major
    return 4, 0


@functools.lru_cache(maxsize=None)
def _device_name(device_type: str, index) -> str:
    if device_type == "cuda":
        return torch.cuda.get_device_name(index)
    return "cpu-interpreter"


def device_name(device) -> str:
    """The GPU's name (the tuning cache is kept per GPU model)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    return _device_name(device.type, index)


def n_sm(device) -> int:
    """Streaming multiprocessors of ``device`` (4 for CPU, a stand-in for the interpreter)."""
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    return _device_facts(device.type, index)[0]


def compute_capability_major(device) -> int:
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    return _device_facts(device.type, index)[1]


def tma_ok(t) -> bool:
    """Can ``t`` ([B, H, N, D]) be read through a TMA tensor descriptor? Hopper or newer (or the
    interpreter, when tests ask for it), unit stride in D, 16-byte aligned base and strides."""
    if TensorDescriptor is None:
        return False
    if interpreting():
        if not INTERPRETER_TMA:
            return False
    elif t.device.type != "cuda" or compute_capability_major(t.device) < 9:
        return False
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st > 0 and (st * size) % 16 == 0 for st in t.stride()[:-1]))


class LazyModule:
    """A module imported at the first read of one of its attributes, which then replaces this
    proxy under ``alias`` in ``owner`` (the importing module's globals): later reads are plain
    global lookups, with nothing added per call. For modules a first call may not need (the
    backward's kernels on a forward-only call: about 75 ms of Triton and Gluon decorators)."""

    __slots__ = ("_name", "_owner", "_alias")

    def __init__(self, name: str, owner: dict, alias: str):
        self._name, self._owner, self._alias = name, owner, alias

    def __getattr__(self, attr):
        import importlib

        module = importlib.import_module(self._name)
        self._owner[self._alias] = module
        return getattr(module, attr)
