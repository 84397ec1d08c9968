"""``attention_kl_varlen``: packed variable-length sequences (``cu_seqlens``), host side.

Conventions (docs/math.md, "Packed sequences"): ``q_t [total_q, H, D_t]``, ``k_t [total_k, H_Kt, D_t]``
(any strides), int32 ``cu_seqlens_q/k [batch + 1]`` on the inputs' device. Sequence ``i`` attends
only within itself, bottom-right causal per sequence; zero-length sequences are allowed; a
sequence with queries but no keys gives KL 0 and zero gradients. Returns float32
``[total_q, H]``.

The kernels are those of ``attention_kl`` with ``VARLEN=True`` (FlashAttention's varlen
scheduling): the grid covers ``cdiv(max_seqlen, BLOCK)`` tiles times ``batch * H``, each program
reads its sequence's bounds from ``cu_seqlens`` and exits at once past the sequence's end, so no
padding work is done. The packed tensors go to the kernels as ``[1, H, total, D]`` views; the
per-row buffers (KL, LSEs, upstream gradient, split-K partial states) are ``[total_q, H]``.

Two custom ops (``streamkl::kl_varlen_fwd``, ``streamkl::kl_varlen_bwd``) with fake
implementations and an autograd formula: traceable by ``torch.compile(fullgraph=True)`` when
``check_seqlens=False`` (the value checks need one device-to-host copy, which a graph cannot hold).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from streamkl_ref._varlen import check_seqlens_values, check_varlen, padded_view

from streamkl_gpu._core import custom_ops as _custom_ops
from streamkl_gpu._core import forcing as _forcing
from streamkl_gpu.attention.triton import bwd as _bwd
from streamkl_gpu.attention.triton import fwd as _fwd
from streamkl_gpu.attention.launch import triton_fwd_order
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core.checks import (
    check_bwd_mode,
    check_causal,
    check_flag,
    check_split_k,
    check_tensors,
    compute_view,
    head_pad,
    scale_value,
    strides,
)
from streamkl_gpu._core.runtime import LOG2E, TensorDescriptor, fresh, interpreting, n_sm, tma_ok
from streamkl_gpu._core.tuning import bucket, pick
from streamkl_gpu._core.launcher import compile_first_call, kernel_call
from streamkl_gpu.attention.configs import (TMA_MIN_KEYS, TUNING_WORK_LIMIT, FwdConfig, auto_bwd_mode, auto_split_k,
                                            fused_fits, fwd_candidates, varlen_bwd_candidates)

__all__ = ["attention_kl_varlen"]


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------

def _check_varlen(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  scale1, scale2, check_seqlens):
    """Shapes, dtypes and devices always (no device sync); with ``check_seqlens`` also the values
    of ``cu_seqlens`` (one small device-to-host copy). Returns ``(dims, batch, max_q, max_k)``
    with ``dims`` of the ``[1, H, total, D]`` views."""
    for name, t in (("q1", q1), ("k1", k1), ("q2", q2), ("k2", k2),
                    ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    scale1, scale2 = scale_value(scale1, "scale1"), scale_value(scale2, "scale2")
    # the packing's shape rules (3-D tensors, cu_seqlens 1-D of one length, max_seqlen_*), then
    # dtypes, devices and head dims as attention_kl checks them, on the [1, H, total, D] views
    _, batch, max_q, max_k = check_varlen(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, scale1=scale1, scale2=scale2)
    dims = check_tensors(*(padded_view(t) for t in (q1, k1, q2, k2)), scale1, scale2)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise ValueError(f"{name} must have dtype torch.int32, got {cu.dtype}")
        if cu.device != q1.device:
            raise ValueError(f"{name} is on {cu.device}, but the inputs are on {q1.device}: "
                             "cu_seqlens must be on the inputs' device")
    if check_seqlens:
        both = torch.stack((cu_seqlens_q, cu_seqlens_k)).cpu().numpy()  # the one device-to-host copy
        check_seqlens_values(both[0], both[1], dims.NQ, dims.NK, max_q, max_k)
    return dims, batch, max_q, max_k


def _timeable(dims, max_k):
    """May the tuner (``STREAMKL_AUTOTUNE=1``) time a packed batch's candidates on the batch
    itself? Only below TUNING_WORK_LIMIT (bounding each row's keys by the longest sequence's);
    past it the first candidate runs untimed: a packed batch has no bounded slice yet, and timing
    the whole of one past 2^31 elements ran every candidate twice at full size."""
    return dims.H * dims.NQ * max_k * (dims.D1 + dims.D2) <= TUNING_WORK_LIMIT


def _schedule_dims(dims, batch, max_q, max_k):
    """The padded problem the varlen grid covers (batch x max_seqlen): for the launch rules."""
    return dataclasses.replace(dims, B=batch, NQ=max_q, NK=max_k)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

def _forward(q1, k1, q2, k2, cu_q, cu_k, max_q, max_k, causal, scale1, scale2, split_k):
    dims, batch, max_q, max_k = _check_varlen(q1, k1, q2, k2, cu_q, cu_k, max_q, max_k,
                                              scale1, scale2, check_seqlens=False)
    device = q1.device
    total_q, H = dims.NQ, dims.H
    kl = fresh((total_q, H), torch.float32, device)
    lse1_bits = fresh((total_q, H), torch.float32, device)
    lse2_bits = fresh((total_q, H), torch.float32, device)
    if total_q == 0 or H == 0 or batch == 0 or max_q == 0:
        return kl, lse1_bits, lse2_bits
    sched = _schedule_dims(dims, batch, max_q, max_k)
    q1, k1, q2, k2 = (compute_view(padded_view(t)) for t in (q1, k1, q2, k2))
    d1_pad, d2_pad = head_pad(dims.D1), head_pad(dims.D2)
    ieee1 = q1.dtype == torch.float32
    ieee2 = q2.dtype == torch.float32
    ieee = ieee1 or ieee2
    probe = fwd_candidates(sched, max(d1_pad, d2_pad), True, ieee)[0]
    n_splits = split_k if split_k is not None else auto_split_k(sched, probe.block_m, probe.block_n, n_sm(device))
    split = n_splits > 1
    # TMA: descriptors over the [1, H_K, total_k, D] views (a tile reaching into the next
    # sequence is masked in the kernel like keys past N_K)
    tma = dims.NK > 0 and tma_ok(k1) and tma_ok(k2) and (interpreting() or max_k >= TMA_MIN_KEYS)
    candidates = fwd_candidates(sched, max(d1_pad, d2_pad), split, ieee, tma, causal=causal, packed=True)
    heavy = causal and triton_fwd_order() == "heavy"  # each sequence's last query tiles first

    def launch(cfg):
        block_m, block_n, warps, stages, use_tma = cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.use_tma
        k1_desc = k2_desc = None
        if use_tma:
            k1_desc = TensorDescriptor(k1, list(k1.shape), list(k1.stride()), [1, 1, block_n, d1_pad])
            k2_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [1, 1, block_n, d2_pad])
        key_tiles = max(1, _runtime.cdiv(max_k, block_n))
        splits = min(n_splits, key_tiles)
        keys_per_split = _runtime.cdiv(key_tiles, splits) * block_n
        splits = max(1, _runtime.cdiv(max_k, keys_per_split))
        part = fresh((5, splits, total_q * H), torch.float32, device) if splits > 1 else kl
        grid = (_runtime.cdiv(max_q, block_m), batch * H, splits)
        kernel_call(_fwd._kl_fwd_kernel, grid)(
            q1, k1, q2, k2, k1_desc, k2_desc, kl, lse1_bits, lse2_bits, part,
            *strides(q1), *strides(k1), *strides(q2), *strides(k2),
            H, total_q, dims.NK, dims.D1, dims.D2, dims.group1, dims.group2,
            keys_per_split, splits, dims.scale1 * LOG2E, dims.scale2 * LOG2E,
            BLOCK_M=block_m, BLOCK_N=block_n, D1_PAD=d1_pad, D2_PAD=d2_pad,
            CAUSAL=causal, SPLIT=splits > 1, IEEE1=ieee1, IEEE2=ieee2, USE_TMA=use_tma,
            NO_CONTRACT=not interpreting(), CU_SEQLENS_Q=cu_q, CU_SEQLENS_K=cu_k, VARLEN=True,
            HEAVY_FIRST=heavy and splits == 1, num_warps=warps, num_stages=stages,
        )
        if splits > 1:
            rows = total_q * H
            block = 256
            kernel_call(_fwd._kl_combine_kernel, (_runtime.cdiv(rows, block),))(
                part, kl, lse1_bits, lse2_bits, rows, splits, BLOCK=block, num_warps=4)

    key = ("varlen_fwd", dims.D1, dims.D2, q1.dtype, q2.dtype, causal, split, tma,
           bucket(max_q), bucket(max_k), bucket(total_q), bucket(batch * H), n_splits)
    # the packed shape rule's tile untimed by default (configs.SHAPE_RULES, "packed causal" / "packed full");
    # STREAMKL_AUTOTUNE=1 times the candidates where the batch is under the work limit
    cfg = _forcing.forced("attention_varlen_fwd_config")
    if cfg is None:
        cfg = pick(key, candidates, launch, device=device) if _timeable(dims, max_k) else candidates[0]
    elif not isinstance(cfg, FwdConfig):
        raise ValueError(f"attention_varlen_fwd_config must be a FwdConfig, got {cfg!r}")
    launch(cfg)
    return kl, lse1_bits, lse2_bits


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

def _backward(g, q1, k1, q2, k2, cu_q, cu_k, max_q, max_k, kl, lse1_bits, lse2_bits, causal,
              scale1, scale2, train1, train2, bwd_mode, deterministic):
    dims, batch, max_q, max_k = _check_varlen(q1, k1, q2, k2, cu_q, cu_k, max_q, max_k,
                                              scale1, scale2, check_seqlens=False)
    out_dtypes = (q1.dtype, k1.dtype, q2.dtype, k2.dtype)
    device = q1.device
    total_q, total_k, H = dims.NQ, dims.NK, dims.H
    both = train1 and train2
    mode = check_bwd_mode(bwd_mode)
    if deterministic:
        mode = "separate"  # no atomics on dQ
    elif mode == "auto":
        mode = auto_bwd_mode(_schedule_dims(dims, batch, max_q, max_k), n_sm(device), both)
    d1_pad, d2_pad = head_pad(dims.D1), head_pad(dims.D2)
    if not fused_fits(max(d1_pad, d2_pad)):
        mode = "separate"  # the fused tiles outgrow the shared memory above D = 128 (configs)
    fused = mode == "fused"
    work = total_q > 0 and total_k > 0 and H > 0 and batch > 0 and max_q > 0 and max_k > 0

    # dK: direct (one query head per key head), fp32 atomics into the key head (GQA), or
    # per-query-head fp32 buffers summed in a fixed order (GQA, deterministic). Keys no launch
    # reaches (no work at all) are zero: torch.zeros then.
    def dk_buffer(train, k, group, d):
        if not train:
            return None, False
        alloc = fresh if work else (lambda shape, dtype, dev: torch.zeros(shape, dtype=dtype, device=dev))
        if group == 1:
            return alloc((total_k, H, d), k.dtype, device), False
        if deterministic:
            return alloc((total_k, H, d), torch.float32, device), False
        return torch.zeros((total_k, k.shape[1], d), dtype=torch.float32, device=device), True

    def dq_buffer(train, q, d):
        if not train:
            return None
        if fused or not work:
            return torch.zeros((total_q, H, d), dtype=torch.float32 if fused else q.dtype, device=device)
        return fresh((total_q, H, d), q.dtype, device)

    views = [compute_view(padded_view(t)) for t in (q1, k1, q2, k2)]
    ieee1 = views[0].dtype == torch.float32
    ieee2 = views[2].dtype == torch.float32
    g = g.to(torch.float32).contiguous()
    kl, lse1_bits, lse2_bits = kl.contiguous(), lse1_bits.contiguous(), lse2_bits.contiguous()
    dummy = kl  # placeholder pointer for outputs a launch does not write

    def variant_flags(cfg, kind):  # the parts of a variant packed sequences take (no TMA, rows or reduce)
        parts = cfg.variant.split("+")
        if kind == "dk":
            return dict(TRANS="trans" in parts, FOLD="fold" in parts)
        return dict(FOLD="fold" in parts, HEAVY_FIRST=causal and "heavy" in parts)

    def run(cfg_dk, cfg_dq):
        dk1, dk1_atomic = dk_buffer(train1, k1, dims.group1, dims.D1)
        dk2, dk2_atomic = dk_buffer(train2, k2, dims.group2, dims.D2)
        dq1 = dq_buffer(train1, q1, dims.D1)
        dq2 = dq_buffer(train2, q2, dims.D2)
        if not work:
            return dq1, dk1, dq2, dk2
        bufs = [padded_view(t) if t is not None else dummy for t in (dk1, dk2, dq1, dq2)]

        def s3(t):  # strides b, h, n of a buffer (last dim contiguous)
            return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, 0, 0)

        common = dict(D1_PAD=d1_pad, D2_PAD=d2_pad, CAUSAL=causal, TRAIN1=train1, TRAIN2=train2,
                      IEEE1=ieee1, IEEE2=ieee2, CU_SEQLENS_Q=cu_q, CU_SEQLENS_K=cu_k, VARLEN=True)
        scalars = (H, total_q, total_k, dims.D1, dims.D2, dims.group1, dims.group2,
                   dims.scale1 * LOG2E, dims.scale2 * LOG2E, dims.scale1, dims.scale2)
        in_strides = [s for v in views for s in strides(v)]
        block_m, block_n, warps, stages = cfg_dk.block_m, cfg_dk.block_n, cfg_dk.num_warps, cfg_dk.num_stages
        kernel_call(_bwd._kl_bwd_dk_kernel, (_runtime.cdiv(max_k, block_n), batch * H))(
            *views, lse1_bits, lse2_bits, kl, g, *bufs, *in_strides,
            *(s for b in bufs for s in s3(b)), *scalars,
            BLOCK_M=block_m, BLOCK_N=block_n, FUSED_DQ=fused,
            DK1_ATOMIC=dk1_atomic, DK2_ATOMIC=dk2_atomic, num_warps=warps, num_stages=stages,
            **variant_flags(cfg_dk, "dk"), **common,
        )
        if not fused:
            block_m, block_n, warps, stages = cfg_dq.block_m, cfg_dq.block_n, cfg_dq.num_warps, cfg_dq.num_stages
            kernel_call(_bwd._kl_bwd_dq_kernel, (_runtime.cdiv(max_q, block_m), batch * H))(
                *views, lse1_bits, lse2_bits, kl, g, bufs[2], bufs[3], *in_strides,
                *s3(bufs[2]), *s3(bufs[3]), *scalars,
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                **variant_flags(cfg_dq, "dq"), **common,
            )
        return dq1, dk1, dq2, dk2

    d_pad = max(d1_pad, d2_pad)
    dk_cands = varlen_bwd_candidates(d_pad, both, "dk", ieee1 or ieee2, fused, causal)
    dq_cands = varlen_bwd_candidates(d_pad, both, "dq", ieee1 or ieee2, fused, causal)
    base_key = ("varlen", dims.D1, dims.D2, views[0].dtype, views[2].dtype, causal, train1, train2,
                bucket(max_q), bucket(max_k), bucket(total_q), bucket(batch * H),
                dims.group1 > 1, dims.group2 > 1)
    # the first candidates untimed by default (STREAMKL_AUTOTUNE=1 times them): the tuner timed them fastest at
    # every 24K-token point (an H100, bench/results/2026-12-07_h100_4e686a7/tuning_log_24k.csv)
    if work and _timeable(dims, max_k):
        cfg_dk = pick(("bwd_dk", fused) + base_key, dk_cands, lambda c: run(c, dq_cands[0]), device=device)
        cfg_dq = dq_cands[0] if fused else pick(("bwd_dq",) + base_key, dq_cands, lambda c: run(cfg_dk, c),
                                                device=device)
    else:
        cfg_dk, cfg_dq = dk_cands[0], dq_cands[0]
    dq1, dk1, dq2, dk2 = run(cfg_dk, cfg_dq)

    def finish(grad, group, dtype, n_key_heads):
        if grad is None:
            return None
        if grad.shape[1] != n_key_heads:  # per-query-head buffer: sum each group in order
            grad = grad.view(total_k, n_key_heads, group, grad.shape[-1]).sum(dim=2)
        return grad.to(dtype)

    return (
        None if dq1 is None else dq1.to(out_dtypes[0]),
        finish(dk1, dims.group1, out_dtypes[1], dims.HK1),
        None if dq2 is None else dq2.to(out_dtypes[2]),
        finish(dk2, dims.group2, out_dtypes[3], dims.HK2),
    )


# ----------------------------------------------------------------------------------------------
# torch.library custom ops + autograd
# ----------------------------------------------------------------------------------------------

@_custom_ops.custom_op("streamkl::kl_varlen_fwd", mutates_args=())
def _kl_varlen_fwd_op(q1: torch.Tensor, k1: torch.Tensor, q2: torch.Tensor, k2: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale1: float, scale2: float,
                      split_k: int, bwd_mode: str, deterministic: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                    scale1, scale2, None if split_k == 0 else split_k)


@_kl_varlen_fwd_op.register_fake
def _kl_varlen_fwd_fake(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        causal, scale1, scale2, split_k, bwd_mode, deterministic):
    shape = (q1.shape[0], q1.shape[1])
    return tuple(q1.new_empty(shape, dtype=torch.float32) for _ in range(3))


@_custom_ops.custom_op("streamkl::kl_varlen_bwd", mutates_args=())
def _kl_varlen_bwd_op(g: torch.Tensor, q1: torch.Tensor, k1: torch.Tensor, q2: torch.Tensor,
                      k2: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, kl: torch.Tensor, lse1_bits: torch.Tensor,
                      lse2_bits: torch.Tensor, causal: bool, scale1: float, scale2: float,
                      train1: bool, train2: bool, bwd_mode: str, deterministic: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _backward(g, q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      kl, lse1_bits, lse2_bits, causal, scale1, scale2, train1, train2, bwd_mode,
                      deterministic)
    # a custom op returns tensors only: gradients not asked for come back as empty tensors
    return tuple(t if t is not None else x.new_empty(0) for t, x in zip(grads, (q1, k1, q2, k2)))


@_kl_varlen_bwd_op.register_fake
def _kl_varlen_bwd_fake(g, q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        kl, lse1_bits, lse2_bits, causal, scale1, scale2, train1, train2, bwd_mode,
                        deterministic):
    wanted = (train1, train1, train2, train2)
    return tuple(torch.empty_like(x) if w else x.new_empty(0) for w, x in zip(wanted, (q1, k1, q2, k2)))


N_FWD_ARGS = 14


def _setup_context(ctx, inputs, output):
    (q1, k1, q2, k2, cu_q, cu_k, max_q, max_k, causal, scale1, scale2, _split_k, bwd_mode,
     deterministic) = inputs
    kl, lse1_bits, lse2_bits = output
    ctx.save_for_backward(q1, k1, q2, k2, cu_q, cu_k, kl, lse1_bits, lse2_bits)
    ctx.args = (max_q, max_k, causal, scale1, scale2, bwd_mode, deterministic)


def _kl_varlen_backward(ctx, g_kl, g_lse1, g_lse2):
    q1, k1, q2, k2, cu_q, cu_k, kl, lse1_bits, lse2_bits = ctx.saved_tensors
    max_q, max_k, causal, scale1, scale2, bwd_mode, deterministic = ctx.args
    need = ctx.needs_input_grad
    train1 = bool(need[0] or need[1])
    train2 = bool(need[2] or need[3])
    if not (train1 or train2):
        return (None,) * N_FWD_ARGS
    # the LSE outputs are internal (saved for backward); attention_kl_varlen never hands them out
    dq1, dk1, dq2, dk2 = _custom_ops.call(_kl_varlen_bwd_op, g_kl, q1, k1, q2, k2, cu_q, cu_k, max_q, max_k,
                                          kl, lse1_bits, lse2_bits, causal, scale1, scale2, train1, train2,
                                          bwd_mode, deterministic)
    return (dq1 if need[0] else None, dk1 if need[1] else None,
            dq2 if need[2] else None, dk2 if need[3] else None) + (None,) * (N_FWD_ARGS - 4)


_custom_ops.register_autograd(_kl_varlen_fwd_op, _kl_varlen_backward, _setup_context)


def _call(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale1,
          scale2, split_k, bwd_mode, deterministic, check_seqlens):
    """Check the arguments, then run the custom op: (kl in nats, lse1, lse2 in bits), [total_q, H]."""
    causal = check_causal(causal)
    dims, _, max_q, max_k = _check_varlen(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, scale1, scale2,
                                          check_flag(check_seqlens, "check_seqlens"))
    check_bwd_mode(bwd_mode)
    check_split_k(split_k)
    deterministic = check_flag(deterministic, "deterministic")
    return _custom_ops.call(_kl_varlen_fwd_op, q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal,
                            dims.scale1, dims.scale2, 0 if split_k is None else split_k, bwd_mode, deterministic)


def attention_kl_varlen(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                        causal=False, scale1=None, scale2=None, split_k: Optional[int] = None,
                        bwd_mode="auto", deterministic=False, check_seqlens=True):
    """Row-wise ``KL(P1 || P2)`` of packed variable-length sequences (FlashAttention's varlen layout).

    Args:
        q1, k1: side 1, ``[total_q, H, D1]`` and ``[total_k, H_K1, D1]``.
        q2, k2: side 2, ``[total_q, H, D2]`` and ``[total_k, H_K2, D2]``. Any strides; dtypes,
            head dims and GQA as :func:`attention_kl`.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` on the inputs' device: 0,
            non-decreasing, ending at ``total_q`` / ``total_k``. Sequence ``i`` is rows
            ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and keys ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``;
            it attends only within itself. Zero-length sequences are allowed; a sequence with
            queries but no keys gives KL 0 and zero gradients.
        max_seqlen_q, max_seqlen_k: Python ints, the longest sequence (the grid covers it).
        causal: bottom-right aligned within each sequence (``j <= i + (n_k - n_q)``).
        scale1, scale2, split_k, bwd_mode, deterministic: as :func:`attention_kl`.
        check_seqlens: check the values of ``cu_seqlens`` (start 0, non-decreasing, last =
            total, no sequence longer than ``max_seqlen_*``) with one small device-to-host copy.
            ``False`` skips it (no sync; needed inside ``torch.compile(fullgraph=True)``); a bad
            ``cu_seqlens`` then gives wrong numbers, but never an out-of-bounds access.

    Returns:
        float32 ``[total_q, H]``: KL in nats per packed query row; differentiable as
        :func:`attention_kl`.

    Raises:
        ValueError: naming the argument: shapes, dtypes (``cu_seqlens`` must be int32), devices,
        ``cu_seqlens`` not 1-D or of different lengths; with ``check_seqlens`` also bad values.
    """
    args = (q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
            scale1, scale2, split_k, bwd_mode, deterministic, check_seqlens)
    # a new signature: the forward's and the backward's kernels compile at once before it runs
    # (_core/launcher.compile_first_call; the sequence lengths by their power-of-two buckets)
    signature_args = (*args[:6], *(bucket(n) if isinstance(n, int) else n for n in args[6:8]), *args[8:])
    compile_first_call("attention_kl_varlen", signature_args, lambda: _call(*args), getattr(q1, "device", None))
    return _call(*args)[0]
