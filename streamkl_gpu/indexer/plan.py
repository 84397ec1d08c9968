"""Host helpers of every indexer launch: the input checks, the launch configuration
(:class:`IndexerConfig`) and its plan (how a config's tile chunks the heads and tokens), the key splits and their merge, TMA descriptors, and the autograd
return shared by the designs. Imports no design and no other host module of the indexer."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

from streamkl_ref._checks import check_indexer_inputs
from streamkl_gpu.indexer.triton import fwd as _indexer_fwd
from streamkl_gpu._core import checks as _checks
from streamkl_gpu._core import runtime as _runtime


MAX_TEACHER_HEAD_DIM = 576  # absorbed MLA: 512 + 64, tiled along D (never padded to 1024)
MAX_INDEXER_HEAD_DIM = 256
REDUCTIONS = ("none", "sum", "mean")
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class IndexerConfig:
    """One launch of an indexer kernel (forward, backward, the training designs' kernels): a
    score tile of ``teacher_rows`` (teacher head, token) rows and ``indexer_rows`` indexer rows
    against ``block_n`` keys, the head dims read in ``block_d``-wide chunks; ``max_heads_per_chunk``:
    teacher heads per chunk at most (None: no cap); ``splits``: key splits of a forward launch
    (their states merged on the host, ``_merge_splits``); ``variant``: the kernel's form
    (``indexer.triton.fwd.variant_meta``: ``tiles``, ``l1``, ``keys...``; the GQA kernel's
    ``gqa...``, ``indexer.triton.fwd_gqa.parse_variant``). Equal fields are one plan."""
    teacher_rows: int
    indexer_rows: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    max_heads_per_chunk: Optional[int] = None
    splits: int = 1
    variant: str = "tiles"


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
    if not isinstance(cfg, IndexerConfig):
        raise TypeError(f"an indexer launch config is an IndexerConfig, got {cfg!r}")
    return dict(_plan_cached(dims, cfg, kind))


@functools.lru_cache(maxsize=4096)
def _plan_cached(dims, cfg, kind):
    rows, irows = cfg.teacher_rows, cfg.indexer_rows
    hb_max = cfg.max_heads_per_chunk if cfg.max_heads_per_chunk is not None else rows
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
        HB=hb, IB=ib, GI_PAD=gi_pad, BLOCK_T=block_t, BLOCK_N=cfg.block_n,
        BLOCK_D=_d_chunk(dims.D, cfg.block_d),
        BLOCK_DI=_d_chunk(dims.DI, cfg.block_d) if kind == "fwd" else _checks.head_pad(dims.DI),
        DI_PAD=_checks.head_pad(dims.DI), warps=cfg.num_warps, stages=cfg.num_stages,
        n_chunks=dims.HK * cpg, cpg=cpg, n_ichunks=dims.HKI * icpg, icpg=icpg,
        splits=int(cfg.splits), variant=cfg.variant,
    )


def _load_mode(pl, use_tma):
    """(TMA loads, q rows through L1) of a launch: the "l1" variant (``IndexerConfig.variant``) reads the
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
    probe = IndexerConfig(teacher_rows=128, indexer_rows=128, block_n=64, block_d=64, num_warps=8, num_stages=2)
    return dims.HK == 1 and _plan(dims, probe, "fwd")["BLOCK_T"] == 1 and dims.H * dims.D * 2 <= 160 * 1024


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


def _rows_with_keys(dims, causal: bool) -> int:
    """Rows with at least one visible key (bottom-right causal: the last min(N_Q, N_K) rows)."""
    return dims.B * (min(dims.NQ, dims.NK) if causal else dims.NQ)
