"""``indexer_kl``: the sparse-attention indexer loss, streamed (docs/math.md, "The indexer loss").

Teacher ``q [B, H, N_Q, D]``, ``k [B, H_K, N_K, D]`` (a constant: no gradient), target
``p = (1/H) sum_h softmax(sigma q_h k^T)``; student ``q_idx [B, H_I, N_Q, D_I]``,
``k_idx [B, H_KI, N_K, D_I]``, ``weights [B, H_I, N_Q]``, logits
``I = sum_j weights_j relu(q_idx_j k_idx^T)``; ``KL[b, t] = KL(p[t] || softmax(I[t]))`` in nats.
The float64 reference is ``streamkl_ref.indexer_kl`` (gradient: ``indexer_kl_grad``).

Kernels (``_indexer_fwd``, ``_indexer_bwd``): an optional first pass for the teacher LSEs, one
forward pass over key tiles per token block (all teacher heads of a key head share each key
tile; optionally the keys split over programs and merged here, the 8th config field), and a
backward of two recomputing kernels (dq_idx + dweights; dk_idx). Extra memory ``O(N_Q (H + 1))``
floats in the forward. Two custom ops (``streamkl::indexer_fwd``, ``streamkl::indexer_bwd``) with
fake implementations make the function traceable by ``torch.compile(fullgraph=True)``.

The accumulating design (``STREAMKL_INDEXER_PACC``, default ``auto``: on for an MQA teacher;
``"sum"``/``"mean"`` with ``lse`` given, one indexer key head, a gradient wanted): ``_indexer_pacc``'s forward also sums the target's share of
the gradient, and the backward runs the indexer alone: the teacher is read once per training
step (custom ops ``streamkl::indexer_loss_fwd`` / ``streamkl::indexer_loss_bwd``). The "store"
design (``STREAMKL_INDEXER_PSTORE``, in the same cases): the plain forward's tile also writes the
target p ``[B, N_Q, N_K]`` and the backward's teacher-free kernels read it back (custom ops
``streamkl::indexer_loss_pstore_fwd`` / ``streamkl::indexer_loss_pstore_bwd``).
"""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
import triton

from streamkl_ref._checks import check_indexer_inputs

from streamkl_gpu.indexer.triton import bwd as _indexer_bwd
from streamkl_gpu.indexer.triton import fwd as _indexer_fwd
from streamkl_gpu.indexer.triton import accumulate as _indexer_pacc
from streamkl_gpu.indexer.triton import fwd_gqa as _indexer_fwd_gqa  # the GQA teacher's forward
from streamkl_gpu._core import checks as _checks
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning

try:  # the Hopper forward in Gluon (MQA teachers); triton builds without Gluon keep the Triton path
    from streamkl_gpu.experimental import indexer_fwd_sm90 as _gluon_indexer
except Exception as exc:  # noqa: BLE001 - no triton.experimental.gluon, or an API it does not know
    _gluon_indexer = None
    GLUON_IMPORT_ERROR: Optional[str] = f"{type(exc).__name__}: {exc}"
else:
    GLUON_IMPORT_ERROR = None

__all__ = ["indexer_kl", "indexer_kl_naive", "MAX_TEACHER_HEAD_DIM", "MAX_INDEXER_HEAD_DIM", "REDUCTIONS"]

MAX_TEACHER_HEAD_DIM = 576  # absorbed MLA: 512 + 64, tiled along D (never padded to 1024)
MAX_INDEXER_HEAD_DIM = 256
REDUCTIONS = ("none", "sum", "mean")
LOG2E = 1.4426950408889634

# One fixed configuration under the interpreter (tests may override):
# (teacher rows, indexer rows, BLOCK_N, BLOCK_D, num_warps, num_stages)
INTERPRETER_CONFIG = (32, 32, 32, 32, 1, 1)
# fp32 inputs: IEEE dots on the FMA units, small tiles (as attention_kl's _IEEE_CONFIG)
_IEEE_CONFIG = (32, 32, 32, 32, 4, 1)


def _fresh(shape, dtype, device):
    # read at call time, so the tests' poison fixture (_runtime.POISON_FRESH) applies here too
    if _runtime.POISON_FRESH:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _pow2(n: int) -> int:
    return _runtime.next_power_of_2(max(1, int(n)))


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------

_NAMES = ("q", "k", "q_idx", "k_idx", "weights")


