"""The accumulating training design: the forward also sums the target's share of the gradient
(``indexer/triton/accumulate.py``), the backward runs the indexer alone, so the teacher is read once per
training step (custom ops ``streamkl::indexer_loss_fwd`` / ``streamkl::indexer_loss_bwd``)."""
from __future__ import annotations

import torch

from streamkl_ref._checks import check_indexer_inputs
from streamkl_gpu._core import custom_ops as _custom_ops
from streamkl_gpu.indexer.triton import accumulate as _indexer_pacc
from streamkl_gpu._core import checks as _checks
from streamkl_gpu._core import forcing as _forcing
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu._core.launcher import kernel_call
from streamkl_gpu.devtools import diagnostics as _diagnostics
from streamkl_gpu.indexer import configs as _configs
from streamkl_gpu.indexer import host as _host
from streamkl_gpu.indexer import plan as _plan_mod


# ----------------------------------------------------------------------------------------------
# Scalar reductions with lse given: the forward accumulates the target's share of the gradient
# (_indexer_pacc), the backward runs the indexer alone. STREAMKL_INDEXER_TRAINING chooses (training/choice.py).
# ----------------------------------------------------------------------------------------------


def _forward_pacc(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    """(sum of KL, LSE_I, dq_p, dk_p, dweights_p): the forward plus the target's share of the
    gradient of the sum with g = 1 (``_indexer_pacc``; fp32, contiguous)."""
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    q, k, q_idx, k_idx, weights = (_checks.compute_view(t) for t in (q, k, q_idx, k_idx, weights))
    device = q.device
    ieee_t, ieee_i = q.dtype == torch.float32, q_idx.dtype == torch.float32
    group = dims.H // dims.HK
    no_contract = not _runtime.interpreting()
    use_tma = _plan_mod._use_tma(q, k, q_idx, k_idx)
    # dk_p's shares by one TMA bulk reduction per tile (Hopper; the interpreter has no reductions
    # through descriptors, so it takes per-element atomics)
    dk_tma = use_tma and not _runtime.interpreting()
    lse_bits = (lse * _plan_mod.LOG2E).contiguous()
    kl = _plan_mod._fresh((dims.B, dims.NQ), torch.float32, device)
    lse_idx = _plan_mod._fresh((dims.B, dims.NQ), torch.float32, device)
    dq_p = _plan_mod._fresh((dims.B, dims.HI, dims.NQ, dims.DI), torch.float32, device)
    dw_p = _plan_mod._fresh((dims.B, dims.HI, dims.NQ), torch.float32, device)
    dk_p = torch.zeros((dims.B, 1, dims.NK, dims.DI), dtype=torch.float32, device=device)
    key = ("idx_pacc", relu, dims.D, dims.DI, dims.H, dims.HK, dims.HI, q.dtype, q_idx.dtype, causal, use_tma,
           _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B))

    def launch(cfg):
        pl = _plan_mod._plan(dims, cfg, "bwd")  # every indexer head x BLOCK_T tokens in one tile
        dk_p.zero_()
        grid = (_runtime.cdiv(dims.NQ, pl["BLOCK_T"]), dims.B)
        tma, a_l1 = _plan_mod._load_mode(pl, use_tma)
        flags = str(pl["variant"]).split("+")  # e.g. "kt+tm"
        # "h2" (with "kt"): each dk_p share in two D halves (half-width reduction boxes)
        dk_halves = "h2" in flags and "kt" in flags and dk_tma and pl["DI_PAD"] >= 32
        box_d = pl["DI_PAD"] // 2 if dk_halves else pl["DI_PAD"]
        dk_desc = (_runtime.TensorDescriptor(dk_p, list(dk_p.shape), list(dk_p.stride()), [1, 1, pl["BLOCK_N"], box_d])
                   if dk_tma else None)
        descs = list(_plan_mod._descriptors(pl, tma, q, k, q_idx, k_idx))
        # "tm": one token per program, q read through a token-major descriptor ([B, N, H, D] view)
        q_tm = "tm" in flags and tma and pl["BLOCK_T"] == 1
        if q_tm:
            qv = q.permute(0, 2, 1, 3)
            descs[0] = _runtime.TensorDescriptor(qv, list(qv.shape), list(qv.stride()), [1, 1, pl["HB"], pl["BLOCK_D"]])
        kernel_call(_indexer_pacc._indexer_fwd_pacc_kernel, grid)(
            q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, dq_p, dw_p, dk_p,
            *descs, dk_desc,
            *_plan_mod._strides(q), *_plan_mod._strides(k), *_plan_mod._strides(q_idx), *_plan_mod._strides(k_idx), *_plan_mod._strides(weights),
            dims.H, group, dims.HI, dims.NQ, dims.NK, dims.scale * _plan_mod.LOG2E, 1.0 / dims.H, pl["n_chunks"], pl["cpg"],
            D=dims.D, BLOCK_D=pl["BLOCK_D"], DI=dims.DI, DI_PAD=pl["DI_PAD"], HB=pl["HB"], GI_PAD=pl["GI_PAD"],
            BLOCK_T=pl["BLOCK_T"], BLOCK_N=pl["BLOCK_N"], CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i,
            NO_CONTRACT=no_contract, USE_TMA=tma, DK_TMA=dk_tma, A_L1=a_l1, PARTS=_diagnostics.indexer_accumulate_parts(_forcing.forced("indexer_accumulate_parts")),
            KEY_ROWS="kt" in flags, Q_TM=q_tm, DK_HALVES=dk_halves,
            num_warps=pl["warps"], num_stages=pl["stages"])

    if _host._use_gluon(dims, q, k, q_idx, k_idx, pacc=True):  # the Gluon accumulating forward (Hopper, MQA)
        part = _plan_mod._fresh((5, 2, dims.B, dims.NQ), torch.float32, device)

        def launch_gluon(cfg):
            for buf in (dq_p, dw_p, dk_p):  # its shares are atomic adds
                buf.zero_()
            _host._gluon_indexer.forward_states(q, k, q_idx, k_idx, weights, lse_bits, causal, dims.scale, relu,
                                          config=cfg, part=part, grads=(dq_p, dw_p, dk_p))

        gl_key = ("idx_gluon_pacc",) + key[1:]
        launch_gluon(_tuning.pick(gl_key, _host._gluon_indexer.candidates(dims, pacc=True), launch_gluon, ruled=False))
        kl, lse_idx = _plan_mod._merge_splits(part)
        return kl.sum(), lse_idx, dq_p, dk_p, dw_p
    cands = _configs._candidates("pacc", ieee_t or ieee_i, dims)
    launch(_tuning.pick(key, cands, launch, ruled=_configs.ruled("pacc", dims, cands)))
    return kl.sum(), lse_idx, dq_p, dk_p, dw_p


