"""The indexer's launch configurations (:class:`IndexerConfig`, defined beside the plan it makes in
``indexer/plan.py``): the interpreter's fixed config and the GPU candidate lists of every kernel
kind (forward, backward, the training designs), which the tuner times."""
from __future__ import annotations

import functools
from dataclasses import replace

import triton

from streamkl_gpu.indexer.triton import fwd as _indexer_fwd
from streamkl_gpu.indexer.triton import fwd_gqa as _indexer_fwd_gqa  # the GQA teacher's forward
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu.indexer import plan as _plan_mod
from streamkl_gpu.indexer.plan import IndexerConfig


def _configs(tiles, **fields):
    """:class:`IndexerConfig` of each ``(teacher_rows, indexer_rows, block_n, block_d, num_warps,
    num_stages)`` tile, the optional ``fields`` (``max_heads_per_chunk``, ``splits``, ``variant``)
    set alike on all."""
    return [IndexerConfig(teacher_rows=rows, indexer_rows=irows, block_n=block_n, block_d=block_d, num_warps=warps,
                          num_stages=stages, **fields) for rows, irows, block_n, block_d, warps, stages in tiles]


# One fixed configuration under the interpreter (tests may override)
INTERPRETER_CONFIG = IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=32, block_d=32, num_warps=1, num_stages=1)
# fp32 inputs: IEEE dots on the FMA units, small tiles (as attention_kl's fp32 tiles)
_IEEE_CONFIG = IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=32, block_d=32, num_warps=4, num_stages=1)


