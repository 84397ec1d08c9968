"""Host side of the Hopper Gluon backward (``bwd_sm90``): launch configurations
(:class:`GluonBwdConfig`), TMA descriptors, the per-call arguments and constexprs
(:func:`launch_args`, also used by the CI compile test) and the launch (:func:`gluon_backward`).
Imports Gluon unconditionally; ``bwd_dispatch`` guards the import."""
from dataclasses import dataclass, replace

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.errors import OutOfResources

from streamkl_gpu._core import forcing as _forcing
from streamkl_gpu._core import launcher as _fast_launch
from streamkl_gpu.attention.gluon.bwd_sm90 import (BLOCK_M, BLOCK_N, DQ_TMA_VARIANT, LN2, LOG2E, VARIANTS, WG_N,
                                                   _gluon_kl_bwd_kernel)

# Registers per thread as compiled: Triton launches a warp-specialised CTA as 12 warps (384
# threads: the 1-warp producer padded to a warpgroup) and refuses registers x threads > 65536,
# so at most 170 (168 in steps of 8), as the Gluon forward (tests/test_gluon_bwd_compile.py
# checks it for every compiled specialisation; 184 failed every launch on the H200).
MAX_REGS = 168


@dataclass(frozen=True)
class GluonBwdConfig:
    """One launch of the Hopper Gluon backward: a ring of ``num_stages`` query-tile slots,
    ``ds_bufs`` dS buffers in shared memory, the consumer warpgroups at ``consumer_regs``
    registers per thread (setmaxnreg), ptxas capped at ``maxnreg`` (0: no cap), and ``dq_lag``:
    each tile's dQ added one tile later (needs ``ds_bufs >= 2``)."""
    num_stages: int
    ds_bufs: int = 2
    consumer_regs: int = 240
    maxnreg: int = MAX_REGS
    dq_lag: bool = False


def kernel_config(d: int, causal: bool) -> GluonBwdConfig:
    """Launch configuration for head dim d (= D1 = D2): two ring stages (on an H100 as fast as three
    where three fit: bench/results/2026-12-06_h100_c32c559/gluon_bwd_dq.csv). Shared memory per CTA
    (16-bit inputs, 227 KB on sm_90): K1, K2 512 d bytes; each ring stage 256 d; dS 16 KB per buffer
    (two: a warpgroup may run one tile ahead of the other); the dQ staging tiles 256 d (fp32); with
    CAUSAL the finite copies 512 d, the staging tiles on the Q copies. D = 128: 193 KB, causal
    225 KB. maxnreg: ``MAX_REGS``."""
    return GluonBwdConfig(num_stages=2)


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def make_descriptor(t, rows: int):
    """4-D TMA descriptor over ``t`` ([B, H, N, D], any TMA-legal strides), block [1, 1, rows, D/2]."""
    block = [1, 1, rows, t.shape[-1] // 2]
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, _GL_DTYPES[t.dtype]))
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def launch_args(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, scale1, scale2, train, dq, dk,
                config=None, variant="kernel"):
    """(grid, positional args, constexprs, options) of one backward launch for trained side
    ``train`` (1 or 2); also used by the CI compile test. ``dq``: fp32 zeros [B, H, N_Q rounded up to
    a multiple of 64, D] (atomics, no row mask); ``dk``: [B, H, N_K, D] contiguous in the key
    dtype, or with GQA on the trained side fp32 zeros [B, H_K, N_K rounded up to 128, D]. ``config``: a
    :class:`GluonBwdConfig` (None: :func:`kernel_config`'s); ``variant``: a key of ``VARIANTS``
    (anything else than "kernel" is wrong)."""
    B, H, N_Q, D = q1.shape
    N_K = k1.shape[2]
    cfg = config if config is not None else kernel_config(D, bool(causal))
    descs = (make_descriptor(q1, BLOCK_M.value), make_descriptor(k1, WG_N.value),
             make_descriptor(q2, BLOCK_M.value), make_descriptor(k2, WG_N.value))
    coef = scale2 if train == 2 else scale1 * LN2
    group1, group2 = H // k1.shape[1], H // k2.shape[1]
    dq_arg = dq
    if VARIANTS[variant] == DQ_TMA_VARIANT:  # the fp32 buffer as rows of D, tiles [64, D/2] (a warpgroup's half)
        rows = dq.reshape(-1, D)
        block = [BLOCK_M.value, D // 2]
        dq_arg = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), block,
                                  gl.NVMMASharedLayout.get_default_for(block, gl.float32))
    args = descs + (lse1_bits, lse2_bits, kl, g, dq_arg, dk, H, N_Q, N_K, group1, group2, scale1 * LOG2E,
                    scale2 * LOG2E, coef)
    dk_atomic = (group1 if train == 1 else group2) > 1
    constexprs = dict(D=D, NUM_STAGES=cfg.num_stages, DS_BUFS=cfg.ds_bufs, TRAIN=int(train),
                      CAUSAL=bool(causal), DK_ATOMIC=dk_atomic, CONSUMER_REGS=cfg.consumer_regs,
                      VARIANT=VARIANTS[variant], DQ_LAG=bool(cfg.dq_lag))
    if constexprs["DQ_LAG"] and cfg.ds_bufs < 2:  # the lagged dQ reads tile i - 1's dS while tile i writes
        raise ValueError("DQ_LAG needs DS_BUFS >= 2")
    options = dict(num_warps=4)
    if cfg.maxnreg:
        options["maxnreg"] = cfg.maxnreg
    grid = (triton.cdiv(N_K, BLOCK_N.value), B * H)
    return grid, args, constexprs, options


