"""streamkl_ref: exact references for attention KL divergence (NumPy + mpmath; never imports torch).

``KL[b,h,i] = KL(P1[b,h,i,:] || P2[b,h,i,:])`` between two attention distributions
``P_t = softmax(σ_t · Q_t K_tᵀ)`` over the keys, per query row. Conventions (the contract is
docs/math.md, "Definitions and conventions"):

- layout ``[B, H, N, D]``; ``q_t [B, H, N_Q, D_t]``, ``k_t [B, H_Kt, N_K, D_t]``; GQA per side
  (query head ``h`` reads key head ``h // (H // H_Kt)``); ``D1`` may differ from ``D2``,
  ``N_Q`` from ``N_K``;
- ``scale_t = None`` means ``1/sqrt(D_t)``;
- ``causal=True`` is bottom-right aligned: key ``j`` visible to query ``i`` iff
  ``j <= i + N_K − N_Q`` (FlashAttention's convention, not SDPA's top-left ``is_causal``);
- a row with no visible key has ``KL = 0``, ``LSE = −inf`` and zero gradient;
- results in nats (natural log), float64 unless a ``dtype`` says otherwise;
- NaN in an input gives NaN in the rows it reaches, never a silent 0.

Modules: ``_dense`` (materialised float64), ``_mp`` (mpmath ground truth), ``_online`` (the
five-scalar streaming recurrence, tiled as a kernel runs it; ``accumulator="max_referenced"``
for the exact form the ``streamkl_gpu`` kernels keep), ``_grad`` (closed-form and tiled
backward), ``_indexer`` (the sparse-attention indexer loss: head-averaged teacher,
weighted-ReLU student; dense, mpmath, online, gradient), ``_varlen`` (packed sequences with
``cu_seqlens``, sequence by sequence), ``_scores`` (scores, masks, GQA plumbing), ``_checks``
(input validation shared with
streamkl_gpu), ``cli`` (the ``streamkl`` command).
"""
__version__ = "0.1.0"  # the one home of the version (pyproject.toml reads it)

from ._dense import attention_kl
from ._grad import attention_kl_grad, attention_kl_grad_tiled
from ._indexer import (
    IndexerOnlineResult,
    IndexerTileStats,
    indexer_kl,
    indexer_kl_grad,
    indexer_kl_mp,
    indexer_kl_online,
)
from ._indexer_topk import indexer_kl_topk, indexer_kl_topk_grad, indexer_kl_topk_mp
from ._mp import attention_kl_mp
from ._online import (
    ACCUMULATORS,
    MaxReferencedState,
    OnlineResult,
    OnlineState,
    TileEvent,
    attention_kl_online,
    convert_state,
    finalize_state,
    initial_state,
    merge_states,
    update_state,
)
from ._varlen import attention_kl_varlen, attention_kl_varlen_grad

__all__ = [
    "__version__",
    "attention_kl",
    "attention_kl_mp",
    "attention_kl_online",
    "attention_kl_grad",
    "attention_kl_grad_tiled",
    "attention_kl_varlen",
    "attention_kl_varlen_grad",
    "OnlineState",
    "MaxReferencedState",
    "ACCUMULATORS",
    "OnlineResult",
    "TileEvent",
    "initial_state",
    "update_state",
    "merge_states",
    "finalize_state",
    "convert_state",
    "indexer_kl",
    "indexer_kl_mp",
    "indexer_kl_online",
    "indexer_kl_grad",
    "indexer_kl_topk",
    "indexer_kl_topk_grad",
    "indexer_kl_topk_mp",
    "IndexerOnlineResult",
    "IndexerTileStats",
]
