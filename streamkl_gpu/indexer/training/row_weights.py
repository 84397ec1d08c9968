"""The indexer loss's training step (``indexer_kl`` with a scalar reduction and a gradient wanted)
on every path, and the per-row weights it can take (``row_weights=``).

Every path of a training step takes the "chunk" design (``training/chunk.py``'s
``_forward_full``): with a scalar reduction the upstream gradient of each row is known in the
forward up to one common factor, so the forward forms the whole gradient (the storing forward writes one chunk of tokens'
target p, the teacher-free gradient kernel reads it with the chunk's final LSE_I, dk by fp32
atomics) and the backward only scales it. The teacher is read once per step with ``lse`` given
and twice without (``indexer/teacher_lse.py``: its per-head LSEs first). Floors, causal, FLOPs:

    lse given:  2 * N^2/2 * (H D + 3 H_I D_I)        (the teacher's scores once; the indexer's
                                                        scores and its two gradient products)
    no lse:     2 * N^2/2 * (2 H D + 3 H_I D_I)      (the teacher's scores twice)

Teachers with several key heads (GQA, MHA) take the same design; where the GQA forward kernel's
plan applies (``indexer/triton/fwd_gqa.py``'s ``applies``: TMA, head dims <= 128, one head per
tile), the chunk's storing forward is ``indexer/triton/fwd_gqa_store.py`` (that kernel's lean
head loop plus the store of p), else the general storing forward
(``indexer/triton/accumulate.py``'s ``_indexer_fwd_pstore_kernel``).

Per-row losses: ``row_weights [B, N_Q]`` (known at forward time: Megatron's per-token loss
weights, a mask of padded rows) make the loss ``sum_t row_weights[t] KL[t]`` (``"sum"``) or that
divided by the rows with at least one visible key (``"mean"``, the unweighted loss's divisor, so
all-ones weights give the unweighted loss; a weighted mean is ``"sum"`` divided by the weights'
sum). The chunk design takes them as its gradient kernel's per-row g: the same single pass, no
teacher in the backward. With ``reduction="none"`` the rows are ``row_weights * KL``; in designs
that cannot take them (``STREAMKL_INDEXER_TRAINING`` forcing another design, ``H_KI > 1``, no
gradient wanted) the plain forward's rows are weighted and the recomputing backward gets
``g * row_weights`` per row (the teacher recomputed in the backward: the no-``lse`` floor and more).
"""
from __future__ import annotations

import torch

__all__ = ["check_row_weights"]


def check_row_weights(row_weights, dims, device):
    """``row_weights`` as a float32 ``[B, N_Q]`` constant (detached: no gradient flows to it), or
    None. Shape, dtype and device are checked; values are not (a NaN weight gives a NaN loss)."""
    if row_weights is None:
        return None
    if not isinstance(row_weights, torch.Tensor):
        raise ValueError(f"row_weights must be None or a torch.Tensor, got {type(row_weights).__name__}")
    want = (dims.B, dims.NQ)
    if tuple(row_weights.shape) != want:
        raise ValueError(f"row_weights must have shape [B, N_Q] = {list(want)}, got {list(row_weights.shape)}")
    if not row_weights.dtype.is_floating_point:
        raise ValueError(f"row_weights must be a floating-point tensor, got {row_weights.dtype}")
    if row_weights.device != device:
        raise ValueError(f"row_weights is on {row_weights.device} but q is on {device}: they must share a device")
    return row_weights.detach().to(torch.float32).contiguous()
