"""``attention_kl``: the PyTorch entry point to the streaming KL kernels.

Conventions (docs/math.md): ``q1 [B,H,N_Q,D1]``, ``k1 [B,H_K1,N_K,D1]``,
``q2 [B,H,N_Q,D2]``, ``k2 [B,H_K2,N_K,D2]``; GQA per side; ``D1 != D2`` allowed; bottom-right
causal; rows with no visible key give KL 0 and zero gradient. Returns float32 ``[B,H,N_Q]``
KL(P1 || P2) in nats per query row.

Two custom ops (``streamkl::kl_fwd``, ``streamkl::kl_bwd``) with fake implementations and an
autograd formula make the function traceable by ``torch.compile`` without graph breaks. This
module holds only the ops, the autograd formula and the public functions (re-exported by
``streamkl_gpu.api`` and ``streamkl_gpu``); the launches live in ``attention/launch.py``, the
checks in ``_core/checks.py``, the launch configurations in ``attention/configs.py``, runtime
facts in ``_core/runtime.py``.
"""
from __future__ import annotations

from typing import Optional

import torch

from streamkl_gpu._core.checks import MAX_HEAD_DIM, SUPPORTED_DTYPES, check_bwd_mode, check_causal, check_flag, check_split_k, check_tensors
from streamkl_gpu.attention.launch import backward as _backward
from streamkl_gpu.attention.launch import forward as _forward
from streamkl_gpu.attention.launch import training_forward as _training_forward
from streamkl_gpu._core.runtime import LN2, interpreting
from streamkl_gpu.attention.configs import auto_bwd_mode, auto_split_k