def _new_fwd_candidates(dims, gqa, n_sm):
    """The forward candidates of the first tensor-core tuning (the DSA and GQA targets; chosen by offline sm_90 compiles and
    the FLOP-per-byte count of a score tile, before they were timed; a script since removed,
    ``git show b7066de:bench/indexer_perf_gpu.py``, timed each:
    bench/results/2026-12-01_h200_3c98559/indexer_perf.csv).

    The score tile of ``rows`` (head, token) pairs by BLOCK_N keys re-reads its q rows from L2 for
    every key tile: about rows * BLOCK_N / (rows + BLOCK_N) FLOP per byte (43 at 128 x 64, the
    measured DSA forward ran at ~4 TB/s of it). BLOCK_N = 128 takes it to 64 (no spills at DSA:
    234 registers on triton 3.9; 256 rows x 128 keys would give 85 but spills 144 B). GQA at 8K had 64-256 programs for 132 SMs, each a serial chain of small tiles: key
    splits (``splits``) bring it to ~4 programs per SM. Tiles below: (teacher_rows, indexer_rows,
    block_n, block_d, num_warps, num_stages)."""
    if dims is None:
        return []
    if not gqa:
        # (256 rows x 128 keys spills 144 B on triton 3.9: left out; 128 x 128 spills 176 B on
        # 3.6, none on 3.9). Measured (H200, DSA 8K causal, lse given): 8 warps, 3
        # stages 25.05 ms (3.50x the floor), 2 stages 30.26. The "l1" variants (pointer loads, the
        # token's q rows cached in L1) measured 46.1 / 30.9 / 71.0 ms at BLOCK_N = 64 / 128 / 32:
        # no longer candidates (bench/results/2026-12-01_h200_3c98559/indexer_perf.csv, timed forced by a
        # script since removed, ``git show b7066de:bench/indexer_perf_gpu.py``).
        # Next: 128 x 128 tiles on 4 warps (one warpgroup, two m64 wgmma per k-step): offline
        # sm_90 compiles, triton 3.6 and 3.9, 255 registers, no spills, 49 KB (2 stages) / 82 KB
        # (3 stages) of shared memory: two CTAs per SM, so one CTA's exponentials and head sums
        # run while the other's products are on the tensor cores (8 warps x 253 registers: one
        # CTA per SM, nothing to overlap with). 16 warps (256 rows, or 128 x 256): capped at 128
        # registers, ~500 B of spills: left out.
        # Nsight Compute of the best (bench/results/2026-12-01_h200_5702577/ncu_idx_dsa8k.txt):
        # tensor pipe 24 %, L2 36 %, 2 warps per scheduler: latency bound, not L2 bound; so also
        # 64 heads x 64 keys (max_heads_per_chunk=64)
        # on 4 warps: 130 registers, 41 KB, three CTAs per SM (offline).
        # Measured (H200, triton 3.6, DSA 8K causal, lse given,
        # bench/results/2026-12-01_h200_121408f/indexer_perf.csv): 4 warps 3 stages
        # 17.48 ms = 2.34x the floor (the first: the untuned choice), 4 warps 2 stages 21.36,
        # 8 warps 3 stages 24.89, 64 x 64 on 4 warps 28.25.
        out = (_configs([(128, 128, 128, 64, 4, 3), (128, 128, 128, 64, 4, 2), (128, 128, 128, 64, 8, 3),
                         (128, 128, 128, 64, 8, 2)])
               + _configs([(64, 64, 64, 64, 4, 3)], max_heads_per_chunk=64))
        # Then keys-major score tiles (variant "keys", _indexer_fwd.variant_meta:
        # S^T = k q^T, the head sum a row sum of the accumulator, no cross-warp reduction; the
        # per-column LSEs / weights loaded once per program). Measured (H200, triton 3.6, DSA 8K
        # causal, lse given, bench/results/2026-12-01_h200_d3b757b/idx_dsa.csv): 128 keys on 4 warps,
        # 3 stages 13.69 ms = 1.87x the floor (row-major default 18.06 in the same run), 16K 61.2 ms
        # = 2.08x (default
        # 77.4); 8 warps at maxnreg 128 14.18; 8 warps 15.76; 2 stages 15.75; 64-key tiles 20.0-25.6
        # (flattened loops, "flat", and reversed token order, "lpt", did not close the gap).
        # First for the DSA-like family (one token per tile, H >= 128: the measured layout);
        # other MQA teachers keep the row-major order and try it last.
        # An H200 run (round-robin medians, 8K / 16K / 32K / 64K): key splits of 4096 keys and token
        # blocks in reverse ("lpt") 13.18 / 53.52 / 215.7 / 854.5 ms = 1.84 / 1.87 / 1.88 / 1.87x the
        # floor, against 14.13 / 60.16 / 254.9 / 1106.5 = 1.97 / 2.10 / 2.23 / 2.42x without either
        # (splits alone 13.40 / 52.41 / 220.7; lpt alone 12.99 / 55.45 / 216.5; row-major 21.27 /
        # 84.34 / 328.96; 8 warps r128 with splits 13.76 / 58.78 / 222.9).
        splits = _keys_major_splits(dims)
        keys = (_configs([(128, 128, 128, 64, 4, 3)], splits=splits, variant="keys_lpt")
                + _configs([(128, 128, 128, 64, 8, 3)], splits=splits, variant="keys_r128")
                + _configs([(128, 128, 128, 64, 4, 3)], variant="keys"))
        out = keys + out if _keys_major_first(dims) else out + keys
    else:
        out = []
        # (64, 64, 64, 64, 4, 3, 1): 64 tokens x 64 keys of one head on 4 warps, 3 stages: 198
        # registers, no spills (offline sm_90, triton 3.9), so two CTAs per SM (the measured best,
        # (128, 128, 128, 64, 8, 2, 1), 2.29 ms at 8K, has 255 registers and 40 B of spills; Nsight
        # Compute of it (Nsight Compute): tensor pipe 19 %, instruction issue at 24 %, stalls on waits and barriers:
        # latency bound). Smaller tiles for more CTAs per SM: 32 x 64 (136 registers, 24 KB: three
        # per SM), 64 x 32 (108 registers, 74 KB, 3 stages: three per SM).
        # Measured (bench/results/2026-12-01_h200_121408f/indexer_perf.csv, GQA 8K):
        # 64 x 64 3 stages 2.341 ms = 5.02x (first), 128 x 128 8 warps
        # 2.483, 64 x 32 2.700, 64 x 64 2 stages 3.256, 32 x 64 4.785.
        # The GQA kernel (_indexer_fwd_gqa) first, its key splits by its own rule; run
        # An H200 run: "gqa-band" 64 x 64, 24 splits 1.967 ms = 4.31x at 8K, 4.464 = 2.45x at 16K, against
        # 2.681 / 6.840 for (64, 64, 64, 64, 4, 3, 1, 5) in the same run
        out += _indexer_fwd_gqa.candidates(dims, n_sm)
        # (tile, teacher heads per chunk at most), each with the key splits _fwd_split sets
        for tile, heads in (((64, 64, 64, 64, 4, 3), 1), ((128, 128, 128, 64, 8, 2), 1), ((128, 128, 64, 64, 8, 2), None),
                            ((128, 128, 64, 64, 8, 2), 1), ((64, 64, 64, 64, 4, 2), None), ((64, 64, 64, 64, 4, 2), 1),
                            ((32, 32, 64, 64, 4, 2), 1), ((64, 64, 32, 64, 4, 3), 1)):
            (base,) = _configs([tile], max_heads_per_chunk=heads)
            out.append(replace(base, splits=_plan_mod._fwd_split(dims, base, n_sm)))
    return out


