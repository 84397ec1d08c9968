"""``attention_kl``: the PyTorch entry point to the streaming KL kernels.

Conventions (../shared/design/MATH.md): ``q1 [B,H,N_Q,D1]``, ``k1 [B,H_K1,N_K,D1]``,
``q2 [B,H,N_Q,D2]``, ``k2 [B,H_K2,N_K,D2]``; GQA per side; ``D1 != D2`` allowed; bottom-right
causal; rows with no visible key give KL 0 and zero gradient. Returns float32 ``[B,H,N_Q]``
KL(P1 || P2) in nats per query row.

Two custom ops (``streamkl::kl_fwd``, ``streamkl::kl_bwd``) with fake implementations and an
autograd formula make the function traceable by ``torch.compile`` without graph breaks.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton

try:  # host-side TMA descriptors (triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

from streamkl_ref._checks import check_inputs

from . import _bwd, _fwd, _gluon_dispatch

__all__ = ["attention_kl", "attention_kl_with_lse", "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634  # the scale fold: scores in bits = sigma * log2(e) * q.k
LN2 = 0.6931471805599453

# Tests set this to True: every buffer the kernels must fully write starts as NaN, so an
# unwritten element cannot pass (flash-linear-attention's fixture pattern).
POISON_FRESH = False


def _fresh(shape, dtype, device):
    if POISON_FRESH:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def interpreting() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    return not hasattr(_fwd._kl_fwd_kernel, "run") or type(_fwd._kl_fwd_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------

def _check_tensors(q1, k1, q2, k2, scale1, scale2):
    for name, t in (("q1", q1), ("k1", k1), ("q2", q2), ("k2", k2)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    devices = {t.device for t in (q1, k1, q2, k2)}
    if len(devices) != 1:
        raise ValueError(
            "q1, k1, q2, k2 must be on one device, got "
            + ", ".join(f"{n}: {t.device}" for n, t in (("q1", q1), ("k1", k1), ("q2", q2), ("k2", k2)))
        )
    device = q1.device
    if device.type == "cpu" and not interpreting():
        raise ValueError(
            "the inputs are CPU tensors, but the Triton kernels need a GPU. To run them on CPU "
            "(slowly, for testing), set the environment variable TRITON_INTERPRET=1 before "
            "importing streamkl_gpu."
        )
    for side, (qn, kn, q, k) in enumerate((("q1", "k1", q1, k1), ("q2", "k2", q2, k2)), start=1):
        if q.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{qn} has dtype {q.dtype}; supported: float16, bfloat16, float32")
        if k.dtype != q.dtype:
            raise ValueError(f"{kn} has dtype {k.dtype} but {qn} has {q.dtype}: q and k of side {side} must match")
    for name, d in (("q1", dims.D1), ("q2", dims.D2)):
        if d > MAX_HEAD_DIM:
            raise ValueError(f"{name} has head dim {d}; the kernels support head dims up to {MAX_HEAD_DIM}")
    if dims.NQ == 0 or dims.NK == 0 or dims.B == 0 or dims.H == 0:
        raise ValueError(f"empty problem: B={dims.B}, H={dims.H}, N_Q={dims.NQ}, N_K={dims.NK}")
    return dims


def _head_pad(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _strides(t):
    return tuple(t.stride())


def _compute_view(t):
    # The interpreter multiplies bf16 bit patterns in tl.dot; bf16 -> fp32 is exact, so compute in fp32 there.
    if t.dtype == torch.bfloat16 and interpreting():
        return t.float()
    return t


# ----------------------------------------------------------------------------------------------
# Launch configurations: a few candidates per shape class, timed once per key on the GPU
# (a small hand-rolled autotuner: triton.autotune cannot run in the interpreter, and pruning by
# shape keeps the tuning cost to a handful of compiles). STREAMKL_AUTOTUNE=0 takes the first.
# ----------------------------------------------------------------------------------------------

_TUNED: dict = {}
INTERPRETER_BLOCK = (16, 16)  # one fixed config under the interpreter (tests may override)
INTERPRETER_TMA = False  # forward keys through TMA descriptors under the interpreter (tests set it)
# Below this many keys the forward is launch-bound and the TMA path measured slower (H200, 1K
# tokens: 0.21 ms vs 0.11 with pointer loads; 2K: 0.21 vs 0.24, TMA ahead from there on;
# bench/results/h200_2026-11-29_tma_bench.csv vs session1/h200_2026-11-29_bench.csv). Presumably the
# per-launch cost of encoding two host descriptors; not profiled.
TMA_MIN_KEYS = 2048


def _n_sm(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _pick(key, candidates, launch):
    """Return the fastest of ``candidates`` for ``key`` (measured once), launching nothing else."""
    if len(candidates) == 1 or interpreting() or os.environ.get("STREAMKL_AUTOTUNE", "1") == "0":
        return candidates[0]
    if key not in _TUNED:
        from triton.testing import do_bench

        best, best_t = None, float("inf")
        for cfg in candidates:
            try:
                t = do_bench(lambda: launch(cfg), warmup=5, rep=20, return_mode="median")
            except Exception as exc:  # out of shared memory / registers: not a usable config
                if "OutOfResources" not in type(exc).__name__ and "out of resource" not in str(exc).lower():
                    raise
                continue
            if t < best_t:
                best, best_t = cfg, t
        if best is None:
            raise RuntimeError(f"no launch configuration fits for {key}")
        _TUNED[key] = best
    return _TUNED[key]


# fp32 inputs promise fp32 accuracy: their dots run in IEEE fp32 on the FMA units (no tensor
# cores); large tiles then unroll into huge code that takes minutes to compile, so small tiles.
_IEEE_CONFIG = (32, 32, 4, 2)


def _tma_ok(t) -> bool:
    """Can ``t`` ([B, H, N, D]) be read through a TMA tensor descriptor? Hopper or newer (or the
    interpreter, when tests ask for it), unit stride in D, 16-byte aligned base and strides."""
    if TensorDescriptor is None:
        return False
    if interpreting():
        if not INTERPRETER_TMA:
            return False
    elif t.device.type != "cuda" or torch.cuda.get_device_capability(t.device)[0] < 9:
        return False
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st > 0 and (st * size) % 16 == 0 for st in t.stride()[:-1]))


def _fwd_candidates(dims, d_pad, split, ieee=False, tma=False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, use_tma) candidates, pruned by shape.

    ``tma``: the key tensors can be read through TMA descriptors (Hopper, aligned strides). At
    D = 128 the best TMA config beat the best pointer config in every measured case (H200, 8K/16K,
    causal or not: bench/results/h200_2026-11-29_fwd_tma_configs.csv), so pointer configs are not
    tried there; at other head dims both kinds are candidates (not measured at scale).
    """
    if interpreting():
        return [INTERPRETER_BLOCK + (1, 1, tma)]
    if ieee:
        return [(16, 32, 4, 2, False) if split else _IEEE_CONFIG + (False,)]
    if split:
        bm = 16 if dims.NQ <= 16 else (32 if dims.NQ <= 32 else 64)
        cands = [(bm, 128, 4, 3), (bm, 64, 4, 3)] if d_pad <= 128 else [(bm, 64, 4, 2), (bm, 32, 4, 2)]
        return [c + (False,) for c in cands]
    tma_only = False
    if d_pad <= 64:
        cands = [(128, 64, 4, 3), (128, 128, 8, 3)]
        tma_cands = [(128, 64, 4, 3), (128, 128, 8, 2)]
    elif d_pad <= 128:
        cands = [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2)]
        # measured best: 128/32/8/3 (8K, 16K non-causal), 128/64/8/3 (16K causal), 64/64/4/2 (8K causal)
        tma_cands = [(128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2)]
        tma_only = True
    else:
        cands = [(64, 64, 4, 2), (64, 32, 4, 2)]
        tma_cands = [(64, 64, 4, 2), (64, 32, 4, 3)]
    if not tma:
        return [c + (False,) for c in cands]
    return [c + (True,) for c in tma_cands] + ([] if tma_only else [c + (False,) for c in cands])