# if a default config does not fit the device's shared memory (OutOfResources at the launch):
# the fields that replace its (``fallback_config``), and the (D, causal) that needed them
FALLBACK = dict(ds_bufs=1, dq_lag=False)
_FELL_BACK: set = set()


def fallback_config(d: int, causal: bool) -> GluonBwdConfig:
    """:func:`kernel_config` with ``FALLBACK``'s fields: one dS buffer, no lagged dQ."""
    return replace(kernel_config(d, causal), **FALLBACK)


def gluon_backward(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, scale1, scale2, train,
                   config=None, variant="kernel"):
    """(dq_t, dk_t) of the trained side ``train`` from the Gluon kernel, in the inputs' dtypes.

    The caller (``_gluon_bwd_dispatch.use_gluon_bwd``) has checked shapes, dtypes, strides and
    device. ``g``, ``kl``, ``lse*_bits``: contiguous fp32 [B, H, N_Q] (the forward's outputs)."""
    B, H, N_Q, D = q1.shape
    N_K = k1.shape[2]
    q_t, k_t = (q1, k1) if train == 1 else (q2, k2)
    ahead = _fast_launch.compiling_ahead()
    if ahead:  # nothing the size of the problem: a launch that only compiles
        B = H = N_Q = 1  # specialises on the buffers' alignment and the descriptors' blocks, not on sizes
        N_K = min(N_K, BLOCK_N.value)
    dq = torch.zeros((B, H, triton.cdiv(N_Q, BLOCK_M.value) * BLOCK_M.value, D), dtype=torch.float32,
                     device=q1.device)
    if k_t.shape[1] != q1.shape[1]:  # GQA: fp32 atomics into the key head, whole 128-key blocks
        dk = torch.zeros((B, k_t.shape[1], triton.cdiv(N_K, BLOCK_N.value) * BLOCK_N.value, D), dtype=torch.float32,
                         device=q1.device)
    else:
        dk = torch.empty((B, H, N_K, D), dtype=k_t.dtype, device=q1.device)
    key = (D, bool(causal))
    if config is None and key in _FELL_BACK:
        config = fallback_config(D, bool(causal))
    grid, args, constexprs, options = launch_args(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, scale1,
                                                  scale2, train, dq, dk, config, variant)
    if ahead:  # a compile-ahead thread (launch.compile_backward_ahead): compile only
        _fast_launch.kernel_call(_gluon_kl_bwd_kernel, grid)(*args, **constexprs, **options)
        return None, None
    try:
        _fast_launch.compiler_ready()
        kernel = _gluon_kl_bwd_kernel[grid](*args, **constexprs, **options)
    except OutOfResources:
        if config is not None:
            raise
        _FELL_BACK.add(key)  # nothing was launched: the same buffers serve the smaller config
        grid, args, constexprs, options = launch_args(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, scale1,
                                                      scale2, train, dq, dk, fallback_config(D, bool(causal)),
                                                      variant)
        kernel = _gluon_kl_bwd_kernel[grid](*args, **constexprs, **options)
    _forcing.record("attention_bwd_sm90", kernel, **constexprs)  # for an open forcing block
    if k_t.shape[1] != H:
        dk = dk[:, :, :N_K].to(k_t.dtype, memory_format=torch.contiguous_format)
    return dq[:, :, :N_Q].to(q_t.dtype, memory_format=torch.contiguous_format), dk
