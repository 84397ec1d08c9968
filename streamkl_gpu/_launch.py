"""Host side of the attention-KL launches: buffers, grids, tuned configs, the split-K combine.

``forward`` returns ``(kl in nats, lse1, lse2 in bits)``; ``backward`` the four gradients (None
for a side that is not trained). Both take resolved float scales (``api`` checks the arguments).
"""
from __future__ import annotations

import torch
import triton

from streamkl_ref._checks import check_inputs

from . import _bwd, _fwd
from ._checks import check_bwd_mode, check_tensors, compute_view, head_pad, is_empty, strides
from ._runtime import LOG2E, TensorDescriptor, fresh, interpreting, n_sm, tma_ok
from ._tuning import TMA_MIN_KEYS, auto_bwd_mode, auto_split_k, bucket, bwd_candidates, fwd_candidates, pick


def _empty_forward(dims, device):
    """Empty in, empty out; no keys: KL 0 and LSE -inf for every row (docs/api.md, "Empty inputs")."""
    shape = (dims.B, dims.H, dims.NQ)
    kl = torch.zeros(shape, dtype=torch.float32, device=device)
    lse = torch.full(shape, float("-inf"), dtype=torch.float32, device=device)
    return kl, lse, lse.clone()


def forward(q1, k1, q2, k2, causal, scale1, scale2, split_k):
    dims = check_tensors(q1, k1, q2, k2, scale1, scale2)
    device = q1.device
    if is_empty(dims):
        return _empty_forward(dims, device)
    q1, k1, q2, k2 = (compute_view(t) for t in (q1, k1, q2, k2))
    BH = dims.B * dims.H
    d1_pad, d2_pad = head_pad(dims.D1), head_pad(dims.D2)
    kl = fresh((dims.B, dims.H, dims.NQ), torch.float32, device)
    lse1_bits = fresh((dims.B, dims.H, dims.NQ), torch.float32, device)
    lse2_bits = fresh((dims.B, dims.H, dims.NQ), torch.float32, device)
    ieee1 = q1.dtype == torch.float32
    ieee2 = q2.dtype == torch.float32

    ieee = ieee1 or ieee2
    tma = tma_ok(k1) and tma_ok(k2) and (interpreting() or dims.NK >= TMA_MIN_KEYS)
    probe = fwd_candidates(dims, max(d1_pad, d2_pad), True, ieee)[0]
    n_splits = split_k if split_k is not None else auto_split_k(dims, probe[0], probe[1], n_sm(device))
    if not isinstance(n_splits, int) or isinstance(n_splits, bool) or n_splits < 1:
        raise ValueError(f"split_k must be None or a positive integer, got {split_k!r}")
    split = n_splits > 1
    candidates = fwd_candidates(dims, max(d1_pad, d2_pad), split, ieee, tma)
    part = None

    def launch(cfg):
        nonlocal part
        block_m, block_n, warps, stages, use_tma = cfg
        k1_desc = k2_desc = None
        if use_tma:
            k1_desc = TensorDescriptor(k1, list(k1.shape), list(k1.stride()), [1, 1, block_n, d1_pad])
            k2_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [1, 1, block_n, d2_pad])
        key_tiles = triton.cdiv(dims.NK, block_n)
        splits = min(n_splits, key_tiles)
        keys_per_split = triton.cdiv(key_tiles, splits) * block_n
        splits = triton.cdiv(dims.NK, keys_per_split)
        if splits > 1:
            part = fresh((5, splits, BH, dims.NQ), torch.float32, device)
        grid = (triton.cdiv(dims.NQ, block_m), BH, splits)
        _fwd._kl_fwd_kernel[grid](
            q1, k1, q2, k2, k1_desc, k2_desc, kl, lse1_bits, lse2_bits, part if splits > 1 else kl,
            *strides(q1), *strides(k1), *strides(q2), *strides(k2),
            dims.H, dims.NQ, dims.NK, dims.D1, dims.D2, dims.group1, dims.group2,
            keys_per_split, splits, dims.scale1 * LOG2E, dims.scale2 * LOG2E,
            BLOCK_M=block_m, BLOCK_N=block_n, D1_PAD=d1_pad, D2_PAD=d2_pad,
            CAUSAL=causal, SPLIT=splits > 1, IEEE1=ieee1, IEEE2=ieee2, USE_TMA=use_tma,
            NO_CONTRACT=not interpreting(),
            num_warps=warps, num_stages=stages,
        )
        if splits > 1:
            rows = BH * dims.NQ
            block = 256
            _fwd._kl_combine_kernel[(triton.cdiv(rows, block),)](
                part, kl, lse1_bits, lse2_bits, rows, splits, BLOCK=block, num_warps=4)

    key = ("fwd", dims.D1, dims.D2, q1.dtype, q2.dtype, causal, split, tma,
           bucket(dims.NQ), bucket(dims.NK), bucket(BH), n_splits)
    cfg = pick(key, candidates, launch)
    launch(cfg)
    return kl, lse1_bits, lse2_bits


