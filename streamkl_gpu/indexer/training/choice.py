"""Which training design runs (``STREAMKL_INDEXER_TRAINING``) and when a design applies: the
accumulating, store and chunk designs serve scalar reductions with the teacher LSEs given."""
from __future__ import annotations

import os

import torch

from streamkl_gpu.indexer.triton import accumulate as _indexer_pacc
from streamkl_gpu._core import runtime as _runtime


PACC_MODES = ("auto", "0", "1")


def pacc_enabled(dims=None) -> bool:
    """``STREAMKL_INDEXER_PACC``: ``1`` = the accumulating design for ``"sum"``/``"mean"`` with
    ``lse`` given and one indexer key head; ``0`` = the plain forward and a recomputing backward;
    ``auto`` (default) = the accumulating design, measured faster at both anchor configs (H200,
    8K causal fwd+bwd, s4r4 run: DSA-like 52.96 ms against 128.4 for the plain separate design;
    GQA-like 12.86 against 18.29)."""
    mode = os.environ.get("STREAMKL_INDEXER_PACC", "auto")
    if mode not in PACC_MODES:
        raise ValueError(f"STREAMKL_INDEXER_PACC must be one of {PACC_MODES}, got {mode!r}")
    if mode == "auto":
        return dims is not None
    return mode == "1"


PSTORE_MODES = ("default", "auto", "0", "1", "chunk")
# "default": the chunk design where it was measured faster, a single-key-head (MQA) teacher: run
# s7r2 (H200, DSA-like 8K causal, mean, lse given, bf16): fwd+bwd 31.60 ms against the accumulating
# design's 51.73 in the same run; elsewhere (GQA teachers: not timed with it) the accumulating design
PSTORE_DEFAULT = "default"
PSTORE_MAX_BYTES = 2 << 30  # "auto": the stored p at most this (8K x 8K fp32: 256 MiB)
# p's storage dtype: float32; float16 halves the memory (p in [0, 1]: relative error 2^-11 from
# 6e-5 up, absolute below; bench/idx_pacc_gpu.py checks and times it as a variant)
PSTORE_DTYPE = torch.float32


def pstore_bytes(dims) -> int:
    return dims.B * dims.NQ * dims.NK * PSTORE_DTYPE.itemsize


def pstore_mode(dims) -> str:
    """``STREAMKL_INDEXER_PSTORE`` resolved for these dims, within the accumulating design's
    cases (``_use_pacc``): ``"chunk"`` = p stored chunk by chunk, the whole gradient in the
    forward (linear memory); ``"1"`` = store p whole; ``"0"`` = accumulate the target's share
    (``_indexer_pacc``). The setting ``auto`` = store p whole where it takes at most
    PSTORE_MAX_BYTES; ``default`` = ``chunk`` for a single-key-head teacher (``H_K = 1``, where it
    was measured faster), ``0`` otherwise."""
    mode = _runtime.env("STREAMKL_INDEXER_PSTORE", PSTORE_DEFAULT)
    if mode not in PSTORE_MODES:
        raise ValueError(f"STREAMKL_INDEXER_PSTORE must be one of {PSTORE_MODES}, got {mode!r}")
    if mode == "default":
        return "chunk" if dims.HK == 1 else "0"
    if mode == "auto":
        return "1" if pstore_bytes(dims) <= PSTORE_MAX_BYTES else "0"
    return mode


def pstore_enabled(dims) -> bool:
    """Does the forward store p (whole, or chunk by chunk)? (:func:`pstore_mode`)"""
    return pstore_mode(dims) in ("1", "chunk")


def _use_pacc(dims, lse, reduction, q_idx, k_idx, weights) -> bool:
    return (reduction != "none" and lse is not None and dims.HKI == 1 and pacc_enabled(dims)
            and torch.is_grad_enabled() and any(t.requires_grad for t in (q_idx, k_idx, weights)))