@_custom_ops.custom_op("streamkl::indexer_loss_fwd", mutates_args=())
def _indexer_loss_fwd_op(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                         weights: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                         relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_pacc(q, k, q_idx, k_idx, weights, lse, causal, scale, relu)


@_indexer_loss_fwd_op.register_fake
def _indexer_loss_fwd_fake(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    B, NQ, NK, HI, DI = q.shape[0], q.shape[2], k.shape[2], q_idx.shape[1], q_idx.shape[3]
    f32 = torch.float32
    return (q.new_empty((), dtype=f32), q.new_empty((B, NQ), dtype=f32), q.new_empty((B, HI, NQ, DI), dtype=f32),
            q.new_empty((B, 1, NK, DI), dtype=f32), q.new_empty((B, HI, NQ), dtype=f32))


@_custom_ops.custom_op("streamkl::indexer_loss_bwd", mutates_args=())
def _indexer_loss_bwd_op(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor,
                         k_idx: torch.Tensor, weights: torch.Tensor, lse_idx: torch.Tensor, dq_p: torch.Tensor,
                         dk_p: torch.Tensor, dw_p: torch.Tensor, causal: bool, scale: float,
                         relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    views = [_checks.compute_view(t) for t in (q, k, q_idx, k_idx, weights)]
    if _host._use_gluon(dims, *views[:4], pacc=True):  # the Gluon forward accumulated: its student part too
        return _backward_gluon_student(dims, g, *views, lse_idx, causal, relu, dq_p, dk_p, dw_p,
                                       (q_idx.dtype, k_idx.dtype, weights.dtype))
    rows = g.to(torch.float32).expand(q.shape[0], q.shape[2]).contiguous()
    return _host._backward(rows, q, k, q_idx, k_idx, weights, lse_idx, lse_idx, causal, scale, relu,
                     target_part=(g, dq_p, dk_p, dw_p))


def _backward_gluon_student(dims, g, q, k, q_idx, k_idx, weights, lse_idx, causal, relu, dq_p, dk_p, dw_p, out_dtypes):
    """(dq_idx, dk_idx, dweights) = g * (student part - target part): the student part
    ``softmax(I)``'s contractions by the Gluon kernel without its teacher (``student_grads``,
    g = 1), the target part from the accumulating forward."""
    dq_s, dw_s, dk_s = (torch.zeros_like(t) for t in (dq_p, dw_p, dk_p))
    lse_idx = lse_idx.to(torch.float32).contiguous()

    def launch(cfg):
        for buf in (dq_s, dw_s, dk_s):  # atomic adds
            buf.zero_()
        _host._gluon_indexer.student_grads(q, k, q_idx, k_idx, weights, lse_idx, causal, relu, (dq_s, dw_s, dk_s),
                                     config=cfg)

    key = ("idx_gluon_student", relu, dims.D, dims.DI, dims.H, dims.HI, q.dtype, q_idx.dtype, causal,
           _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B))
    launch(_tuning.pick(key, _host._gluon_indexer.candidates(dims, student=True), launch, ruled=False))
    g0 = g.to(torch.float32)
    # in place (no gradient-sized temporaries): the student buffers become g * (student - target)
    return tuple(s.sub_(p).mul_(g0).to(dt) for s, p, dt in ((dq_s, dq_p, out_dtypes[0]), (dk_s, dk_p, out_dtypes[1]),
                                                            (dw_s, dw_p, out_dtypes[2])))


@_indexer_loss_bwd_op.register_fake
def _indexer_loss_bwd_fake(g, q, k, q_idx, k_idx, weights, lse_idx, dq_p, dk_p, dw_p, causal, scale, relu):
    return torch.empty_like(q_idx), torch.empty_like(k_idx), torch.empty_like(weights)


def _loss_setup_context(ctx, inputs, output):
    q, k, q_idx, k_idx, weights, lse, causal, scale, relu = inputs
    _, lse_idx, dq_p, dk_p, dw_p = output
    ctx.save_for_backward(q, k, q_idx, k_idx, weights, lse_idx, dq_p, dk_p, dw_p)
    ctx.args = (causal, scale, relu)


def _loss_backward(ctx, g_total, g_lse_idx, g_dq, g_dk, g_dw):
    q, k, q_idx, k_idx, weights, lse_idx, dq_p, dk_p, dw_p = ctx.saved_tensors
    causal, scale, relu = ctx.args
    return _plan_mod._student_grads(ctx.needs_input_grad, lambda: _custom_ops.call(_indexer_loss_bwd_op,
        g_total, q, k, q_idx, k_idx, weights, lse_idx, dq_p, dk_p, dw_p, causal, scale, relu))


_custom_ops.register_autograd(_indexer_loss_fwd_op, _loss_backward, _loss_setup_context)