def _check(q, k, q_idx, k_idx, weights, *, causal, scale, relu, lse, reduction):
    tensors = (q, k, q_idx, k_idx, weights)
    for name, t in zip(_NAMES, tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError("q, k, q_idx, k_idx, weights must be on one device, got "
                         + ", ".join(f"{n}: {t.device}" for n, t in zip(_NAMES, tensors)))
    if q.device.type == "cpu" and not _runtime.interpreting():
        raise ValueError(
            "the inputs are CPU tensors, but the Triton kernels need a GPU. To run them on CPU "
            "(slowly, for testing), set the environment variable TRITON_INTERPRET=1 before "
            "importing streamkl_gpu.")
    for name, t in zip(_NAMES, tensors):
        if t.dtype not in _checks.SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if k.dtype != q.dtype:
        raise ValueError(f"k has dtype {k.dtype} but q has {q.dtype}: the teacher's q and k must match")
    if k_idx.dtype != q_idx.dtype:
        raise ValueError(f"k_idx has dtype {k_idx.dtype} but q_idx has {q_idx.dtype}: the indexer's q_idx and k_idx must match")
    if dims.D > MAX_TEACHER_HEAD_DIM:
        raise ValueError(f"q has head dim {dims.D}; the teacher supports head dims up to {MAX_TEACHER_HEAD_DIM}")
    if dims.DI > MAX_INDEXER_HEAD_DIM:
        raise ValueError(f"q_idx has head dim {dims.DI}; the indexer supports head dims up to {MAX_INDEXER_HEAD_DIM}")
    if 0 in (dims.B, dims.H, dims.NQ, dims.NK, dims.HI):
        raise ValueError(f"empty problem: B={dims.B}, H={dims.H}, H_I={dims.HI}, N_Q={dims.NQ}, N_K={dims.NK}")
    for name, flag in (("causal", causal), ("relu", relu)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if lse is not None:
        if not isinstance(lse, torch.Tensor):
            raise ValueError(f"lse must be None or a torch.Tensor, got {type(lse).__name__}")
        want = (dims.B, dims.H, dims.NQ)
        if tuple(lse.shape) != want:
            raise ValueError(f"lse must have shape [B, H, N_Q] = {list(want)}, got {list(lse.shape)}")
        if lse.dtype != torch.float32:
            raise ValueError(f"lse must be float32 (natural-log LSEs, FlashAttention's softmax_lse), got {lse.dtype}")
        if lse.device != q.device:
            raise ValueError(f"lse is on {lse.device} but q is on {q.device}: they must share a device")
    return dims


# ----------------------------------------------------------------------------------------------
# Launch plans
# ----------------------------------------------------------------------------------------------

def _plan(dims, cfg, kind):
    """Chunking of one launch: teacher heads per chunk HB, indexer heads per chunk IB, tokens per
    block BLOCK_T (all powers of two; every dot at least 16 wide). Memoised (a pure function of
    its arguments; the host path plans every candidate on each call): a fresh dict each time."""
    return dict(_plan_cached(dims, tuple(cfg), kind))


@functools.lru_cache(maxsize=4096)
def _plan_cached(dims, cfg, kind):
    rows, irows, block_n, block_d, warps, stages, *rest = cfg
    # optional 7th field: teacher heads per chunk at most (None: no cap)
    hb_max = rest[0] if rest and rest[0] is not None else rows
    group, group_i = dims.H // dims.HK, dims.HI // dims.HKI
    hb = min(_pow2(group), _pow2(rows), hb_max)
    gi_pad = _pow2(group_i)
    if kind == "fwd":
        block_t = max(1, rows // hb)
    elif kind == "bwd_student":  # no teacher tiles (TEACHER=False): the indexer rows alone
        block_t = max(1, irows // gi_pad)
    else:  # the backward holds every indexer head of a key head (dq/dk accumulators): <= irows rows
        block_t = max(1, min(rows // hb, irows // gi_pad))
    ib = min(gi_pad, max(1, _pow2(irows) // block_t))
    block_t = max(block_t, 16 // hb, 16 // ib, 16 // gi_pad if kind != "fwd" else 1)
    if kind != "fwd":  # the backward's q_idx rows / k_idx tiles are whole boxes (TMA: one descriptor each)
        ib = gi_pad
    cpg = _runtime.cdiv(group, hb)
    icpg = _runtime.cdiv(group_i, ib)
    return dict(
        HB=hb, IB=ib, GI_PAD=gi_pad, BLOCK_T=block_t, BLOCK_N=block_n,
        BLOCK_D=_d_chunk(dims.D, block_d),
        BLOCK_DI=_d_chunk(dims.DI, block_d) if kind == "fwd" else _checks.head_pad(dims.DI),
        DI_PAD=_checks.head_pad(dims.DI), warps=warps, stages=stages,
        n_chunks=dims.HK * cpg, cpg=cpg, n_ichunks=dims.HKI * icpg, icpg=icpg,
        splits=int(rest[1]) if len(rest) > 1 else 1, variant=rest[2] if len(rest) > 2 else "tiles",
    )


def _load_mode(pl, use_tma):
    """(TMA loads, q rows through L1) of a launch: the "l1" variant (9th config field) reads the
    score tiles by pointers, the teacher's (and indexer's) q rows cached in L1 (cp.async.ca), which
    TMA cannot do: a token's 147 KB of DSA q rows, re-read for every key tile, then come from L1."""
    if pl["variant"] == "l1":
        return False, True
    return use_tma, False


def _key_splits(dims, pl):
    """(splits, keys per split) of a forward launch: the plan's key splits, each a whole number
    of BLOCK_N tiles, never more splits than key tiles."""
    key_tiles = _runtime.cdiv(dims.NK, pl["BLOCK_N"])
    splits = max(1, min(pl["splits"], key_tiles))
    per = _runtime.cdiv(key_tiles, splits) * pl["BLOCK_N"]
    return _runtime.cdiv(dims.NK, per), per


def _merge_splits(part):
    """(KL, LSE_I) [B, N_Q] from the key splits' states ``part [5, splits, B, N_Q]`` (m, l, mass,
    acc, plogp; acc re-referenced to its split's max): the online merge of
    streamkl_ref.indexer_kl_online's state, re-referenced to the common max, then the kernel's
    finalisation (``_indexer_fwd._finish``). A NaN state gives a NaN row."""
    m, l, mass, acc, plogp = part.unbind(0)
    m_all = m.amax(0)  # NaN propagates (the kernel's own max ignores NaN; its l is NaN then)
    shift = torch.where(m_all == float("-inf"), 0.0, m_all)
    m_safe = torch.where(m == float("-inf"), 0.0, m)
    l_all = (l * torch.exp(m - shift)).sum(0)  # exp(-inf) = 0 for a split that saw no key
    acc_all = (acc - mass * (shift - m_safe)).sum(0)
    plogp_all = plogp.sum(0)
    empty = l_all == 0.0
    log_l = torch.log(torch.where(empty, 1.0, l_all))
    kl = torch.where(empty, 0.0, plogp_all - acc_all + log_l)
    lse_i = torch.where(empty, float("-inf"), m_all + log_l)
    return kl, lse_i


def _d_chunk(d: int, block_d: int) -> int:
    """Width of the D chunks of a score tile: the whole (padded) head up to 128 wide when the
    config asks for >= 64-wide chunks (no K loop overhead), else ``block_d`` (D = 576: 9 x 64)."""
    pad = _checks.head_pad(d)
    return pad if (pad <= 128 and block_d >= 64) else min(block_d, pad)


def _fwd_split(dims, cfg, n_sm, waves=4):
    """Key splits that bring a forward launch to about ``waves`` programs per SM (1: enough
    token blocks already)."""
    blocks = _runtime.cdiv(dims.NQ, _plan(dims, cfg, "fwd")["BLOCK_T"]) * dims.B
    return max(1, min(16, _runtime.cdiv(waves * n_sm, blocks)))


def _l1_fits(dims) -> bool:
    """The "l1" variant only where one token's teacher q rows (all heads, one key head) fit in L1
    beside the kernel's shared memory: H * D * 2 bytes <= 160 KB (DSA: 147 KB)."""
    return dims.HK == 1 and _plan(dims, (128, 128, 64, 64, 8, 2), "fwd")["BLOCK_T"] == 1 and dims.H * dims.D * 2 <= 160 * 1024


def _new_fwd_candidates(dims, gqa, n_sm):
    """Session 4's forward candidates (issue 10's targets; chosen by offline sm_90 compiles and
    the FLOP-per-byte count of a score tile, not yet timed; bench/indexer_perf_gpu.py times each).

    The score tile of ``rows`` (head, token) pairs by BLOCK_N keys re-reads its q rows from L2 for
    every key tile: about rows * BLOCK_N / (rows + BLOCK_N) FLOP per byte (43 at 128 x 64, the
    measured DSA forward ran at ~4 TB/s of it). BLOCK_N = 128 takes it to 64 (no spills at DSA:
    234 registers on triton 3.9; 256 rows x 128 keys would give 85 but spills 144 B). GQA at 8K had 64-256 programs for 132 SMs, each a serial chain of small tiles: key
    splits (8th field) bring it to ~4 programs per SM."""
    if dims is None:
        return []
    if not gqa:
        # (256 rows x 128 keys spills 144 B on triton 3.9: left out; 128 x 128 spills 176 B on
        # 3.6, none on 3.9). Measured (H200, DSA 8K causal, lse given, s4r4 run): 8 warps, 3
        # stages 25.05 ms (3.50x the floor), 2 stages 30.26. The "l1" variants (pointer loads, the
        # token's q rows cached in L1) measured 46.1 / 30.9 / 71.0 ms at BLOCK_N = 64 / 128 / 32:
        # no longer candidates (bench/indexer_perf_gpu.py still times them, forced).
        # Session 5: 128 x 128 tiles on 4 warps (one warpgroup, two m64 wgmma per k-step): offline
        # sm_90 compiles, triton 3.6 and 3.9, 255 registers, no spills, 49 KB (2 stages) / 82 KB
        # (3 stages) of shared memory: two CTAs per SM, so one CTA's exponentials and head sums
        # run while the other's products are on the tensor cores (8 warps x 253 registers: one
        # CTA per SM, nothing to overlap with). 16 warps (256 rows, or 128 x 256): capped at 128
        # registers, ~500 B of spills: left out.
        # The lead's Nsight Compute of the best (r5a): tensor pipe 24 %, L2 36 %, 2 warps per
        # scheduler: latency bound, not L2 bound; so also 64 heads x 64 keys (7th field: 64 heads
        # per chunk) on 4 warps: 130 registers, 41 KB, three CTAs per SM (offline).
        # Measured (H200, triton 3.6, DSA 8K causal, lse given, run r5c): 4 warps 3 stages
        # 17.48 ms = 2.34x the floor (the first: the untuned choice), 4 warps 2 stages 21.36,
        # 8 warps 3 stages 24.89, 64 x 64 on 4 warps 28.25.
        out = [(128, 128, 128, 64, 4, 3), (128, 128, 128, 64, 4, 2), (128, 128, 128, 64, 8, 3),
               (128, 128, 128, 64, 8, 2), (64, 64, 64, 64, 4, 3, 64)]
        # Session 6 (s6-idxdsa): keys-major score tiles (9th field "keys", _indexer_fwd.variant_meta:
        # S^T = k q^T, the head sum a row sum of the accumulator, no cross-warp reduction; the
        # per-column LSEs / weights loaded once per program). Measured (H200, triton 3.6, DSA 8K
        # causal, lse given, run s6r2, bench/idx_dsa_gpu.py): 128 keys on 4 warps, 3 stages 13.69 ms
        # = 1.87x the floor (row-major default 18.06 in the same run), 16K 61.2 ms = 2.08x (default
        # 77.4); 8 warps at maxnreg 128 14.18; 8 warps 15.76; 2 stages 15.75; 64-key tiles 20.0-25.6
        # (flattened loops, "flat", and reversed token order, "lpt", did not close the gap).
        # First for the DSA-like family (one token per tile, H >= 128: the measured layout);
        # other MQA teachers keep the row-major order and try it last.
        # Run s6r3 (round-robin medians, 8K / 16K / 32K / 64K): key splits of 4096 keys and token
        # blocks in reverse ("lpt") 13.18 / 53.52 / 215.7 / 854.5 ms = 1.84 / 1.87 / 1.88 / 1.87x the
        # floor, against 14.13 / 60.16 / 254.9 / 1106.5 = 1.97 / 2.10 / 2.23 / 2.42x without either
        # (splits alone 13.40 / 52.41 / 220.7; lpt alone 12.99 / 55.45 / 216.5; row-major 21.27 /
        # 84.34 / 328.96; 8 warps r128 with splits 13.76 / 58.78 / 222.9).
        splits = _keys_major_splits(dims)
        keys = [(128, 128, 128, 64, 4, 3, None, splits, "keys_lpt"), (128, 128, 128, 64, 8, 3, None, splits, "keys_r128"),
                (128, 128, 128, 64, 4, 3, None, 1, "keys")]
        out = keys + out if _keys_major_first(dims) else out + keys
    else:
        out = []
        # (64, 64, 64, 64, 4, 3, 1): 64 tokens x 64 keys of one head on 4 warps, 3 stages: 198
        # registers, no spills (offline sm_90, triton 3.9), so two CTAs per SM (the measured best,
        # (128, 128, 128, 64, 8, 2, 1), 2.29 ms at 8K, has 255 registers and 40 B of spills; Nsight
        # Compute of it, lead's r5b: tensor pipe 19 %, issue 24 %, stalls on waits and barriers:
        # latency bound). Smaller tiles for more CTAs per SM: 32 x 64 (136 registers, 24 KB: three
        # per SM), 64 x 32 (108 registers, 74 KB, 3 stages: three per SM).
        # Measured (r5c, GQA 8K): 64 x 64 3 stages 2.341 ms = 5.02x (first), 128 x 128 8 warps
        # 2.483, 64 x 32 2.700, 64 x 64 2 stages 3.256, 32 x 64 4.785.
        # s6-idxgqa: the GQA kernel (_indexer_fwd_gqa) first, its key splits by its own rule; run
        # s6r3: "gqa-band" 64 x 64, 24 splits 1.967 ms = 4.31x at 8K, 4.464 = 2.45x at 16K, against
        # 2.681 / 6.840 for (64, 64, 64, 64, 4, 3, 1, 5) in the same run
        out += _indexer_fwd_gqa.candidates(dims, n_sm)
        for base in ((64, 64, 64, 64, 4, 3, 1), (128, 128, 128, 64, 8, 2, 1), (128, 128, 64, 64, 8, 2, None),
                     (128, 128, 64, 64, 8, 2, 1), (64, 64, 64, 64, 4, 2, None), (64, 64, 64, 64, 4, 2, 1),
                     (32, 32, 64, 64, 4, 2, 1), (64, 64, 32, 64, 4, 3, 1)):
            out.append(_canonical(base + (_fwd_split(dims, base, n_sm),)))
    return out


def _keys_major_first(dims) -> bool:
    """The keys-major forward first (the untuned choice): MQA teachers of at least 128 heads, so
    a 128-row tile is one token's heads (BLOCK_T = 1), the layout measured at DSA (s6r2)."""
    return dims.HK == 1 and dims.H >= 128


# Keys per split of the keys-major forward from this many keys on (None: no key splits). Splits
# keep the resident programs on one key range, so their key window stays in L2 beside their q rows
# (without: ~264 resident CTAs x 147 KB of q rows, ~39 MB, plus every key up to the diagonal, 19 MB
# at 16K and 75 MB at 64K, against the H200's 50 MB of L2: 2.10x the floor at 16K, 2.42x at 64K
# in run s6r3, 1.87x with splits). Measured from 8K (run s6r3); below, one split. At most
# KEYS_MAJOR_MAX_SPLITS: the splits' states (PART, 5 floats per split and token) stay a bounded
# 320 B per token, so the forward's extra memory stays linear in N (past 64K the splits grow
# beyond 4096 keys: 8192 at 128K, not timed).
KEYS_MAJOR_SPLIT_FROM = 8192
KEYS_MAJOR_KEYS_PER_SPLIT = 4096
KEYS_MAJOR_MAX_SPLITS = 16


def _keys_major_splits(dims) -> int:
    """Key splits of the keys-major forward candidates (8th config field)."""
    if KEYS_MAJOR_SPLIT_FROM is None or dims.NK < KEYS_MAJOR_SPLIT_FROM:
        return 1
    return min(KEYS_MAJOR_MAX_SPLITS, _runtime.cdiv(dims.NK, KEYS_MAJOR_KEYS_PER_SPLIT))


def l1_fwd_candidates(dims):
    """The forward's "l1" variants (measured slower at DSA, s4r4: no longer the tuner's
    candidates); bench/indexer_perf_gpu.py still times them, forced."""
    if dims is None or not _l1_fits(dims):
        return []
    return [(128, 128, 64, 64, 8, 2, None, 1, "l1"), (128, 128, 128, 64, 8, 2, None, 1, "l1"),
            (128, 128, 32, 64, 8, 2, None, 1, "l1")]


def _canonical(cfg):
    """A config without its trailing default fields (key splits 1, heads cap None), so that
    equal plans are one candidate."""
    cfg = tuple(cfg)
    while len(cfg) > 6 and cfg[-1] == (1 if len(cfg) == 8 else None):
        cfg = cfg[:-1]
    return cfg


def _candidates(kind, ieee, dims=None, n_sm=132, teacher=True):
    """Launch configs of a kernel kind, the untuned default first. The GPU's lists are memoised:
    forming them plans every candidate, which cost ~half of a GQA forward's host time (a CPU
    timing with the launches stubbed: 650 -> 300 us with the host-side cdiv alone)."""
    if _runtime.interpreting():
        return [INTERPRETER_CONFIG]
    if ieee:
        return [_IEEE_CONFIG]
    return list(_gpu_candidates(kind, dims, n_sm, teacher))


@functools.lru_cache(maxsize=1024)
def _gpu_candidates(kind, dims, n_sm, teacher):
    # (teacher rows, indexer rows, BLOCK_N, BLOCK_D, warps, stages); not yet measured on the GPU
    # Pruned by offline sm_90 compiles (triton 3.6 and 3.9, TMA path): BLOCK_N = 128 spills in the
    # forward at both anchor configs (DSA 32 B, GQA 552 B of stack); 256 teacher rows spill 104 B
    # at DSA on 3.6. The first candidate spills nowhere. Times not yet measured.
    # Measured (H200, pointer loads, before TMA; bench/results/session3 r3): DSA-like 8K forward
    # 3.6x the floor, GQA-like 17.6x. GQA's chunks of 4 heads x 32 tokens need a reshape-sum per
    # chunk and 8 chunks per key tile; a 7th field of 1 makes chunks of one head x 128 tokens
    # (no head sum inside a chunk), tried where there is more than one key head. Not yet measured.
    gqa = dims is not None and dims.HK > 1
    if kind == "fwd":
        # the measured best first (the untuned choice, STREAMKL_AUTOTUNE=0), then the rest
        second = (128, 128, 64, 64, 8, 2, 1) if gqa else (128, 128, 64, 64, 8, 3)
        old = [(128, 128, 64, 64, 8, 2), second, (256, 128, 64, 64, 8, 2)]
        return list(dict.fromkeys(_new_fwd_candidates(dims, gqa, n_sm) + old))  # no duplicates
    if kind == "pacc":
        # planned as the backward ("bwd"): all indexer heads x BLOCK_T tokens per tile. Offline
        # sm_90 compiles (triton 3.9, DSA 8K, dk shares by TMA reduction): BLOCK_N = 32 spills
        # nothing (254 registers), BLOCK_N = 64 spills 216 B of stack, yet measured the faster.
        # Measured (H200, DSA 8K causal fwd+bwd, 12:49 run): BLOCK_N = 64 73.2 ms, 32 101.3 ms.
        # s4r4 run: 3 stages 52.96 ms, 2 stages 61.79, "l1" 60.29. Session 5: BLOCK_N = 128 (the
        # forward's best tile; offline sm_90, triton 3.9: ~1 KB of spills, BLOCK_N = 64 328 B),
        # r5c: BLOCK_N = 64 53.05 ms fwd+bwd (accumulating forward 38.71, backward 14.34), BLOCK_N
        # = 128 54.13. 4 warps (two CTAs per SM, as the forward's best): spills 568 B offline at
        # BLOCK_N = 64, not yet timed.
        return [(128, 128, 64, 64, 8, 3), (128, 128, 64, 64, 4, 3), (128, 128, 128, 64, 8, 3), (128, 128, 64, 64, 8, 2),
                (128, 128, 64, 64, 8, 2, None, 1, "l1"), (128, 128, 128, 64, 8, 2), (128, 128, 32, 64, 8, 2),
                (128, 128, 32, 64, 8, 2, None, 1, "l1"), (128, 128, 32, 64, 8, 3), (128, 128, 32, 64, 4, 2)]
    if kind == "pstore":  # the forward's tile (it only adds a store of p per tile): the forward's candidates
        return _gpu_candidates("fwd", dims, n_sm, True)
    if kind == "lse":
        out = [(128, 128, 64, 64, 8, 2), (128, 128, 64, 64, 8, 2, 1) if gqa else (128, 128, 128, 64, 8, 2)]
        if dims is not None and _l1_fits(dims):  # the "l1" variant, as for the forward (not yet timed)
            out += [(128, 128, 64, 64, 8, 2, None, 1, "l1"), (128, 128, 32, 64, 8, 2, None, 1, "l1")]
        return out
    out = [(128, 128, 64, 64, 8, 2), (64, 64, 64, 64, 4, 2)]
    if dims is not None and teacher and _l1_fits(dims):
        # the "l1" variant: the dq kernel's q rows / the dk kernel's key tile cached in L1 (not yet
        # timed; offline, triton 3.6, DSA 8K: dq no spills, dk 272 B (BLOCK_N 64) / 160 B (32))
        out += [(128, 128, 64, 64, 8, 2, None, 1, "l1"), (128, 128, 32, 64, 8, 2, None, 1, "l1")]
    return out


def _strides(t):
    return tuple(t.stride())


def _use_tma(*tensors) -> bool:
    """Read the score tiles through TMA descriptors: Hopper (or the interpreter when a test asks,
    api.INTERPRETER_TMA), unit stride in D, 16-byte aligned base and strides."""
    if os.environ.get("STREAMKL_INDEXER_TMA", "1") == "0":  # escape hatch: pointer loads
        return False
    return all(_runtime.tma_ok(t) for t in tensors)


def _descriptors(pl, use_tma, q, k, q_idx, k_idx):
    """(q, k, q_idx, k_idx) descriptors with the plan's boxes, or four Nones (pointer loads)."""
    if not use_tma:
        return None, None, None, None
    TD = _runtime.TensorDescriptor

    def desc(t, box):
        return TD(t, list(t.shape), list(t.stride()), box)

    return (desc(q, [1, pl["HB"], pl["BLOCK_T"], pl["BLOCK_D"]]), desc(k, [1, 1, pl["BLOCK_N"], pl["BLOCK_D"]]),
            desc(q_idx, [1, pl["IB"], pl["BLOCK_T"], pl["BLOCK_DI"]]), desc(k_idx, [1, 1, pl["BLOCK_N"], pl["BLOCK_DI"]]))


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

def _forward(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    q, k, q_idx, k_idx, weights = (_checks.compute_view(t) for t in (q, k, q_idx, k_idx, weights))
    device = q.device
    ieee_t, ieee_i = q.dtype == torch.float32, q_idx.dtype == torch.float32
    qk_scale = dims.scale * LOG2E  # teacher scores in bits: sigma * log2(e) * q.k
    group, group_i = dims.H // dims.HK, dims.HI // dims.HKI
    no_contract = not _runtime.interpreting()
    use_tma = _use_tma(q, k, q_idx, k_idx)
    key_base = (dims.D, dims.DI, dims.H, dims.HK, dims.HI, dims.HKI, q.dtype, q_idx.dtype, causal, use_tma,
                _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B))

    if lse is None:  # first pass: the teacher's per-head LSEs, in bits
        lse_bits = _fresh((dims.B, dims.H, dims.NQ), torch.float32, device)

        def launch_lse(cfg):
            pl = _plan(dims, cfg, "fwd")
            grid = (_runtime.cdiv(dims.NQ, pl["BLOCK_T"]), pl["n_chunks"], dims.B)
            tma, a_l1 = _load_mode(pl, use_tma)
            q_desc, k_desc, _, _ = _descriptors(pl, tma, q, k, q_idx, k_idx)
            _indexer_fwd._teacher_lse_kernel[grid](
                q, k, q_desc, k_desc, lse_bits, *_strides(q), *_strides(k), dims.H, group, dims.NQ, dims.NK, qk_scale,
                pl["cpg"], D=dims.D, BLOCK_D=pl["BLOCK_D"], HB=pl["HB"], BLOCK_T=pl["BLOCK_T"],
                BLOCK_N=pl["BLOCK_N"], CAUSAL=causal, IEEE=ieee_t, NO_CONTRACT=no_contract, USE_TMA=tma,
                A_L1=a_l1, num_warps=pl["warps"], num_stages=pl["stages"])

        launch_lse(_tuning.pick(("idx_lse",) + key_base, _candidates("lse", ieee_t, dims), launch_lse))
    else:  # the caller's natural-log LSEs, once to bits (the kernels' unit)
        lse_bits = (lse * LOG2E).contiguous()

    if _use_gluon(dims, q, k, q_idx, k_idx):
        return (*_forward_gluon(dims, q, k, q_idx, k_idx, weights, lse_bits, causal, relu, key_base), lse_bits)

    kl = _fresh((dims.B, dims.NQ), torch.float32, device)
    lse_idx = _fresh((dims.B, dims.NQ), torch.float32, device)

    def launch(cfg):
        pl = _plan(dims, cfg, "fwd")
        if _indexer_fwd_gqa.applies(pl, dims, use_tma):  # the GQA kernel (variants "gqa...", s6-idxgqa)
            return _indexer_fwd_gqa.launch(dims, pl, q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, causal,
                                           relu, ieee_t, ieee_i)
        splits, per_split = _key_splits(dims, pl)
        part = _fresh((5, splits, dims.B, dims.NQ), torch.float32, device) if splits > 1 else kl
        grid = (_runtime.cdiv(dims.NQ, pl["BLOCK_T"]), splits, dims.B)
        tma, a_l1 = _load_mode(pl, use_tma)
        _indexer_fwd._indexer_fwd_kernel[grid](
            q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, part,
            *_descriptors(pl, tma, q, k, q_idx, k_idx),
            *_strides(q), *_strides(k), *_strides(q_idx), *_strides(k_idx), *_strides(weights),
            dims.H, group, group_i, dims.NQ, dims.NK, qk_scale, 1.0 / dims.H,
            pl["n_chunks"], pl["cpg"], pl["n_ichunks"], pl["icpg"], per_split,
            D=dims.D, BLOCK_D=pl["BLOCK_D"], DI=dims.DI, BLOCK_DI=pl["BLOCK_DI"],
            HB=pl["HB"], IB=pl["IB"], BLOCK_T=pl["BLOCK_T"], BLOCK_N=pl["BLOCK_N"],
            CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i, NO_CONTRACT=no_contract,
            USE_TMA=tma, SPLIT=splits > 1, A_L1=a_l1,
            **_indexer_fwd.variant_meta(pl["variant"], _runtime.interpreting()),  # s6-idxdsa: "keys_flat" etc.
            num_warps=pl["warps"], num_stages=pl["stages"])
        if splits > 1:
            merged_kl, merged_lse = _merge_splits(part)
            kl.copy_(merged_kl)
            lse_idx.copy_(merged_lse)

    candidates = _candidates("fwd", ieee_t or ieee_i, dims, _runtime.n_sm(device))
    launch(_tuning.pick(("idx_fwd", relu) + key_base, candidates, launch))
    return kl, lse_idx, lse_bits


# ----------------------------------------------------------------------------------------------
# The Gluon forward (Hopper, MQA teacher): STREAMKL_INDEXER_GLUON chooses
# ----------------------------------------------------------------------------------------------

GLUON_MODES = ("0", "1", "auto")
# "auto" only where measured faster: the DSA-like family (wide MQA teacher) from this many keys on
GLUON_AUTO_MIN_KEYS = 2048
GLUON_AUTO_MIN_TEACHER = 64 * 512  # H * D
GLUON_DEFAULT = "0"  # STREAMKL_INDEXER_GLUON's default
GLUON_PACC_DEFAULT = "0"  # STREAMKL_INDEXER_GLUON_PACC's default


def _gluon_auto(dims) -> bool:
    return dims.NK >= GLUON_AUTO_MIN_KEYS and dims.H * dims.D >= GLUON_AUTO_MIN_TEACHER


def gluon_mode(pacc: bool = False) -> str:
    """``STREAMKL_INDEXER_GLUON`` (the forward) / ``STREAMKL_INDEXER_GLUON_PACC`` (the
    accumulating forward of the training case): ``0`` (default: not yet measured on the GPU) the
    Triton kernel; ``1`` the Gluon kernel (``_gluon_indexer``) or a ``ValueError`` saying why it
    does not apply (a forced path never falls back silently); ``auto`` the Gluon kernel where it
    applies and was measured faster (``_gluon_auto``: the DSA-like family, N_K >= 2048)."""
    var = "STREAMKL_INDEXER_GLUON_PACC" if pacc else "STREAMKL_INDEXER_GLUON"
    mode = _runtime.env(var, GLUON_PACC_DEFAULT if pacc else GLUON_DEFAULT)
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
        var = "STREAMKL_INDEXER_GLUON_PACC" if pacc else "STREAMKL_INDEXER_GLUON"
        raise ValueError(f"{var}=1, but the Gluon {'accumulating ' if pacc else ''}forward does not apply: {why}")
    return not why


def _forward_gluon(dims, q, k, q_idx, k_idx, weights, lse_bits, causal, relu, key_base):
    """(KL, LSE_I) by the Gluon forward: two key splits (its consumer warpgroups), merged here."""
    part = _fresh((5, 2, dims.B, dims.NQ), torch.float32, q.device)

    def launch(cfg):
        _gluon_indexer.forward_states(q, k, q_idx, k_idx, weights, lse_bits, causal, dims.scale, relu,
                                      config=cfg, part=part)

    cands = _gluon_indexer.candidates(dims)
    launch(_tuning.pick(("idx_gluon_fwd", relu) + key_base, cands, launch))
    return _merge_splits(part)


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
    Which is faster is not yet measured; bench/indexer_gpu.py times separate and fused,
    bench/idx_pacc_gpu.py separate and dqk (teacher-free)."""
    mode = os.environ.get("STREAMKL_INDEXER_BWD", "separate")
    if mode not in BWD_MODES:
        raise ValueError(f"STREAMKL_INDEXER_BWD must be one of {BWD_MODES}, got {mode!r}")
    return mode


# The backward kernels sum the student's logits from their own products a = q_idx k_idx^T where
# one indexer key head makes a program's rows every indexer head (offline sm_90, triton 3.9, DSA
# student kernels on 4 warps: no spills, against 72 / 120 B with the logits formed again).
# False: formed again by _indexer_logits, as before session 6 (bench/idx_pacc_gpu.py times both).
BWD_LOGITS_FROM_A = True

# The dq kernel's dk shares ("dqk" backward, the chunk design) by one TMA bulk reduction per tile:
# off, fp32 atomics instead: on the H200 (run s6r3, triton 3.6) the TMA form stopped both with
# "illegal instruction" / "illegal memory access" (the accumulating forward's own dk_p reduction
# runs); not diagnosed.
DQK_TMA = False

# Tests set this: the dk kernel's token split (tokens per program) instead of the rule below.
INTERPRETER_DK_SPLIT = None


def dk_token_split(dims, block_t: int, key_programs: int, n_sm: int, causal: bool) -> int:
    """Tokens per dk program (a multiple of BLOCK_T; N_Q or more means one split, no atomics).

    The dk kernel has one program per key tile; at DSA-like shapes that is ~N/64 programs for
    132 SMs, each walking up to N tokens (causal: a triangle, the first tile walks them all). So
    the tokens are cut into fixed-size splits until there are about 8 programs per SM (causal:
    about half exit at once), each split adding its partial dk with one fp32 atomic add.
    Reasoned, not yet measured."""
    if _runtime.interpreting() and INTERPRETER_DK_SPLIT is not None:
        per = INTERPRETER_DK_SPLIT
    else:
        want = 8 * n_sm * (2 if causal else 1)
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
    qk_scale = dims.scale * LOG2E
    group, group_i = dims.H // dims.HK, dims.HI // dims.HKI
    no_contract = not _runtime.interpreting()
    use_tma = _use_tma(q, k, q_idx, k_idx)
    g = g.to(torch.float32).contiguous()
    lse_bits, lse_idx = lse_bits.contiguous(), lse_idx.contiguous()
    dq_idx = _fresh((dims.B, dims.HI, dims.NQ, dims.DI), torch.float32, device)
    dweights = _fresh((dims.B, dims.HI, dims.NQ), torch.float32, device)
    dk_idx = _fresh((dims.B, dims.HKI, dims.NK, dims.DI), torch.float32, device)
    common = (q, k, q_idx, k_idx, weights, lse_bits, lse_idx, g)
    strides = _strides(q) + _strides(k) + _strides(q_idx) + _strides(k_idx) + _strides(weights)
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
        pl = _plan(dims, cfg, plan_kind)
        grid = (_runtime.cdiv(dims.NQ, pl["BLOCK_T"]), dims.B * dims.HKI)
        tma, l1 = _load_mode(pl, use_tma)
        dk_share, dk_desc = 0, None
        if dqk:  # dk_idx's shares from this kernel: zeroed; one bulk TMA reduction per tile on Hopper
            dk_idx.zero_()
            dk_share = 2 if DQK_TMA and tma and not _runtime.interpreting() else 1
            if dk_share == 2:
                dk_desc = _runtime.TensorDescriptor(dk_idx, list(dk_idx.shape), list(dk_idx.stride()),
                                                    [1, 1, pl["BLOCK_N"], pl["DI_PAD"]])
        _indexer_bwd._indexer_bwd_dq_kernel[grid](
            *common, dq_idx, dweights, *_descriptors(pl, tma, q, k, q_idx, k_idx), dk_idx, dk_desc, 0, dims.NQ, *strides,
            dims.H, group, dims.HI, dims.HKI, group_i, dims.NQ, dims.NK, qk_scale, 1.0 / dims.H,
            pl["n_chunks"], pl["cpg"], pl["n_ichunks"], pl["icpg"], DK_SHARE=dk_share, **meta(pl, tma, l1))

    def launch_dk(cfg):
        nonlocal dk_idx
        pl = _plan(dims, cfg, plan_kind)
        key_programs = _runtime.cdiv(dims.NK, pl["BLOCK_N"]) * dims.B * dims.HKI
        per_split = dk_token_split(dims, pl["BLOCK_T"], key_programs, _runtime.n_sm(device), causal)
        splits = _runtime.cdiv(dims.NQ, per_split)
        if splits > 1:
            dk_idx = torch.zeros((dims.B, dims.HKI, dims.NK, dims.DI), dtype=torch.float32, device=device)
        if fused:
            dq_idx.zero_()
            dweights.zero_()
        grid = (_runtime.cdiv(dims.NK, pl["BLOCK_N"]), dims.B * dims.HKI, splits)
        tma, l1 = _load_mode(pl, use_tma)
        _indexer_bwd._indexer_bwd_dk_kernel[grid](
            *common, dk_idx, dq_idx, dweights, *_descriptors(pl, tma, q, k, q_idx, k_idx), *strides,
            dims.H, group, dims.HI, dims.HKI, group_i, dims.NQ, dims.NK, qk_scale, 1.0 / dims.H,
            pl["n_chunks"], pl["cpg"], pl["n_ichunks"], pl["icpg"], per_split, ATOMIC=splits > 1, FUSED_DQ=fused,
            **meta(pl, tma, l1))

    ieee = ieee_t or ieee_i
    if not fused:
        launch_dq(_tuning.pick(("idx_bwd_dq",) + key_base, _candidates("bwd", ieee, dims, teacher=teacher), launch_dq))
    if not dqk:
        launch_dk(_tuning.pick(("idx_bwd_dk",) + key_base, _candidates("bwd", ieee, dims, teacher=teacher), launch_dk))
    if target_part is not None:
        g0, dq_p, dk_p, dw_p = target_part
        g0 = g0.to(torch.float32)
        # in place: no gradient-sized temporaries (run r5a: fwd+bwd peak 160 KB per token at DSA)
        dq_idx.addcmul_(g0, dq_p, value=-1.0)
        dk_idx.addcmul_(g0, dk_p, value=-1.0)
        dweights.addcmul_(g0, dw_p, value=-1.0)
    return dq_idx.to(out_dtypes[0]), dk_idx.to(out_dtypes[1]), dweights.to(out_dtypes[2])


# ----------------------------------------------------------------------------------------------
# torch.library custom ops + autograd (traceable by torch.compile)
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("streamkl::indexer_fwd", mutates_args=())
def _indexer_fwd_op(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                    weights: torch.Tensor, lse: Optional[torch.Tensor], causal: bool, scale: float,
                    relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q, k, q_idx, k_idx, weights, lse, causal, scale, relu)


@_indexer_fwd_op.register_fake
def _indexer_fwd_fake(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    B, H, NQ = q.shape[0], q.shape[1], q.shape[2]
    return (q.new_empty((B, NQ), dtype=torch.float32), q.new_empty((B, NQ), dtype=torch.float32),
            q.new_empty((B, H, NQ), dtype=torch.float32))


@torch.library.custom_op("streamkl::indexer_bwd", mutates_args=())
def _indexer_bwd_op(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor,
                    k_idx: torch.Tensor, weights: torch.Tensor, lse_bits: torch.Tensor,
                    lse_idx: torch.Tensor, causal: bool, scale: float,
                    relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(g, q, k, q_idx, k_idx, weights, lse_bits, lse_idx, causal, scale, relu)


@_indexer_bwd_op.register_fake
def _indexer_bwd_fake(g, q, k, q_idx, k_idx, weights, lse_bits, lse_idx, causal, scale, relu):
    return torch.empty_like(q_idx), torch.empty_like(k_idx), torch.empty_like(weights)


def _student_grads(need, run):
    """The autograd return of an indexer loss whose inputs are ``(q, k, q_idx, k_idx, weights,
    ...)``: the teacher (q, k) is a constant, so no gradient even if it requires one (documented);
    ``run()`` gives ``(dq_idx, dk_idx, dweights)`` and is not called when none of them is needed."""
    none = (None,) * len(need)
    if not (need[2] or need[3] or need[4]):
        return none
    dq_idx, dk_idx, dweights = run()
    return (None, None, dq_idx if need[2] else None, dk_idx if need[3] else None,
            dweights if need[4] else None) + none[5:]


def _setup_context(ctx, inputs, output):
    q, k, q_idx, k_idx, weights, lse, causal, scale, relu = inputs
    kl, lse_idx, lse_bits = output
    ctx.save_for_backward(q, k, q_idx, k_idx, weights, lse_bits, lse_idx)
    ctx.args = (causal, scale, relu)


def _indexer_backward(ctx, g_kl, g_lse_idx, g_lse_bits):
    q, k, q_idx, k_idx, weights, lse_bits, lse_idx = ctx.saved_tensors
    causal, scale, relu = ctx.args
    return _student_grads(ctx.needs_input_grad, lambda: _indexer_bwd_op(
        g_kl, q, k, q_idx, k_idx, weights, lse_bits, lse_idx, causal, scale, relu))


_indexer_fwd_op.register_autograd(_indexer_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Scalar reductions with lse given: the forward accumulates the target's share of the gradient
# (_indexer_pacc), the backward runs the indexer alone. STREAMKL_INDEXER_PACC chooses (pacc_enabled).
# ----------------------------------------------------------------------------------------------

PACC_MODES = ("auto", "0", "1")


def pacc_enabled(dims=None) -> bool:
    """``STREAMKL_INDEXER_PACC``: ``1`` = the accumulating design for ``"sum"``/``"mean"`` with
    ``lse`` given and one indexer key head; ``0`` = the plain forward and a recomputing backward;
    ``auto`` (default) = the accumulating design, measured faster at both anchor configs (H200,
    8K causal fwd+bwd, s4r4 run: DSA-like 52.96 ms against 128.4 for the plain separate design;
    GQA-like 12.86 against 18.29)."""
    mode = os.environ.get("STREAMKL_INDEXER_PACC", "auto")
    if mode not in PACC_MODES:
        raise ValueError(f"STREAMKL_INDEXER_PACC must be one of {PACC_MODES}, got {mode!r}")
    if mode == "auto":
        return dims is not None
    return mode == "1"


# Timing-only variants of the accumulating forward (9th config field; bench/idx_pacc_gpu.py
# forces them, never a candidate: their gradients are incomplete): how much of its time each
# part takes. "teacher": the target and the online state alone (no indexer products); "logits":
# + the student's logits (the plain forward's work); "nodk": + dq_p and dweights_p, no dk_p.
PACC_PARTS = {"teacher": 0, "logits": 1, "nodk": 2}


def _forward_pacc(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    """(sum of KL, LSE_I, dq_p, dk_p, dweights_p): the forward plus the target's share of the
    gradient of the sum with g = 1 (``_indexer_pacc``; fp32, contiguous)."""
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    q, k, q_idx, k_idx, weights = (_checks.compute_view(t) for t in (q, k, q_idx, k_idx, weights))
    device = q.device
    ieee_t, ieee_i = q.dtype == torch.float32, q_idx.dtype == torch.float32
    group = dims.H // dims.HK
    no_contract = not _runtime.interpreting()
    use_tma = _use_tma(q, k, q_idx, k_idx)
    # dk_p's shares by one TMA bulk reduction per tile (Hopper; the interpreter has no reductions
    # through descriptors); STREAMKL_INDEXER_DK_TMA=0: per-element atomics
    dk_tma = use_tma and not _runtime.interpreting() and os.environ.get("STREAMKL_INDEXER_DK_TMA", "1") != "0"
    lse_bits = (lse * LOG2E).contiguous()
    kl = _fresh((dims.B, dims.NQ), torch.float32, device)
    lse_idx = _fresh((dims.B, dims.NQ), torch.float32, device)
    dq_p = _fresh((dims.B, dims.HI, dims.NQ, dims.DI), torch.float32, device)
    dw_p = _fresh((dims.B, dims.HI, dims.NQ), torch.float32, device)
    dk_p = torch.zeros((dims.B, 1, dims.NK, dims.DI), dtype=torch.float32, device=device)
    key = ("idx_pacc", relu, dims.D, dims.DI, dims.H, dims.HK, dims.HI, q.dtype, q_idx.dtype, causal, use_tma,
           _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B))

    def launch(cfg):
        pl = _plan(dims, cfg, "bwd")  # every indexer head x BLOCK_T tokens in one tile
        dk_p.zero_()
        grid = (_runtime.cdiv(dims.NQ, pl["BLOCK_T"]), dims.B)
        tma, a_l1 = _load_mode(pl, use_tma)
        flags = str(pl["variant"]).split("+")  # e.g. "kt+tm"
        # "h2" (with "kt"): each dk_p share in two D halves (half-width reduction boxes)
        dk_halves = "h2" in flags and "kt" in flags and dk_tma and pl["DI_PAD"] >= 32
        box_d = pl["DI_PAD"] // 2 if dk_halves else pl["DI_PAD"]
        dk_desc = (_runtime.TensorDescriptor(dk_p, list(dk_p.shape), list(dk_p.stride()), [1, 1, pl["BLOCK_N"], box_d])
                   if dk_tma else None)
        descs = list(_descriptors(pl, tma, q, k, q_idx, k_idx))
        # "tm": one token per program, q read through a token-major descriptor ([B, N, H, D] view)
        q_tm = "tm" in flags and tma and pl["BLOCK_T"] == 1
        if q_tm:
            qv = q.permute(0, 2, 1, 3)
            descs[0] = _runtime.TensorDescriptor(qv, list(qv.shape), list(qv.stride()), [1, 1, pl["HB"], pl["BLOCK_D"]])
        _indexer_pacc._indexer_fwd_pacc_kernel[grid](
            q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, dq_p, dw_p, dk_p,
            *descs, dk_desc,
            *_strides(q), *_strides(k), *_strides(q_idx), *_strides(k_idx), *_strides(weights),
            dims.H, group, dims.HI, dims.NQ, dims.NK, dims.scale * LOG2E, 1.0 / dims.H, pl["n_chunks"], pl["cpg"],
            D=dims.D, BLOCK_D=pl["BLOCK_D"], DI=dims.DI, DI_PAD=pl["DI_PAD"], HB=pl["HB"], GI_PAD=pl["GI_PAD"],
            BLOCK_T=pl["BLOCK_T"], BLOCK_N=pl["BLOCK_N"], CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i,
            NO_CONTRACT=no_contract, USE_TMA=tma, DK_TMA=dk_tma, A_L1=a_l1, PARTS=next((PACC_PARTS[f] for f in flags if f in PACC_PARTS), 3),
            KEY_ROWS="kt" in flags, Q_TM=q_tm, DK_HALVES=dk_halves,
            num_warps=pl["warps"], num_stages=pl["stages"])

    if _use_gluon(dims, q, k, q_idx, k_idx, pacc=True):  # the Gluon accumulating forward (Hopper, MQA)
        part = _fresh((5, 2, dims.B, dims.NQ), torch.float32, device)

        def launch_gluon(cfg):
            for buf in (dq_p, dw_p, dk_p):  # its shares are atomic adds
                buf.zero_()
            _gluon_indexer.forward_states(q, k, q_idx, k_idx, weights, lse_bits, causal, dims.scale, relu,
                                          config=cfg, part=part, grads=(dq_p, dw_p, dk_p))

        gl_key = ("idx_gluon_pacc",) + key[1:]
        launch_gluon(_tuning.pick(gl_key, _gluon_indexer.candidates(dims, pacc=True), launch_gluon))
        kl, lse_idx = _merge_splits(part)
        return kl.sum(), lse_idx, dq_p, dk_p, dw_p
    launch(_tuning.pick(key, _candidates("pacc", ieee_t or ieee_i, dims), launch))
    return kl.sum(), lse_idx, dq_p, dk_p, dw_p


@torch.library.custom_op("streamkl::indexer_loss_fwd", mutates_args=())
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


@torch.library.custom_op("streamkl::indexer_loss_bwd", mutates_args=())
def _indexer_loss_bwd_op(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor,
                         k_idx: torch.Tensor, weights: torch.Tensor, lse_idx: torch.Tensor, dq_p: torch.Tensor,
                         dk_p: torch.Tensor, dw_p: torch.Tensor, causal: bool, scale: float,
                         relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    views = [_checks.compute_view(t) for t in (q, k, q_idx, k_idx, weights)]
    if _use_gluon(dims, *views[:4], pacc=True):  # the Gluon forward accumulated: its student part too
        return _backward_gluon_student(dims, g, *views, lse_idx, causal, relu, dq_p, dk_p, dw_p,
                                       (q_idx.dtype, k_idx.dtype, weights.dtype))
    rows = g.to(torch.float32).expand(q.shape[0], q.shape[2]).contiguous()
    return _backward(rows, q, k, q_idx, k_idx, weights, lse_idx, lse_idx, causal, scale, relu,
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
        _gluon_indexer.student_grads(q, k, q_idx, k_idx, weights, lse_idx, causal, relu, (dq_s, dw_s, dk_s),
                                     config=cfg)

    key = ("idx_gluon_student", relu, dims.D, dims.DI, dims.H, dims.HI, q.dtype, q_idx.dtype, causal,
           _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B))
    launch(_tuning.pick(key, _gluon_indexer.candidates(dims, student=True), launch))
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
    return _student_grads(ctx.needs_input_grad, lambda: _indexer_loss_bwd_op(
        g_total, q, k, q_idx, k_idx, weights, lse_idx, dq_p, dk_p, dw_p, causal, scale, relu))


_indexer_loss_fwd_op.register_autograd(_loss_backward, setup_context=_loss_setup_context)


# The "store" design (STREAMKL_INDEXER_PSTORE): the forward's tile also writes the target p
# [B, N_Q, N_K] (fp32); the backward's teacher-free kernels read it back (P_SAVED). No gradient
# accumulators in the forward (the accumulating kernel's registers and dk_p reductions), at the
# price of B * N_Q * N_K floats kept from the forward to the backward (capped: pstore_enabled).

PSTORE_MODES = ("default", "auto", "0", "1", "chunk")
# "default": the chunk design where it was measured faster, a single-key-head (MQA) teacher: run
# s7r2 (H200, DSA-like 8K causal, mean, lse given, bf16): fwd+bwd 31.60 ms against the accumulating
# design's 51.73 in the same run; elsewhere (GQA teachers: not timed with it) the accumulating design
PSTORE_DEFAULT = "default"
PSTORE_MAX_BYTES = 2 << 30  # "auto": the stored p at most this (8K x 8K fp32: 256 MiB)
# p's storage dtype: float32; float16 halves the memory (p in [0, 1]: relative error 2^-11 from
# 6e-5 up, absolute below; bench/idx_pacc_gpu.py checks and times it as a variant)
PSTORE_DTYPE = torch.float32


def pstore_bytes(dims) -> int:
    return dims.B * dims.NQ * dims.NK * PSTORE_DTYPE.itemsize


def pstore_mode(dims) -> str:
    """``STREAMKL_INDEXER_PSTORE`` resolved for these dims, within the accumulating design's
    cases (``_use_pacc``): ``"chunk"`` = p stored chunk by chunk, the whole gradient in the
    forward (linear memory); ``"1"`` = store p whole; ``"0"`` = accumulate the target's share
    (``_indexer_pacc``). The setting ``auto`` = store p whole where it takes at most
    PSTORE_MAX_BYTES; ``default`` = ``chunk`` for a single-key-head teacher (``H_K = 1``, where it
    was measured faster), ``0`` otherwise."""
    mode = _runtime.env("STREAMKL_INDEXER_PSTORE", PSTORE_DEFAULT)
    if mode not in PSTORE_MODES:
        raise ValueError(f"STREAMKL_INDEXER_PSTORE must be one of {PSTORE_MODES}, got {mode!r}")
    if mode == "default":
        return "chunk" if dims.HK == 1 else "0"
    if mode == "auto":
        return "1" if pstore_bytes(dims) <= PSTORE_MAX_BYTES else "0"
    return mode


def pstore_enabled(dims) -> bool:
    """Does the forward store p (whole, or chunk by chunk)? (:func:`pstore_mode`)"""
    return pstore_mode(dims) in ("1", "chunk")


def _pstore_meta(pl) -> dict:
    """The storing forward's options from the forward config's variant (_indexer_fwd.variant_meta):
    the keys-major tile (KEYS_MAJOR) and a register cap; its other options (flat, lpt) not."""
    meta = _indexer_fwd.variant_meta(str(pl["variant"]), _runtime.interpreting())
    return {k: v for k, v in meta.items() if k in ("KEYS_MAJOR", "maxnreg")}


def _forward_pstore(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    """(sum of KL, LSE_I, p [B, N_Q, N_K] in PSTORE_DTYPE): the forward (its launch candidates) storing p."""
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    q, k, q_idx, k_idx, weights = (_checks.compute_view(t) for t in (q, k, q_idx, k_idx, weights))
    device = q.device
    ieee_t, ieee_i = q.dtype == torch.float32, q_idx.dtype == torch.float32
    group, group_i = dims.H // dims.HK, dims.HI // dims.HKI
    no_contract = not _runtime.interpreting()
    use_tma = _use_tma(q, k, q_idx, k_idx)
    lse_bits = (lse * LOG2E).contiguous()
    kl = _fresh((dims.B, dims.NQ), torch.float32, device)
    lse_idx = _fresh((dims.B, dims.NQ), torch.float32, device)
    p = _fresh((dims.B, dims.NQ, dims.NK), PSTORE_DTYPE, device)  # entries past the causal frontier unwritten
    key = ("idx_pstore", relu, dims.D, dims.DI, dims.H, dims.HK, dims.HI, dims.HKI, q.dtype, q_idx.dtype, causal,
           use_tma, _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B))

    def launch(cfg):
        pl = _plan(dims, cfg, "fwd")
        splits, per_split = _key_splits(dims, pl)
        part = _fresh((5, splits, dims.B, dims.NQ), torch.float32, device) if splits > 1 else kl
        grid = (_runtime.cdiv(dims.NQ, pl["BLOCK_T"]), splits, dims.B)
        tma, a_l1 = _load_mode(pl, use_tma)
        _indexer_pacc._indexer_fwd_pstore_kernel[grid](
            q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, part, p,
            *_descriptors(pl, tma, q, k, q_idx, k_idx),
            *_strides(q), *_strides(k), *_strides(q_idx), *_strides(k_idx), *_strides(weights),
            dims.H, group, group_i, dims.NQ, dims.NK, dims.scale * LOG2E, 1.0 / dims.H,
            pl["n_chunks"], pl["cpg"], pl["n_ichunks"], pl["icpg"], per_split, 0, dims.NQ,
            D=dims.D, BLOCK_D=pl["BLOCK_D"], DI=dims.DI, BLOCK_DI=pl["BLOCK_DI"],
            HB=pl["HB"], IB=pl["IB"], BLOCK_T=pl["BLOCK_T"], BLOCK_N=pl["BLOCK_N"],
            CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i, NO_CONTRACT=no_contract,
            USE_TMA=tma, SPLIT=splits > 1, A_L1=a_l1, num_warps=pl["warps"], num_stages=pl["stages"],
            **_pstore_meta(pl))
        if splits > 1:
            merged_kl, merged_lse = _merge_splits(part)
            kl.copy_(merged_kl)
            lse_idx.copy_(merged_lse)

    launch(_tuning.pick(key, _candidates("pstore", ieee_t or ieee_i, dims, _runtime.n_sm(device)), launch))
    return kl.sum(), lse_idx, p


# The "chunk" design (STREAMKL_INDEXER_PSTORE=chunk): the whole gradient of the sum (g = 1) in the
# forward, chunk by chunk of tokens: the storing forward writes the chunk's p into a scratch
# [B, PCHUNK_TOKENS, N_K] (linear memory: 4 * PCHUNK_TOKENS bytes per key), then the teacher-free
# dq kernel with DK_SHARE (the "dqk" backward, dk by fp32 atomics) reads it with the chunk's final LSE_I and forms
# g (softmax(I) - p)'s contractions for those tokens; the backward only scales by g. The teacher
# is read once, by the plain forward's tile.
PCHUNK_TOKENS = 2048


def _pchunk(dims, block_ts) -> int:
    """Tokens per chunk: PCHUNK_TOKENS rounded up to a multiple of every launch's BLOCK_T."""
    m = 1
    for bt in block_ts:
        m = m * bt // math.gcd(m, bt)
    return max(m, _runtime.cdiv(min(PCHUNK_TOKENS, dims.NQ), m) * m)


_FULL_CONFIGS = {}  # launch key -> the (storing forward, gradient kernel) configs that fit the device


def _forward_full(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    """(sum of KL, LSE_I, dq1, dk1, dw1): the forward and the gradient of the sum (g = 1), fp32.

    Untuned: the first candidates of each kernel (the forward's measured best tile, the student
    backward's first), or the next ones where a launch does not fit the device (Triton raises
    OutOfResources before the kernel runs: e.g. shared memory at D = 96, run s7r10); the pair
    that fits is remembered per shape class."""
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    ieee = q.dtype == torch.float32 or q_idx.dtype == torch.float32
    fwd_cands = _candidates("pstore", ieee, dims, _runtime.n_sm(q.device))
    bwd_cands = _candidates("bwd", ieee, dims, teacher=False)
    key = ("idx_full", relu, dims.D, dims.DI, dims.H, dims.HK, dims.HI, dims.HKI, q.dtype, q_idx.dtype, causal,
           _tuning.bucket(dims.NQ), _tuning.bucket(dims.NK), _tuning.bucket(dims.B), q.device.type,
           tuple(fwd_cands), tuple(bwd_cands))  # (a caller forcing other candidates gets its own entry)
    if key in _FULL_CONFIGS:
        return _forward_full_with(*_FULL_CONFIGS[key], q, k, q_idx, k_idx, weights, lse, causal, scale, relu)
    last = None
    for fcfg in fwd_cands:
        for bcfg in bwd_cands:
            try:
                out = _forward_full_with(fcfg, bcfg, q, k, q_idx, k_idx, weights, lse, causal, scale, relu)
            except Exception as exc:  # noqa: BLE001 - only a launch that does not fit moves on
                if not _tuning.out_of_resources(exc):
                    raise
                last = exc
                continue
            _FULL_CONFIGS[key] = (fcfg, bcfg)
            return out
    raise last


def _forward_full_with(fcfg, bcfg, q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    q, k, q_idx, k_idx, weights = (_checks.compute_view(t) for t in (q, k, q_idx, k_idx, weights))
    device = q.device
    ieee_t, ieee_i = q.dtype == torch.float32, q_idx.dtype == torch.float32
    group, group_i = dims.H // dims.HK, dims.HI // dims.HKI
    no_contract = not _runtime.interpreting()
    use_tma = _use_tma(q, k, q_idx, k_idx)
    lse_bits = (lse * LOG2E).contiguous()
    kl = _fresh((dims.B, dims.NQ), torch.float32, device)
    lse_idx = _fresh((dims.B, dims.NQ), torch.float32, device)
    dq1 = _fresh((dims.B, dims.HI, dims.NQ, dims.DI), torch.float32, device)
    dw1 = _fresh((dims.B, dims.HI, dims.NQ), torch.float32, device)
    dk1 = torch.zeros((dims.B, dims.HKI, dims.NK, dims.DI), dtype=torch.float32, device=device)
    g_rows = torch.ones((dims.B, dims.NQ), dtype=torch.float32, device=device)
    strides = _strides(q) + _strides(k) + _strides(q_idx) + _strides(k_idx) + _strides(weights)
    fpl, bpl = _plan(dims, fcfg, "fwd"), _plan(dims, bcfg, "bwd_student")
    chunk = _pchunk(dims, (fpl["BLOCK_T"], bpl["BLOCK_T"]))
    p = _fresh((dims.B, chunk, dims.NK), torch.float32, device)  # one chunk's target, reused
    splits, per_split = _key_splits(dims, fpl)
    part = _fresh((5, splits, dims.B, dims.NQ), torch.float32, device) if splits > 1 else kl
    ftma, fl1 = _load_mode(fpl, use_tma)
    btma, _ = _load_mode(bpl, use_tma)
    dk_share = 2 if DQK_TMA and btma and not _runtime.interpreting() else 1
    dk_desc = (_runtime.TensorDescriptor(dk1, list(dk1.shape), list(dk1.stride()), [1, 1, bpl["BLOCK_N"], bpl["DI_PAD"]])
               if dk_share == 2 else None)
    fdesc = _descriptors(fpl, ftma, q, k, q_idx, k_idx)
    bdesc = _descriptors(bpl, btma, q, k, q_idx, k_idx)
    for c0 in range(0, dims.NQ, chunk):
        rows = min(chunk, dims.NQ - c0)
        _indexer_pacc._indexer_fwd_pstore_kernel[(_runtime.cdiv(rows, fpl["BLOCK_T"]), splits, dims.B)](
            q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, part, p, *fdesc, *strides,
            dims.H, group, group_i, dims.NQ, dims.NK, dims.scale * LOG2E, 1.0 / dims.H,
            fpl["n_chunks"], fpl["cpg"], fpl["n_ichunks"], fpl["icpg"], per_split, c0, chunk,
            D=dims.D, BLOCK_D=fpl["BLOCK_D"], DI=dims.DI, BLOCK_DI=fpl["BLOCK_DI"],
            HB=fpl["HB"], IB=fpl["IB"], BLOCK_T=fpl["BLOCK_T"], BLOCK_N=fpl["BLOCK_N"],
            CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i, NO_CONTRACT=no_contract,
            USE_TMA=ftma, SPLIT=splits > 1, A_L1=fl1, num_warps=fpl["warps"], num_stages=fpl["stages"],
            **_pstore_meta(fpl))
        if splits > 1:  # this chunk's rows merged before its gradient reads LSE_I
            merged_kl, merged_lse = _merge_splits(part[..., c0:c0 + rows])
            kl[:, c0:c0 + rows] = merged_kl
            lse_idx[:, c0:c0 + rows] = merged_lse
        _indexer_bwd._indexer_bwd_dq_kernel[(_runtime.cdiv(rows, bpl["BLOCK_T"]), dims.B * dims.HKI)](
            q, k, q_idx, k_idx, weights, p, lse_idx, g_rows, dq1, dw1, *bdesc, dk1, dk_desc, c0, chunk, *strides,
            dims.H, group, dims.HI, dims.HKI, group_i, dims.NQ, dims.NK, dims.scale * LOG2E, 1.0 / dims.H,
            bpl["n_chunks"], bpl["cpg"], bpl["n_ichunks"], bpl["icpg"], DK_SHARE=dk_share,
            D=dims.D, BLOCK_D=bpl["BLOCK_D"], DI=dims.DI, BLOCK_DI=bpl["BLOCK_DI"], DI_PAD=bpl["DI_PAD"],
            HB=bpl["HB"], IB=bpl["IB"], GI_PAD=bpl["GI_PAD"], BLOCK_T=bpl["BLOCK_T"], BLOCK_N=bpl["BLOCK_N"],
            CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i, NO_CONTRACT=no_contract,
            USE_TMA=btma, TEACHER=False, L1=False, P_SAVED=True,
            LOGITS_FROM_A=BWD_LOGITS_FROM_A and bpl["n_ichunks"] == 1,
            num_warps=bpl["warps"], num_stages=bpl["stages"])
    return kl.sum(), lse_idx, dq1, dk1, dw1


@torch.library.custom_op("streamkl::indexer_loss_full_fwd", mutates_args=())
def _indexer_loss_full_fwd_op(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                              weights: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                              relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_full(q, k, q_idx, k_idx, weights, lse, causal, scale, relu)


@_indexer_loss_full_fwd_op.register_fake
def _indexer_loss_full_fwd_fake(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
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
    g = g_total.to(torch.float32)
    grads = [(g * t).to(dt) if need[i] else None for i, t, dt in zip((2, 3, 4), (dq1, dk1, dw1), ctx.dtypes)]
    return (None, None, *grads, None, None, None, None)


_indexer_loss_full_fwd_op.register_autograd(_full_backward, setup_context=_full_setup_context)


@torch.library.custom_op("streamkl::indexer_loss_pstore_fwd", mutates_args=())
def _indexer_loss_pstore_fwd_op(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                                weights: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                                relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_pstore(q, k, q_idx, k_idx, weights, lse, causal, scale, relu)


@_indexer_loss_pstore_fwd_op.register_fake
def _indexer_loss_pstore_fwd_fake(q, k, q_idx, k_idx, weights, lse, causal, scale, relu):
    B, NQ, NK = q.shape[0], q.shape[2], k.shape[2]
    f32 = torch.float32
    return q.new_empty((), dtype=f32), q.new_empty((B, NQ), dtype=f32), q.new_empty((B, NQ, NK), dtype=PSTORE_DTYPE)


@torch.library.custom_op("streamkl::indexer_loss_pstore_bwd", mutates_args=())
def _indexer_loss_pstore_bwd_op(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor,
                                k_idx: torch.Tensor, weights: torch.Tensor, lse_idx: torch.Tensor, p: torch.Tensor,
                                causal: bool, scale: float, relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = g.to(torch.float32).expand(q.shape[0], q.shape[2]).contiguous()
    return _backward(rows, q, k, q_idx, k_idx, weights, None, lse_idx, causal, scale, relu, p_saved=p)


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
    return _student_grads(ctx.needs_input_grad, lambda: _indexer_loss_pstore_bwd_op(
        g_total, q, k, q_idx, k_idx, weights, lse_idx, p, causal, scale, relu))


_indexer_loss_pstore_fwd_op.register_autograd(_pstore_backward, setup_context=_pstore_setup_context)


def _use_pacc(dims, lse, reduction, q_idx, k_idx, weights) -> bool:
    return (reduction != "none" and lse is not None and dims.HKI == 1 and pacc_enabled(dims)
            and torch.is_grad_enabled() and any(t.requires_grad for t in (q_idx, k_idx, weights)))


def _rows_with_keys(dims, causal: bool) -> int:
    """Rows with at least one visible key (bottom-right causal: the last min(N_Q, N_K) rows)."""
    return dims.B * (min(dims.NQ, dims.NK) if causal else dims.NQ)


def indexer_kl(q, k, q_idx, k_idx, weights, *, causal=False, scale=None, relu=True, lse=None,
               reduction="none"):
    """The sparse-attention indexer loss ``KL(p || softmax(I))`` per query row, streamed.

    Args:
        q: ``[B, H, N_Q, D]`` teacher queries, ``D <= 576``. k: ``[B, H_K, N_K, D]`` teacher keys
            (``H % H_K == 0``; MQA: ``H_K = 1``). The teacher is a constant: ``q`` and ``k`` get
            no gradient even if they require one.
        q_idx: ``[B, H_I, N_Q, D_I]`` indexer queries, ``D_I <= 256``. k_idx: ``[B, H_KI, N_K, D_I]``
            (``H_I % H_KI == 0``). weights: ``[B, H_I, N_Q]`` (any scale folded in).
            Any strides (Megatron's ``[S, B, H, D]`` tensors as ``.permute(1, 2, 0, 3)`` views);
            fp16, bf16 or fp32 (q and k share a dtype, q_idx and k_idx share one).
        causal: bottom-right aligned (key ``s`` visible to row ``t`` iff ``s <= t + N_K - N_Q``).
        scale: the teacher's score scale; ``None`` means ``1/sqrt(D)``. An absorbed-MLA teacher
            (``D = 576``) needs the MLA scale, e.g. ``192 ** -0.5``.
        relu: ``I = sum_j weights_j relu(q_idx_j . k_idx)``; ``False`` drops the ReLU.
        lse: optional teacher LSEs, float32 ``[B, H, N_Q]``, natural log, ``-inf`` for rows with
            no visible key (FlashAttention's ``softmax_lse``): the teacher is then read once in
            the forward. Shape, dtype and device are checked, values are not (a wrong ``lse``
            gives wrong rows).
        reduction: ``"none"`` (``[B, N_Q]``), ``"sum"``, or ``"mean"`` over the rows with at
            least one visible key (Megatron's reduction).

    Returns:
        float32 KL in nats, ``[B, N_Q]`` or a scalar; rows with no visible key give 0 and zero
        gradient. Differentiable in ``q_idx``, ``k_idx``, ``weights``.
    """
    dims = _check(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=relu, lse=lse,
                  reduction=reduction)
    if _use_pacc(dims, lse, reduction, q_idx, k_idx, weights):
        if pstore_enabled(dims):  # store p (whole, or chunk by chunk with the gradient in the forward)
            op = _indexer_loss_full_fwd_op if pstore_mode(dims) == "chunk" else _indexer_loss_pstore_fwd_op
        else:  # accumulate the target's share
            op = _indexer_loss_fwd_op
        total = op(q, k, q_idx, k_idx, weights, lse, causal, dims.scale, relu)[0]
        return total if reduction == "sum" else total / _rows_with_keys(dims, causal)
    kl = _indexer_fwd_op(q, k, q_idx, k_idx, weights, lse, causal, dims.scale, relu)[0]
    if reduction == "none":
        return kl
    total = kl.sum()
    if reduction == "sum":
        return total
    return total / _rows_with_keys(dims, causal)


# ----------------------------------------------------------------------------------------------
# The materialised PyTorch form (what users run today): the benchmark's baseline and the tests'
# same-precision computation (FlashAttention's tolerance rule). Differentiable through autograd.
# ----------------------------------------------------------------------------------------------

def indexer_kl_naive(q, k, q_idx, k_idx, weights, *, causal=False, scale=None, relu=True,
                     compute_dtype=torch.float32):
    """``[B, N_Q]`` KL in ``compute_dtype``, every score matrix materialised: teacher scores per
    head, softmax, head mean; indexer scores, ReLU, weights, log-softmax; KL. Products are formed
    from the inputs cast to ``compute_dtype`` (the anchors' baseline: bf16 inputs,
    ``compute_dtype=torch.float32``). Rows with no visible key give 0. The formula has one home,
    :func:`streamkl_ref.testing.indexer_kl_torch` (the conformance suite's baseline)."""
    from streamkl_ref.testing import indexer_kl_torch

    return indexer_kl_torch(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=relu,
                            compute_dtype=compute_dtype)