def _keys_major_first(dims) -> bool:
    """The keys-major forward first (the untuned choice): MQA teachers of at least 128 heads, so
    a 128-row tile is one token's heads (BLOCK_T = 1), the layout measured at DSA."""
    return dims.HK == 1 and dims.H >= 128


# Keys per split of the keys-major forward from this many keys on (None: no key splits). Splits
# keep the resident programs on one key range, so their key window stays in L2 beside their q rows
# (without: ~264 resident CTAs x 147 KB of q rows, ~39 MB, plus every key up to the diagonal, 19 MB
# at 16K and 75 MB at 64K, against the H200's 50 MB of L2: 2.10x the floor at 16K, 2.42x at 64K
# in an H200 run, 1.87x with splits). Measured from 8K (an H200 run); below, one split. At most
# KEYS_MAJOR_MAX_SPLITS: the splits' states (PART, 5 floats per split and token) stay a bounded
# 320 B per token, so the forward's extra memory stays linear in N (past 64K the splits grow
# beyond 4096 keys: 8192 at 128K, not timed).
KEYS_MAJOR_SPLIT_FROM = 8192
KEYS_MAJOR_KEYS_PER_SPLIT = 4096
KEYS_MAJOR_MAX_SPLITS = 16


def _keys_major_splits(dims) -> int:
    """Key splits of the keys-major forward candidates (``IndexerConfig.splits``)."""
    if KEYS_MAJOR_SPLIT_FROM is None or dims.NK < KEYS_MAJOR_SPLIT_FROM:
        return 1
    return min(KEYS_MAJOR_MAX_SPLITS, _runtime.cdiv(dims.NK, KEYS_MAJOR_KEYS_PER_SPLIT))


def l1_fwd_candidates(dims):
    """The forward's "l1" variants (measured slower at DSA: no longer the tuner's
    candidates: bench/results/2026-12-01_h200_3c98559/indexer_perf.csv, timed forced by a script
    since removed, ``git show b7066de:bench/indexer_perf_gpu.py``)."""
    if dims is None or not _plan_mod._l1_fits(dims):
        return []
    return _configs([(128, 128, 64, 64, 8, 2), (128, 128, 128, 64, 8, 2), (128, 128, 32, 64, 8, 2)], variant="l1")


