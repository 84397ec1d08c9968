"""Diagnostic kernel variants: deliberately incomplete kernels that explain where a kernel's time
goes (each leaves out one part of the work and is timed against the whole). They compute wrong
results on purpose, are never a tuner candidate, and are reached only through the forcing hook
(which also reaches the complete variants, ``ATTENTION_FWD_COMPLETE_VARIANTS``: correct kernels
not yet timed against the default):

    from streamkl_gpu._core.forcing import forcing
    with forcing(attention_fwd_variant="no_exp"):
        streamkl_gpu.attention_kl(q1, k1, q2, k2)          # the Gluon forward without exponentials

The constexpr each name selects lives in the kernel (``VARIANT`` of ``attention/gluon/fwd_sm90.py``,
``PARTS`` of ``indexer/triton/accumulate.py``); this module only names them.
"""
from __future__ import annotations

from typing import Optional

# The Hopper Gluon forward's VARIANT constexpr (0: the kernel itself).
ATTENTION_FWD_VARIANTS = {
    "no_exp": 1,  # the exponentials replaced by their argument: the MUFU share of the time
    "no_second_product": 2,  # side 2's score product skipped: one product's share
    "no_acc": 3,  # the log-ratio accumulator left out: the second pass's share
    "lazy_max": 4,  # complete (not diagnostic): ATTENTION_FWD_COMPLETE_VARIANTS below
}
# Complete variants of the same kernel (correct KL, lse1, lse2, within float rounding of the
# default), forced the same way so that a GPU script can time them against the default in one
# process; never a tuner candidate until a GPU timing says so.
ATTENTION_FWD_COMPLETE_VARIANTS = {
    # whole tiles without the row maxima while they grow by <= 8 bits (fwd_sm90._fold_sub_lazy)
    "lazy_max": 4,
}

# The indexer's accumulating forward's PARTS constexpr (3: the whole forward).
INDEXER_ACCUMULATE_PARTS = {
    "teacher": 0,  # the target and the online state alone (no indexer products)
    "logits": 1,  # + the student's logits (the plain forward's work)
    "nodk": 2,  # + dq_p and dweights_p, no dk_p
}


def attention_fwd_variant(name: Optional[str]) -> int:
    """The VARIANT constexpr of a forced attention forward variant (``None``: the kernel, 0)."""
    if name is None:
        return 0
    if name not in ATTENTION_FWD_VARIANTS:
        raise ValueError(f"attention_fwd_variant must be one of {sorted(ATTENTION_FWD_VARIANTS)}, got {name!r}")
    return ATTENTION_FWD_VARIANTS[name]


def indexer_accumulate_parts(name: Optional[str]) -> int:
    """The PARTS constexpr of a forced accumulating-forward variant (``None``: all of it, 3)."""
    if name is None:
        return 3
    if name not in INDEXER_ACCUMULATE_PARTS:
        raise ValueError(f"indexer_accumulate_parts must be one of {sorted(INDEXER_ACCUMULATE_PARTS)}, got {name!r}")
    return INDEXER_ACCUMULATE_PARTS[name]
