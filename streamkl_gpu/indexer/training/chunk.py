"""The chunk training design: the whole gradient of the sum formed in the forward chunk by chunk
of tokens (linear memory), the backward only scales it by g (custom op
``streamkl::indexer_loss_full_fwd``). The default for one key head, and for several where the step computes the LSEs
or has row weights (their storing forward: ``indexer/triton/fwd_gqa_store.py`` where the GQA kernel's plan applies).
Per-row weights (``row_weights``, ``training/row_weights.py``) are its gradient kernel's per-row g."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from streamkl_ref._checks import check_indexer_inputs
from streamkl_gpu._core import custom_ops as _custom_ops
from streamkl_gpu._core import forcing as _forcing
from streamkl_gpu.devtools import diagnostics as _diagnostics
from streamkl_gpu.indexer.triton import bwd as _indexer_bwd
from streamkl_gpu.indexer.triton import chunk_grad_keys as _chunk_grad_keys
from streamkl_gpu.indexer.triton import accumulate as _indexer_pacc
from streamkl_gpu.indexer.triton import fwd_gqa as _indexer_fwd_gqa  # the key splits' merge kernel
from streamkl_gpu.indexer.triton import fwd_gqa_store as _indexer_gqa_store  # several key heads
from streamkl_gpu.indexer.triton import scale_grads as _scale_grads
from streamkl_gpu._core import checks as _checks
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu._core.launcher import kernel_call
from streamkl_gpu.indexer import configs as _configs
from streamkl_gpu.indexer import host as _host
from streamkl_gpu.indexer import plan as _plan_mod
from streamkl_gpu.indexer.training import store as _store


# The "chunk" design (STREAMKL_INDEXER_PSTORE=chunk): the whole gradient of the sum (g = 1) in the
# forward, chunk by chunk of tokens: the storing forward writes the chunk's p into a scratch
# [B, PCHUNK_TOKENS, N_K] (linear memory: 4 * PCHUNK_TOKENS bytes per key), then the teacher-free
# dq kernel with DK_SHARE (the "dqk" backward, dk by fp32 atomics) reads it with the chunk's final LSE_I and forms
# g (softmax(I) - p)'s contractions for those tokens; the backward only scales by g. The teacher
# is read once, by the plain forward's tile.
PCHUNK_TOKENS = 2048
# The GQA storing forward's variant flag "-one" (fwd_gqa.parse_variant; the default order's,
# configs.STORING_FORWARD_GQA_FLAGS): as many tokens per chunk as keep the scratch p within this budget (at least PCHUNK_TOKENS),
# so a short sequence runs in one chunk: one storing forward, one merge, one gradient launch instead
# of one per 2048 tokens (GQA-like 8K: 256 MiB of p, 4 chunks -> 1). Extra memory stays linear in N
# past the budget (max(budget, 4 * PCHUNK_TOKENS * N_K * B bytes)).
PCHUNK_MAX_BYTES = 256 << 20


def _pchunk(dims, block_ts, one_chunk=False) -> int:
    """Tokens per chunk: PCHUNK_TOKENS (``one_chunk``: as many as PCHUNK_MAX_BYTES of p hold, at
    least PCHUNK_TOKENS) rounded up to a multiple of every launch's BLOCK_T."""
    m = 1
    for bt in block_ts:
        m = m * bt // math.gcd(m, bt)
    tokens = PCHUNK_TOKENS
    if one_chunk:
        tokens = max(tokens, PCHUNK_MAX_BYTES // (4 * dims.B * dims.NK))
    return max(m, _runtime.cdiv(min(tokens, dims.NQ), m) * m)


_FULL_CONFIGS = {}  # launch key -> the (storing forward, gradient kernel) configs that fit the device


def _forward_full(q, k, q_idx, k_idx, weights, lse, causal, scale, relu, row_weights=None):
    """(sum of KL, LSE_I, dq1, dk1, dw1): the forward and the gradient of the sum (g = 1), fp32.
    ``row_weights [B, N_Q]`` (fp32): the sum is ``sum_t row_weights[t] KL[t]`` and its gradient
    (the gradient kernel's per-row g), so per-row losses known at forward time keep this path.

    Untuned: the first candidates of each kernel (the storing forward's: the Gluon kernel's where
    ``host.use_gluon_store``, then the Triton ones in the plain forward's rule order,
    ``configs.storing_forward_candidates``; the gradient kernel's rule tile,
    ``configs.chunk_gradient_candidates``), or the next ones where a launch does not fit the device (Triton raises
    OutOfResources before the kernel runs: e.g. shared memory at D = 96); the pair
    that fits is remembered per shape class."""
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    ieee = q.dtype == torch.float32 or q_idx.dtype == torch.float32
    fwd_cands = _configs.storing_forward_candidates(ieee, dims, _runtime.n_sm(q.device),
                                                    _forcing.forced("indexer_storing_forward_order") or "forward_rule")
    if _host.use_gluon_store(dims, q, k, q_idx, k_idx):  # the Hopper Gluon kernel first (host.py)
        fwd_cands = tuple(_host._gluon_indexer.candidates(dims)) + tuple(fwd_cands)
    bwd_cands = _configs.chunk_gradient_candidates(ieee, dims, _forcing.forced("indexer_chunk_gradient_order") or "rule",
                                                   _forcing.forced("indexer_chunk_gradient_config"))
    key = ("idx_full", relu, dims.D, dims.DI, dims.H, dims.HK, dims.HI, dims.HKI, q.dtype, q_idx.dtype, causal,
           _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B), q.device.type,
           tuple(fwd_cands), tuple(bwd_cands))  # (a caller forcing other candidates gets its own entry)
    return _tuning.first_that_fits(
        _FULL_CONFIGS, key, ((fcfg, bcfg) for fcfg in fwd_cands for bcfg in bwd_cands),
        lambda pair: _forward_full_with(*pair, q, k, q_idx, k_idx, weights, lse, causal, scale, relu, row_weights))


