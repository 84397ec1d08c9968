"""streamkl_gpu: Triton kernels for streaming attention KL behind one PyTorch function.

``attention_kl(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None)`` -> float32
``[B, H, N_Q]``. Runs on NVIDIA GPUs, and on CPU tensors under the Triton interpreter
(set ``TRITON_INTERPRET=1`` before the kernels are first used). Conventions: docs/math.md.

The kernel modules are imported lazily, on first use of the API: Triton decides at kernel
definition time whether to interpret, so ``streamkl verify`` (``streamkl_gpu.verify``) can still
choose the interpreter after ``import streamkl_gpu``.
"""
import importlib

from streamkl_ref import __version__  # one version for both packages

__all__ = [
    "attention_kl",
    "attention_kl_with_lse",
    "attention_kl_varlen",
    "indexer_kl",
    "indexer_kl_topk",
    "auto_split_k",
    "auto_bwd_mode",
    "interpreting",
    "bounds_checked",
    "OutOfBoundsAccess",
    "DataRace",
    "SUPPORTED_DTYPES",
    "MAX_HEAD_DIM",
    "__version__",
]


_HOMES = {  # the rest lives in .api
    "attention_kl_varlen": ".attention.varlen",
    "indexer_kl": ".indexer.api",
    "indexer_kl_topk": ".indexer.topk",
    "bounds_checked": ".devtools.bounds",  # the interpreter's memory check (a testing aid)
    "OutOfBoundsAccess": ".devtools.bounds",
    "DataRace": ".devtools.bounds",
}


def __getattr__(name):
    if name == "nn":  # the loss modules: a public submodule reachable as an attribute (imports no kernel)
        return importlib.import_module(".nn", __name__)
    if name in __all__:
        if name != "__version__":  # the first API use: Triton's compiler set-up starts (_core/first_use.py)
            importlib.import_module("._core.first_use", __name__).warm_compiler()
        value = getattr(importlib.import_module(_HOMES.get(name, ".api"), __name__), name)
        globals()[name] = value  # later lookups skip this hook (it ran on every call)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    # the public API only (the private modules are implementation)
    return sorted(__all__)