__all__ = ["attention_kl", "attention_kl_with_lse", "auto_split_k", "auto_bwd_mode", "interpreting",
           "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]


# ----------------------------------------------------------------------------------------------
# torch.library custom ops + autograd (traceable by torch.compile)
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("streamkl::kl_fwd", mutates_args=())
def _kl_fwd_op(q1: torch.Tensor, k1: torch.Tensor, q2: torch.Tensor, k2: torch.Tensor,
               causal: bool, scale1: float, scale2: float, split_k: int,
               bwd_mode: str, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q1, k1, q2, k2, causal, scale1, scale2, None if split_k == 0 else split_k, one_buffer=False)


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


def _trained_sides(need):
    """(train1, train2) from ``ctx.needs_input_grad``: a side is trained when its q or k needs grad."""
    return bool(need[0] or need[1]), bool(need[2] or need[3])


def _kl_backward(ctx, g_kl, g_lse1, g_lse2):
    q1, k1, q2, k2, kl, lse1_bits, lse2_bits = ctx.saved_tensors
    causal, scale1, scale2, bwd_mode, deterministic = ctx.args
    need = ctx.needs_input_grad
    train1, train2 = _trained_sides(need)
    if not (train1 or train2):
        return (None,) * 10
    # the LSE outputs are internal (saved for backward); attention_kl never hands them out
    dq1, dk1, dq2, dk2 = _kl_bwd_op(g_kl, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, scale1, scale2,
                                    train1, train2, bwd_mode, deterministic)
    return (dq1 if need[0] else None, dk1 if need[1] else None,
            dq2 if need[2] else None, dk2 if need[3] else None) + (None,) * 6


_kl_fwd_op.register_autograd(_kl_backward, setup_context=_setup_context)


class _EagerAttentionKL(torch.autograd.Function):
    """The eager path: the same launches as the custom ops, called directly.

    The custom ops exist for torch.compile (fake implementations, no graph breaks); outside a
    compiled region their dispatch (schema binding, the dynamo-disable wrapper, autograd
    registration) cost more host time per call than the launches themselves, so eager calls
    come here. Both paths run ``launch.forward`` / ``launch.backward`` with the same arguments.
    The forward's training binding (``launch.training_forward``) carries the backward's plan
    from one call to the next. ``opts``: ``(causal, dims, split_k, bwd_mode, deterministic,
    want_lse)``, one argument (each argument of a Function costs the engine host time, forward and
    backward). ``want_lse``: the LSEs are outputs too (``attention_kl_with_lse``); otherwise the KL
    is the one output and the LSEs are only kept for the backward.
    """

    @staticmethod
    def forward(ctx, q1, k1, q2, k2, opts):
        causal, dims, split_k, bwd_mode, deterministic, want_lse = opts
        train1, train2 = _trained_sides(ctx.needs_input_grad)
        (kl, lse1_bits, lse2_bits), ctx.binding = _training_forward(q1, k1, q2, k2, causal, dims, split_k, train1,
                                                                    train2, bwd_mode, deterministic)
        ctx.args = (causal, dims, bwd_mode, deterministic, train1, train2)
        if not want_lse:
            # the LSEs are buffers of this call alone (never handed out, never written again): held
            # on ctx, without the saved-tensor bookkeeping the inputs and the output need
            ctx.save_for_backward(q1, k1, q2, k2, kl)
            ctx.lse = (lse1_bits, lse2_bits)
            return kl
        ctx.save_for_backward(q1, k1, q2, k2, kl, lse1_bits, lse2_bits)
        ctx.mark_non_differentiable(lse1_bits, lse2_bits)
        ctx.set_materialize_grads(False)  # no zero tensors for the LSE outputs (never differentiated)
        return kl, lse1_bits, lse2_bits

    @staticmethod
    def backward(ctx, g_kl, *g_lse):
        causal, dims, bwd_mode, deterministic, train1, train2 = ctx.args
        if not (train1 or train2) or g_kl is None:  # None: the KL output took no part in the loss
            return (None,) * 5
        q1, k1, q2, k2, kl, *lse = ctx.saved_tensors
        lse1_bits, lse2_bits = lse or ctx.lse
        dq1, dk1, dq2, dk2 = _backward(g_kl, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, dims.scale1,
                                       dims.scale2, train1, train2, bwd_mode, deterministic, dims=dims,
                                       binding=ctx.binding)
        need = ctx.needs_input_grad
        return (dq1 if need[0] else None, dk1 if need[1] else None,
                dq2 if need[2] else None, dk2 if need[3] else None, None)


# ``Function.apply`` is a Python wrapper around the C ``apply`` (``torch._C._FunctionBase``): outside
# functorch transforms it only passes each tensor argument through ``unwrap_if_dead`` (a tensor left
# over from a finished vmap or grad) and calls it; ``_train`` does the same without the wrapper's
# generic argument handling (12.1 against 9.7 us a call on the 2-core CPU machine, a Function of this
# form that launches nothing: bench/results/2026-12-07_cpu-2core_6f41c0c/; not measured on a GPU
# host). Inside a transform it takes ``Function.apply``.
_apply_c = super(torch.autograd.Function, _EagerAttentionKL).apply
_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _train(q1, k1, q2, k2, opts):
    if _transforms_active():
        return _EagerAttentionKL.apply(q1, k1, q2, k2, opts)
    return _apply_c(_unwrap_if_dead(q1), _unwrap_if_dead(k1), _unwrap_if_dead(q2), _unwrap_if_dead(k2), opts)


def _call(q1, k1, q2, k2, causal, scale1, scale2, split_k, bwd_mode, deterministic, want_lse=True):
    """Check the arguments, then run the forward: (kl in nats, lse1, lse2 in bits), or the KL
    alone with ``want_lse=False``.

    Under torch.compile: the custom op; in eager mode: the same launches without its dispatch."""
    causal = check_causal(causal)
    dims = check_tensors(q1, k1, q2, k2, scale1, scale2)
    check_bwd_mode(bwd_mode)
    check_split_k(split_k)
    deterministic = check_flag(deterministic, "deterministic")
    if torch.compiler.is_compiling():
        out = _kl_fwd_op(q1, k1, q2, k2, causal, dims.scale1, dims.scale2,
                         0 if split_k is None else split_k, bwd_mode, deterministic)
    elif torch.is_grad_enabled() and (q1.requires_grad or k1.requires_grad or q2.requires_grad or k2.requires_grad):
        return _train(q1, k1, q2, k2, (causal, dims, split_k, bwd_mode, deterministic, want_lse))
    else:  # nothing to train
        out = _forward(q1, k1, q2, k2, causal, dims.scale1, dims.scale2, split_k, dims=dims, keep_lse=want_lse)
    return out if want_lse else out[0]


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
            ``"separate"`` (dK and dQ kernels, no dQ atomics); above D = 128 always separate
            (the fused tiles outgrow the shared memory).
        deterministic: bitwise-repeatable gradients (separate kernels, no atomics anywhere).

    Returns:
        float32 ``[B, H, N_Q]``: KL in nats per query row. Differentiable: gradients go to exactly
        the inputs that require grad (setting 1: q2, k2; setting 2: q1, k1; or all four).
        NaN in an input gives NaN in the rows it reaches; it is never turned into 0.
    """
    return _call(q1, k1, q2, k2, causal, scale1, scale2, split_k, bwd_mode, deterministic, want_lse=False)