# ----------------------------------------------------------------------------------------------
# The shape rules: where the tuner's record covers a teacher family, the pick's winner goes first
# and, by default (STREAMKL_AUTOTUNE=auto), runs untimed: one kernel compiled per pick.
# The record: every candidate of every pick timed (STREAMKL_AUTOTUNE=1, the tuner's medians, close
# ones re-timed) at DSA-like (H = 128, D = 576, one key head; indexer 64 x 128) 8K and 16K, an MQA
# teacher of 64 heads at 8K, and GQA-like (H = 32 over 8 key heads, D = 128; indexer 16 x 64) 4K-16K,
# causal, bf16 (H200, triton 3.6: bench/results/2026-12-04_h200_19ad57e/tuning_log.csv, written by
# ``python bench/compare_trees.py --tuning-log .``). In every row below the rule's config is the
# fastest or within 0.5 % of it at every point of its family, and the first candidate before was
# up to 2.4x slower (the ratio, worst point). A family or kind not listed stays timed.
#   dsa  lse     the "qreg" form, 128 rows x 64 keys, 8 warps, 3 stages: measured after the record, forced
#                one candidate at a time (H100, 8K causal, 5 interleaved rounds): 9.84 ms against the
#                record's rule tile (128 x 128 x 128, 4 warps, 3 stages) 12.90, the training step
#                without lse 32.65 against 35.46 ms (64-head MQA: 22.93 against 24.41); GQA-like the
#                64 x 64 "qreg" tile on 4 warps, 3 stages, one head per chunk: 0.614 against 0.948 ms
#                (bench/results/2026-12-06_h100_6dc1dc9/lse_sweep.csv, dsa_nolse.csv)
#        fwd     the keys-major "keys_lpt" forward with splits (already first: 1.00x)
#        topk    the separate-student forward                  (0.4 % from the best; 1.60x better at mqa)
#        (the recomputing backward stays timed: with the record's winners, dq 128 x 128 x 64 on 8
#        warps and dk 64 x 64 x 64 on 4, the per-row-loss step at 8K measured 5.2 % slower than with
#        the tuner's own choice, 10 interleaved rounds: bench/results/2026-12-04_h200_4a5f2d4/)
#   mqa  (one key head, 64 <= H < 128) as dsa, and bwd_dq, bwd_dk 64 x 64 x 64 on 4 warps, 2 stages
#        (first before 1.42x, 1.15x); fwd keys_lpt first (the row-major first before: 1.28x)
#   gqa  lse     "qreg" 64 x 64, 4 warps, 3 stages, one head per chunk (see dsa lse)
#        fwd     the GQA kernel's band ("gqa-band-r128", already first: 1.00x)
#        pacc    128 x 128 x 64, 4 warps, 3 stages             (first before: 1.96x)
#        bwd_dq, bwd_dk  64 x 64 x 64, 4 warps, 2 stages       (first before: 2.37x, 2.05x)
# ----------------------------------------------------------------------------------------------
_TILES_64_4W = dict(teacher_rows=64, block_n=64, num_warps=4, num_stages=2, variant="tiles")
# the teacher-LSE pass with the program's q rows kept in registers ("qreg"): see the rule notes above
_MQA_LSE = dict(teacher_rows=128, block_n=64, num_warps=8, num_stages=3, variant="qreg")
SHAPE_RULES = {
    ("dsa", "lse"): _MQA_LSE, ("mqa", "lse"): _MQA_LSE,
    ("dsa", "fwd"): dict(variant="keys_lpt"), ("mqa", "fwd"): dict(variant="keys_lpt"),
    ("mqa", "bwd_dq"): _TILES_64_4W, ("mqa", "bwd_dk"): _TILES_64_4W,
    ("gqa", "lse"): dict(teacher_rows=64, block_n=64, num_warps=4, num_stages=3, max_heads_per_chunk=1, variant="qreg"),
    ("gqa", "fwd"): dict(variant="gqa-band-r128"),
    ("gqa", "pacc"): dict(teacher_rows=128, block_n=64, num_warps=4, num_stages=3, variant="tiles"),
    ("gqa", "bwd_dq"): _TILES_64_4W, ("gqa", "bwd_dk"): _TILES_64_4W,
    ("dsa", "topk"): dict(separate_student=True), ("mqa", "topk"): dict(separate_student=True),
}


# The Gluon kernels (indexer/gluon/, Hopper, one teacher key head) under STREAMKL_INDEXER_BACKEND=auto
# only where they were measured faster: wide MQA teachers from 2048 keys on (docs/indexer.md,
# "The Hopper forward in Gluon"; bench/results/2026-12-06_h100_526679b/)
BACKEND_VAR = "STREAMKL_INDEXER_BACKEND"
GLUON_MIN_KEYS = 2048
GLUON_MIN_TEACHER = 64 * 512  # H * D


def gluon_family(dims) -> bool:
    return dims.NK >= GLUON_MIN_KEYS and dims.H * dims.D >= GLUON_MIN_TEACHER


def teacher_family(dims):
    """The rules' teacher family: ``"dsa"`` (one key head, >= 128 heads), ``"mqa"`` (one key head,
    64-127 heads), ``"gqa"`` (several key heads), or None (no rule: timed)."""
    if dims is None:
        return None
    if dims.HK > 1:
        return "gqa"
    return "dsa" if dims.H >= 128 else "mqa" if dims.H >= 64 else None


def _matches(cfg, fields):
    return all(getattr(cfg, name, None) == value for name, value in fields.items())


def _rule_first(kind, dims, cands):
    """``cands`` with the shape rule's config of ``kind`` first (unchanged where there is none)."""
    fields = SHAPE_RULES.get((teacher_family(dims), kind))
    hit = next((c for c in cands if fields is not None and _matches(c, fields)), None)
    return cands if hit is None else [hit] + [c for c in cands if c is not hit]


STORING_FORWARD_ORDERS = ("forward_rule", "candidates")


