"""A conformance suite for anyone's attention-KL kernel (``check_attention_kl``).

The same battery, float64 reference and tolerance rule that gate streamkl's own kernels
(``streamkl verify``), pointed at *your* callable::

    from streamkl_ref.testing import assert_attention_kl_conforms
    assert_attention_kl_conforms(my_kl, device="cuda", dtypes=("float32", "bfloat16"))

``fn(q1, k1, q2, k2, *, causal, scale1, scale2)`` receives torch tensors on ``device`` in the
case's dtype (``requires_grad`` set when ``grads=True``) and returns ``KL(P1 ‖ P2)`` per query
row (``returns="rows"``), or its sum or mean over all rows. Conventions (docs/api.md): layout
``[B, H, N, D]`` (``layout="bnhd"``: ``[B, N, H, D]``, rows returned as ``[B, N_Q, H]``); GQA
query head ``h`` reads key head ``h // (H / H_K)``; ``scale=None`` means ``1/sqrt(D)``;
``causal`` is bottom-right aligned (``causal_align="top-left"`` for SDPA's ``is_causal``: see
:func:`check_attention_kl` for how the suite handles ``N_Q != N_K`` then); results in nats.

The tolerance rule (:func:`tolerance`), FlashAttention's: an output passes when its error against
the float64 reference is at most ``C_TOL`` times the error that the same math, done densely in
PyTorch at the inputs' own precision (:func:`attention_kl_torch`), makes against that reference,
plus a floor per dtype. Errors are relative Frobenius norms (:func:`relative_error`).

This module imports torch only inside its functions: ``import streamkl_ref`` (and this module)
works without it; calling a check needs it. Its parts live in ``streamkl_ref._testing``, one
concern each: ``tolerance`` (the rule), ``dense`` (the PyTorch baselines), ``cases`` (the
batteries), ``report`` (table, JSON, hints), ``attention`` and ``indexer`` (the two checks); this
module is their public face.
"""
from __future__ import annotations

from ._testing.attention import (
    CAUSAL_ALIGNS,
    GRAD_NAMES,
    INPUT_NAMES,
    LAYOUTS,
    RETURNS,
    SUPPORT_KEYS,
    assert_attention_kl_conforms,
    check_attention_kl,
)
from ._testing.cases import (
    ATTENTION_CASES,
    CASE_SETS,
    GPU_ATTENTION_CASES,
    GPU_INDEXER_CASES,
    INDEXER_CASES,
    INDEXER_GRADS,
    INDEXER_INPUTS,
    LARGE_ATTENTION_CASES,
    LARGE_INDEXER_CASES,
    PLANT_PAD,
    Case,
    IndexerCase,
    attention_cases,
    case_generator,
    indexer_cases,
)
from ._testing.dense import attention_kl_torch, attention_kl_torch_chunked, causal_mask, indexer_kl_torch
from ._testing.indexer import (
    INDEXER_SUPPORT_KEYS,
    assert_indexer_kl_conforms,
    check_indexer_kl,
    indexer_row_floor,
)
from ._testing.report import Report, Row
from ._testing.tolerance import (
    C_TOL,
    FLOOR,
    KL_ROUNDING_ULPS,
    ROW_STAT_EPS,
    TOLERANCE_RULE,
    ZERO_GRAD_TOL,
    kl_error_and_tolerance,
    kl_row_floor,
    relative_error,
    tolerance,
)

__all__ = [
    "C_TOL", "FLOOR", "ZERO_GRAD_TOL", "tolerance", "relative_error",
    "KL_ROUNDING_ULPS", "ROW_STAT_EPS", "kl_row_floor", "indexer_row_floor", "kl_error_and_tolerance", "case_generator",
    "Case", "ATTENTION_CASES", "GPU_ATTENTION_CASES", "LARGE_ATTENTION_CASES", "CASE_SETS", "attention_cases",
    "Row", "Report", "check_attention_kl", "assert_attention_kl_conforms",
    "attention_kl_torch", "attention_kl_torch_chunked", "causal_mask",
    "SUPPORT_KEYS",
    "IndexerCase", "INDEXER_CASES", "GPU_INDEXER_CASES", "LARGE_INDEXER_CASES", "indexer_cases", "INDEXER_SUPPORT_KEYS",
    "check_indexer_kl", "assert_indexer_kl_conforms", "indexer_kl_torch",
]
