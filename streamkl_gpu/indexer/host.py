"""Host code of the indexer's plain forward and backward: the teacher-LSE pass (``teacher_lse.py``),
the forward over key tiles (the general kernel, the GQA-teacher kernel, or for wide MQA teachers
the Hopper Gluon forward, ``indexer/gluon/fwd_sm90.py``), the split merge, and the two recomputing
backward kernels (dq_idx + dweights; dk_idx).

Kernels: ``indexer/triton/fwd.py``, ``fwd_gqa.py``, ``bwd.py``. The entry point and the custom ops
are in ``indexer/api.py``; the training designs that read the teacher once per step in
``indexer/training/``. Extra memory ``O(N_Q (H + 1))`` floats in the forward.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton

from streamkl_ref._checks import check_indexer_inputs

from streamkl_gpu._core import checks as _checks
from streamkl_gpu._core import env as _env
from streamkl_gpu._core import forcing as _forcing
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu._core.launcher import kernel_call
from streamkl_gpu.indexer import configs as _configs
from streamkl_gpu.indexer import plan as _plan_mod
from streamkl_gpu.indexer import teacher_lse as _teacher_lse  # the teacher's LSEs when the caller gives none
from streamkl_gpu.indexer.triton import bwd as _indexer_bwd
from streamkl_gpu.indexer.triton import fwd as _indexer_fwd
from streamkl_gpu.indexer.triton import fwd_gqa as _indexer_fwd_gqa  # the GQA teacher's forward

try:  # the Hopper forward in Gluon (MQA teachers); triton builds without Gluon keep the Triton path
    from streamkl_gpu.indexer.gluon import fwd_sm90 as _gluon_indexer
except Exception as exc:  # noqa: BLE001 - no triton.experimental.gluon, or an API it does not know
    _gluon_indexer = None
    GLUON_IMPORT_ERROR: Optional[str] = f"{type(exc).__name__}: {exc}"
else:
    GLUON_IMPORT_ERROR = None


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

def _forward(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    q, k, q_idx, k_idx, weights = (_checks.compute_view(t) for t in (q, k, q_idx, k_idx, weights))
    device = q.device
    ieee_t, ieee_i = q.dtype == torch.float32, q_idx.dtype == torch.float32
    qk_scale = dims.scale * _plan_mod.LOG2E  # teacher scores in bits: sigma * log2(e) * q.k
    group, group_i = dims.H // dims.HK, dims.HI // dims.HKI
    no_contract = not _runtime.interpreting()
    use_tma = _plan_mod._use_tma(q, k, q_idx, k_idx)
    key_base = (dims.D, dims.DI, dims.H, dims.HK, dims.HI, dims.HKI, q.dtype, q_idx.dtype, causal, use_tma,
                _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B))

    if lse is None:  # first pass: the teacher's per-head LSEs, in bits (indexer/teacher_lse.py)
        lse_bits = _teacher_lse.teacher_lse_bits(q, k, q_idx, k_idx, weights, causal, dims.scale)
    else:  # the caller's natural-log LSEs, once to bits (the kernels' unit)
        lse_bits = (lse * _plan_mod.LOG2E).contiguous()

    if _use_gluon(dims, q, k, q_idx, k_idx):
        return (*_forward_gluon(dims, q, k, q_idx, k_idx, weights, lse_bits, causal, relu, key_base), lse_bits)

    kl = _plan_mod._fresh((dims.B, dims.NQ), torch.float32, device)
    lse_idx = _plan_mod._fresh((dims.B, dims.NQ), torch.float32, device)

    def launch(cfg):
        pl = _plan_mod._plan(dims, cfg, "fwd")
        if _indexer_fwd_gqa.applies(pl, dims, use_tma):  # the GQA kernel (variants "gqa...")
            return _indexer_fwd_gqa.launch(dims, pl, q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, causal,
                                           relu, ieee_t, ieee_i)
        splits, per_split = _plan_mod._key_splits(dims, pl)
        part = _plan_mod._fresh((5, splits, dims.B, dims.NQ), torch.float32, device) if splits > 1 else kl
        grid = (_runtime.cdiv(dims.NQ, pl["BLOCK_T"]), splits, dims.B)
        tma, a_l1 = _plan_mod._load_mode(pl, use_tma)
        kernel_call(_indexer_fwd._indexer_fwd_kernel, grid)(
            q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, part,
            *_plan_mod._descriptors(pl, tma, q, k, q_idx, k_idx),
            *_plan_mod._strides(q), *_plan_mod._strides(k), *_plan_mod._strides(q_idx), *_plan_mod._strides(k_idx), *_plan_mod._strides(weights),
            dims.H, group, group_i, dims.NQ, dims.NK, qk_scale, 1.0 / dims.H,
            pl["n_chunks"], pl["cpg"], pl["n_ichunks"], pl["icpg"], per_split,
            D=dims.D, BLOCK_D=pl["BLOCK_D"], DI=dims.DI, BLOCK_DI=pl["BLOCK_DI"],
            HB=pl["HB"], IB=pl["IB"], BLOCK_T=pl["BLOCK_T"], BLOCK_N=pl["BLOCK_N"],
            CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i, NO_CONTRACT=no_contract,
            USE_TMA=tma, SPLIT=splits > 1, A_L1=a_l1,
            **_indexer_fwd.variant_meta(pl["variant"], _runtime.interpreting()),  # keys-major variants: "keys_flat" etc.
            num_warps=pl["warps"], num_stages=pl["stages"])
        if splits > 1:
            merged_kl, merged_lse = _plan_mod._merge_splits(part)
            kl.copy_(merged_kl)
            lse_idx.copy_(merged_lse)

    candidates = _configs._candidates("fwd", ieee_t or ieee_i, dims, _runtime.n_sm(device))
    launch(_tuning.pick(("idx_fwd", relu) + key_base, candidates, launch, ruled=_configs.ruled("fwd", dims, candidates)))
    return kl, lse_idx, lse_bits


# ----------------------------------------------------------------------------------------------
# The Gluon forward (Hopper, MQA teacher): STREAMKL_INDEXER_BACKEND chooses; by default the plain
# forward and the chunk design's storing forward (use_gluon_store) in the measured family
# ----------------------------------------------------------------------------------------------

BACKEND_VAR = _configs.BACKEND_VAR
GLUON_MODES = ("0", "1", "auto")  # the old STREAMKL_INDEXER_GLUON / _GLUON_PACC values
_gluon_auto = _configs.gluon_family  # (old "auto" too: the family where the Gluon kernels were measured faster)


def _old_gluon_var(pacc: bool) -> str:
    return "STREAMKL_INDEXER_GLUON_PACC" if pacc else "STREAMKL_INDEXER_GLUON"


def gluon_mode(pacc: bool = False) -> str:
    """``"0"`` the Triton kernel, ``"1"`` the Gluon kernel (``indexer/gluon/fwd_sm90.py``)
    or a ``ValueError`` saying why it does not apply (a forced path never falls back silently),
    ``"auto"`` the Gluon kernel where it applies and was measured faster (``_gluon_auto``).

    ``STREAMKL_INDEXER_BACKEND`` (the plain and accumulating forwards; the chunk design's storing
    forward: :func:`use_gluon_store`): ``auto`` (default) gives ``"auto"`` for the plain forward
    (measured faster in ``configs.gluon_family``) and ``"0"`` for the accumulating one (its Gluon
    form not timed), ``triton`` gives ``"0"``, ``gluon`` gives ``"1"``. While it is set to nothing
    the old names are read, per forward: ``STREAMKL_INDEXER_GLUON`` (the forward) /
    ``STREAMKL_INDEXER_GLUON_PACC`` (the accumulating forward) = ``0``, ``1`` or ``auto``; neither
    set: the default."""
    default = "0" if pacc else "auto"
    if _runtime.env(BACKEND_VAR) is not None:
        return {"auto": default, "triton": "0", "gluon": "1"}[_env.backend(BACKEND_VAR)]
    var = _old_gluon_var(pacc)
    mode = _env.old(var)
    if mode is None:
        return default
    if mode not in GLUON_MODES:
        raise ValueError(f"{var} must be one of {GLUON_MODES}, got {mode!r}")
    return mode


def gluon_why_not(dims, q, k, q_idx, k_idx, pacc: bool = False) -> str:
    """Why the Gluon forward (``pacc``: the accumulating one) does not apply ('' when it does)."""
    if _gluon_indexer is None:
        return f"Gluon is not available ({GLUON_IMPORT_ERROR})"
    if _runtime.interpreting() or q.device.type != "cuda":
        return "not a CUDA device (the Gluon forward does not run under the interpreter)"
    cap = torch.cuda.get_device_capability(q.device)
    return _gluon_indexer.why_not(dims, (q.dtype, k.dtype, q_idx.dtype, k_idx.dtype),
                                  all(_runtime.tma_ok(t) for t in (q, k, q_idx, k_idx)), cap, pacc)


def _use_gluon(dims, q, k, q_idx, k_idx, pacc: bool = False) -> bool:
    mode = gluon_mode(pacc)
    if mode == "0":
        return False
    if mode == "auto" and not _gluon_auto(dims):
        return False
    why = gluon_why_not(dims, q, k, q_idx, k_idx, pacc)
    if why and mode == "1":
        var = f"{BACKEND_VAR}=gluon" if _runtime.env(BACKEND_VAR) is not None else f"{_old_gluon_var(pacc)}=1"
        raise ValueError(f"{var}, but the Gluon {'accumulating ' if pacc else ''}forward does not apply: {why}")
    return not why


def use_gluon_store(dims, q, k, q_idx, k_idx) -> bool:
    """Does the chunk design's storing forward run the Gluon kernel? The forcing hook's
    ``indexer_storing_forward_backend`` (``"gluon"`` / ``"triton"``) first, else
    ``STREAMKL_INDEXER_BACKEND``: ``gluon`` forces it (a ``ValueError`` says why where it does not
    apply), ``triton`` never, ``auto`` (default) where it applies in ``configs.gluon_family``, where
    it was measured faster than the Triton storing forward (docs/indexer.md, "The Hopper forward in
    Gluon")."""
    forced = _forcing.forced("indexer_storing_forward_backend")
    if forced is not None and forced not in ("gluon", "triton"):
        raise ValueError(f"indexer_storing_forward_backend is 'gluon' or 'triton', got {forced!r}")
    mode = forced or _env.backend(BACKEND_VAR)
    if mode == "triton" or (mode == "auto" and not _gluon_auto(dims)):
        return False
    why = gluon_why_not(dims, q, k, q_idx, k_idx)
    if why and mode == "gluon":
        how = "indexer_storing_forward_backend='gluon'" if forced else f"{BACKEND_VAR}=gluon"
        raise ValueError(f"{how}, but the Gluon storing forward does not apply: {why}")
    return not why


def _forward_gluon(dims, q, k, q_idx, k_idx, weights, lse_bits, causal, relu, key_base):
    """(KL, LSE_I) by the Gluon forward: two key splits (its consumer warpgroups), merged here."""
    part = _plan_mod._fresh((5, 2, dims.B, dims.NQ), torch.float32, q.device)

    def launch(cfg):
        _gluon_indexer.forward_states(q, k, q_idx, k_idx, weights, lse_bits, causal, dims.scale, relu,
                                      config=cfg, part=part)

    cands = _gluon_indexer.candidates(dims)  # the first (the deepest ring) untimed, as the storing forward's
    launch(_tuning.pick(("idx_gluon_fwd", relu) + key_base, cands, launch, ruled=True))
    kl = _plan_mod._fresh((dims.B, dims.NQ), torch.float32, q.device)
    lse_idx = _plan_mod._fresh((dims.B, dims.NQ), torch.float32, q.device)
    _indexer_fwd_gqa.merge_states_wide(part, kl, lse_idx, 0, dims.NQ)  # the two warpgroups' states, one launch
    return kl, lse_idx


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

BWD_MODES = ("separate", "fused", "dqk")


def bwd_mode() -> str:
    """The backward's kernels: ``STREAMKL_INDEXER_BWD`` = ``separate`` (default: a dq/dweights
    kernel and a dk kernel, each recomputing the teacher; no atomics but dk's token splits),
    ``fused`` (the dk kernel alone, dq/dweights by fp32 atomics: the teacher read once per
    backward) or ``dqk`` (the dq kernel alone, each key tile's dk share added by fp32 atomics,
    DQK_TMA: one TMA bulk reduction: one pass, three indexer products per tile).

    Measured on an H200 at the DSA-like 8K causal point, by scripts since removed: ``fused``
    against ``separate`` with the teacher, fwd+bwd 132.9 ms against 136.7, one run
    (bench/results/2026-12-01_h200_e7b0b01/indexer_perf.csv, ``git show
    b7066de:bench/indexer_perf_gpu.py``); ``dqk`` against ``separate`` without the teacher (the
    accumulating design's student backward), 17.57 ms against 13.08 and 18.68 against 13.13 in
    two runs (bench/results/2026-12-01_h200_58bba27/idx_pacc.csv,
    bench/results/2026-12-01_h200_6c0ad88/idx_pacc.csv, ``git show b7066de:bench/idx_pacc_gpu.py``).
    ``separate`` stays the default: fused's 3 % lead is one run, dqk was 34-42 % slower; dqk
    with the teacher has not been timed."""
    mode = os.environ.get("STREAMKL_INDEXER_BWD", "separate")
    if mode not in BWD_MODES:
        raise ValueError(f"STREAMKL_INDEXER_BWD must be one of {BWD_MODES}, got {mode!r}")
    return mode


# The backward kernels sum the student's logits from their own products a = q_idx k_idx^T where
# one indexer key head makes a program's rows every indexer head (offline sm_90, triton 3.9, DSA
# student kernels on 4 warps: no spills, against 72 / 120 B with the logits formed again).
# False: formed again by _indexer_logits, as the first backward did (a script since
# removed, ``git show b7066de:bench/idx_pacc_gpu.py``, timed both).
BWD_LOGITS_FROM_A = True

# The dq kernel's dk shares ("dqk" backward, the chunk design) by one TMA bulk reduction per tile:
# off, fp32 atomics instead: on the H200 (triton 3.6) the TMA form stopped both with
# "illegal instruction" / "illegal memory access" (the accumulating forward's own dk_p reduction
# runs); not diagnosed.
DQK_TMA = False

# Tests set this: the dk kernel's token split (tokens per program) instead of the rule below.
INTERPRETER_DK_SPLIT = None


def dk_token_split(dims, block_t: int, block_n: int, n_sm: int, causal: bool) -> int:
    """Tokens per dk program (a multiple of BLOCK_T; N_Q or more means one split, no atomics).

    The dk kernel has one program per key tile; at DSA-like shapes that is ~N/64 programs for
    132 SMs, each walking up to N tokens (causal: a triangle, the first tile walks them all). So
    the tokens are cut into fixed-size splits until there are about 8 programs per SM (causal:
    about half exit at once), each split adding its partial dk with one fp32 atomic add.
    Reasoned, not yet measured.

    The programs are counted for **one batch entry** (key tiles x indexer key heads), so that
    the split, and with it the grouping of each entry's dk sum, does not depend on the batch
    size: an entry of a batch sums its dk as it does alone (with one or two splits bitwise, as
    fp32 addition of two partials onto zero commutes; with more, in an order the atomics
    choose). Counted over the whole batch, the split changed with B, and at 128K tokens
    (DSA-like, B = 2) the batched dk_idx was 8.5e-3 relative away from each entry's own
    (bench/results/2026-12-04_h200_cd11444/first_call_big.csv)."""
    if _runtime.interpreting() and INTERPRETER_DK_SPLIT is not None:
        per = INTERPRETER_DK_SPLIT
    else:
        want = 8 * n_sm * (2 if causal else 1)
        key_programs = _runtime.cdiv(dims.NK, block_n) * dims.HKI  # one batch entry's (see above)
        splits = max(1, min(_runtime.cdiv(want, key_programs), _runtime.cdiv(dims.NQ, 4 * block_t)))
        per = _runtime.cdiv(dims.NQ, splits)
    return max(block_t, _runtime.cdiv(per, block_t) * block_t)


def _backward(g, q, k, q_idx, k_idx, weights, lse_bits, lse_idx, causal, scale, relu, target_part=None,
              p_saved=None):
    """(dq_idx, dk_idx, dweights) of ``sum_t g[t] KL[t]``. ``target_part = (g0, dq_p, dk_p,
    dweights_p)``: the forward accumulated the target's share (``_indexer_pacc``, g = g0 for
    every row): the kernels then skip the teacher (TEACHER=False, the student's share
    ``g softmax(I)`` only) and ``g0 * target_part`` is subtracted here; ``lse_bits`` is unused.
    ``p_saved [B, N_Q, N_K]``: the target the forward stored (the "store" design): the
    teacher-free kernels read p from it (P_SAVED; any g); ``lse_bits`` is unused."""
    teacher = target_part is None and p_saved is None
    if p_saved is not None:  # the kernels read p where they would read the teacher LSEs
        lse_bits = p_saved
    plan_kind = "bwd" if teacher else "bwd_student"
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    out_dtypes = (q_idx.dtype, k_idx.dtype, weights.dtype)
    q, k, q_idx, k_idx, weights = (_checks.compute_view(t) for t in (q, k, q_idx, k_idx, weights))
    device = q.device
    ieee_t, ieee_i = q.dtype == torch.float32, q_idx.dtype == torch.float32
    qk_scale = dims.scale * _plan_mod.LOG2E
    group, group_i = dims.H // dims.HK, dims.HI // dims.HKI
    no_contract = not _runtime.interpreting()
    use_tma = _plan_mod._use_tma(q, k, q_idx, k_idx)
    g = g.to(torch.float32).contiguous()
    lse_bits, lse_idx = lse_bits.contiguous(), lse_idx.contiguous()
    dq_idx = _plan_mod._fresh((dims.B, dims.HI, dims.NQ, dims.DI), torch.float32, device)
    dweights = _plan_mod._fresh((dims.B, dims.HI, dims.NQ), torch.float32, device)
    dk_idx = _plan_mod._fresh((dims.B, dims.HKI, dims.NK, dims.DI), torch.float32, device)
    common = (q, k, q_idx, k_idx, weights, lse_bits, lse_idx, g)
    strides = _plan_mod._strides(q) + _plan_mod._strides(k) + _plan_mod._strides(q_idx) + _plan_mod._strides(k_idx) + _plan_mod._strides(weights)
    mode = bwd_mode()
    fused, dqk = mode == "fused", mode == "dqk"
    if dqk:
        dk_idx = torch.zeros((dims.B, dims.HKI, dims.NK, dims.DI), dtype=torch.float32, device=device)
    if fused:  # dq_idx / dweights by atomics from the dk kernel
        dq_idx = torch.zeros((dims.B, dims.HI, dims.NQ, dims.DI), dtype=torch.float32, device=device)
        dweights = torch.zeros((dims.B, dims.HI, dims.NQ), dtype=torch.float32, device=device)
    key_base = (mode, teacher, dims.D, dims.DI, dims.H, dims.HK, dims.HI, dims.HKI, q.dtype, q_idx.dtype, causal, relu,
                use_tma, _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B))
    if p_saved is not None:
        key_base += ("p_saved",)

    def meta(pl, tma, l1):
        return dict(D=dims.D, BLOCK_D=pl["BLOCK_D"], DI=dims.DI, BLOCK_DI=pl["BLOCK_DI"], DI_PAD=pl["DI_PAD"],
                    HB=pl["HB"], IB=pl["IB"], GI_PAD=pl["GI_PAD"], BLOCK_T=pl["BLOCK_T"], BLOCK_N=pl["BLOCK_N"],
                    CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i, NO_CONTRACT=no_contract,
                    USE_TMA=tma, TEACHER=teacher, L1=l1, P_SAVED=p_saved is not None,
                    # one indexer key head: a program's rows are every indexer head, so the logits
                    # are summed from its own products (no second product per tile)
                    LOGITS_FROM_A=BWD_LOGITS_FROM_A and pl["n_ichunks"] == 1, num_warps=pl["warps"],
                    num_stages=pl["stages"])

    def launch_dq(cfg):
        pl = _plan_mod._plan(dims, cfg, plan_kind)
        grid = (_runtime.cdiv(dims.NQ, pl["BLOCK_T"]), dims.B * dims.HKI)
        tma, l1 = _plan_mod._load_mode(pl, use_tma)
        dk_share, dk_desc = 0, None
        if dqk:  # dk_idx's shares from this kernel: zeroed; one bulk TMA reduction per tile on Hopper
            dk_idx.zero_()
            dk_share = 2 if DQK_TMA and tma and not _runtime.interpreting() else 1
            if dk_share == 2:
                dk_desc = _runtime.TensorDescriptor(dk_idx, list(dk_idx.shape), list(dk_idx.stride()),
                                                    [1, 1, pl["BLOCK_N"], pl["DI_PAD"]])
        kernel_call(_indexer_bwd._indexer_bwd_dq_kernel, grid)(
            *common, dq_idx, dweights, *_plan_mod._descriptors(pl, tma, q, k, q_idx, k_idx), dk_idx, dk_desc, 0, dims.NQ, *strides,
            dims.H, group, dims.HI, dims.HKI, group_i, dims.NQ, dims.NK, qk_scale, 1.0 / dims.H,
            pl["n_chunks"], pl["cpg"], pl["n_ichunks"], pl["icpg"], DK_SHARE=dk_share, **meta(pl, tma, l1))

    def launch_dk(cfg):
        nonlocal dk_idx
        pl = _plan_mod._plan(dims, cfg, plan_kind)
        per_split = dk_token_split(dims, pl["BLOCK_T"], pl["BLOCK_N"], _runtime.n_sm(device), causal)
        splits = _runtime.cdiv(dims.NQ, per_split)
        if splits > 1:
            dk_idx = torch.zeros((dims.B, dims.HKI, dims.NK, dims.DI), dtype=torch.float32, device=device)
        if fused:
            dq_idx.zero_()
            dweights.zero_()
        grid = (_runtime.cdiv(dims.NK, pl["BLOCK_N"]), dims.B * dims.HKI, splits)
        tma, l1 = _plan_mod._load_mode(pl, use_tma)
        kernel_call(_indexer_bwd._indexer_bwd_dk_kernel, grid)(
            *common, dk_idx, dq_idx, dweights, *_plan_mod._descriptors(pl, tma, q, k, q_idx, k_idx), *strides,
            dims.H, group, dims.HI, dims.HKI, group_i, dims.NQ, dims.NK, qk_scale, 1.0 / dims.H,
            pl["n_chunks"], pl["cpg"], pl["n_ichunks"], pl["icpg"], per_split, ATOMIC=splits > 1, FUSED_DQ=fused,
            **meta(pl, tma, l1))

    ieee = ieee_t or ieee_i
    for kind, run, wanted in (("bwd_dq", launch_dq, not fused), ("bwd_dk", launch_dk, not dqk)):
        if wanted:
            cands = _configs._candidates(kind, ieee, dims, teacher=teacher)
            run(_tuning.pick(("idx_" + kind,) + key_base, cands, run, ruled=_configs.ruled(kind, dims, cands)))
    if target_part is not None:
        g0, dq_p, dk_p, dw_p = target_part
        g0 = g0.to(torch.float32)
        # in place: no gradient-sized temporaries (with them the fwd+bwd peak was 160 KB per token at
        # DSA, 20.28 GiB at 128K: bench/results/2026-12-01_h200_5702577/indexer_memory.csv)
        dq_idx.addcmul_(g0, dq_p, value=-1.0)
        dk_idx.addcmul_(g0, dk_p, value=-1.0)
        dweights.addcmul_(g0, dw_p, value=-1.0)
    return dq_idx.to(out_dtypes[0]), dk_idx.to(out_dtypes[1]), dweights.to(out_dtypes[2])
