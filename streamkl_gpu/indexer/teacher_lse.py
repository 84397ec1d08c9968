"""The indexer loss's teacher LSEs, one streaming pass: what ``indexer_kl`` computes first when
the caller gives no ``lse``, so that the training step takes the same fast path as with it.

``lse[b, h, t] = log sum_{s visible to t} exp(sigma q[b, h, t] . k[b, h // (H / H_K), s])``, float32
``[B, H, N_Q]``, natural log (FlashAttention's ``softmax_lse``; ``-inf`` for a row with no visible
key), bottom-right causal as every indexer kernel. The kernel is the forward's first pass,
``indexer/triton/fwd.py``'s ``_teacher_lse_kernel`` (an online logsumexp of the scores over the visible keys,
no values, the causal frontier's whole tiles unmasked and the diagonal band masked, scores in
bits); its launch candidates are the tuner's ``"lse"`` list (``indexer/configs.py``). For wide MQA
teachers on Hopper (``configs.gluon_family``) the Gluon pass ``indexer/gluon/lse_sm90.py`` runs
instead (q rows as the products' A operand from registers): ``STREAMKL_INDEXER_BACKEND`` and the
forcing hook's ``indexer_teacher_lse_config="gluon"`` choose as for the storing forward.

Cost: the teacher's scores once more, ``2 * N_Q * N_K * H * D`` FLOPs (causal: half), so a
training step without ``lse`` has the floor ``2 * N^2/2 * (2 H D + 3 H_I D_I)`` (causal) against
``2 * N^2/2 * (H D + 3 H_I D_I)`` with it; extra memory ``4 * B * H * N_Q`` bytes.

One custom op (``streamkl::indexer_teacher_lse``) with a fake implementation, so ``indexer_kl``
stays traceable by ``torch.compile(fullgraph=True)``; the LSEs are a constant (no gradient).
"""
from __future__ import annotations

import math

import torch

from streamkl_ref._checks import check_indexer_inputs

from streamkl_gpu._core import custom_ops as _custom_ops
from streamkl_gpu._core import env as _env
from streamkl_gpu._core import forcing as _forcing
from streamkl_gpu._core import checks as _checks
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu._core.launcher import kernel_call
from streamkl_gpu.indexer import configs as _configs
from streamkl_gpu.indexer import plan as _plan_mod
from streamkl_gpu.indexer.triton import fwd as _indexer_fwd

try:  # the Hopper pass in Gluon (MQA teachers); triton builds without Gluon keep the Triton pass
    from streamkl_gpu.indexer.gluon import lse_sm90 as _gluon_lse
except Exception as exc:  # noqa: BLE001 - no triton.experimental.gluon, or an API it does not know
    _gluon_lse = None
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    GLUON_IMPORT_ERROR = None

__all__ = ["teacher_lse", "teacher_lse_bits"]

LN2 = math.log(2.0)


def teacher_lse_bits(q, k, q_idx, k_idx, weights, causal: bool, scale: float) -> torch.Tensor:
    """The teacher's per-head LSEs in bits (log2), float32 ``[B, H, N_Q]`` (the kernels' unit)."""
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    q, k, q_idx, k_idx = (_checks.compute_view(t) for t in (q, k, q_idx, k_idx))
    ieee = q.dtype == torch.float32
    use_tma = _plan_mod._use_tma(q, k, q_idx, k_idx)
    lse_bits = _plan_mod._fresh((dims.B, dims.H, dims.NQ), torch.float32, q.device)
    group = dims.H // dims.HK
    if use_gluon(dims, q, k):
        return _gluon_lse.teacher_lse_bits(q, k, lse_bits, causal, dims.scale)

    def launch(cfg):
        pl = _plan_mod._plan(dims, cfg, "fwd")
        opts = pl["variant"].split("_")  # "tiles" / "l1" / "qreg" (Q_RESIDENT), then "lpt" (LPT)
        grid = (_runtime.cdiv(dims.NQ, pl["BLOCK_T"]), pl["n_chunks"], dims.B)
        tma, a_l1 = _plan_mod._load_mode(pl, use_tma)
        q_desc, k_desc, _, _ = _plan_mod._descriptors(pl, tma, q, k, q_idx, k_idx)
        kernel_call(_indexer_fwd._teacher_lse_kernel, grid)(
            q, k, q_desc, k_desc, lse_bits, *_plan_mod._strides(q), *_plan_mod._strides(k), dims.H, group, dims.NQ, dims.NK,
            dims.scale * _plan_mod.LOG2E, pl["cpg"], D=dims.D, BLOCK_D=pl["BLOCK_D"], HB=pl["HB"],
            BLOCK_T=pl["BLOCK_T"], BLOCK_N=pl["BLOCK_N"], CAUSAL=causal, IEEE=ieee,
            NO_CONTRACT=not _runtime.interpreting(), USE_TMA=tma, A_L1=a_l1, Q_RESIDENT=opts[0] == "qreg",
            LPT="lpt" in opts[1:], num_warps=pl["warps"], num_stages=pl["stages"])

    key = ("idx_lse", dims.D, dims.DI, dims.H, dims.HK, dims.HI, dims.HKI, q.dtype, q_idx.dtype, causal, use_tma,
           _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B))
    forced = _forcing.forced("indexer_teacher_lse_config")
    if forced not in (None, "triton"):  # a benchmark's choice (the forcing hook): launched as named, untimed
        launch(_configs.forced_lse_config(forced, dims))
        return lse_bits

    def in_order():  # the pick, then the other candidates (read only for a key not yet in _FITTING)
        cands = _configs._candidates("lse", ieee, dims)
        picked = _tuning.pick(key, cands, launch, ruled=_configs.ruled("lse", dims, cands))
        yield picked
        yield from (c for c in cands if c is not picked)

    _tuning.first_that_fits(_FITTING, key, in_order(), launch)
    return lse_bits


