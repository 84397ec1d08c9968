"""The store training design: the forward writes the whole target p ``[B, N_Q, N_K]`` and the
backward's teacher-free kernels read it back (custom ops ``streamkl::indexer_loss_pstore_fwd`` /
``streamkl::indexer_loss_pstore_bwd``). Quadratic memory: an experiment, never the default."""
from __future__ import annotations

import torch

from streamkl_ref._checks import check_indexer_inputs
from streamkl_gpu._core import custom_ops as _custom_ops
from streamkl_gpu.indexer.triton import fwd as _indexer_fwd
from streamkl_gpu.indexer.triton import accumulate as _indexer_pacc
from streamkl_gpu._core import checks as _checks
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu._core.launcher import kernel_call
from streamkl_gpu.indexer.training import choice as _choice
from streamkl_gpu.indexer import configs as _configs
from streamkl_gpu.indexer import host as _host
from streamkl_gpu.indexer import plan as _plan_mod


# The "store" design (STREAMKL_INDEXER_PSTORE): the forward's tile also writes the target p
# [B, N_Q, N_K] (fp32); the backward's teacher-free kernels read it back (P_SAVED). No gradient
# accumulators in the forward (the accumulating kernel's registers and dk_p reductions), at the
# price of B * N_Q * N_K floats kept from the forward to the backward (capped: pstore_enabled).


def _pstore_meta(pl) -> dict:
    """The storing forward's options from the forward config's variant (_indexer_fwd.variant_meta):
    the keys-major tile (KEYS_MAJOR), the longest rows first (LPT) and a register cap; flat not."""
    meta = _indexer_fwd.variant_meta(str(pl["variant"]), _runtime.interpreting())
    return {k: v for k, v in meta.items() if k in ("KEYS_MAJOR", "LPT", "maxnreg")}


def _forward_pstore(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    """(sum of KL, LSE_I, p [B, N_Q, N_K] in PSTORE_DTYPE): the forward (its launch candidates) storing p."""
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    q, k, q_idx, k_idx, weights = (_checks.compute_view(t) for t in (q, k, q_idx, k_idx, weights))
    device = q.device
    ieee_t, ieee_i = q.dtype == torch.float32, q_idx.dtype == torch.float32
    group, group_i = dims.H // dims.HK, dims.HI // dims.HKI
    no_contract = not _runtime.interpreting()
    use_tma = _plan_mod._use_tma(q, k, q_idx, k_idx)
    lse_bits = (lse * _plan_mod.LOG2E).contiguous()
    kl = _plan_mod._fresh((dims.B, dims.NQ), torch.float32, device)
    lse_idx = _plan_mod._fresh((dims.B, dims.NQ), torch.float32, device)
    p = _plan_mod._fresh((dims.B, dims.NQ, dims.NK), _choice.PSTORE_DTYPE, device)  # entries past the causal frontier unwritten
    key = ("idx_pstore", relu, dims.D, dims.DI, dims.H, dims.HK, dims.HI, dims.HKI, q.dtype, q_idx.dtype, causal,
           use_tma, _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B))

    def launch(cfg):
        pl = _plan_mod._plan(dims, cfg, "fwd")
        splits, per_split = _plan_mod._key_splits(dims, pl)
        part = _plan_mod._fresh((5, splits, dims.B, dims.NQ), torch.float32, device) if splits > 1 else kl
        grid = (_runtime.cdiv(dims.NQ, pl["BLOCK_T"]), splits, dims.B)
        tma, a_l1 = _plan_mod._load_mode(pl, use_tma)
        kernel_call(_indexer_pacc._indexer_fwd_pstore_kernel, grid)(
            q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, part, p,
            *_plan_mod._descriptors(pl, tma, q, k, q_idx, k_idx),
            *_plan_mod._strides(q), *_plan_mod._strides(k), *_plan_mod._strides(q_idx), *_plan_mod._strides(k_idx), *_plan_mod._strides(weights),
            dims.H, group, group_i, dims.NQ, dims.NK, dims.scale * _plan_mod.LOG2E, 1.0 / dims.H,
            pl["n_chunks"], pl["cpg"], pl["n_ichunks"], pl["icpg"], per_split, 0, dims.NQ,
            D=dims.D, BLOCK_D=pl["BLOCK_D"], DI=dims.DI, BLOCK_DI=pl["BLOCK_DI"],
            HB=pl["HB"], IB=pl["IB"], BLOCK_T=pl["BLOCK_T"], BLOCK_N=pl["BLOCK_N"],
            CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i, NO_CONTRACT=no_contract,
            USE_TMA=tma, SPLIT=splits > 1, A_L1=a_l1, num_warps=pl["warps"], num_stages=pl["stages"],
            **_pstore_meta(pl))
        if splits > 1:
            merged_kl, merged_lse = _plan_mod._merge_splits(part)
            kl.copy_(merged_kl)
            lse_idx.copy_(merged_lse)

    launch(_tuning.pick(key, _configs._candidates("pstore", ieee_t or ieee_i, dims, _runtime.n_sm(device)), launch, ruled=False))
    return kl.sum(), lse_idx, p


@_custom_ops.custom_op("streamkl::indexer_loss_pstore_fwd", mutates_args=())
def _indexer_loss_pstore_fwd_op(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                                weights: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                                relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_pstore(q, k, q_idx, k_idx, weights, lse, causal, scale, relu)


@_indexer_loss_pstore_fwd_op.register_fake
def _indexer_loss_pstore_fwd_fake(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    B, NQ, NK = q.shape[0], q.shape[2], k.shape[2]
    f32 = torch.float32
    return q.new_empty((), dtype=f32), q.new_empty((B, NQ), dtype=f32), q.new_empty((B, NQ, NK), dtype=_choice.PSTORE_DTYPE)


@_custom_ops.custom_op("streamkl::indexer_loss_pstore_bwd", mutates_args=())
def _indexer_loss_pstore_bwd_op(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor,
                                k_idx: torch.Tensor, weights: torch.Tensor, lse_idx: torch.Tensor, p: torch.Tensor,
                                causal: bool, scale: float, relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = g.to(torch.float32).expand(q.shape[0], q.shape[2]).contiguous()
    return _host._backward(rows, q, k, q_idx, k_idx, weights, None, lse_idx, causal, scale, relu, p_saved=p)


@_indexer_loss_pstore_bwd_op.register_fake
def _indexer_loss_pstore_bwd_fake(g, q, k, q_idx, k_idx, weights, lse_idx, p, causal, scale, relu):
    return torch.empty_like(q_idx), torch.empty_like(k_idx), torch.empty_like(weights)


def _pstore_setup_context(ctx, inputs, output):
    q, k, q_idx, k_idx, weights, lse, causal, scale, relu = inputs
    _, lse_idx, p = output
    ctx.save_for_backward(q, k, q_idx, k_idx, weights, lse_idx, p)
    ctx.args = (causal, scale, relu)


def _pstore_backward(ctx, g_total, g_lse_idx, g_p):
    q, k, q_idx, k_idx, weights, lse_idx, p = ctx.saved_tensors
    causal, scale, relu = ctx.args
    return _plan_mod._student_grads(ctx.needs_input_grad, lambda: _custom_ops.call(_indexer_loss_pstore_bwd_op,
        g_total, q, k, q_idx, k_idx, weights, lse_idx, p, causal, scale, relu))


_custom_ops.register_autograd(_indexer_loss_pstore_fwd_op, _pstore_backward, _pstore_setup_context)
