"""Diagnostic kernel variants: deliberately incomplete kernels that explain where a kernel's time
goes (each leaves out one part of the work and is timed against the whole). They compute wrong
results on purpose, are never a tuner candidate, and are reached only through the forcing hook
(which also reaches the complete variants, ``ATTENTION_FWD_COMPLETE_VARIANTS``: correct kernels,
the default among them, that a GPU script times against each other):

    from streamkl_gpu._core.forcing import forcing
    with forcing(attention_fwd_variant="no_exp"):
        streamkl_gpu.attention_kl(q1, k1, q2, k2)          # the Gluon forward without exponentials

The constexpr each name selects lives in the kernel (``VARIANT`` of ``attention/gluon/fwd_sm90.py``,
``PARTS`` of ``indexer/triton/accumulate.py``); this module only names them.
"""
from __future__ import annotations

from typing import Optional

# The Hopper Gluon forward's VARIANT constexpr. What runs unforced is ATTENTION_FWD_DEFAULTS' entry for
# the mask (the lazy maxima: 5, with the cheaper vote, non-causal; 4 causal); 0 is the fold with the
# row maxima on every tile, which the diagnostic variants 1-3 modify.
ATTENTION_FWD_VARIANTS = {
    "no_exp": 1,  # the exponentials replaced by their argument: the MUFU share of the time
    "no_second_product": 2,  # side 2's score product skipped: one product's share
    "no_acc": 3,  # the log-ratio accumulator left out: the second pass's share
    "lazy_max": 4,  # complete (not diagnostic): ATTENTION_FWD_COMPLETE_VARIANTS below
    "eager_max": 0,  # complete: ATTENTION_FWD_COMPLETE_VARIANTS below
    "lazy_vote": 5,  # complete: ATTENTION_FWD_COMPLETE_VARIANTS below
}
# Complete variants of the same kernel (correct KL, lse1, lse2, within float rounding of each
# other), forced the same way so that a GPU script can time them against each other in one process.
ATTENTION_FWD_COMPLETE_VARIANTS = {
    # whole tiles without the row maxima while they grow by <= 8 bits (fwd_sm90_fold._fold_sub_lazy);
    # the default: 0.89-0.97x the eager fold's time at B=1 H=32 D=128 bf16, 4K-32K
    # (bench/results/2026-12-06_h100_3b920d9/fwd_variants.csv)
    "lazy_max": 4,
    # the row maxima folded on every tile (fwd_sm90_fold._fold_sub): the kernel before lazy_max
    "eager_max": 0,
    # lazy_max with a cheaper vote (fwd_sm90_fold._vote VOTE 1: the 4 warps' votes through 4 shared ints,
    # one barrier) and the slot's descriptors rebuilt on the slow path. Offline SASS per whole-tile
    # fast path (bf16 D = 128, the two consumers), triton 3.6: 665 / 669 instructions, 3 BAR.SYNC,
    # 1 + 4 LDL, no STL, 56 B stack (lazy_max: 675 / 679, 4 BAR, 3 + 5 LDL/STL, 48 B); 3.9: 700 / 715,
    # 2 BAR, 0 + 2 LDL/STL, 56 B (lazy_max: 699 / 712, 2 BAR, 3 + 3, 72 B). Timed against lazy_max
    # (one H100, B=1 H=32 D=128 bf16, 5 rounds in rotated order, bench/results/2026-12-06_h100_2037f01/
    # attn_vs_cudnn.csv): non-causal 0.909 / 0.917 / 0.992 / 1.016 / 0.992x at 4K / 8K / 16K / 32K /
    # 64K, causal 1.041-1.105x (slower at every N): the non-causal default
    "lazy_vote": 5,
}
# What runs unforced, by mask (causal -> VARIANT)
ATTENTION_FWD_DEFAULTS = {False: ATTENTION_FWD_COMPLETE_VARIANTS["lazy_vote"],
                          True: ATTENTION_FWD_COMPLETE_VARIANTS["lazy_max"]}

# The indexer's accumulating forward's PARTS constexpr (3: the whole forward).
INDEXER_ACCUMULATE_PARTS = {
    "teacher": 0,  # the target and the online state alone (no indexer products)
    "logits": 1,  # + the student's logits (the plain forward's work)
    "nodk": 2,  # + dq_p and dweights_p, no dk_p
}

# The chunk design's keys-major gradient kernel's DK_SHARE constexpr (indexer/triton/chunk_grad_keys.py),
# forced to leave out each key tile's dk_idx share (its product and its reduction into dk): the
# share's part of the kernel's time (dk_idx comes out 0).
INDEXER_CHUNK_GRADIENT_PARTS = {
    "no_dk": 0,
}


def attention_fwd_variant(name: Optional[str], causal: bool = True) -> int:
    """The VARIANT constexpr of a forced attention forward variant (``None``: what runs unforced at
    that mask, ``ATTENTION_FWD_DEFAULTS[causal]``)."""
    if name is None:
        return ATTENTION_FWD_DEFAULTS[bool(causal)]
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


def indexer_chunk_gradient_parts(name: str) -> int:
    """The DK_SHARE constexpr of a forced chunk-gradient variant."""
    if name not in INDEXER_CHUNK_GRADIENT_PARTS:
        raise ValueError(f"indexer_chunk_gradient_parts must be one of {sorted(INDEXER_CHUNK_GRADIENT_PARTS)}, got {name!r}")
    return INDEXER_CHUNK_GRADIENT_PARTS[name]