def storing_forward_candidates(ieee, dims, n_sm, order="forward_rule"):
    """The chunk design's storing-forward tiles, in the order it tries them (the first that fits
    runs, untimed): the forward's candidates with the plain forward's shape rule first
    (``"forward_rule"``, the default), or as listed (``"candidates"``, a benchmark's choice through
    the forcing hook). The two orders differ only for the 64-127-head MQA teachers ("mqa"), where
    the rule's keys-major tile ran the 64-head training step at 8K in 38.41 ms against the listed
    row-major tile's 41.32 (H100, bench/results/2026-12-06_h100_0120efb/step_times.csv,
    mqa64_no_lse_fwdrule and mqa64_no_lse) and compiles in 1.52 s instead of 2.45
    (bench/results/2026-12-05_cpu-2core_abe628f/pstore_order_mqa64.csv)."""
    order, *flags = order.split("+")
    if order not in STORING_FORWARD_ORDERS:
        raise ValueError(f"indexer_storing_forward_order is one of {STORING_FORWARD_ORDERS}, optionally with "
                         f"+flags of the GQA kernel's variant ({_indexer_fwd_gqa.FLAGS}), got {order!r}")
    if order == "forward_rule" and not flags and not (_runtime.interpreting() or ieee):
        return list(_storing_forward_default(dims, n_sm))
    cands = _candidates("pstore", ieee, dims, n_sm)
    if order == "forward_rule" and not (_runtime.interpreting() or ieee):  # (those lists are one config)
        cands = list(_storing_forward_rule_order(dims, n_sm))
    return _with_gqa_flags(cands, flags) if flags else cands


# The GQA kernel's flags in the default order: the key splits merged side by side and written in
# place ("wm"), the chunk design in one chunk while p fits PCHUNK_MAX_BYTES ("one"). GQA-like 8K
# causal training step (H100, 5 interleaved rounds): 2.752 against 3.599 ms with lse given, 3.684
# against 4.539 without; kernels launched 24 against 44 (bench/results/2026-12-06_h100_6dc1dc9/
# gqa_variants.csv). The order "candidates" keeps the list without them.
STORING_FORWARD_GQA_FLAGS = ("wm", "one")


@functools.lru_cache(maxsize=1024)
def _storing_forward_default(dims, n_sm):  # memoised: the chunk design asks on every call
    return tuple(_with_gqa_flags(list(_storing_forward_rule_order(dims, n_sm)), STORING_FORWARD_GQA_FLAGS))


def _with_gqa_flags(cands, flags):
    """``cands`` with its first GQA-kernel config given the variant flags ``flags`` (``fwd_gqa.FLAGS``:
    e.g. ``wm``, ``one``), put first; unchanged where no candidate is the GQA kernel's. The order's
    ``+flag`` suffixes (``"forward_rule+wm+one"``), a benchmark's choice through the forcing hook."""
    hit = next((c for c in cands if _indexer_fwd_gqa.parse_variant(c.variant) is not None), None)
    if hit is None:
        return cands
    first = replace(hit, variant=_indexer_fwd_gqa.with_flags(hit.variant, flags))
    return [first] + [c for c in cands if c is not hit]


@functools.lru_cache(maxsize=1024)
def _storing_forward_rule_order(dims, n_sm):  # memoised: the chunk design asks on every call
    return tuple(_rule_first("fwd", dims, _candidates("pstore", False, dims, n_sm)))


CHUNK_GRADIENT_ORDERS = ("rule", "rows_first", "keys_first", "branch_first")
# The chunk design's keys-major gradient tiles (``indexer/triton/chunk_grad_keys.py``): (indexer
# columns, keys, warps, stages).
_KEYS_GRADIENT_TILES = ((128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 2), (64, 128, 8, 2), (64, 64, 4, 2))
# The gradient kernel's tile by teacher family (the kernel reads no teacher tile: what matters is
# the indexer, 64 x 128 for "dsa" and "mqa", 16 x 64 for "gqa"): keys-major, 128 columns. Each
# tile forced first in turn through the forcing hook, the 8K causal training step with lse given
# (H100, rotated rounds, bench/results/2026-12-06_h100_8fbe1d5/chunk_gradient_tiles.csv): DSA-like
# 128 keys x 8 warps 20.87 ms against 22.48 for the 64-key tile before it (128 x 32: 25.05, 256
# columns: 31.41); GQA-like 64 keys x 4 warps 1.90 ms against 2.51 (128 keys x 8 warps 2.08, 64
# columns x 4 warps 1.99). Before that record the 64-key, 8-warp tile won a kernel split against
# the row-major tiles (bench/results/2026-12-06_h100_0120efb/kernel_split.csv).
CHUNK_GRADIENT_RULES = {
    **{family: dict(variant="keys", indexer_rows=128, block_n=128, num_warps=8, num_stages=2) for family in ("dsa", "mqa")},
    "gqa": dict(variant="keys", indexer_rows=128, block_n=64, num_warps=4, num_stages=2),
}