def gluon_why_not(dims, q, k) -> str:
    """Why the Gluon pass does not apply ('' when it does)."""
    if _gluon_lse is None:
        return f"Gluon is not available ({GLUON_IMPORT_ERROR})"
    if _runtime.interpreting() or q.device.type != "cuda":
        return "not a CUDA device (the Gluon pass does not run under the interpreter)"
    if q.dtype != k.dtype:
        return f"dtypes {q.dtype}, {k.dtype}: q and k must be one dtype"
    return _gluon_lse.why_not(dims, q.dtype, _runtime.tma_ok(q) and _runtime.tma_ok(k),
                              torch.cuda.get_device_capability(q.device))


def use_gluon(dims, q, k) -> bool:
    """Does the Gluon pass run? The forcing hook's ``indexer_teacher_lse_config``: ``"gluon"``
    forces it (a ``ValueError`` says why where it does not apply), ``"triton"`` the Triton pass
    with its own pick, any other choice is a Triton config; else ``STREAMKL_INDEXER_BACKEND``:
    ``gluon`` forces it, ``triton`` never, ``auto`` (default) where it applies in
    ``configs.gluon_family``."""
    forced = _forcing.forced("indexer_teacher_lse_config")
    mode = ("gluon" if forced == "gluon" else "triton") if forced is not None else _env.backend(_configs.BACKEND_VAR)
    if mode == "triton" or (mode == "auto" and not _configs.gluon_family(dims)):
        return False
    why = gluon_why_not(dims, q, k)
    if why and mode == "gluon":
        how = "indexer_teacher_lse_config='gluon'" if forced else f"{_configs.BACKEND_VAR}=gluon"
        raise ValueError(f"{how}, but the Gluon teacher-LSE pass does not apply: {why}")
    return not why


# launch key -> the config that ran: the pick, or where it does not fit the device (the DSA "qreg"
# tiles take 221 KB of shared memory, what a Hopper CTA has) the next candidate that does
_FITTING: dict = {}


@_custom_ops.custom_op("streamkl::indexer_teacher_lse", mutates_args=())
def _teacher_lse_op(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                    weights: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    # natural log, the unit of the caller's ``lse`` (the fast path takes it back to bits: one
    # rounding of a number of magnitude ~|lse|, far below the loss's tolerance)
    return teacher_lse_bits(q, k, q_idx, k_idx, weights, causal, scale).mul_(LN2)


@_teacher_lse_op.register_fake
def _teacher_lse_fake(q, k, q_idx, k_idx, weights, causal, scale):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32)


def teacher_lse(q, k, q_idx, k_idx, weights, *, causal: bool, scale: float) -> torch.Tensor:
    """The teacher's per-head LSEs, float32 ``[B, H, N_Q]``, natural log (``indexer_kl``'s ``lse``);
    ``scale`` is the resolved score scale (``check_indexer_inputs``'s ``dims.scale``). The
    indexer tensors only shape the launch (the tuner's key, the TMA decision); they are not read."""
    with torch.no_grad():
        return _custom_ops.call(_teacher_lse_op, q.detach(), k.detach(), q_idx.detach(), k_idx.detach(),
                                weights.detach(), causal, float(scale))