def _empty_backward(dims, q1, k1, q2, k2, train1, train2):
    """Zero gradients (no visible key anywhere) or empty ones (no row, no key)."""
    def zeros(train, x):
        return torch.zeros_like(x) if train else None
    return zeros(train1, q1), zeros(train1, k1), zeros(train2, q2), zeros(train2, k2)


def backward(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, scale1, scale2,
             train1, train2, bwd_mode, deterministic):
    dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    if is_empty(dims):
        return _empty_backward(dims, q1, k1, q2, k2, train1, train2)
    out_dtypes = (q1.dtype, k1.dtype, q2.dtype, k2.dtype)
    q1, k1, q2, k2 = (compute_view(t) for t in (q1, k1, q2, k2))
    device = q1.device
    BH = dims.B * dims.H
    d1_pad, d2_pad = head_pad(dims.D1), head_pad(dims.D2)
    ieee1 = q1.dtype == torch.float32
    ieee2 = q2.dtype == torch.float32
    g = g.to(torch.float32).contiguous()
    kl, lse1_bits, lse2_bits = kl.contiguous(), lse1_bits.contiguous(), lse2_bits.contiguous()
    both = train1 and train2
    mode = check_bwd_mode(bwd_mode)
    if deterministic:
        mode = "separate"  # no atomics on dQ
    elif mode == "auto":
        mode = auto_bwd_mode(dims, n_sm(device), both)
    fused = mode == "fused"
    dummy = kl  # placeholder pointer for outputs a launch does not write

    # dK outputs: direct (one query head per key head), fp32 atomics into the key head (GQA,
    # default) or per-query-head fp32 buffers summed in a fixed order (GQA, deterministic).
    def dk_buffer(train, k, group, d):
        if not train:
            return None, False
        if group == 1:
            return fresh((dims.B, dims.H, dims.NK, d), k.dtype, device), False
        if deterministic:
            return fresh((dims.B, dims.H, dims.NK, d), torch.float32, device), False
        return torch.zeros((dims.B, k.shape[1], dims.NK, d), dtype=torch.float32, device=device), True

    def dq_buffer(train, q, d):
        if not train:
            return None
        if fused:
            return torch.zeros((dims.B, dims.H, dims.NQ, d), dtype=torch.float32, device=device)
        return fresh((dims.B, dims.H, dims.NQ, d), q.dtype, device)

    def run(cfg_dk, cfg_dq):
        dk1, dk1_atomic = dk_buffer(train1, k1, dims.group1, dims.D1)
        dk2, dk2_atomic = dk_buffer(train2, k2, dims.group2, dims.D2)
        dq1 = dq_buffer(train1, q1, dims.D1)
        dq2 = dq_buffer(train2, q2, dims.D2)
        t_dk1, t_dk2 = (dk1 if dk1 is not None else dummy), (dk2 if dk2 is not None else dummy)
        t_dq1, t_dq2 = (dq1 if dq1 is not None else dummy), (dq2 if dq2 is not None else dummy)

        def s3(t):  # strides b, h, n of a buffer (last dim contiguous)
            return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, 0, 0)

        block_m, block_n, warps, stages = cfg_dk
        _bwd._kl_bwd_dk_kernel[(triton.cdiv(dims.NK, block_n), BH)](
            q1, k1, q2, k2, lse1_bits, lse2_bits, kl, g, t_dk1, t_dk2, t_dq1, t_dq2,
            *strides(q1), *strides(k1), *strides(q2), *strides(k2),
            *s3(t_dk1), *s3(t_dk2), *s3(t_dq1), *s3(t_dq2),
            dims.H, dims.NQ, dims.NK, dims.D1, dims.D2, dims.group1, dims.group2,
            dims.scale1 * LOG2E, dims.scale2 * LOG2E, dims.scale1, dims.scale2,
            BLOCK_M=block_m, BLOCK_N=block_n, D1_PAD=d1_pad, D2_PAD=d2_pad, CAUSAL=causal,
            TRAIN1=train1, TRAIN2=train2, FUSED_DQ=fused, DK1_ATOMIC=dk1_atomic, DK2_ATOMIC=dk2_atomic,
            IEEE1=ieee1, IEEE2=ieee2, num_warps=warps, num_stages=stages,
        )
        if not fused:
            block_m, block_n, warps, stages = cfg_dq
            _bwd._kl_bwd_dq_kernel[(triton.cdiv(dims.NQ, block_m), BH)](
                q1, k1, q2, k2, lse1_bits, lse2_bits, kl, g, t_dq1, t_dq2,
                *strides(q1), *strides(k1), *strides(q2), *strides(k2),
                *s3(t_dq1), *s3(t_dq2),
                dims.H, dims.NQ, dims.NK, dims.D1, dims.D2, dims.group1, dims.group2,
                dims.scale1 * LOG2E, dims.scale2 * LOG2E, dims.scale1, dims.scale2,
                BLOCK_M=block_m, BLOCK_N=block_n, D1_PAD=d1_pad, D2_PAD=d2_pad, CAUSAL=causal,
                TRAIN1=train1, TRAIN2=train2, IEEE1=ieee1, IEEE2=ieee2,
                num_warps=warps, num_stages=stages,
            )
        return dq1, dk1, dq2, dk2

    dk_cands = bwd_candidates(max(d1_pad, d2_pad), both, "dk", ieee1 or ieee2)
    dq_cands = bwd_candidates(max(d1_pad, d2_pad), both, "dq", ieee1 or ieee2)
    base_key = (dims.D1, dims.D2, q1.dtype, q2.dtype, causal, train1, train2,
                bucket(dims.NQ), bucket(dims.NK), bucket(BH), dims.group1 > 1, dims.group2 > 1)
    cfg_dk = pick(("bwd_dk", fused) + base_key, dk_cands, lambda c: run(c, dq_cands[0]))
    cfg_dq = dq_cands[0] if fused else pick(("bwd_dq",) + base_key, dq_cands, lambda c: run(cfg_dk, c))
    dq1, dk1, dq2, dk2 = run(cfg_dk, cfg_dq)

    def finish(grad, group, dtype, n_key_heads):
        if grad is None:
            return None
        if grad.shape[1] != n_key_heads:  # per-query-head buffer: sum each group in order
            grad = grad.view(dims.B, n_key_heads, group, dims.NK, grad.shape[-1]).sum(dim=2)
        return grad.to(dtype)

    return (
        None if dq1 is None else dq1.to(out_dtypes[0]),
        finish(dk1, dims.group1, out_dtypes[1], dims.HK1),
        None if dq2 is None else dq2.to(out_dtypes[2]),
        finish(dk2, dims.group2, out_dtypes[3], dims.HK2),
    )