def chunk_gradient_candidates(ieee, dims, order="rule", first=None):
    """The chunk design's gradient-kernel tiles, in the order it tries them (the first that fits
    runs, untimed): the family's ``CHUNK_GRADIENT_RULES`` tile first, then the student backward's
    row-major candidates, then the keys-major tiles (``"rule"``, the default); or, a benchmark's
    choice through the forcing hook, the row-major tiles first (``"rows_first"``, the order before
    the rule), the keys-major tiles first (``"keys_first"``), or the rule's keys-major tile (the
    interpreter's: its one) in the variant ``"keys_branch"`` first (``"branch_first"``: the first
    product under a branch, ``chunk_grad_keys.py``; timed, no faster). ``first``: an
    :class:`IndexerConfig` tried before all of them (the hook's ``indexer_chunk_gradient_config``).
    The interpreter's and fp32's lists are their one config, then the same keys-major."""
    if order not in CHUNK_GRADIENT_ORDERS:
        raise ValueError(f"indexer_chunk_gradient_order is one of {CHUNK_GRADIENT_ORDERS}, got {order!r}")
    if first is not None:
        if not isinstance(first, IndexerConfig):
            raise ValueError(f"indexer_chunk_gradient_config is an IndexerConfig, got {first!r}")
        return [first] + [c for c in chunk_gradient_candidates(ieee, dims, order) if c != first]
    if order == "branch_first":
        base = _chunk_gradient_listed(ieee, dims, "rule")
        return [replace(next(c for c in base if c.variant == "keys"), variant="keys_branch")] + base
    return _chunk_gradient_listed(ieee, dims, order)


def _chunk_gradient_listed(ieee, dims, order):
    if _runtime.interpreting() or ieee:  # their one config, keys-major
        rows = _candidates("bwd", ieee, dims, teacher=False)
        keys = [replace(INTERPRETER_CONFIG if _runtime.interpreting() else _IEEE_CONFIG, variant="keys")]
        return keys + rows if order == "keys_first" else rows + keys
    return list(_gpu_chunk_gradient_candidates(dims, order))


@functools.lru_cache(maxsize=1024)
def _gpu_chunk_gradient_candidates(dims, order):  # memoised: the chunk design asks on every call
    rows = _candidates("bwd", False, dims, teacher=False)
    keys = _configs([(cols, cols, block_n, 64, warps, stages) for cols, block_n, warps, stages in _KEYS_GRADIENT_TILES],
                    variant="keys")
    if order == "keys_first":
        return tuple(keys + rows)
    listed = rows + keys
    fields = CHUNK_GRADIENT_RULES.get(teacher_family(dims)) if order == "rule" else None
    hit = next((c for c in listed if fields is not None and _matches(c, fields)), None)
    return tuple(listed if hit is None else [hit] + [c for c in listed if c is not hit])


def ruled(kind, dims, candidates) -> bool:
    """Does a shape rule choose this pick (its config first in ``candidates``)? Then the pick is not
    timed by default (``_tuning.pick``'s ``ruled``)."""
    fields = SHAPE_RULES.get((teacher_family(dims), kind))
    return fields is not None and bool(candidates) and _matches(candidates[0], fields)


def lse_config_name(cfg) -> str:
    """The short name of a teacher-LSE launch config (the forcing hook's ``indexer_teacher_lse_config``):
    ``<variant>_<teacher_rows>x<block_n>_w<warps>s<stages>``, ``_h<n>`` for at most n heads per
    chunk, ``_k<n>`` for n key splits; e.g. ``tiles_128x128_w4s3``, ``qreg_128x64_w8s3``."""
    name = f"{cfg.variant}_{cfg.teacher_rows}x{cfg.block_n}_w{cfg.num_warps}s{cfg.num_stages}"
    if cfg.block_d != 64:
        name += f"_d{cfg.block_d}"
    if cfg.max_heads_per_chunk is not None:
        name += f"_h{cfg.max_heads_per_chunk}"
    if cfg.splits != 1:
        name += f"_k{cfg.splits}"
    return name