def _forward_full_with(fcfg, bcfg, q, k, q_idx, k_idx, weights, lse, causal, scale, relu, row_weights=None):
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
    dq1 = _plan_mod._fresh((dims.B, dims.HI, dims.NQ, dims.DI), torch.float32, device)
    dw1 = _plan_mod._fresh((dims.B, dims.HI, dims.NQ), torch.float32, device)
    dk1 = torch.zeros((dims.B, dims.HKI, dims.NK, dims.DI), dtype=torch.float32, device=device)
    g_rows = (torch.ones((dims.B, dims.NQ), dtype=torch.float32, device=device) if row_weights is None
              else row_weights.to(torch.float32).contiguous())  # the gradient kernel's per-row g
    strides = _plan_mod._strides(q) + _plan_mod._strides(k) + _plan_mod._strides(q_idx) + _plan_mod._strides(k_idx) + _plan_mod._strides(weights)
    bpl = _plan_mod._plan(dims, bcfg, "bwd_student")
    gluon = _host._gluon_indexer is not None and isinstance(fcfg, _host._gluon_indexer.GluonIndexerConfig)
    if gluon:  # one CTA per token; its two consumer warpgroups are two key splits
        fpl, splits, gqa_store = None, 2, False
        chunk = _pchunk(dims, (1, bpl["BLOCK_T"]))
    else:
        fpl = _plan_mod._plan(dims, fcfg, "fwd")
        splits, per_split = _plan_mod._key_splits(dims, fpl)
        gqa_store = _indexer_gqa_store.applies(fpl, dims, use_tma)  # several key heads: the GQA kernel's loop
        one_chunk = gqa_store and _indexer_gqa_store.parse_variant(fpl["variant"]).one_chunk
        chunk = _pchunk(dims, (fpl["BLOCK_T"], bpl["BLOCK_T"]), one_chunk)
        ftma, fl1 = _plan_mod._load_mode(fpl, use_tma)
        fdesc = _plan_mod._descriptors(fpl, ftma, q, k, q_idx, k_idx)
    p = _plan_mod._fresh((dims.B, chunk, dims.NK), torch.float32, device)  # one chunk's target, reused
    part = (_plan_mod._fresh((5, splits, dims.B, dims.NQ), torch.float32, device) if splits > 1 and not gqa_store
            else kl)
    btma, _ = _plan_mod._load_mode(bpl, use_tma)
    dk_share = 2 if _host.DQK_TMA and btma and not _runtime.interpreting() else 1
    parts = _forcing.forced("indexer_chunk_gradient_parts")
    if parts is not None:  # a diagnostic (wrong dk_idx)
        dk_share = _diagnostics.indexer_chunk_gradient_parts(parts)
    dk_desc = (_runtime.TensorDescriptor(dk1, list(dk1.shape), list(dk1.stride()), [1, 1, bpl["BLOCK_N"], bpl["DI_PAD"]])
               if dk_share == 2 else None)
    bdesc = _plan_mod._descriptors(bpl, btma, q, k, q_idx, k_idx)
    for c0 in range(0, dims.NQ, chunk):
        rows = min(chunk, dims.NQ - c0)
        if gluon:
            _host._gluon_indexer.storing_states(q, k, q_idx, k_idx, weights, lse_bits, causal, dims.scale, relu, part,
                                                p, c0, rows, fcfg)
        elif gqa_store:  # (its key splits merged inside)
            _indexer_gqa_store.launch_chunk(dims, fpl, q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, p, c0, rows,
                                            causal, relu, ieee_t, ieee_i)
        else:
            kernel_call(_indexer_pacc._indexer_fwd_pstore_kernel, (_runtime.cdiv(rows, fpl["BLOCK_T"]), splits, dims.B))(
                q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, part, p, *fdesc, *strides,
                dims.H, group, group_i, dims.NQ, dims.NK, dims.scale * _plan_mod.LOG2E, 1.0 / dims.H,
                fpl["n_chunks"], fpl["cpg"], fpl["n_ichunks"], fpl["icpg"], per_split, c0, chunk,
                D=dims.D, BLOCK_D=fpl["BLOCK_D"], DI=dims.DI, BLOCK_DI=fpl["BLOCK_DI"],
                HB=fpl["HB"], IB=fpl["IB"], BLOCK_T=fpl["BLOCK_T"], BLOCK_N=fpl["BLOCK_N"],
                CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i, NO_CONTRACT=no_contract,
                USE_TMA=ftma, SPLIT=splits > 1, A_L1=fl1, num_warps=fpl["warps"], num_stages=fpl["stages"],
                **_store._pstore_meta(fpl))
        if splits > 1 and not gqa_store:  # this chunk's rows merged (one launch) before its gradient reads LSE_I
            _indexer_fwd_gqa.merge_states_wide(part, kl, lse_idx, c0, rows, t0=c0)
        if bpl["variant"].startswith("keys"):  # keys-major tiles (chunk_grad_keys.py)
            kernel_call(_chunk_grad_keys._chunk_grad_keys_kernel, (_runtime.cdiv(rows, bpl["BLOCK_T"]), dims.B * dims.HKI))(
                q_idx, k_idx, weights, p, lse_idx, g_rows, dq1, dw1, dk1, bdesc[2], bdesc[3], dk_desc, c0, chunk,
                *q_idx.stride(), *k_idx.stride(), *weights.stride(), dims.HI, dims.HKI, group_i, dims.NQ, dims.NK,
                DI=dims.DI, DI_PAD=bpl["DI_PAD"], GI_PAD=bpl["GI_PAD"], BLOCK_T=bpl["BLOCK_T"], BLOCK_N=bpl["BLOCK_N"],
                CAUSAL=causal, RELU=relu, IEEE_I=ieee_i, USE_TMA=btma, DK_SHARE=dk_share,
                BRANCH_LAYOUT=bpl["variant"] == "keys_branch", LPT=causal,  # causal: the longest rows first
                num_warps=bpl["warps"], num_stages=bpl["stages"])
            continue
        kernel_call(_indexer_bwd._indexer_bwd_dq_kernel, (_runtime.cdiv(rows, bpl["BLOCK_T"]), dims.B * dims.HKI))(
            q, k, q_idx, k_idx, weights, p, lse_idx, g_rows, dq1, dw1, *bdesc, dk1, dk_desc, c0, chunk, *strides,
            dims.H, group, dims.HI, dims.HKI, group_i, dims.NQ, dims.NK, dims.scale * _plan_mod.LOG2E, 1.0 / dims.H,
            bpl["n_chunks"], bpl["cpg"], bpl["n_ichunks"], bpl["icpg"], DK_SHARE=dk_share,
            D=dims.D, BLOCK_D=bpl["BLOCK_D"], DI=dims.DI, BLOCK_DI=bpl["BLOCK_DI"], DI_PAD=bpl["DI_PAD"],
            HB=bpl["HB"], IB=bpl["IB"], GI_PAD=bpl["GI_PAD"], BLOCK_T=bpl["BLOCK_T"], BLOCK_N=bpl["BLOCK_N"],
            CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i, NO_CONTRACT=no_contract,
            USE_TMA=btma, TEACHER=False, L1=False, P_SAVED=True,
            LOGITS_FROM_A=_host.BWD_LOGITS_FROM_A and bpl["n_ichunks"] == 1,
            num_warps=bpl["warps"], num_stages=bpl["stages"])
    total = kl.sum() if row_weights is None else torch.dot(kl.flatten(), g_rows.flatten())
    return total, lse_idx, dq1, dk1, dw1