def _bwd_candidates(d_pad, both, kind, ieee=False):
    if interpreting():
        return [INTERPRETER_BLOCK + (1, 1)]
    if ieee:
        return [_IEEE_CONFIG]
    if kind == "dq":
        if d_pad <= 128 and not both:
            return [(128, 64, 8, 2), (64, 64, 4, 2)]
        return [(64, 64, 8, 2), (64, 32, 4, 2)]
    # dk (BLOCK_M = query tile, BLOCK_N = key tile held in registers)
    if d_pad <= 128 and not both:
        return [(64, 128, 8, 2), (32, 128, 8, 3)]
    return [(64, 64, 8, 2), (32, 64, 4, 2)]


def auto_split_k(dims, block_m: int, block_n: int, n_sm: int) -> int:
    """Split the keys across programs when the query blocks alone cannot fill the GPU.

    Rule: with ``P = ceil(N_Q / BLOCK_M) * B * H`` query-block programs, split only when
    ``P < n_sm``; then aim at about ``4 * n_sm`` programs in all, keeping at least 4 key tiles
    per split (below that the merge traffic outweighs the parallelism).
    """
    programs = triton.cdiv(dims.NQ, block_m) * dims.B * dims.H
    if programs >= n_sm:
        return 1
    key_tiles = triton.cdiv(dims.NK, block_n)
    return max(1, min(triton.cdiv(4 * n_sm, programs), key_tiles // 4))


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

def _forward(q1, k1, q2, k2, causal, scale1, scale2, split_k):
    dims = _check_tensors(q1, k1, q2, k2, scale1, scale2)
    q1, k1, q2, k2 = (_compute_view(t) for t in (q1, k1, q2, k2))
    device = q1.device
    BH = dims.B * dims.H
    d1_pad, d2_pad = _head_pad(dims.D1), _head_pad(dims.D2)
    kl = _fresh((dims.B, dims.H, dims.NQ), torch.float32, device)
    lse1_bits = _fresh((dims.B, dims.H, dims.NQ), torch.float32, device)
    lse2_bits = _fresh((dims.B, dims.H, dims.NQ), torch.float32, device)
    ieee1 = q1.dtype == torch.float32
    ieee2 = q2.dtype == torch.float32

    ieee = ieee1 or ieee2
    tma = _tma_ok(k1) and _tma_ok(k2) and (interpreting() or dims.NK >= TMA_MIN_KEYS)
    probe = _fwd_candidates(dims, max(d1_pad, d2_pad), True, ieee)[0]
    n_splits = split_k if split_k is not None else auto_split_k(dims, probe[0], probe[1], _n_sm(device))
    if not isinstance(n_splits, int) or isinstance(n_splits, bool) or n_splits < 1:
        raise ValueError(f"split_k must be None or a positive integer, got {split_k!r}")
    split = n_splits > 1
    inputs = (q1, k1, q2, k2)
    if _gluon_dispatch.use_gluon(dims, tuple(t.dtype for t in inputs), tuple(_strides(t) for t in inputs),
                                 _gluon_dispatch.device_capability(device), split,
                                 tuple(t.data_ptr() for t in inputs), split_explicit=split_k is not None):
        return _gluon_dispatch.gluon_forward(q1, k1, q2, k2, causal, dims.scale1, dims.scale2,
                                             out=(kl, lse1_bits, lse2_bits))
    candidates = _fwd_candidates(dims, max(d1_pad, d2_pad), split, ieee, tma)
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
            part = _fresh((5, splits, BH, dims.NQ), torch.float32, device)
        grid = (triton.cdiv(dims.NQ, block_m), BH, splits)
        _fwd._kl_fwd_kernel[grid](
            q1, k1, q2, k2, k1_desc, k2_desc, kl, lse1_bits, lse2_bits, part if splits > 1 else kl,
            *_strides(q1), *_strides(k1), *_strides(q2), *_strides(k2),
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
           _bucket(dims.NQ), _bucket(dims.NK), _bucket(BH), n_splits)
    cfg = _pick(key, candidates, launch)
    launch(cfg)
    return kl, lse1_bits, lse2_bits


def _bucket(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

def auto_bwd_mode(dims, n_sm: int, both: bool = False) -> str:
    """Pick the fused kernel (each tile pair visited once, dQ by fp32 atomics) or the separate ones.

    Measured on the H200 (bench/results/session1/h200_2026-11-29_bench.csv; B=1, H=32, D=128, bf16):
    - one setting (s1 or s2): fused is as fast or faster at N = 4K..32K, causal or not
      (s1, 8K non-causal: 12.84 ms fused vs 13.72 separate), and at N_Q = 16..512 with N_K = 32K;
    - both settings: fused wins at small N_Q (N_K = 32K, N_Q = 16: 1.53 vs 1.79 ms; N_Q = 256:
      2.83 vs 2.92), separate from N_Q = 512 on (N_Q = 512: 4.46 vs 5.24; N = 8K: 16.7 vs 20.5).
    Not measured, reasoned: with fewer key-tile programs than SMs the fused kernel has too
    little parallelism (each program walks every query tile), so the separate kernels run then.
    """
    key_programs = triton.cdiv(dims.NK, 64) * dims.B * dims.H
    if key_programs < n_sm:
        return "separate"
    if both and dims.NQ >= 512:
        return "separate"
    return "fused"


def _backward(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, scale1, scale2,
              train1, train2, bwd_mode, deterministic):
    dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    out_dtypes = (q1.dtype, k1.dtype, q2.dtype, k2.dtype)
    q1, k1, q2, k2 = (_compute_view(t) for t in (q1, k1, q2, k2))
    device = q1.device
    BH = dims.B * dims.H
    d1_pad, d2_pad = _head_pad(dims.D1), _head_pad(dims.D2)
    ieee1 = q1.dtype == torch.float32
    ieee2 = q2.dtype == torch.float32
    g = g.to(torch.float32).contiguous()
    kl, lse1_bits, lse2_bits = kl.contiguous(), lse1_bits.contiguous(), lse2_bits.contiguous()
    both = train1 and train2
    if bwd_mode not in ("auto", "fused", "separate"):
        raise ValueError(f"bwd_mode must be 'auto', 'fused' or 'separate', got {bwd_mode!r}")
    mode = bwd_mode
    if deterministic:
        mode = "separate"  # no atomics on dQ
    elif mode == "auto":
        mode = auto_bwd_mode(dims, _n_sm(device), both)
    fused = mode == "fused"
    dummy = kl  # placeholder pointer for outputs a launch does not write

    # dK outputs: direct (one query head per key head), fp32 atomics into the key head (GQA,
    # default) or per-query-head fp32 buffers summed in a fixed order (GQA, deterministic).
    def dk_buffer(train, k, group, d):
        if not train:
            return None, False
        if group == 1:
            return _fresh((dims.B, dims.H, dims.NK, d), k.dtype, device), False
        if deterministic:
            return _fresh((dims.B, dims.H, dims.NK, d), torch.float32, device), False
        return torch.zeros((dims.B, k.shape[1], dims.NK, d), dtype=torch.float32, device=device), True

    def dq_buffer(train, q, d):
        if not train:
            return None
        if fused:
            return torch.zeros((dims.B, dims.H, dims.NQ, d), dtype=torch.float32, device=device)
        return _fresh((dims.B, dims.H, dims.NQ, d), q.dtype, device)

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
            *_strides(q1), *_strides(k1), *_strides(q2), *_strides(k2),
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
                *_strides(q1), *_strides(k1), *_strides(q2), *_strides(k2),
                *s3(t_dq1), *s3(t_dq2),
                dims.H, dims.NQ, dims.NK, dims.D1, dims.D2, dims.group1, dims.group2,
                dims.scale1 * LOG2E, dims.scale2 * LOG2E, dims.scale1, dims.scale2,
                BLOCK_M=block_m, BLOCK_N=block_n, D1_PAD=d1_pad, D2_PAD=d2_pad, CAUSAL=causal,
                TRAIN1=train1, TRAIN2=train2, IEEE1=ieee1, IEEE2=ieee2,
                num_warps=warps, num_stages=stages,
            )
        return dq1, dk1, dq2, dk2

    dk_cands = _bwd_candidates(max(d1_pad, d2_pad), both, "dk", ieee1 or ieee2)
    dq_cands = _bwd_candidates(max(d1_pad, d2_pad), both, "dq", ieee1 or ieee2)
    base_key = (dims.D1, dims.D2, q1.dtype, q2.dtype, causal, train1, train2,
                _bucket(dims.NQ), _bucket(dims.NK), _bucket(BH), dims.group1 > 1, dims.group2 > 1)
    cfg_dk = _pick(("bwd_dk", fused) + base_key, dk_cands, lambda c: run(c, dq_cands[0]))
    cfg_dq = dq_cands[0] if fused else _pick(("bwd_dq",) + base_key, dq_cands, lambda c: run(cfg_dk, c))
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


# ----------------------------------------------------------------------------------------------
# torch.library custom ops + autograd (traceable by torch.compile)
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("streamkl::kl_fwd", mutates_args=())
def _kl_fwd_op(q1: torch.Tensor, k1: torch.Tensor, q2: torch.Tensor, k2: torch.Tensor,
               causal: bool, scale1: float, scale2: float, split_k: int,
               bwd_mode: str, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q1, k1, q2, k2, causal, scale1, scale2, None if split_k == 0 else split_k)


@_kl_fwd_op.register_fake
def _kl_fwd_fake(q1, k1, q2, k2, causal, scale1, scale2, split_k, bwd_mode, deterministic):
    shape = (q1.shape[0], q1.shape[1], q1.shape[2])
    return (q1.new_empty(shape, dtype=torch.float32), q1.new_empty(shape, dtype=torch.float32),
            q1.new_empty(shape, dtype=torch.float32))


@torch.library.custom_op("streamkl::kl_bwd", mutates_args=())
def _kl_bwd_op(g: torch.Tensor, q1: torch.Tensor, k1: torch.Tensor, q2: torch.Tensor, k2: torch.Tensor,
               kl: torch.Tensor, lse1_bits: torch.Tensor, lse2_bits: torch.Tensor, causal: bool,
               scale1: float, scale2: float, train1: bool, train2: bool, bwd_mode: str,
               deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _backward(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, scale1, scale2,
                      train1, train2, bwd_mode, deterministic)
    # a custom op returns tensors only: gradients not asked for come back as empty tensors
    return tuple(t if t is not None else x.new_empty(0) for t, x in zip(grads, (q1, k1, q2, k2)))


@_kl_bwd_op.register_fake
def _kl_bwd_fake(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, scale1, scale2, train1, train2,
                 bwd_mode, deterministic):
    wanted = (train1, train1, train2, train2)
    return tuple(torch.empty_like(x) if w else x.new_empty(0) for w, x in zip(wanted, (q1, k1, q2, k2)))


def _setup_context(ctx, inputs, output):
    q1, k1, q2, k2, causal, scale1, scale2, split_k, bwd_mode, deterministic = inputs
    kl, lse1_bits, lse2_bits = output
    ctx.save_for_backward(q1, k1, q2, k2, kl, lse1_bits, lse2_bits)
    ctx.args = (causal, scale1, scale2, bwd_mode, deterministic)


def _kl_backward(ctx, g_kl, g_lse1, g_lse2):
    q1, k1, q2, k2, kl, lse1_bits, lse2_bits = ctx.saved_tensors
    causal, scale1, scale2, bwd_mode, deterministic = ctx.args
    need = ctx.needs_input_grad
    train1 = bool(need[0] or need[1])
    train2 = bool(need[2] or need[3])
    if not (train1 or train2):
        return (None,) * 10
    # the LSE outputs are internal (saved for backward); attention_kl never hands them out
    dq1, dk1, dq2, dk2 = _kl_bwd_op(g_kl, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, scale1, scale2,
                                    train1, train2, bwd_mode, deterministic)
    return (dq1 if need[0] else None, dk1 if need[1] else None,
            dq2 if need[2] else None, dk2 if need[3] else None) + (None,) * 6


_kl_fwd_op.register_autograd(_kl_backward, setup_context=_setup_context)


def _call(q1, k1, q2, k2, causal, scale1, scale2, split_k, bwd_mode, deterministic):
    """Check the arguments, then run the custom op: (kl in nats, lse1, lse2 in bits)."""
    dims = _check_tensors(q1, k1, q2, k2, scale1, scale2)
    if bwd_mode not in ("auto", "fused", "separate"):
        raise ValueError(f"bwd_mode must be 'auto', 'fused' or 'separate', got {bwd_mode!r}")
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be None or a positive integer, got {split_k!r}")
    return _kl_fwd_op(q1, k1, q2, k2, bool(causal), dims.scale1, dims.scale2,
                      0 if split_k is None else split_k, bwd_mode, bool(deterministic))


def attention_kl_with_lse(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None,
                          split_k: Optional[int] = None, bwd_mode="auto", deterministic=False):
    """Like :func:`attention_kl`, also returning ``lse1, lse2`` (float32 ``[B,H,N_Q]``, nats;
    -inf for rows with no visible key). The LSEs carry no gradient."""
    kl, lse1_bits, lse2_bits = _call(q1, k1, q2, k2, causal, scale1, scale2, split_k, bwd_mode, deterministic)
    # the op keeps its LSEs in bits (what the backward reads); users get nats
    return kl, (lse1_bits * LN2).detach(), (lse2_bits * LN2).detach()


def attention_kl(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None,
                 split_k: Optional[int] = None, bwd_mode="auto", deterministic=False):
    """Row-wise ``KL(P1 || P2)``, ``P_t = softmax(scale_t * q_t k_t^T)``, streamed: no ``N_Q x N_K`` buffer.

    Args:
        q1, k1: side 1 ("teacher" in setting 1), ``[B, H, N_Q, D1]`` and ``[B, H_K1, N_K, D1]``.
        q2, k2: side 2 ("student"), ``[B, H, N_Q, D2]`` and ``[B, H_K2, N_K, D2]``.
            Any strides (a transposed ``[B, N, H, D]`` tensor works without a copy); fp16, bf16
            or fp32 (q and k of one side share a dtype; the sides may differ); head dims 1..256.
            GQA: query head ``h`` reads key head ``h // (H // H_K)`` on each side.
        causal: bottom-right aligned: key ``j`` is visible to query ``i`` iff
            ``j <= i + (N_K - N_Q)`` (FlashAttention's convention; SDPA's ``is_causal`` is
            top-left). Rows with no visible key give KL 0 and zero gradient.
        scale1, scale2: score scales; ``None`` means ``1/sqrt(D)``. A temperature tau is ``scale/tau``.
        split_k: forward key splits: ``None`` picks by :func:`auto_split_k`, ``1`` is one pass.
        bwd_mode: ``"auto"``, ``"fused"`` (each tile pair visited once, dQ by fp32 atomics) or
            ``"separate"`` (dK and dQ kernels, no dQ atomics).
        deterministic: bitwise-repeatable gradients (separate kernels, no atomics anywhere).

    Returns:
        float32 ``[B, H, N_Q]``: KL in nats per query row. Differentiable: gradients go to exactly
        the inputs that require grad (setting 1: q2, k2; setting 2: q1, k1; or all four).
        NaN in an input gives NaN in the rows it reaches; it is never turned into 0.
    """
    return _call(q1, k1, q2, k2, causal, scale1, scale2, split_k, bwd_mode, deterministic)[0]
