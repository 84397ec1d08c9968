"""Which training design runs (``STREAMKL_INDEXER_TRAINING``) and when a design applies: the
accumulating, store and chunk designs serve scalar reductions with the teacher LSEs given (a
training step without them computes them first: ``indexer/teacher_lse.py``)."""
from __future__ import annotations

import torch

from streamkl_gpu._core import env as _env
from streamkl_gpu._core import runtime as _runtime


# STREAMKL_INDEXER_TRAINING's words. Within the cases the designs serve (_use_pacc: "sum"/"mean"
# with lse given, one indexer key head, a gradient wanted):
#   plain       the plain forward and a recomputing backward (the teacher read again)
#   accumulate  the forward also sums the target's share of the gradient (teacher read once)
#   store       the forward keeps p [B, N_Q, N_K] whole (quadratic memory: an experiment)
#   chunk       the whole gradient in the forward, chunk by chunk of tokens (linear memory)
#   auto        chunk, for every teacher. One key head (MQA; H200, DSA-like 8K causal, mean, lse
#               given, bf16): fwd+bwd 30.79 ms against the accumulating design's 41.07 in the same
#               run (bench/results/2026-12-03_h200_57f6d64/). Several key heads (GQA-like 8K, H100,
#               5 interleaved rounds in one process): lse given 5.37 ms against the accumulating
#               design's 6.10, without lse 6.29 ms (the LSE pass first; 11.1 before it), with
#               row weights 5.35 (bench/results/2026-12-06_h100_26b8f65/indexer_training.csv).
#               Both before the relaxed atomics, which took the chunk design's GQA-like lse step to
#               3.55 ms on an H200 (bench/results/2026-12-06_h200_a1ce46d/); the accumulating
#               design, whose atomics changed too, was not timed again.
#               The accumulating design itself was measured faster than the plain one at both
#               anchors (H200, 8K causal fwd+bwd: DSA-like 52.96 ms against 128.4, GQA-like 12.86
#               against 18.29).
TRAINING_DESIGNS = ("auto", "plain", "accumulate", "store", "chunk")
TRAINING_VAR = "STREAMKL_INDEXER_TRAINING"

# The old names (still read while STREAMKL_INDEXER_TRAINING is unset, with a warning):
# STREAMKL_INDEXER_PACC=0 is "plain"; then STREAMKL_INDEXER_PSTORE: default -> "auto", 0 ->
# "accumulate", 1 -> "store", chunk -> "chunk", auto -> store where p fits in PSTORE_MAX_BYTES,
# else accumulate (that last choice has no new word).
PACC_MODES = ("auto", "0", "1")
PSTORE_MODES = ("default", "auto", "0", "1", "chunk")
PSTORE_DEFAULT = "default"
PSTORE_MAX_BYTES = 2 << 30  # old PSTORE=auto: the stored p at most this (8K x 8K fp32: 256 MiB)
# p's storage dtype: float32; float16 halves the memory (p in [0, 1]: relative error 2^-11 from
# 6e-5 up, absolute below; tests/test_indexer_pstore.py checks it, and a GPU script since removed,
# ``git show b7066de:bench/idx_pacc_gpu.py``, checked and timed it as a variant)
PSTORE_DTYPE = torch.float32


def pstore_bytes(dims) -> int:
    return dims.B * dims.NQ * dims.NK * PSTORE_DTYPE.itemsize


def _setting() -> str:
    """The design asked for: a TRAINING_DESIGNS word, or "store_if_fits" (only the old
    STREAMKL_INDEXER_PSTORE=auto asks for it). Bad values raise, naming their variable."""
    value = _runtime.env(TRAINING_VAR)
    if value is not None:
        value = value.strip().lower() or "auto"
        if value not in TRAINING_DESIGNS:
            raise ValueError(f"{TRAINING_VAR} must be one of {TRAINING_DESIGNS}, got {value!r}")
        return value
    pacc = _env.old("STREAMKL_INDEXER_PACC")
    if pacc is not None and pacc not in PACC_MODES:
        raise ValueError(f"STREAMKL_INDEXER_PACC must be one of {PACC_MODES}, got {pacc!r}")
    pstore = _env.old("STREAMKL_INDEXER_PSTORE")
    if pstore is not None and pstore not in PSTORE_MODES:
        raise ValueError(f"STREAMKL_INDEXER_PSTORE must be one of {PSTORE_MODES}, got {pstore!r}")
    if pacc == "0":
        return "plain"
    return {None: "auto", "default": "auto", "0": "accumulate", "1": "store", "chunk": "chunk",
            "auto": "store_if_fits"}[pstore]


def training_design(dims) -> str:
    """The design that runs for these dims, within the designs' cases: plain, accumulate, store or
    chunk (the same with the teacher LSEs given or computed first, with row weights or without)."""
    design = _setting()
    if design == "auto":
        return "chunk"
    if design == "store_if_fits":
        return "store" if pstore_bytes(dims) <= PSTORE_MAX_BYTES else "accumulate"
    return design


def pacc_enabled(dims=None) -> bool:
    """Does a design that reads the teacher once (accumulate, store, chunk) run? (not "plain")"""
    if dims is None:
        return _setting() != "plain"
    return training_design(dims) != "plain"


def pstore_mode(dims) -> str:
    """The design within the teacher-once designs, in the old words: ``"chunk"``, ``"1"`` (store
    p whole) or ``"0"`` (accumulate the target's share)."""
    design = training_design(dims)
    return {"chunk": "chunk", "store": "1"}.get(design, "0")


def pstore_enabled(dims) -> bool:
    """Does the forward store p (whole, or chunk by chunk)? (:func:`pstore_mode`)"""
    return pstore_mode(dims) in ("1", "chunk")


def _use_pacc(dims, lse, reduction, q_idx, k_idx, weights) -> bool:
    return (reduction != "none" and lse is not None and dims.HKI == 1 and pacc_enabled(dims)
            and torch.is_grad_enabled() and any(t.requires_grad for t in (q_idx, k_idx, weights)))
