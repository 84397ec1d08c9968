"""``indexer_kl_topk``: the sparse stage's indexer loss over each row's selected keys (docs/indexer.md,
"The sparse stage"). Kernels: ``_indexer_topk_kernels``; float64 reference: ``streamkl_ref.indexer_kl_topk``.

Per row ``t`` with set ``S_t`` (the keys listed in ``topk_indices[b, t]``, ``-1`` = unused, that the
row sees), Megatron-LM's ``sparse_loss`` convention: every teacher head's softmax over ``S_t``
(teacher LSEs over the set), head mean; the student's softmax over ``S_t``; their KL.

Two custom ops (``streamkl::indexer_topk_fwd``, ``streamkl::indexer_topk_bwd``) with fake
implementations make the function traceable by ``torch.compile(fullgraph=True)``. The forward saves
the target per slot (``[B, N_Q, K]`` fp32, as large as ``topk_indices`` in int32), so the
backward reads the indexer alone. ``lse`` (the teacher's LSEs over the set, as a sparse attention
over the same indices returns them) skips the forward's first pass over the teacher. The forward's
launch config: the shape rule's for a teacher of one key head (64 heads or more), else tuned on the first call
(``_fwd_candidates``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton

from streamkl_ref._checks import check_indexer_inputs

from streamkl_gpu._core import custom_ops as _custom_ops
from streamkl_gpu._core import checks as _checks
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu._core.launcher import compile_first_call, kernel_call
from streamkl_gpu.indexer import configs as _configs
from streamkl_gpu.indexer.training.row_weights import check_row_weights as _check_row_weights
from streamkl_gpu.indexer.triton import topk as _kernels
from streamkl_gpu.indexer.plan import _check, _fresh, _pow2, _rows_with_keys, _student_grads

__all__ = ["indexer_kl_topk", "indexer_kl_topk_naive", "MAX_TOPK_INDEXER_HEADS", "TOPK_DTYPES"]

LOG2E = 1.4426950408889634
MAX_TOPK_INDEXER_HEADS = 128  # all indexer heads of a token are one tile's rows
TOPK_DTYPES = (torch.int32, torch.int64)

@dataclass(frozen=True)
class TopkConfig:
    """One launch of the top-k forward kernels: ``block_k`` selected slots per tile, head dims in
    ``block_d``-wide chunks, at most ``max_heads_per_chunk`` teacher heads per chunk;
    ``teacher_q_l1``: the forward's teacher q rows through L1 (A_L1); ``separate_student``: the
    student's logits and LSE by their own kernel first, the teacher kernel's second pass then only
    reads them (_topk_student_kernel). The backward takes ``block_k`` (at most 64), warps, stages."""
    block_k: int
    block_d: int
    max_heads_per_chunk: int
    num_warps: int
    num_stages: int
    teacher_q_l1: bool = False
    separate_student: bool = False


INTERPRETER_CONFIG = TopkConfig(block_k=16, block_d=32, max_heads_per_chunk=32, num_warps=1, num_stages=1)
# bench/results/2026-12-01_h200_121408f/indexer_topk.csv (H200): DSA 8K, K=2048 fwd 26.1 ms;
# also the backward's
DEFAULT_CONFIG = TopkConfig(block_k=64, block_d=64, max_heads_per_chunk=128, num_warps=8, num_stages=2)
IEEE_CONFIG = TopkConfig(block_k=32, block_d=32, max_heads_per_chunk=64, num_warps=4, num_stages=1)
# offline sm_90 (3.6): teacher kernel 176 registers
SEPARATE_CONFIG = TopkConfig(block_k=64, block_d=64, max_heads_per_chunk=128, num_warps=8, num_stages=2,
                             separate_student=True)
L1_CONFIG = TopkConfig(block_k=64, block_d=64, max_heads_per_chunk=128, num_warps=8, num_stages=2, teacher_q_l1=True)
# set to time other configs (None: the rule in _config); tests/test_indexer_topk.py sets it, as did a
# GPU script since removed (``git show b7066de:bench/indexer_topk_gpu.py``;
# bench/results/2026-12-01_h200_121408f/indexer_topk.csv)
CONFIG_OVERRIDE: Optional[TopkConfig] = None


def _config(ieee: bool):
    if CONFIG_OVERRIDE is not None:  # the benchmark's variants; tests under the interpreter
        return CONFIG_OVERRIDE
    if _runtime.interpreting():
        return INTERPRETER_CONFIG
    return IEEE_CONFIG if ieee else DEFAULT_CONFIG


def _check_topk(topk_indices, dims, device):
    """``topk_indices [B, N_Q, K]`` int32 or int64 on the inputs' device. Values are checked on CPU
    tensors only (range ``[-1, N_K)``, no key twice in a row), outside torch.compile: on a GPU a check
    would synchronise."""
    if not isinstance(topk_indices, torch.Tensor):
        raise ValueError(f"topk_indices must be a torch.Tensor, got {type(topk_indices).__name__}")
    if topk_indices.dtype not in TOPK_DTYPES:
        raise ValueError(f"topk_indices must be int32 (or int64), -1 = unused slot, got dtype {topk_indices.dtype}")
    if topk_indices.ndim != 3 or tuple(topk_indices.shape[:2]) != (dims.B, dims.NQ):
        raise ValueError(f"topk_indices must have shape [B, N_Q, K] = [{dims.B}, {dims.NQ}, K], "
                         f"got {list(topk_indices.shape)}")
    if topk_indices.device != device:
        raise ValueError(f"topk_indices is on {topk_indices.device} but q is on {device}: they must share a device")
    # (under torch.compile the values are data: not checked while tracing)
    if topk_indices.device.type == "cpu" and topk_indices.numel() and not torch.compiler.is_compiling():
        lo, hi = int(topk_indices.min()), int(topk_indices.max())
        if lo < -1 or hi >= dims.NK:
            raise ValueError(f"topk_indices must be -1 (unused) or a key index in [0, {dims.NK}), "
                             f"got values from {lo} to {hi}")
        srt = torch.sort(topk_indices, dim=-1).values
        dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
        if bool(dup.any()):
            raise ValueError("topk_indices lists a key twice in one row; each key may appear at most once")


# ----------------------------------------------------------------------------------------------
# Launches
# ----------------------------------------------------------------------------------------------

def _strides(t):
    return tuple(t.stride())


def _fwd_candidates(ieee: bool, dims=None):
    """The forward's launch configs: the one-kernel default, the separate-student design and the L1
    variant. For a teacher of one key head and at least 64 heads the shape rule puts the separate-student design first
    and it runs untimed (indexer/configs.py, ``SHAPE_RULES``: 1.60x faster than the one-kernel
    default with 64 teacher heads at 8K, within 0.4 % of the best at DSA-like 8K); other teachers
    time the three on the first call of each shape bucket (``_tuning.pick``)."""
    if CONFIG_OVERRIDE is not None or _runtime.interpreting() or ieee:
        return [_config(ieee)]
    return _configs._rule_first("topk", dims, [DEFAULT_CONFIG, SEPARATE_CONFIG, L1_CONFIG])  # SHAPE_RULES


def _forward(q, k, q_idx, k_idx, weights, topk_indices, lse, causal, scale, relu):
    """(KL [B, N_Q], LSE_I [B, N_Q], p_set [B, N_Q, K]) in fp32; ``lse``: the caller's set LSEs
    (natural log) or None (the kernel's first pass computes them)."""
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    q, k, q_idx, k_idx, weights = (_checks.compute_view(t) for t in (q, k, q_idx, k_idx, weights))
    device = q.device
    n_sel = topk_indices.shape[-1]
    ieee_t, ieee_i = q.dtype == torch.float32, q_idx.dtype == torch.float32
    group, group_i = dims.H // dims.HK, dims.HI // dims.HKI
    pad = _checks.head_pad(dims.D)
    pad_i = _checks.head_pad(dims.DI)
    hi_pad = max(16, _pow2(dims.HI))
    kl = _fresh((dims.B, dims.NQ), torch.float32, device)
    lse_i = _fresh((dims.B, dims.NQ), torch.float32, device)
    if lse is None:
        lse_t = _fresh((dims.B, dims.H, dims.NQ), torch.float32, device)
    else:  # natural log -> bits, the kernels' unit
        lse_t = (lse * LOG2E).contiguous()
    p_set = _fresh((dims.B, dims.NQ, n_sel), torch.float32, device)

    def launch(cfg):
        block_k, block_d, hb_max, warps, stages = (cfg.block_k, cfg.block_d, cfg.max_heads_per_chunk, cfg.num_warps,
                                                   cfg.num_stages)
        a_l1, separate = cfg.teacher_q_l1, cfg.separate_student
        hb = max(16, min(_pow2(group), _pow2(hb_max)))
        cpg = _runtime.cdiv(group, hb)
        block_di = pad_i if pad_i <= 128 else min(block_d, pad_i)
        logits = p_set
        if separate:
            logits = _fresh((dims.B, dims.NQ, n_sel), torch.float32, device)
            kernel_call(_kernels._topk_student_kernel, (dims.NQ, dims.B))(
                q_idx, k_idx, weights, topk_indices, logits, lse_i,
                *_strides(q_idx), *_strides(k_idx), *_strides(weights), *_strides(topk_indices),
                dims.HI, dims.HKI, group_i, dims.NQ, dims.NK, n_sel,
                DI=dims.DI, BLOCK_DI=block_di, HI_PAD=hi_pad, BLOCK_K=block_k, CAUSAL=causal, RELU=relu,
                IEEE_I=ieee_i, num_warps=4, num_stages=2)
        kernel_call(_kernels._topk_fwd_kernel, (dims.NQ, dims.B))(
            q, k, q_idx, k_idx, weights, topk_indices, lse_t, kl, lse_i, p_set, logits,
            *_strides(q), *_strides(k), *_strides(q_idx), *_strides(k_idx), *_strides(weights),
            *_strides(topk_indices),
            dims.H, group, dims.HI, dims.HKI, group_i, dims.NQ, dims.NK, n_sel, dims.scale * LOG2E, 1.0 / dims.H,
            dims.HK * cpg, cpg,
            D=dims.D, BLOCK_D=min(block_d, pad), DI=dims.DI, BLOCK_DI=block_di, HB=hb, HI_PAD=hi_pad,
            BLOCK_K=block_k, CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i,
            NO_CONTRACT=not _runtime.interpreting(), HAS_LSE=lse is not None, A_L1=a_l1,
            STUDENT_SEPARATE=separate, num_warps=warps, num_stages=stages)

    key = ("topk_fwd", dims.D, dims.DI, dims.H, dims.HK, dims.HI, dims.HKI, q.dtype, q_idx.dtype, causal, relu,
           lse is not None, _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(n_sel),
           _tuning.bucket(dims.B))
    cands = _fwd_candidates(ieee_t or ieee_i, dims)
    launch(_tuning.pick(key, cands, launch, ruled=_configs.ruled("topk", dims, cands)))
    return kl, lse_i, p_set


def _backward(g, q_idx, k_idx, weights, topk_indices, p_set, lse_i, causal, relu):
    """(dq_idx, dk_idx, dweights) of ``sum_t g[t] KL[t]``, in the inputs' dtypes."""
    out_dtypes = (q_idx.dtype, k_idx.dtype, weights.dtype)
    q_idx, k_idx, weights = (_checks.compute_view(t) for t in (q_idx, k_idx, weights))
    B, HI, NQ, DI = q_idx.shape
    HKI, NK = k_idx.shape[1], k_idx.shape[2]
    device = q_idx.device
    n_sel = topk_indices.shape[-1]
    ieee_i = q_idx.dtype == torch.float32
    cfg = _config(ieee_i)
    block_k, warps, stages = cfg.block_k, cfg.num_warps, cfg.num_stages
    block_k = min(block_k, 64)  # offline sm_90 compiles (DSA, triton 3.6 and 3.9): 128 spills 192-232 B here
    g = g.to(torch.float32).contiguous()
    dq_idx = _fresh((B, HI, NQ, DI), torch.float32, device)
    dweights = _fresh((B, HI, NQ), torch.float32, device)
    dk_idx = torch.zeros((B, HKI, NK, DI), dtype=torch.float32, device=device)  # atomic adds
    kernel_call(_kernels._topk_bwd_kernel, (NQ, B))(
        q_idx, k_idx, weights, topk_indices, p_set.contiguous(), lse_i.contiguous(), g, dq_idx, dk_idx, dweights,
        *_strides(q_idx), *_strides(k_idx), *_strides(weights), *_strides(topk_indices),
        HI, HKI, HI // HKI, NQ, NK, n_sel,
        DI=DI, DI_PAD=_checks.head_pad(DI), HI_PAD=max(16, _pow2(HI)), BLOCK_K=block_k,
        CAUSAL=causal, RELU=relu, IEEE_I=ieee_i, num_warps=warps, num_stages=stages)
    return dq_idx.to(out_dtypes[0]), dk_idx.to(out_dtypes[1]), dweights.to(out_dtypes[2])


# ----------------------------------------------------------------------------------------------
# torch.library custom ops + autograd (traceable by torch.compile)
# ----------------------------------------------------------------------------------------------

@_custom_ops.custom_op("streamkl::indexer_topk_fwd", mutates_args=())
def _topk_fwd_op(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                 weights: torch.Tensor, topk_indices: torch.Tensor, lse: Optional[torch.Tensor], causal: bool,
                 scale: float, relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q, k, q_idx, k_idx, weights, topk_indices, lse, causal, scale, relu)


@_topk_fwd_op.register_fake
def _topk_fwd_fake(q, k, q_idx, k_idx, weights, topk_indices, lse, causal, scale, relu):
    B, NQ, KS = topk_indices.shape
    f32 = torch.float32
    return (q.new_empty((B, NQ), dtype=f32), q.new_empty((B, NQ), dtype=f32), q.new_empty((B, NQ, KS), dtype=f32))


@_custom_ops.custom_op("streamkl::indexer_topk_bwd", mutates_args=())
def _topk_bwd_op(g: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor,
                 topk_indices: torch.Tensor, p_set: torch.Tensor, lse_i: torch.Tensor, causal: bool,
                 relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(g, q_idx, k_idx, weights, topk_indices, p_set, lse_i, causal, relu)


@_topk_bwd_op.register_fake
def _topk_bwd_fake(g, q_idx, k_idx, weights, topk_indices, p_set, lse_i, causal, relu):
    return torch.empty_like(q_idx), torch.empty_like(k_idx), torch.empty_like(weights)


def _setup_context(ctx, inputs, output):
    q, k, q_idx, k_idx, weights, topk_indices, lse, causal, scale, relu = inputs
    _, lse_i, p_set = output
    ctx.save_for_backward(q_idx, k_idx, weights, topk_indices, p_set, lse_i)
    ctx.args = (causal, relu)


def _topk_backward(ctx, g_kl, g_lse_i, g_p_set):
    q_idx, k_idx, weights, topk_indices, p_set, lse_i = ctx.saved_tensors
    causal, relu = ctx.args
    return _student_grads(ctx.needs_input_grad, lambda: _custom_ops.call(_topk_bwd_op,
        g_kl, q_idx, k_idx, weights, topk_indices, p_set, lse_i, causal, relu))


_custom_ops.register_autograd(_topk_fwd_op, _topk_backward, _setup_context)


# ----------------------------------------------------------------------------------------------
# The public function
# ----------------------------------------------------------------------------------------------

def indexer_kl_topk(q, k, q_idx, k_idx, weights, topk_indices, *, causal=False, scale=None, relu=True,
                    lse=None, reduction="none", row_weights=None):
    """The sparse stage's indexer loss: per row, ``KL(p_S || softmax_S(I))`` over the row's set ``S``.

    ``S_t`` = the keys listed in ``topk_indices[b, t]`` that row ``t`` sees (with ``causal``, keys
    past the bottom-right diagonal are dropped). Target ``p_S = (1/H) sum_h softmax_S(sigma q_h k^T)``
    (each teacher head's softmax over the set: Megatron-LM's ``sparse_loss``); student
    ``softmax_S(I)`` with ``I = sum_j weights_j relu(q_idx_j . k_idx)``.

    Args:
        q, k, q_idx, k_idx, weights, causal, scale, relu: as :func:`indexer_kl` (teacher
            ``D <= 576``, indexer ``D_I <= 256``, ``H_I <= 128``; the teacher gets no gradient).
        topk_indices: ``[B, N_Q, K]`` int32 (int64 accepted), any strides, ``-1`` = unused slot;
            ``K`` need not be a power of two. Each key at most once per row. On CPU tensors the
            values are checked (``ValueError``); on a GPU they are not (a check would synchronise):
            there a value outside ``[0, N_K)`` reads as an unused slot and a listed-twice key
            counts twice.
        reduction: ``"none"`` (``[B, N_Q]``), ``"sum"``, or ``"mean"`` over the rows with at least
            one visible key (as :func:`indexer_kl`).

        lse: optional teacher LSEs **over each row's set**, float32 ``[B, H, N_Q]``, natural log:
            what a sparse attention over the same ``topk_indices`` returns (e.g. a sparse-MLA
            prefill's ``softmax_lse``), *not* a dense FlashAttention's full-row LSE (that one
            gives wrong rows: the target then sums to less than 1). Given, the forward skips its
            first pass over the teacher. Shape, dtype and device are checked, values are not.
        row_weights: optional ``[B, N_Q]`` per-row weights (a constant, as in :func:`indexer_kl`):
            rows ``row_weights * KL``, summed by ``"sum"``, divided by the rows with a visible key
            by ``"mean"``. The backward gets ``g * row_weights`` per row.

    Returns:
        float32 KL in nats; rows with an empty set give 0 and zero gradient. Differentiable in
        ``q_idx``, ``k_idx``, ``weights``.
    """
    args = (q, k, q_idx, k_idx, weights, topk_indices, causal, scale, relu, lse, reduction, row_weights)
    # a new signature: the call's kernels compile at once before it runs (_core/launcher.py)
    compile_first_call("indexer_kl_topk", args, lambda: _indexer_kl_topk(*args), getattr(q, "device", None))
    return _indexer_kl_topk(*args)


def _indexer_kl_topk(q, k, q_idx, k_idx, weights, topk_indices, causal, scale, relu, lse, reduction, row_weights):
    dims = _check(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=relu, lse=lse,
                  reduction=reduction)
    if dims.HI > MAX_TOPK_INDEXER_HEADS:
        raise ValueError(f"q_idx has {dims.HI} heads; indexer_kl_topk supports up to {MAX_TOPK_INDEXER_HEADS}")
    _check_topk(topk_indices, dims, q.device)
    row_weights = _check_row_weights(row_weights, dims, q.device)
    kl = _custom_ops.call(_topk_fwd_op, q, k, q_idx, k_idx, weights, topk_indices, lse, causal, dims.scale, relu)[0]
    if row_weights is not None:
        kl = kl * row_weights
    if reduction == "none":
        return kl
    total = kl.sum()
    return total if reduction == "sum" else total / _rows_with_keys(dims, causal)


# ----------------------------------------------------------------------------------------------
# The PyTorch gather form: the benchmark's baseline and the tests' same-precision computation
# ----------------------------------------------------------------------------------------------

def indexer_kl_topk_naive(q, k, q_idx, k_idx, weights, topk_indices, *, causal=False, scale=None, relu=True,
                          compute_dtype=torch.float32):
    """``[B, N_Q]`` KL, the selected keys gathered (``[B, N_Q, K, H_K, D]``), scores per head,
    softmax over the set, head mean; the indexer likewise; KL with ``0 log 0 = 0``. Products in
    ``compute_dtype`` (``None``: the inputs' dtype, softmax and KL in float32; the benchmark's
    memory-lean form). Duplicates count as listed; out-of-range values as unused slots."""
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    cd = compute_dtype
    f = torch.float32 if cd is None else cd
    idx = topk_indices.long()
    used = (idx >= 0) & (idx < dims.NK)
    if causal:
        rows = torch.arange(dims.NQ, device=idx.device)[None, :, None]
        used = used & (idx <= rows + (dims.NK - dims.NQ))
    safe = torch.where(used, idx, 0)
    bidx = torch.arange(dims.B, device=idx.device)[:, None, None]

    def cast(t):
        return t if cd is None else t.to(cd)

    def scores(qq, kk, n_kv):
        kg = cast(kk)[bidx, :, safe]  # [B, N_Q, K, n_kv, D]
        qg = cast(qq).reshape(dims.B, n_kv, qq.shape[1] // n_kv, dims.NQ, qq.shape[-1])
        return torch.einsum("bzgtd,btszd->bzgts", qg, kg).reshape(dims.B, qq.shape[1], dims.NQ, -1).to(f)

    mask = used[:, None]
    s = scores(q, k, dims.HK) * dims.scale
    empty = ~used.any(-1)  # [B, N_Q]
    live = mask | empty[:, None, :, None]  # an empty row is computed unmasked, then set to 0
    p = torch.softmax(s.masked_fill(~live, float("-inf")), dim=-1).masked_fill(~mask, 0.0).mean(dim=1)
    a = scores(q_idx, k_idx, dims.HKI)
    act = torch.relu(a) if relu else a
    logits = (weights.to(f)[..., None] * act).sum(dim=1)
    log_q = torch.log_softmax(logits.masked_fill(~(used | empty[..., None]), float("-inf")), dim=-1)
    pos = used & (p > 0)
    log_p = torch.log(torch.where(pos, p, torch.ones((), dtype=p.dtype, device=p.device)))
    kl = torch.where(pos, p * (log_p - log_q), torch.zeros((), dtype=p.dtype, device=p.device)).sum(-1)
    return torch.where(empty, torch.zeros((), dtype=kl.dtype, device=kl.device), kl)