def lse_config_names(dims, n_sm=132):
    """The names of the GPU's teacher-LSE candidates at ``dims``, in the tuner's order (the shape
    rule's first)."""
    return [lse_config_name(c) for c in _ruled_candidates("lse", dims, n_sm, True)]


def forced_lse_config(choice, dims, n_sm=132):
    """The teacher-LSE config the forcing hook names: an :class:`IndexerConfig` as is, or the name
    (``lse_config_name``) of one of the GPU's candidates at ``dims`` (under the interpreter too, so
    a test can run a GPU tile at a small shape); ``ValueError`` listing the names otherwise."""
    if isinstance(choice, IndexerConfig):
        return choice
    for cfg in _ruled_candidates("lse", dims, n_sm, True):
        if lse_config_name(cfg) == choice:
            return cfg
    raise ValueError(f"indexer_teacher_lse_config is an IndexerConfig or one of {lse_config_names(dims, n_sm)}, "
                     f"got {choice!r}")


def _candidates(kind, ieee, dims=None, n_sm=132, teacher=True):
    """Launch configs of a kernel kind, the untuned default first (the shape rule's, where one
    covers the kind: ``SHAPE_RULES``; ``bwd_dq`` and ``bwd_dk`` are the recomputing backward's two
    kernels, ordered apart from the ``bwd`` list the chunk design takes). The GPU's lists are
    memoised: forming them plans every candidate, which cost ~half of a GQA forward's host time (a
    CPU timing with the launches stubbed: 650 -> 300 us with the host-side cdiv alone)."""
    if _runtime.interpreting():
        return [INTERPRETER_CONFIG]
    if ieee:
        return [_IEEE_CONFIG]
    return list(_ruled_candidates(kind, dims, n_sm, teacher))


@functools.lru_cache(maxsize=1024)
def _ruled_candidates(kind, dims, n_sm, teacher):
    base = "bwd" if kind in ("bwd_dq", "bwd_dk") else kind
    return tuple(_rule_first(kind, dims, list(_gpu_candidates(base, dims, n_sm, teacher))))


