"""The indexer loss's forward for GQA teachers (H_K > 1): a lean one-pass kernel (the
GQA-like target, <= 3.0x the matmul floor).

Chosen by the config's variant (``IndexerConfig.variant``, the plan's "variant"): ``"gqa"`` (each key head's K tile
loaded once per key step, then its group's heads in an inner loop: a quarter of the K reads of
``_indexer_fwd`` at groups of 4), ``"gqa-flat"`` (one flat loop over the teacher heads, the K
tile loaded per head as ``_indexer_fwd`` does: one longer pipelined loop), ``"gqa-pp"`` (the flat
loop with head h + 1's product written before head h's exponentials; triton 3.9 still waits for
each product at once, offline, so only ptxas's scheduling can overlap them). The student's k_idx
tile is loaded once per key step and indexer key head in both. A suffix ``-rNNN`` caps ptxas at
NNN registers (``maxnreg``: more CTAs per SM, at the price of spills). Everything else is
``_indexer_fwd._indexer_fwd_kernel``'s math, with the same five-scalar student state
(``_online_update``, ``_finish``: one home for those formulas).

Layout: one program per (BLOCK_T query tokens, key split, batch element). The rows of every
score tile are the BLOCK_T tokens of ONE teacher head (box ``[1, 1, BLOCK_T, D_PAD]``), so the
head sum of ``p`` is an elementwise add in registers (no reshape, no cross-warp reduction); per
key tile the program walks the H teacher heads and then the H_I indexer heads.

What it saves per teacher score against the general kernel (the work per (token, key) pair is
32 teacher exponentials at the GQA-like config): the scale, the teacher LSE and the head mean
``1/H`` fold into ONE FFMA before ``exp2`` (``x = s * sigma log2(e) - (lse_h + log2 H)``; the
per-row ``lse_h + log2 H`` is formed once per head and tile, a row with ``lse = -inf`` (no
visible key) or past N_Q gets ``+inf`` there, so its scores give ``exp2(-inf) = 0``), with no
select at all: one head per box (TMA fills rows past N_Q and dims past D with zeros), and the
masks (causal diagonal, ragged last tile) are applied once per tile, by the student's online
update, which selects the visible entries of ``p`` (``tl.where``, never a product: an invisible
entry's inf or NaN never counts), instead of once per head.

TMA descriptors only (Hopper, or the interpreter when a test asks): the host falls back to the
general kernel elsewhere (``applies``). Head dims up to 128 (one box per head and tile).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from streamkl_gpu._core import checks as _checks
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core.jit import _dot, _key_stages
from streamkl_gpu._core.launcher import kernel_call
from streamkl_gpu.indexer.triton.fwd import _finish, _online_update
from streamkl_gpu.indexer.plan import IndexerConfig, _fresh, _key_splits, _merge_splits

LOOPS = ("gqa-flat", "gqa", "gqa-pp")  # LOOP = 0, 1, 2


class Variant(NamedTuple):
    loop: int  # LOOP: 0 "gqa-flat", 1 "gqa", 2 "gqa-pp"
    cap: Optional[int]  # ptxas register cap (maxnreg) or None
    split_major: bool  # grid (key splits, token blocks, B) with the last token blocks first
    band: bool  # the masked tiles (causal diagonal band, ragged last tile) in a second launch
    side: bool  # -band's second launch on a side stream, concurrent with the main one
    wide_merge: bool = False  # -wm: the key splits merged by merge_states_wide (splits side by side, in place)
    one_chunk: bool = False  # -one: the chunk design's storing forward in one chunk where p fits its budget


FLAGS = ("tm", "band", "ss", "wm", "one")


def parse_variant(variant) -> Optional[Variant]:
    """The :class:`Variant` of ``"gqa[-flat|-pp][-tm][-band[-ss]][-wm][-one][-rNNN]"``, or None when it is not
    one of this kernel's. ``-rNNN``: ptxas capped at NNN registers (``"gqa-r168"``: three 4-warp
    CTAs per SM). ``-tm``: the general kernel's token-major grid (token blocks fastest); without
    it the key splits of a token block are neighbours in the grid (and the heaviest, causal-last,
    blocks come first), so the CTAs resident at once share few token blocks' q rows in L2.
    ``-band``: the main launch walks whole tiles only and a second, small launch (its own
    register allocation) the masked band, its state one more split for the merge: the masked
    stage's selects cost ~40 registers (offline, 64x64: 208 with it, 165 without). ``-ss``
    (with ``-band``): the band's launch on a side stream, so its few programs run beside the
    main launch's instead of after them (on a GPU; the interpreter runs them in turn). ``-wm``: the
    key splits' states merged by :func:`merge_states_wide` (all splits of a row block loaded at once,
    written in place: the chunk design's storing forward writes its chunk's rows of KL / LSE_I
    directly). ``-one``: the chunk design (``training/chunk.py``) runs this storing forward in one
    chunk of up to ``PCHUNK_MAX_BYTES`` of p (its budget) instead of ``PCHUNK_TOKENS``-token chunks.
    Both are in the chunk design's default order (``configs.STORING_FORWARD_GQA_FLAGS``): the
    GQA-like 8K step 2.75 against 3.60 ms with them (H100, bench/results/2026-12-06_h100_6dc1dc9/)."""
    if not isinstance(variant, str):
        return None
    parts = variant.split("-")
    cap = None
    if len(parts) > 1 and parts[-1].startswith("r") and parts[-1][1:].isdigit():
        cap = int(parts.pop()[1:])
    flags = set()
    for flag in reversed(FLAGS):  # in FLAGS' order, each at most once
        if len(parts) > 1 and parts[-1] == flag:
            flags.add(parts.pop())
    loop = "-".join(parts)
    if loop not in LOOPS:
        return None
    if "ss" in flags and "band" not in flags:
        return None
    return Variant(LOOPS.index(loop), cap, "tm" not in flags, "band" in flags, "ss" in flags, "wm" in flags,
                   "one" in flags)


def with_flags(variant: str, flags) -> str:
    """``variant`` with the flags ``flags`` (of FLAGS) added in their place (before ``-rNNN``)."""
    var = parse_variant(variant)
    if var is None:
        raise ValueError(f"{variant!r} is not a GQA kernel variant")
    bad = sorted(set(flags) - set(FLAGS))
    if bad:
        raise ValueError(f"GQA variant flags are {FLAGS}, got {bad}")
    have = {"tm": not var.split_major, "band": var.band, "ss": var.side, "wm": var.wide_merge, "one": var.one_chunk}
    out = [LOOPS[var.loop]] + [f for f in FLAGS if have[f] or f in flags]
    if var.cap is not None:
        out.append(f"r{var.cap}")
    return "-".join(out)


MAX_BOX_DIM = 128  # one TMA box per head and tile (D_PAD, DI_PAD)


# The tuner's GQA-kernel candidates, measured best first (H200, triton 3.6, GQA-like causal bf16,
# lse given; a script since removed, ``git show b7066de:bench/idx_gqa_gpu.py``). An H200 run
# (bench/results/2026-12-01_h200_d2682d7/idx_gqa.csv; round robin, 3 passes): "gqa-band" 64 tokens
# x 64 keys on 4 warps, 3 stages (157 registers offline: 3 CTAs/SM) at 8K 5 / 10 / 16 / 24 key splits
# 2.221 / 2.105 / 2.002 / 1.967 ms (4.31x the floor at 24), at 16K 5.633 / 5.123 / 4.638 / 4.464 ms
# (2.45x at 24), against 2.681 / 6.840 ms for the general kernel's former default
# (64, 64, 64, 64, 4, 3, 1, 5); "gqa-band-r128" (2 stages, capped at 128 registers) 10 splits 1.951
# / 4.888; "gqa-flat-band" (2 stages) 10 splits 1.904 at 8K (the best there) but 5.715 at 16K.
# An H200 run (one pass): "gqa-band" 5 splits 1.785 ms = 4.00x against 2.836 for the former default.
# An H200 run (triton 3.6, round robin, 3 passes, medians; the rule's 48 splits from 8K to 64K):
# "gqa-band-r128" (2 stages, 128 registers: 4 CTAs per SM) 1.425 / 3.916 / 14.17 / 59.35 ms at 8K /
# 16K / 32K / 64K = 3.28 / 2.25 / 2.04 / 2.13x the floor, against "gqa-band" 1.506 / 4.304 / 16.76 /
# 64.77 (3.46 / 2.48 / 2.41 / 2.33x): the first candidate since.
# the candidates' tiles (one teacher head per chunk), their key splits set by ``key_splits``
CANDIDATE_BASES = tuple(
    IndexerConfig(teacher_rows=64, indexer_rows=64, block_n=64, block_d=64, num_warps=4, num_stages=stages,
                  max_heads_per_chunk=1, variant=variant)
    for stages, variant in ((2, "gqa-band-r128"), (3, "gqa-band"), (2, "gqa-flat-band")))
# Key splits: more were faster at every count measured. One H200 run: 24, the most tried then, best at 8K
# and 16K. Another (triton 3.6, round robin, 3 passes, medians), the rule of 24 / 24 / 13 / 7
# splits at 8K / 16K / 32K / 64K against 32 and 48 forced: 1.739 / 4.911 / 18.22 / 73.68 ms,
# 32 splits 1.698 / 4.825 / 16.39 / 66.76, 48 splits 1.609 / 4.553 / 16.18 / 66.59 (7-11 % below
# the rule at every N, KL within 1e-5 of the rule's). So now ~SPLIT_WAVES waves of 3-CTA-per-SM
# slots (causal: about half the programs have work), at most MAX_SPLITS = 48, the most measured
# (the split states, 20 B per split and row: 63 MB at 64K, 1 M tokens get 4 splits).
SPLIT_WAVES = 64
MAX_SPLITS = 48


def key_splits(n_q: int, block_t: int, n_sm: int) -> int:
    """Key splits of the GQA kernel's launch: ``SPLIT_WAVES`` waves of ``3 * n_sm`` CTA slots over
    the token blocks (twice that many programs: causal, about half exit at once), at most
    ``MAX_SPLITS``. H200 (132 SMs), 64-token blocks: 48 from 8K to 64K (as measured best), 25 at 128K."""
    blocks = max(1, _runtime.cdiv(n_q, block_t))
    return max(1, min(MAX_SPLITS, _runtime.cdiv(2 * SPLIT_WAVES * 3 * n_sm, blocks)))


def candidates(dims, n_sm):
    """The GQA kernel's launch configs for ``_indexer._new_fwd_candidates`` (GQA teachers; the
    first is the untuned default): :data:`CANDIDATE_BASES` with :func:`key_splits` (per batch
    element: B token-block rows of programs share the slots)."""
    out = []
    for base in CANDIDATE_BASES:
        splits = key_splits(dims.NQ * dims.B, base.teacher_rows, n_sm)  # rows = BLOCK_T tokens (one head per tile)
        out.append(replace(base, splits=splits))
    return out


def applies(pl, dims, use_tma: bool) -> bool:
    """Does the GQA kernel run this plan? Its variant asked, TMA loads, head dims <= 128, one
    teacher head per tile row block (HB = 1, IB = 1)."""
    return (parse_variant(pl["variant"]) is not None and use_tma and pl["HB"] == 1 and pl["IB"] == 1
            and _checks.head_pad(dims.D) <= MAX_BOX_DIM and _checks.head_pad(dims.DI) <= MAX_BOX_DIM)


def launch(dims, pl, q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, causal, relu, ieee_t, ieee_i):
    """Run the GQA kernel with plan ``pl`` (``_indexer._plan(..., "fwd")``), writing ``kl`` and
    ``lse_idx`` [B, N_Q] (key splits merged on the host as for the general kernel)."""
    d_pad, di_pad = _checks.head_pad(dims.D), _checks.head_pad(dims.DI)
    bt, bn = pl["BLOCK_T"], pl["BLOCK_N"]
    TD = _runtime.TensorDescriptor

    def desc(t, rows, width):
        return TD(t, list(t.shape), list(t.stride()), [1, 1, rows, width])

    splits, per_split = _key_splits(dims, pl)
    var = parse_variant(pl["variant"])
    slots = splits + 1 if var.band else splits  # -band: the band's state is one more "split"
    part = _fresh((5, slots, dims.B, dims.NQ), torch.float32, q.device) if slots > 1 else kl
    n_t = _runtime.cdiv(dims.NQ, bt)
    # the head mean 1/H as a shift of the exponent (bits): exp2(x - log2 H) = exp2(x) / H
    log2_heads = math.log2(dims.H)
    extra = {} if (var.cap is None or _runtime.interpreting()) else {"maxnreg": var.cap}
    args = (desc(q, bt, d_pad), desc(k, bn, d_pad), desc(q_idx, bt, di_pad), desc(k_idx, bn, di_pad),
            weights, lse_bits, kl, lse_idx, part, *weights.stride(),
            dims.H, dims.HK, dims.HI, dims.HKI, dims.NQ, dims.NK, dims.scale * 1.4426950408889634, log2_heads)
    meta = dict(GROUP=dims.H // dims.HK, GROUP_I=dims.HI // dims.HKI, D_PAD=d_pad, DI_PAD=di_pad, BLOCK_T=bt,
                BLOCK_N=bn, CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i, SPLIT=slots > 1, LOOP=var.loop,
                num_warps=pl["warps"], num_stages=pl["stages"])
    grid = (splits, n_t, dims.B) if var.split_major else (n_t, splits, dims.B)
    # STAGES 0: whole tiles then the masked band; 1: whole tiles only (the band launched below)
    side = var.side and q.device.type == "cuda" and not _runtime.interpreting()
    if side:  # the band's launch first, on a side stream that waits for this stream's inputs
        main_stream = torch.cuda.current_stream(q.device)
        band_stream = _side_stream(q.device)
        band_stream.wait_stream(main_stream)
        with torch.cuda.stream(band_stream):
            kernel_call(_indexer_fwd_gqa_kernel, (1, n_t, dims.B))(*args, dims.NK, splits, slots, **meta, SPLIT_MAJOR=True,
                                                      STAGES=2)
    kernel_call(_indexer_fwd_gqa_kernel, grid)(*args, per_split, 0, slots, **meta, SPLIT_MAJOR=var.split_major,
                                  STAGES=1 if var.band else 0, **extra)
    if side:  # the merge (and everything after, on this stream) waits for the band
        main_stream.wait_stream(band_stream)
    elif var.band:  # one program per token block: its masked band only, into slot ``splits``
        kernel_call(_indexer_fwd_gqa_kernel, (1, n_t, dims.B))(*args, dims.NK, splits, slots, **meta, SPLIT_MAJOR=True,
                                                  STAGES=2)
    if slots > 1:
        if var.wide_merge:
            merge_states_wide(part, kl, lse_idx, 0, dims.NQ)
        elif MERGE_KERNEL:
            merge_states(part, kl, lse_idx)
        else:
            merged_kl, merged_lse = _merge_splits(part)
            kl.copy_(merged_kl)
            lse_idx.copy_(merged_lse)


_SIDE_STREAMS: dict = {}


def _side_stream(device):
    """One side stream per device for -ss's band launch (created once)."""
    key = torch.device(device).index
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[key]


