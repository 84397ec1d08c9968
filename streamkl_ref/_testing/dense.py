"""The dense PyTorch formulas (what everyone writes; the same-precision baseline of the rule):
every score matrix materialised, differentiable through autograd. Torch is imported inside."""
from __future__ import annotations


def causal_mask(n_q: int, n_k: int, device=None):
    """Bottom-right causal mask, ``True`` where key j is visible to query i: ``j <= i + (N_K - N_Q)``."""
    import torch

    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + (n_k - n_q)


def _expand_kv(k, h: int):
    # GQA: query head h reads key head h // (H // H_K)
    return k.repeat_interleave(h // k.shape[1], dim=1) if k.shape[1] != h else k


def attention_kl_torch(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None,
                       compute_dtype=None):
    """KL(P1 || P2) per query row, ``[B, H, N_Q]`` in ``compute_dtype``, fully materialised.

    Plain PyTorch, differentiable through autograd. Scores are formed in ``compute_dtype``
    (default: torch.float32) from the inputs cast to it. Masked entries are -inf on both sides
    and contribute exactly 0; rows with no visible key give 0. (NaN isolation: the forward of a
    row never sees an invisible key's NaN, but autograd's matmul backward multiplies the masked
    zeros by it, so gradients are not isolated; see docs/conformance.md.)
    """
    import torch

    from .._checks import check_flag, check_inputs

    causal = check_flag(causal, "causal")

    dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    compute_dtype = torch.float32 if compute_dtype is None else compute_dtype
    return _torch_rows(q1, k1, q2, k2, dims, causal, compute_dtype, 0, dims.NQ)


def _torch_rows(q1, k1, q2, k2, dims, causal, compute_dtype, row_offset, n_q_total):
    import torch

    H = dims.H
    s1 = dims.scale1 * (q1.to(compute_dtype) @ _expand_kv(k1, H).to(compute_dtype).transpose(-1, -2))
    s2 = dims.scale2 * (q2.to(compute_dtype) @ _expand_kv(k2, H).to(compute_dtype).transpose(-1, -2))
    empty = None
    if causal:
        n_q = q1.shape[2]
        i = torch.arange(row_offset, row_offset + n_q, device=q1.device)[:, None]
        j = torch.arange(dims.NK, device=q1.device)[None, :]
        visible = j <= i + (dims.NK - n_q_total)
        # rows with no visible key: keep them unmasked for the arithmetic (no all -inf row, so no
        # NaN, also not in autograd) and set their KL to the convention's 0 below
        empty = ~visible.any(-1)
        visible = visible | empty[:, None]
        s1 = s1.masked_fill(~visible, float("-inf"))
        s2 = s2.masked_fill(~visible, float("-inf"))
    logp1 = torch.log_softmax(s1, dim=-1)
    logp2 = torch.log_softmax(s2, dim=-1)
    p1 = logp1.exp()
    # 0 * log(0/.) = 0: the log-ratio of masked entries (p1 == 0) is replaced by 0 before the
    # product, so neither the value nor its autograd ever touches -inf - -inf
    log_ratio = torch.where(p1 > 0, logp1 - logp2, torch.zeros((), dtype=p1.dtype, device=p1.device))
    kl = (p1 * log_ratio).sum(-1)
    if empty is not None:
        kl = kl.masked_fill(empty, 0.0)
    return kl


def attention_kl_torch_chunked(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None,
                               compute_dtype=None, chunk=1024):
    """The same, over query chunks of ``chunk`` rows (what users do today to avoid OOM)."""
    import torch

    from .._checks import check_flag, check_inputs

    causal = check_flag(causal, "causal")

    dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    compute_dtype = torch.float32 if compute_dtype is None else compute_dtype
    out = []
    for start in range(0, dims.NQ, chunk):
        sl = slice(start, start + chunk)
        out.append(_torch_rows(q1[:, :, sl], k1, q2[:, :, sl], k2, dims, causal, compute_dtype,
                               start, dims.NQ))
    return torch.cat(out, dim=-1)


def indexer_kl_torch(q, k, q_idx, k_idx, weights, *, causal=False, scale=None, relu=True, compute_dtype=None):
    """``[B, N_Q]`` indexer KL ``KL(p || softmax(I))`` in ``compute_dtype`` (default float32),
    every score matrix materialised: teacher scores per head, softmax, head mean; indexer scores,
    ReLU, weights, log-softmax; KL. Products are formed from the inputs cast to ``compute_dtype``.
    Rows with no visible key give 0. Differentiable through autograd (in ``q_idx, k_idx,
    weights``; the teacher too, if its tensors require grad)."""
    import torch

    from .._checks import check_flag, check_indexer_inputs

    causal, relu = check_flag(causal, "causal"), check_flag(relu, "relu")

    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    cd = torch.float32 if compute_dtype is None else compute_dtype
    kt = k.to(cd).repeat_interleave(dims.H // dims.HK, dim=1)
    ki = k_idx.to(cd).repeat_interleave(dims.HI // dims.HKI, dim=1)
    i = torch.arange(dims.NQ, device=q.device)[:, None]
    j = torch.arange(dims.NK, device=q.device)[None, :]
    visible = (j <= i + (dims.NK - dims.NQ)) if causal else torch.ones_like(i * j, dtype=torch.bool)
    empty = ~visible.any(-1)
    visible = visible | empty[:, None]  # an empty row is computed unmasked, then set to 0
    s = (q.to(cd) @ kt.transpose(-1, -2)) * dims.scale
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).mean(dim=1)  # [B, N_Q, N_K]
    a = q_idx.to(cd) @ ki.transpose(-1, -2)
    act = torch.relu(a) if relu else a
    logits = (weights.to(cd)[..., None] * act).sum(dim=1)
    log_q = torch.log_softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    # 0 log 0 = 0: masked / underflowed entries are selected away before the product
    pos = p > 0
    log_p = torch.log(torch.where(pos, p, torch.ones((), dtype=p.dtype, device=p.device)))
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    kl = torch.where(pos, p * (log_p - torch.where(visible, log_q, zero)), zero).sum(-1)
    return kl.masked_fill(empty, 0.0)