@functools.lru_cache(maxsize=1024)
def _gpu_candidates(kind, dims, n_sm, teacher):
    # tiles (teacher_rows, indexer_rows, block_n, block_d, num_warps, num_stages); not yet measured on the GPU
    # Pruned by offline sm_90 compiles (triton 3.6 and 3.9, TMA path): BLOCK_N = 128 spills in the
    # forward at both anchor configs (DSA 32 B, GQA 552 B of stack); 256 teacher rows spill 104 B
    # at DSA on 3.6. The first candidate spills nowhere. Times not yet measured.
    # Measured (H200, pointer loads, before TMA; bench/results/): DSA-like 8K forward
    # 3.6x the floor, GQA-like 17.6x. GQA's chunks of 4 heads x 32 tokens need a reshape-sum per
    # chunk and 8 chunks per key tile; max_heads_per_chunk=1 makes chunks of one head x 128 tokens
    # (no head sum inside a chunk), tried where there is more than one key head. Not yet measured.
    gqa = dims is not None and dims.HK > 1
    if kind == "fwd":
        # the measured best first (the untuned choice, STREAMKL_AUTOTUNE=0), then the rest
        second = (_configs([(128, 128, 64, 64, 8, 2)], max_heads_per_chunk=1) if gqa else
                  _configs([(128, 128, 64, 64, 8, 3)]))
        old = _configs([(128, 128, 64, 64, 8, 2)]) + second + _configs([(256, 128, 64, 64, 8, 2)])
        return list(dict.fromkeys(_new_fwd_candidates(dims, gqa, n_sm) + old))  # no duplicates
    if kind == "pacc":
        # planned as the backward ("bwd"): all indexer heads x BLOCK_T tokens per tile. Offline
        # sm_90 compiles (triton 3.9, DSA 8K, dk shares by TMA reduction): BLOCK_N = 32 spills
        # nothing (254 registers), BLOCK_N = 64 spills 216 B of stack, yet measured the faster.
        # Measured (H200, DSA 8K causal fwd+bwd, 12:49 run): BLOCK_N = 64 73.2 ms, 32 101.3 ms.
        # An H200 run: 3 stages 52.96 ms, 2 stages 61.79, "l1" 60.29. Later: BLOCK_N = 128 (the
        # forward's best tile; offline sm_90, triton 3.9: ~1 KB of spills, BLOCK_N = 64 328 B),
        # bench/results/2026-12-01_h200_121408f/indexer_perf.csv:
        # BLOCK_N = 64 53.05 ms fwd+bwd (accumulating forward 38.71, backward 14.34), BLOCK_N
        # = 128 54.13. 4 warps (two CTAs per SM, as the forward's best): spills 568 B offline at
        # BLOCK_N = 64, not yet timed.
        return (_configs([(128, 128, 64, 64, 8, 3), (128, 128, 64, 64, 4, 3), (128, 128, 128, 64, 8, 3),
                          (128, 128, 64, 64, 8, 2)])
                + _configs([(128, 128, 64, 64, 8, 2)], variant="l1")
                + _configs([(128, 128, 128, 64, 8, 2), (128, 128, 32, 64, 8, 2)])
                + _configs([(128, 128, 32, 64, 8, 2)], variant="l1")
                + _configs([(128, 128, 32, 64, 8, 3), (128, 128, 32, 64, 4, 2)]))
    if kind == "pstore":  # the forward's tile (it only adds a store of p per tile): the forward's candidates
        return _gpu_candidates("fwd", dims, n_sm, True)
    if kind == "lse":
        out = _configs([(128, 128, 64, 64, 8, 2)]) + (_configs([(128, 128, 64, 64, 8, 2)], max_heads_per_chunk=1) if gqa
                                                       else _configs([(128, 128, 128, 64, 8, 2)]))
        # 4-warp tiles, two CTAs per SM (offline sm_90, triton 3.9, no spills: DSA 128 x 128, 3 stages,
        # 233 registers, 82 KB; GQA 64 tokens x 64 keys of one head, 3 stages, 87 registers, 98 KB;
        # the 8-warp ones 143 / 77 registers, one CTA per SM); timed with the rest below (lse_sweep.csv)
        out += (_configs([(64, 64, 64, 64, 4, 3)], max_heads_per_chunk=1) if gqa else
                _configs([(128, 128, 128, 64, 4, 3)]))
        # every one of these timed forced on an H100 (DSA-like / GQA-like 8K, ms): the tiles 12.90-23.75 /
        # 0.95-1.07, "l1" 21.57 and 39.81 (DSA), "qreg" 9.84 / 0.61, the rules' choice
        # (bench/results/2026-12-06_h100_6dc1dc9/lse_sweep.csv)
        if dims is not None and _plan_mod._l1_fits(dims):  # the "l1" variant, as for the forward
            out += _configs([(128, 128, 64, 64, 8, 2), (128, 128, 32, 64, 8, 2)], variant="l1")
        # The "qreg" variant (Q_RESIDENT): the program's q rows loaded once and kept in registers
        # as the products' A operand, so a key tile reads only its keys from L2 (at DSA ~128 FLOP
        # per byte against ~64 for the tiles that re-read a token's 147 KB of q rows per key tile;
        # docs/design/indexer.md, "The teacher LSE pass"). 128 rows x 576 dims need two
        # warpgroups (8 warps: 144 registers of q per thread); 3 stages of 64-key tiles, 221 KB of
        # shared memory, no spills on triton 3.6 (225 registers) and 3.9 (253); 2 stages spill 56 B
        # on 3.9, 32-key tiles 8 B (bench/results/2026-12-06_sass-sm90_2b3f2c0/). The rules' choice (SHAPE_RULES).
        # "qreg_lpt": the same, token blocks in reverse order (the longest causal rows first).
        out += (_configs([(64, 64, 64, 64, 4, 3), (128, 128, 64, 64, 8, 2)], max_heads_per_chunk=1, variant="qreg")
                if gqa else _configs([(128, 128, 64, 64, 8, 3)], variant="qreg")
                + _configs([(128, 128, 64, 64, 8, 3)], variant="qreg_lpt"))
        return out
    out = _configs([(128, 128, 64, 64, 8, 2), (64, 64, 64, 64, 4, 2)])
    if dims is not None and teacher and _plan_mod._l1_fits(dims):
        # the "l1" variant: the dq kernel's q rows / the dk kernel's key tile cached in L1 (not yet
        # timed; offline, triton 3.6, DSA 8K: dq no spills, dk 272 B (BLOCK_N 64) / 160 B (32))
        out += _configs([(128, 128, 64, 64, 8, 2), (128, 128, 32, 64, 8, 2)], variant="l1")
    return out