# The key splits' states merged by one Triton launch (merge_states) instead of _merge_splits's ~20
# PyTorch ops (each a launch of a few microseconds at 8K: ~5 % of a 1.4 ms forward). Tests set it.
MERGE_KERNEL = True
MERGE_BLOCK = 1024


def merge_states(part, kl, lse_idx):
    """``kl``, ``lse_idx`` [B, N_Q] from ``part [5, splits, B, N_Q]`` (contiguous fp32): exactly
    ``_indexer._merge_splits`` (its formula; the tests compare the two), one launch."""
    rows = kl.numel()
    kernel_call(_merge_states_kernel, (_runtime.cdiv(rows, MERGE_BLOCK),))(part, kl, lse_idx, part.shape[1], rows,
                                                            BLOCK=MERGE_BLOCK, num_warps=4)


# merge_states_wide: rows per program for its [SPLITS, rows] tiles (SPLITS: the splits padded to a power of 2)
WIDE_MERGE_ELEMENTS = 2048


def merge_states_wide(part, kl, lse_idx, t_off, n_valid, t0=0):
    """As :func:`merge_states`, but each program loads all splits of its rows at once (one latency, not
    two per split: the chunk design's 2048-row merge of ~44 splits ran on two programs, each walking
    the splits in turn) and writes in place: ``part [5, splits, B, p_rows]``'s rows ``(b, t0 + t)``
    for ``t < n_valid`` into ``kl`` / ``lse_idx [B, N_Q]`` at ``(b, t_off + t)``."""
    n_splits, batch, p_rows = part.shape[1], part.shape[2], part.shape[3]
    splits_pad = _runtime.next_power_of_2(n_splits)
    block = max(16, min(1024, WIDE_MERGE_ELEMENTS // splits_pad))
    rows = batch * n_valid
    if rows == 0:
        return
    kernel_call(_merge_states_wide_kernel, (_runtime.cdiv(rows, block),))(
        part, kl, lse_idx, n_splits, batch * p_rows, p_rows, t0, n_valid, rows, kl.shape[1], t_off,
        SPLITS=splits_pad, BLOCK=block, num_warps=4)


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _merge_states_wide_kernel(PART, KL, LSE_I, n_splits, split_stride, p_rows, t0, n_valid, rows, n_q, t_off,
                              SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``_merge_states_kernel``'s formulas on a [SPLITS, BLOCK] tile of each plane (splits as rows,
    loaded at once; padded splits read as a split that saw no key), the sums as tree reductions.
    Work item ``r = b * n_valid + t`` (``rows`` of them) reads row ``b * p_rows + t0 + t`` of each
    split (``split_stride`` apart) and writes ``b * n_q + t_off + t`` of KL / LSE_I."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < rows
    b = offs // n_valid
    t = offs - b * n_valid
    src = b.to(tl.int64) * p_rows + t0 + t
    sp = tl.arange(0, SPLITS)
    mask = (sp < n_splits)[:, None] & ok[None, :]
    at = PART + sp[:, None].to(tl.int64) * split_stride + src[None, :]
    plane = n_splits.to(tl.int64) * split_stride
    m = tl.load(at, mask=mask, other=float("-inf"))
    m_all = tl.reduce(m, 0, _nan_max)
    shift = tl.where(m_all == float("-inf"), 0.0, m_all)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_all = tl.sum(tl.load(at + plane, mask=mask, other=0.0) * tl.exp(m - shift[None, :]), 0)
    acc = tl.load(at + 3 * plane, mask=mask, other=0.0) - tl.load(at + 2 * plane, mask=mask, other=0.0) * (
        shift[None, :] - m_safe)
    acc_all = tl.sum(acc, 0)
    plogp_all = tl.sum(tl.load(at + 4 * plane, mask=mask, other=0.0), 0)
    empty = l_all == 0.0
    log_l = tl.log(tl.where(empty, 1.0, l_all))
    out = b.to(tl.int64) * n_q + t_off + t
    tl.store(KL + out, tl.where(empty, 0.0, plogp_all - acc_all + log_l), mask=ok)
    tl.store(LSE_I + out, tl.where(empty, float("-inf"), m_all + log_l), mask=ok)


@triton.jit
def _head_exp(s, lse_shift, qk_scale):
    """``exp2(s * sigma log2(e) - lse_shift)`` of one head's [BLOCK_T, BLOCK_N] scores: that
    head's share ``P_h / H`` of the target (one FFMA before exp2). Unmasked: entries a row does
    not see (causal future, keys past N_K) may hold anything, even inf or NaN; the online update
    selects the visible entries of ``p`` (``tl.where``, never a product), so they never count."""
    return tl.exp2(s * qk_scale - lse_shift[:, None])


@triton.jit
def _lse_shift(LSE_T, row_base, toks, tok_ok, log2_heads):
    """Per row: ``lse_h + log2 H`` (bits); ``+inf`` for a row with no visible key (lse = -inf)
    or past N_Q, so its scores give exp2(-inf) = 0; a NaN lse stays NaN (its row stays NaN)."""
    lse = tl.load(LSE_T + row_base + toks, mask=tok_ok, other=float("-inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse + log2_heads)


@triton.jit
def _gqa_key_range(
    m, l, mass, acc, plogp,
    Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, stride_wb, stride_wh, stride_wn,
    b, t0, lo, hi, H, HK, HI, HKI, N_Q, N_K, qk_scale, log2_heads,
    GROUP: tl.constexpr, GROUP_I: tl.constexpr, D_PAD: tl.constexpr, DI_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    RELU: tl.constexpr, IEEE_T: tl.constexpr, IEEE_I: tl.constexpr, LOOP: tl.constexpr,
):
    toks = t0 + tl.arange(0, BLOCK_T)
    tok_ok = toks < N_Q
    b64 = b.to(tl.int64)
    diag_offset = N_K - N_Q
    for s0 in range(lo, hi, BLOCK_N):
        keys = s0 + tl.arange(0, BLOCK_N)
        # the target p [BLOCK_T, BLOCK_N]: the sum of the H heads' P_h / H, head after head. Each
        # head's row shift (lse_h + log2 H) is loaded one head ahead, before the previous head's
        # product, so the load's latency hides under it (carried as ``shift``; the last head
        # loads itself again).
        p = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        shift = _lse_shift(LSE_T, b64 * H * N_Q, toks, tok_ok, log2_heads)
        if LOOP == 1:  # "gqa": one K tile load per key head, then its group's heads (an inner pipelined loop)
            for kv in range(0, HK):
                kt = K_DESC.load([b, kv, s0, 0]).reshape(BLOCK_N, D_PAD)
                for g in range(0, H // HK):  # (a runtime count: not unrolled, fewer registers)
                    h = kv * GROUP + g
                    shift_next = _lse_shift(LSE_T, (b64 * H + tl.minimum(h + 1, H - 1)) * N_Q, toks, tok_ok, log2_heads)
                    qt = Q_DESC.load([b, h, t0, 0]).reshape(BLOCK_T, D_PAD)
                    s = _dot(qt, tl.trans(kt), IEEE_T)
                    p += _head_exp(s, shift, qk_scale)
                    shift = shift_next
        elif LOOP == 2:  # "gqa-pp": head h + 1's product issued before head h's exponentials
            kt = K_DESC.load([b, 0, s0, 0]).reshape(BLOCK_N, D_PAD)
            qt = Q_DESC.load([b, 0, t0, 0]).reshape(BLOCK_T, D_PAD)
            s_prev = _dot(qt, tl.trans(kt), IEEE_T)
            for h in range(1, H):
                shift_next = _lse_shift(LSE_T, (b64 * H + h) * N_Q, toks, tok_ok, log2_heads)
                kt = K_DESC.load([b, h // GROUP, s0, 0]).reshape(BLOCK_N, D_PAD)
                qt = Q_DESC.load([b, h, t0, 0]).reshape(BLOCK_T, D_PAD)
                s_cur = _dot(qt, tl.trans(kt), IEEE_T)
                p += _head_exp(s_prev, shift, qk_scale)
                shift = shift_next
                s_prev = s_cur
            p += _head_exp(s_prev, shift, qk_scale)
        else:  # "gqa-flat": one K tile load per teacher head (from L2 after the group's first head), one flat loop
            for h in range(0, H):
                shift_next = _lse_shift(LSE_T, (b64 * H + tl.minimum(h + 1, H - 1)) * N_Q, toks, tok_ok, log2_heads)
                kt = K_DESC.load([b, h // GROUP, s0, 0]).reshape(BLOCK_N, D_PAD)
                qt = Q_DESC.load([b, h, t0, 0]).reshape(BLOCK_T, D_PAD)
                s = _dot(qt, tl.trans(kt), IEEE_T)
                p += _head_exp(s, shift, qk_scale)
                shift = shift_next
        # the student's logits I = sum_j w_j relu(q_idx_j . k_idx) (unmasked: selected below);
        # one k_idx tile load per indexer key head (usually one), its heads in an inner loop; the
        # weights one head ahead, as the teacher's shifts
        logits = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        w_row = W + b64 * stride_wb + toks.to(tl.int64) * stride_wn
        w = tl.load(w_row, mask=tok_ok, other=0.0).to(tl.float32)
        for kvi in range(0, HKI):
            kit = KI_DESC.load([b, kvi, s0, 0]).reshape(BLOCK_N, DI_PAD)
            for jj in range(0, HI // HKI):
                j = kvi * GROUP_I + jj
                w_next = tl.load(w_row + tl.minimum(j + 1, HI - 1) * stride_wh, mask=tok_ok, other=0.0).to(tl.float32)
                qit = QI_DESC.load([b, j, t0, 0]).reshape(BLOCK_T, DI_PAD)
                a = _dot(qit, tl.trans(kit), IEEE_I)
                if RELU:
                    a = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) stays NaN
                logits += w[:, None] * a
                w = w_next
        if MASKED:
            visible = tok_ok[:, None] & (keys < N_K)[None, :]
            if CAUSAL:
                visible = visible & (keys[None, :] <= toks[:, None] + diag_offset)
        else:  # whole tiles: a row mask only (broadcast in the selects: no per-entry predicate)
            visible = tok_ok[:, None]
        m, l, mass, acc, plogp = _online_update(m, l, mass, acc, plogp, p, logits, visible)
    return m, l, mass, acc, plogp


@triton.jit
def _indexer_fwd_gqa_kernel(
    Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, KL, LSE_I, PART,
    stride_wb, stride_wh, stride_wn,
    H, HK, HI, HKI, N_Q, N_K, qk_scale, log2_heads, keys_per_split, slot0, n_slots,
    GROUP: tl.constexpr, GROUP_I: tl.constexpr, D_PAD: tl.constexpr, DI_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, RELU: tl.constexpr,
    IEEE_T: tl.constexpr, IEEE_I: tl.constexpr, SPLIT: tl.constexpr, LOOP: tl.constexpr,
    SPLIT_MAJOR: tl.constexpr, STAGES: tl.constexpr,
):
    """KL [B, N_Q] and LSE_I [B, N_Q] (nats) from the teacher LSEs (bits), as
    ``_indexer_fwd._indexer_fwd_kernel`` (grid (token blocks, key splits, B), SPLIT_MAJOR: (key
    splits, token blocks, B) with the last token blocks first; SPLIT: the five-scalar states into
    ``PART [5, n_splits, B, N_Q]``, merged on the host)."""
    if SPLIT_MAJOR:
        split = tl.program_id(0)
        pid_t = tl.num_programs(1) - 1 - tl.program_id(1)  # causal: the longest key ranges first
    else:
        pid_t = tl.program_id(0)
        split = tl.program_id(1)
    b = tl.program_id(2)
    t0 = pid_t * BLOCK_T
    toks = t0 + tl.arange(0, BLOCK_T)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T], tl.float32)
    mass = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T], tl.float32)
    plogp = tl.zeros([BLOCK_T], tl.float32)
    key_lo = split * keys_per_split  # a multiple of BLOCK_N (the host rounds keys_per_split)
    # whole tiles every token of the block sees (no masks), then the diagonal band / ragged tile
    full_hi, key_hi = _key_stages(t0, key_lo, tl.minimum(key_lo + keys_per_split, N_K), N_Q, N_K,
                                  BLOCK_T, BLOCK_N, CAUSAL)
    key_hi = tl.maximum(key_hi, key_lo)  # a split past the causal frontier walks nothing
    if STAGES != 2:
        m, l, mass, acc, plogp = _gqa_key_range(
            m, l, mass, acc, plogp, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, stride_wb, stride_wh, stride_wn,
            b, t0, key_lo, full_hi, H, HK, HI, HKI, N_Q, N_K, qk_scale, log2_heads,
            GROUP, GROUP_I, D_PAD, DI_PAD, BLOCK_T, BLOCK_N, False, CAUSAL, RELU, IEEE_T, IEEE_I, LOOP)
    if STAGES != 1:
        m, l, mass, acc, plogp = _gqa_key_range(
            m, l, mass, acc, plogp, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, stride_wb, stride_wh, stride_wn,
            b, t0, full_hi, key_hi, H, HK, HI, HKI, N_Q, N_K, qk_scale, log2_heads,
            GROUP, GROUP_I, D_PAD, DI_PAD, BLOCK_T, BLOCK_N, True, CAUSAL, RELU, IEEE_T, IEEE_I, LOOP)
    ok = toks < N_Q
    out = b.to(tl.int64) * N_Q + toks
    if SPLIT:
        plane = tl.num_programs(2).to(tl.int64) * n_slots * N_Q
        at = PART + (slot0 + split).to(tl.int64) * tl.num_programs(2) * N_Q + out
        tl.store(at, m, mask=ok)
        tl.store(at + plane, l, mask=ok)
        tl.store(at + 2 * plane, mass, mask=ok)
        tl.store(at + 3 * plane, acc, mask=ok)
        tl.store(at + 4 * plane, plogp, mask=ok)
    else:
        kl, lse_i = _finish(m, l, acc, plogp)
        tl.store(KL + out, kl, mask=ok)
        tl.store(LSE_I + out, lse_i, mask=ok)


@triton.jit
def _merge_states_kernel(PART, KL, LSE_I, n_splits, rows, BLOCK: tl.constexpr):
    """``_indexer._merge_splits`` per row: the splits' (m, l, mass, acc, plogp) re-referenced to
    the common max m_all (a NaN max stays NaN), then ``_finish``'s rule (empty row: KL 0, LSE_I
    -inf). ``PART [5, n_splits, rows]`` as ``rows = B * N_Q`` contiguous floats per plane."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < rows
    plane = n_splits * rows
    m_all = tl.full([BLOCK], float("-inf"), tl.float32)
    for sp in range(0, n_splits):
        m = tl.load(PART + sp * rows + offs, mask=ok, other=float("-inf"))
        m_all = tl.maximum(m_all, m, propagate_nan=tl.PropagateNan.ALL)
    shift = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK], tl.float32)
    acc_all = tl.zeros([BLOCK], tl.float32)
    plogp_all = tl.zeros([BLOCK], tl.float32)
    for sp in range(0, n_splits):
        at = PART + sp * rows + offs
        m = tl.load(at, mask=ok, other=float("-inf"))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l_all += tl.load(at + plane, mask=ok, other=0.0) * tl.exp(m - shift)  # exp(-inf) = 0: a split that saw no key
        acc_all += tl.load(at + 3 * plane, mask=ok, other=0.0) - tl.load(at + 2 * plane, mask=ok, other=0.0) * (shift - m_safe)
        plogp_all += tl.load(at + 4 * plane, mask=ok, other=0.0)
    empty = l_all == 0.0
    log_l = tl.log(tl.where(empty, 1.0, l_all))
    tl.store(KL + offs, tl.where(empty, 0.0, plogp_all - acc_all + log_l), mask=ok)
    tl.store(LSE_I + offs, tl.where(empty, float("-inf"), m_all + log_l), mask=ok)
