"""Hopper (sm_90) teacher-LSE pass of the indexer loss in Gluon, for an MQA teacher (one key head,
up to 128 heads, D up to 576): what a training step without ``lse`` runs first
(``indexer/teacher_lse.py``; the Triton ``_teacher_lse_kernel`` is the reference it is checked
against on the GPU, beside float64).

``lse[b, h, t] = log2 sum_{s visible to t} 2^(sigma log2(e) q[b, h, t] . k[b, 0, s])`` in bits
(``mul.rn`` of the score, then the online max and sum of ``_indexer_fwd._lse_fold``), ``-inf``
for a row with no visible key, NaN for a row whose scores hold a NaN; bottom-right causal.

Why: the Triton "qreg" pass keeps its q rows in registers but ran at 505-530 TFLOP/s of products
at DSA-like 8K on an H100; the Gluon storing forward reads both wgmma operands from shared memory,
which at 64-wide tiles is about the shared-memory bandwidth the products need. Here the q rows are
the wgmma's A operand from registers, so a product reads only its key chunk from shared memory:
8.42 ms against the Triton pass's 9.64 (587 against 513 TFLOP/s;
bench/results/2026-12-06_h100_0361b36/teacher_lse_gluon.txt).

Schedule: one CTA per token (H > 64: consumer warpgroup w takes heads 64 w .. 64 w + 63) or per
two tokens (H <= 64: warpgroup w takes token t + w, all heads), causal CTAs longest first.
- a producer warp streams ``[64, 64]`` boxes through one ring of NUM_STAGES slots, in order: the
  first warpgroup's cdiv(D, 64) q chunks, the second's, then for every key tile its cdiv(D, 64)
  key chunks (``[64 keys, 64 dims]``);
- both consumer warpgroups read every key chunk (the same keys, other rows), so a slot is free
  once both have arrived on its empty barrier (count 2); a warpgroup arrives at once on the other
  warpgroup's q chunks. Each warpgroup first loads its q chunks into registers (the A operand's
  layout), then per key tile chains one m64 x 64 x 64 product per chunk into the tile's scores
  ``s [64 rows, 64 keys]``, waits for them, releases the tile's slots and folds ``s`` into its
  rows' running max and sum (keys as columns: row reductions within a thread and its quad).
Masks (keys past the row's causal frontier or N_K) are selections on the scores of the tiles
past the CTA's whole tiles; heads past H are TMA zero fill and never stored.

This module imports Gluon unconditionally; ``teacher_lse.py`` guards the import.
"""
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra import libdevice

from streamkl_gpu._core import forcing as _forcing
from streamkl_gpu._core.gluon_compat import tma_load
from streamkl_gpu._core.launcher import kernel_call


ROWS = gl.constexpr(64)  # q rows per consumer warpgroup (the wgmma's M)
BOX = gl.constexpr(64)  # keys per tile and dims per chunk: one [64, 64] box (128 bytes of bf16 per row)
LOG2E = 1.4426950408889634
SMEM_BYTES = 227 * 1024
SMEM_RESERVE = 4096  # barriers and the compiler's reduction scratch
MAX_HEADS = 128
MAX_CHUNKS = 9  # D <= 576: 9 chunks of q in registers, 16 per chunk (144 per thread)


@gluon.constexpr_function
def _acc_layout():
    # wgmma accumulator of one warpgroup: [64 rows, 64 keys] fp32
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])


@gluon.jit
def _rows_of(WG, t, TWO_TOKENS: gl.constexpr):
    """(first head, token) of warpgroup WG's rows (WG: a constexpr in the consumers, a runtime
    value in the producer)."""
    if TWO_TOKENS:
        return 0, t + WG
    return WG * ROWS, t


