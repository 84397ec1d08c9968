"""Launch configurations: a few candidates per shape class, timed once per key on the GPU.

A small hand-rolled tuner (``triton.autotune`` cannot run in the interpreter, and pruning by shape
keeps the tuning cost to a handful of compiles). ``STREAMKL_AUTOTUNE=0`` takes the first
candidate. Also the two automatic rules: ``auto_split_k`` (forward) and ``auto_bwd_mode``.
"""
from __future__ import annotations

import os

import triton

from . import _runtime
from ._runtime import interpreting

_TUNED: dict = {}

# Below this many keys the forward is launch-bound and the TMA path measured slower (H200, 1K
# tokens: 0.21 ms vs 0.11 with pointer loads; 2K: 0.21 vs 0.24, TMA ahead from there on;
# bench/results/h200_2026-11-29_tma_bench.csv vs session1/h200_2026-11-29_bench.csv). Presumably the
# per-launch cost of encoding two host descriptors; not profiled.
TMA_MIN_KEYS = 2048

# fp32 inputs promise fp32 accuracy: their dots run in IEEE fp32 on the FMA units (no tensor
# cores); large tiles then unroll into huge code that takes minutes to compile, so small tiles.
_IEEE_CONFIG = (32, 32, 4, 2)


def bucket(n: int) -> int:
    """The shape bucket of a size: the next power of two (tuned choices are shared within it)."""
    return 1 << max(0, int(n - 1).bit_length())


def pick(key, candidates, launch):
    """Return the fastest of ``candidates`` for ``key`` (measured once), launching nothing else."""
    if len(candidates) == 1 or interpreting() or os.environ.get("STREAMKL_AUTOTUNE", "1") == "0":
        return candidates[0]
    if key not in _TUNED:
        from triton.testing import do_bench

        best, best_t = None, float("inf")
        for cfg in candidates:
            try:
                t = do_bench(lambda: launch(cfg), warmup=5, rep=20, return_mode="median")
            except Exception as exc:  # out of shared memory / registers: not a usable config
                if "OutOfResources" not in type(exc).__name__ and "out of resource" not in str(exc).lower():
                    raise
                continue
            if t < best_t:
                best, best_t = cfg, t
        if best is None:
            raise RuntimeError(f"no launch configuration fits for {key}")
        _TUNED[key] = best
    return _TUNED[key]


def fwd_candidates(dims, d_pad, split, ieee=False, tma=False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, use_tma) candidates, pruned by shape.

    ``tma``: the key tensors can be read through TMA descriptors (Hopper, aligned strides). At
    D = 128 the best TMA config beat the best pointer config in every measured case (H200, 8K/16K,
    causal or not: bench/results/h200_2026-11-29_fwd_tma_configs.csv), so pointer configs are not
    tried there; at other head dims both kinds are candidates (not measured at scale).
    """
    if interpreting():
        return [_runtime.INTERPRETER_BLOCK + (1, 1, tma)]
    if ieee:
        return [(16, 32, 4, 2, False) if split else _IEEE_CONFIG + (False,)]
    if split:
        bm = 16 if dims.NQ <= 16 else (32 if dims.NQ <= 32 else 64)
        cands = [(bm, 128, 4, 3), (bm, 64, 4, 3)] if d_pad <= 128 else [(bm, 64, 4, 2), (bm, 32, 4, 2)]
        return [c + (False,) for c in cands]
    tma_only = False
    if d_pad <= 64:
        cands = [(128, 64, 4, 3), (128, 128, 8, 3)]
        tma_cands = [(128, 64, 4, 3), (128, 128, 8, 2)]
    elif d_pad <= 128:
        cands = [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2)]
        # measured best: 128/32/8/3 (8K, 16K non-causal), 128/64/8/3 (16K causal), 64/64/4/2 (8K causal)
        tma_cands = [(128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2)]
        tma_only = True
    else:
        cands = [(64, 64, 4, 2), (64, 32, 4, 2)]
        tma_cands = [(64, 64, 4, 2), (64, 32, 4, 3)]
    if not tma:
        return [c + (False,) for c in cands]
    return [c + (True,) for c in tma_cands] + ([] if tma_only else [c + (False,) for c in cands])


def bwd_candidates(d_pad, both, kind, ieee=False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK (``kind="dk"``) or dQ kernel."""
    if interpreting():
        return [_runtime.INTERPRETER_BLOCK + (1, 1)]
    if ieee:
        return [_IEEE_CONFIG]
    if kind == "dq":
        if d_pad <= 128 and not both:
            return [(128, 64, 8, 2), (64, 64, 4, 2)]
        return [(64, 64, 8, 2), (64, 32, 4, 2)]
    # dk (BLOCK_M = query tile, BLOCK_N = key tile held in registers)
    if d_pad <= 128 and not both:
        return [(64, 128, 8, 2), (32, 128, 8, 3)]
    return [(64, 64, 8, 2), (32, 64, 4, 2)]


def auto_split_k(dims, block_m: int, block_n: int, n_sm: int) -> int:
    """Split the keys across programs when the query blocks alone cannot fill the GPU.

    Rule: with ``P = ceil(N_Q / BLOCK_M) * B * H`` query-block programs, split only when
    ``P < n_sm``; then aim at about ``4 * n_sm`` programs in all, keeping at least 4 key tiles
    per split (below that the merge traffic outweighs the parallelism).
    """
    programs = triton.cdiv(dims.NQ, block_m) * dims.B * dims.H
    if programs >= n_sm:
        return 1
    key_tiles = triton.cdiv(dims.NK, block_n)
    return max(1, min(triton.cdiv(4 * n_sm, programs), key_tiles // 4))


def auto_bwd_mode(dims, n_sm: int, both: bool = False) -> str:
    """Pick the fused kernel (each tile pair visited once, dQ by fp32 atomics) or the separate ones.

    Measured on the H200 (bench/results/session1/h200_2026-11-29_bench.csv; B=1, H=32, D=128, bf16):
    - one setting (s1 or s2): fused is as fast or faster at N = 4K..32K, causal or not
      (s1, 8K non-causal: 12.84 ms fused vs 13.72 separate), and at N_Q = 16..512 with N_K = 32K;
    - both settings: fused wins at small N_Q (N_K = 32K, N_Q = 16: 1.53 vs 1.79 ms; N_Q = 256:
      2.83 vs 2.92), separate from N_Q = 512 on (N_Q = 512: 4.46 vs 5.24; N = 8K: 16.7 vs 20.5).
    Not measured, reasoned: with fewer key-tile programs than SMs the fused kernel has too
    little parallelism (each program walks every query tile), so the separate kernels run then.
    """
    key_programs = triton.cdiv(dims.NK, 64) * dims.B * dims.H
    if key_programs < n_sm:
        return "separate"
    if both and dims.NQ >= 512:
        return "separate"
    return "fused"