@_custom_ops.custom_op("streamkl::indexer_loss_full_fwd", mutates_args=())
def _indexer_loss_full_fwd_op(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                              weights: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                              relu: bool, row_weights: Optional[torch.Tensor] = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_full(q, k, q_idx, k_idx, weights, lse, causal, scale, relu, row_weights)


@_indexer_loss_full_fwd_op.register_fake
def _indexer_loss_full_fwd_fake(q, k, q_idx, k_idx, weights, lse, causal, scale, relu, row_weights=None):
    B, NQ, NK, HI, HKI, DI = q.shape[0], q.shape[2], k.shape[2], q_idx.shape[1], k_idx.shape[1], q_idx.shape[3]
    f32 = torch.float32
    return (q.new_empty((), dtype=f32), q.new_empty((B, NQ), dtype=f32), q.new_empty((B, HI, NQ, DI), dtype=f32),
            q.new_empty((B, HKI, NK, DI), dtype=f32), q.new_empty((B, HI, NQ), dtype=f32))


def _full_setup_context(ctx, inputs, output):
    q_idx, k_idx, weights = inputs[2], inputs[3], inputs[4]
    _, _, dq1, dk1, dw1 = output
    ctx.save_for_backward(dq1, dk1, dw1)
    ctx.dtypes = (q_idx.dtype, k_idx.dtype, weights.dtype)


def _full_backward(ctx, g_total, g_lse_idx, g_dq, g_dk, g_dw):
    dq1, dk1, dw1 = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = _scaled_grads(g_total.to(torch.float32), [(t, dt) if need[i] else None
                                                      for i, t, dt in zip((2, 3, 4), (dq1, dk1, dw1), ctx.dtypes)])
    return (None, None, *grads) + (None,) * (len(need) - 5)  # lse, causal, scale, relu, row_weights


_SCALE_BLOCK = 1024  # elements per program (8 per thread at 4 warps)
_FAKE = (FakeTensor, FunctionalTensor)


def _scaled_grads(g, parts):
    """``[(g * t).to(dtype) or None for each (t, dtype) or None]`` in one launch
    (``triton/scale_grads.py``); ``g``: the 0-dim fp32 upstream gradient. Traced (torch.compile
    traces this backward with fake tensors), the PyTorch expression, which the compiler fuses."""
    if torch.compiler.is_compiling() or any(isinstance(t, _FAKE) for t in [g] + [p[0] for p in parts if p]):
        return [None if part is None else (g * part[0]).to(part[1]) for part in parts]
    outs = [None if part is None else torch.empty(part[0].shape, dtype=part[1], device=part[0].device)
            for part in parts]
    buffers = [(part[0], out, part[0].numel()) for part, out in zip(parts, outs) if part is not None]
    buffers += [(g, g, 0)] * (3 - len(buffers))  # (no elements: no program reads it)
    grid = (sum(_runtime.cdiv(n, _SCALE_BLOCK) for _, _, n in buffers),)
    if grid[0]:
        kernel_call(_scale_grads._scale_cast_kernel, grid)(g, *(x for buf in buffers for x in buf),
                                                            BLOCK=_SCALE_BLOCK, num_warps=4)
    return outs


_custom_ops.register_autograd(_indexer_loss_full_fwd_op, _full_backward, _full_setup_context)