@gluon.jit
def _load_partition(q_desc, k_desc, ring, ready, empty, b, t, n_tiles, DC: gl.constexpr,
                    NUM_STAGES: gl.constexpr, TWO_TOKENS: gl.constexpr):
    """Producer warp: both warpgroups' q chunks, then every key tile's chunks, through the ring."""
    for g in range(0, 2 * DC + n_tiles * DC):
        s = g % NUM_STAGES
        mbarrier.wait(empty.index(s), ((g // NUM_STAGES) & 1) ^ 1)  # a fresh barrier passes the phase-1 wait
        slot = ring.index(s)
        if g < 2 * DC:
            h0, tok = _rows_of(g // DC, t, TWO_TOKENS)  # the warpgroup whose q chunk this is
            mbarrier.expect(ready.index(s), q_desc.block_type.nbytes)
            tma_load(q_desc, [b, h0, tok, (g % DC) * BOX], ready.index(s), slot.reshape([1, ROWS, 1, BOX]))
        else:
            tile = (g - 2 * DC) // DC
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes)
            tma_load(k_desc, [b, 0, tile * BOX, ((g - 2 * DC) % DC) * BOX], ready.index(s), slot)


@gluon.jit
def _landed(ring, ready, g, NUM_STAGES: gl.constexpr):
    """Chunk g's slot once its load has landed, as a [64, 64] tile."""
    s = g % NUM_STAGES
    mbarrier.wait(ready.index(s), (g // NUM_STAGES) & 1)
    return ring.index(s).reshape([BOX, BOX])


@gluon.jit
def _fold(m, l, s, qk_scale, keys, key_lim, MASKED: gl.constexpr):
    """One key tile's scores ``s [64 rows, 64 keys]`` (raw products) into the rows' online max and
    sum in bits (``_indexer_fwd._lse_fold``: mul.rn, then the masked keys selected away)."""
    s = libdevice.mul_rn(s, qk_scale)
    if MASKED:
        s = gl.where((keys < key_lim)[None, :], s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, axis=1))
    shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    l = l * gl.exp2(m - shift) + gl.sum(gl.exp2(s - shift[:, None]), axis=1)
    return m_new, l


@gluon.jit
def _tile(m, l, q_chunks, ring, ready, empty, turn, zero, g0, i, qk_scale, key_lim, keys0, WG: gl.constexpr,
          DC: gl.constexpr, NUM_STAGES: gl.constexpr, MASKED: gl.constexpr, PINGPONG: gl.constexpr):
    """Key tile i: its products, then its fold. PINGPONG (FlashAttention-3's turnstile): the
    warpgroups issue a tile's products in turn, so one folds while the other's products run."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), i & 1)
    s = zero
    for c in gl.static_range(DC):
        kc = _landed(ring, ready, g0 + c, NUM_STAGES)
        s = warpgroup_mma(q_chunks[c], kc.permute((1, 0)), s, use_acc=c > 0, is_async=True)
    if PINGPONG:  # issued: the other warpgroup's turn
        mbarrier.arrive(turn.index(1 - WG), count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    for c in gl.static_range(DC):  # every product reading the tile's chunks has retired
        mbarrier.arrive(empty.index((g0 + c) % NUM_STAGES), count=1)
    return _fold(m, l, s, qk_scale, i * BOX + keys0, key_lim, MASKED)


@gluon.jit
def _consumer(WG: gl.constexpr, ring, ready, empty, turn, LSE_T, b, t, n_full, n_tiles, H, N_Q, N_K, qk_scale,
              DC: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, TWO_TOKENS: gl.constexpr,
              PINGPONG: gl.constexpr):
    acc_layout: gl.constexpr = _acc_layout()
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    h0, tok = _rows_of(WG, t, TWO_TOKENS)
    # this warpgroup's q chunks into registers; the other warpgroup's chunks need no wait
    q_chunks = ()
    for c in gl.static_range(DC):
        q_chunks = q_chunks + (_landed(ring, ready, WG * DC + c, NUM_STAGES).load(a_layout),)
    for g in gl.static_range(2 * DC):
        mbarrier.arrive(empty.index(g % NUM_STAGES), count=1)
    key_lim = N_K
    if CAUSAL:  # bottom-right causal: key s visible to token tok iff s <= tok + (N_K - N_Q)
        key_lim = gl.minimum(N_K, tok + (N_K - N_Q) + 1)
    zero = gl.zeros([ROWS, BOX], gl.float32, acc_layout)
    keys0 = gl.arange(0, BOX, layout=gl.SliceLayout(0, acc_layout))
    m = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l = gl.zeros([ROWS], gl.float32, row_layout)
    for i in range(n_full):  # tiles every row of the CTA sees whole
        m, l = _tile(m, l, q_chunks, ring, ready, empty, turn, zero, 2 * DC + i * DC, i, qk_scale, key_lim, keys0,
                     WG, DC, NUM_STAGES, False, PINGPONG)
    for i in range(n_full, n_tiles):  # the causal band and the ragged last tile
        m, l = _tile(m, l, q_chunks, ring, ready, empty, turn, zero, 2 * DC + i * DC, i, qk_scale, key_lim, keys0,
                     WG, DC, NUM_STAGES, True, PINGPONG)
    lse = gl.where(l == 0.0, float("-inf"), m + gl.log2(l))  # l is NaN (not 0) for a NaN row
    heads = h0 + gl.arange(0, ROWS, layout=row_layout)
    ok = (heads < H) & (tok < N_Q)
    gl.store(LSE_T + (b.to(gl.int64) * H + heads) * N_Q + tok, lse, mask=ok)


@gluon.jit
def _consumer0(ring, ready, empty, turn, LSE_T, b, t, n_full, n_tiles, H, N_Q, N_K, qk_scale, DC: gl.constexpr,
               NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, TWO_TOKENS: gl.constexpr, PINGPONG: gl.constexpr):
    _consumer(0, ring, ready, empty, turn, LSE_T, b, t, n_full, n_tiles, H, N_Q, N_K, qk_scale, DC, NUM_STAGES,
              CAUSAL, TWO_TOKENS, PINGPONG)


@gluon.jit
def _consumer1(ring, ready, empty, turn, LSE_T, b, t, n_full, n_tiles, H, N_Q, N_K, qk_scale, DC: gl.constexpr,
               NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, TWO_TOKENS: gl.constexpr, PINGPONG: gl.constexpr):
    _consumer(1, ring, ready, empty, turn, LSE_T, b, t, n_full, n_tiles, H, N_Q, N_K, qk_scale, DC, NUM_STAGES,
              CAUSAL, TWO_TOKENS, PINGPONG)


@gluon.jit
def _gluon_teacher_lse_kernel(q_desc, k_desc, LSE_T, H, N_Q, N_K, qk_scale, DC: gl.constexpr,
                              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, TWO_TOKENS: gl.constexpr,
                              PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Grid (cdiv(N_Q, tokens per CTA), B); LSE_T [B, H, N_Q] fp32, bits."""
    TOKENS: gl.constexpr = 2 if TWO_TOKENS else 1
    pid = gl.program_id(0)
    if CAUSAL:  # the longest tokens (most key tiles) first: fewer idle SMs in the last wave
        pid = gl.num_programs(0) - 1 - pid
    t = pid * TOKENS
    b = gl.program_id(1)
    lo_lim = N_K  # the keys every row of the CTA sees, and the most any row sees
    hi_lim = N_K
    if CAUSAL:
        lo_lim = gl.maximum(gl.minimum(N_K, t + (N_K - N_Q) + 1), 0)
        hi_lim = gl.maximum(gl.minimum(N_K, t + TOKENS - 1 + (N_K - N_Q) + 1), 0)
    n_full = lo_lim // BOX
    n_tiles = gl.cdiv(hi_lim, BOX)

    ring = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, 1, 1, BOX, BOX], k_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release every chunk
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    if PINGPONG:
        mbarrier.arrive(turn.index(0), count=1)  # warpgroup 0 goes first

    gl.warp_specialize([
        (_consumer0, (ring, ready, empty, turn, LSE_T, b, t, n_full, n_tiles, H, N_Q, N_K, qk_scale, DC, NUM_STAGES,
                      CAUSAL, TWO_TOKENS, PINGPONG)),
        (_consumer1, (ring, ready, empty, turn, LSE_T, b, t, n_full, n_tiles, H, N_Q, N_K, qk_scale, DC, NUM_STAGES,
                      CAUSAL, TWO_TOKENS, PINGPONG)),
        (_load_partition, (q_desc, k_desc, ring, ready, empty, b, t, n_tiles, DC, NUM_STAGES, TWO_TOKENS)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

CTA_THREADS = 384  # the two consumer warpgroups and the producer warp's group (as fwd_sm90)
CTA_REGS = 168 * CTA_THREADS


def producer_regs(consumer_regs: int) -> int:
    return min(256, (CTA_REGS - 2 * 128 * consumer_regs) // 128 // 8 * 8)


@dataclass(frozen=True)
class GluonLseConfig:
    """One launch of the Gluon teacher-LSE pass: ``num_stages`` ring slots of one [64, 64] box, the
    consumer warpgroups at ``consumer_regs`` registers per thread (setmaxnreg); ``pingpong``: the
    warpgroups issue each key tile's products in turn (FlashAttention-3's turnstile). Off: on an H100
    it ran the DSA-like pass 3 % faster alone and the MQA-64 one 3 % slower, the training steps within
    their spread (bench/results/2026-12-06_h100_1080bf3/)."""
    num_stages: int
    consumer_regs: int = 240
    pingpong: bool = False


def candidates(dims):
    """Launch configurations, default first: the deepest ring that fits (27 slots of 8 KB: three
    DSA-like key tiles in flight)."""
    stages = (SMEM_BYTES - SMEM_RESERVE) // (64 * 64 * 2)
    return [GluonLseConfig(num_stages=stages)]


def why_not(dims, dtype, tensors_tma_ok: bool, capability) -> str:
    """Why the Gluon teacher-LSE pass does not apply ('' when it does): pure, CPU-testable."""
    if tuple(capability) != (9, 0):
        return f"compute capability {tuple(capability)}, not (9, 0)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype}: q and k must be float16 or bfloat16"
    if dims.HK != 1:
        return f"H_K = {dims.HK}: one teacher key head only"
    if dims.H > MAX_HEADS:
        return f"H = {dims.H}: at most {MAX_HEADS}"
    if triton.cdiv(dims.D, 64) > MAX_CHUNKS:
        return f"D = {dims.D}: at most {64 * MAX_CHUNKS} (the q rows in registers)"
    if not tensors_tma_ok:
        return "q or k is not TMA-legal (unit stride in D, 16-byte aligned base and strides)"
    return ""


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _descriptor(t, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, _GL_DTYPES[t.dtype]))
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def launch_args(q, k, lse_bits, causal, scale, config=None):
    """(grid, positional args, constexprs, options) of one launch (the CI compile test passes the
    same to ``GluonASTSource``); ``lse_bits`` [B, H, N_Q] fp32 contiguous, written."""
    B, H, N_Q, D = q.shape
    cfg = config if config is not None else candidates(None)[0]
    two = H <= 64
    grid = (triton.cdiv(N_Q, 2 if two else 1), B)
    args = (_descriptor(q, [1, 64, 1, 64]), _descriptor(k, [1, 1, 64, 64]), lse_bits, H, N_Q, k.shape[2],
            float(scale * LOG2E))
    constexprs = dict(DC=triton.cdiv(D, 64), NUM_STAGES=cfg.num_stages, CAUSAL=bool(causal), TWO_TOKENS=two,
                      PINGPONG=bool(cfg.pingpong), CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=producer_regs(cfg.consumer_regs))
    return grid, args, constexprs, dict(num_warps=4, maxnreg=CTA_REGS // CTA_THREADS)


def teacher_lse_bits(q, k, lse_bits, causal, scale, config=None):
    """Launch into ``lse_bits`` (the caller, ``teacher_lse.py``, has checked applicability)."""
    grid, args, constexprs, options = launch_args(q, k, lse_bits, causal, scale, config)
    kernel = kernel_call(_gluon_teacher_lse_kernel, grid)(*args, **constexprs, **options)
    _forcing.record("indexer_lse_sm90", kernel, **constexprs)  # for an open forcing block
    return lse_bits
