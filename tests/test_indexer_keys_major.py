"""The indexer forward's keys-major score tiles (the "keys" variant, ``IndexerConfig.variant``; the
DSA-like speed work) and the flattened key loop ("keys_flat", "tiles_flat") under the interpreter: against the float64 reference
(streamkl_ref.indexer_kl) over odd shapes, and against the (head, token)-major kernel.

Tiny shapes: programs run one after another on CPU. Configs are
``(rows, irows, BLOCK_N, BLOCK_D, warps, stages, hb_max, key_splits, variant)``.
"""
from __future__ import annotations

import pytest
import torch

from streamkl_gpu.indexer import configs as idx_configs
from streamkl_gpu.indexer.plan import IndexerConfig
from streamkl_gpu.indexer import host as idx_host
from streamkl_gpu.indexer import plan as idx_plan
from streamkl_ref._checks import check_indexer_inputs

from test_gpu_indexer import check_case, make
from _compiler_env import compiler_env

KEYS = IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=32, num_warps=1, num_stages=1, variant="keys")


def _with_config(monkeypatch, cfg):
    monkeypatch.setattr(idx_configs, "INTERPRETER_CONFIG", cfg)


def _forward(xs, lse=None, causal=True, scale=0.25, relu=True):
    kl, lse_idx, _ = idx_host._forward(*xs, lse, causal, scale, relu)
    return kl, lse_idx


# (B, H, H_K, N_Q, N_K, D, H_I, H_KI, D_I), causal, lse given, config
CASES = [
    ((1, 4, 1, 13, 21, 24, 4, 1, 16), True, True, KEYS),     # MQA both sides, N_K > N_Q, ragged
    ((1, 8, 1, 11, 11, 40, 4, 1, 16), True, False, IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=16, num_warps=1, num_stages=1, variant="keys")),  # D tiled 16 + 16 + 8
    ((2, 4, 2, 9, 5, 40, 2, 2, 8), True, True, KEYS),        # GQA teacher, 2 indexer key heads, N_Q > N_K
    ((1, 6, 3, 17, 17, 16, 3, 1, 12), False, True, KEYS),    # groups of 3 in boxes of 4 heads
    ((1, 2, 2, 1, 1, 8, 1, 1, 8), True, True, KEYS),         # N = 1
    ((1, 4, 1, 19, 40, 16, 4, 1, 16), True, True, IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=32, num_warps=1, num_stages=1, splits=3, variant="keys")),  # key splits
    ((1, 4, 1, 13, 21, 24, 4, 1, 16), True, True, IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=16, num_warps=1, num_stages=1, variant="keys_flat")),  # flattened loop
    ((1, 6, 3, 17, 17, 16, 3, 1, 12), True, False, IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=16, num_warps=1, num_stages=1, variant="tiles_flat")),
]


@pytest.mark.parametrize("shape,causal,with_lse,cfg", CASES)
def test_keys_major_matches_reference(monkeypatch, shape, causal, with_lse, cfg):
    _with_config(monkeypatch, cfg)
    xs = make(*shape, seed=sum(shape) + 3)
    check_case(xs, with_lse=with_lse, causal=causal, grad=False)


@pytest.mark.parametrize("tma", [True, False], indirect=True)
def test_keys_major_equals_rows_major(monkeypatch, tma):
    """Same products, same formulas, only the tile's orientation (and the loop nest) differs: KL
    and LSE_I agree with the (head, token)-major kernel to fp32 summation order. D = 24 is two
    16-wide chunks (the flattened loop's inner trip count). H = 16 fills one 16-wide column block
    with one token (BLOCK_T = 1, the DSA layout: the head sum is a plain row sum)."""
    xs = make(1, 16, 1, 14, 20, 24, 16, 1, 16, seed=41)
    pl = idx_plan._plan(check_indexer_inputs(*xs), IndexerConfig(teacher_rows=16, indexer_rows=16, block_n=16, block_d=16, num_warps=1, num_stages=1, variant="keys"), "fwd")
    assert pl["BLOCK_T"] == 1 and pl["HB"] == 16
    out = {}
    variants = ("keys", "keys_flat", "tiles_flat", "keys_flat_lpt_r168")
    for variant in ("tiles",) + variants:
        _with_config(monkeypatch, IndexerConfig(teacher_rows=16, indexer_rows=16, block_n=16, block_d=16, num_warps=1, num_stages=1, variant=variant))
        out[variant] = _forward(xs)
    for variant in variants:
        for a, b in zip(out["tiles"], out[variant]):
            assert torch.allclose(a, b, rtol=2e-5, atol=2e-6), (variant, (a - b).abs().max())
    assert torch.isfinite(out["keys"][0]).all()


def test_keys_major_relu_off_and_fp16(monkeypatch):
    _with_config(monkeypatch, KEYS)
    xs = make(1, 4, 1, 10, 12, 16, 2, 1, 16, seed=43, dtype=torch.float16)
    check_case(xs, with_lse=True, causal=True, grad=False, relu=False)


def test_keys_major_dsa_head_dim_576(monkeypatch):
    """The absorbed-MLA head width, tiled along D (9 chunks of 64 here)."""
    _with_config(monkeypatch, IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=64, num_warps=1, num_stages=1, variant="keys"))
    xs = make(1, 2, 1, 5, 7, 576, 2, 1, 16, seed=44, qscale=0.1)
    check_case(xs, with_lse=True, causal=True, grad=False, scale=192 ** -0.5)


def test_keys_major_empty_rows_and_nan_isolation(monkeypatch):
    """N_Q > N_K causal: the first rows see no key (KL 0, LSE_I -inf). A NaN in a teacher key, an
    indexer key, or one teacher query row poisons exactly the rows that see it."""
    _with_config(monkeypatch, KEYS)
    xs = make(1, 4, 1, 12, 8, 16, 2, 1, 8, seed=45)
    kl0, lse0 = _forward(xs)
    assert torch.equal(kl0[0, :4], torch.zeros(4)) and torch.isneginf(lse0[0, :4]).all()
    assert torch.isfinite(kl0[0, 4:]).all()
    for which, idx in ((1, (0, 0, 5, 3)), (3, (0, 0, 5, 1))):  # key 5: rows t with t - 4 >= 5
        bad = [x.clone() for x in xs]
        bad[which][idx] = float("nan")
        kl = _forward(bad)[0]
        assert torch.equal(kl[0, :9], kl0[0, :9]) and torch.isnan(kl[0, 9:]).all()
    bad = [x.clone() for x in xs]
    bad[0][0, 2, 6, 0] = float("nan")  # teacher query row 6 of head 2
    kl = _forward(bad)[0]
    others = [t for t in range(12) if t != 6]
    assert torch.equal(kl[0, others], kl0[0, others]) and torch.isnan(kl[0, 6])


def test_keys_major_gradients_after_its_forward(monkeypatch):
    """The backward reads the keys-major forward's LSE_I (its own kernels are the usual ones)."""
    _with_config(monkeypatch, KEYS)
    xs = make(1, 4, 1, 11, 15, 16, 2, 1, 16, seed=46)
    check_case(xs, with_lse=True, causal=True, grad=True)


def test_variant_options():
    """The config variant's options: keys-major, flattened, reversed token blocks, maxnreg (a
    compile option: not passed to the interpreter)."""
    from streamkl_gpu.indexer.triton.fwd import variant_meta

    assert variant_meta("tiles") == dict(KEYS_MAJOR=False, FLATTEN=False, LPT=False)
    assert variant_meta("l1") == dict(KEYS_MAJOR=False, FLATTEN=False, LPT=False)
    assert variant_meta("keys_flat_lpt_r168") == dict(KEYS_MAJOR=True, FLATTEN=True, LPT=True, maxnreg=168)
    assert "maxnreg" not in variant_meta("keys_r168", interpreting=True)
    assert variant_meta("tiles_flat") == dict(KEYS_MAJOR=False, FLATTEN=True, LPT=False)


def test_reversed_token_blocks_key_splits(monkeypatch):
    """LPT with key splits: the program's token block is reversed, its split is not; the merged
    result matches the reference (N_K > N_Q causal: early splits see every row)."""
    _with_config(monkeypatch, IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=32, num_warps=1, num_stages=1, splits=3, variant="keys_lpt"))
    xs = make(1, 4, 1, 37, 45, 16, 4, 1, 16, seed=47)
    check_case(xs, with_lse=True, causal=True, grad=False)


def test_sm90_compile_head_sum_stays_in_registers():
    """Offline sm_90 compile (CPU, tests/_indexer_fwd_sm90_compile.py) of the DSA-like forward: the keys-major
    tile (64 keys on 4 warps) has no spills, a few dozen lane shuffles, not the row-major tile's
    hundreds (its head sum crosses lanes and warps), and fits three CTAs per SM (<= 168
    registers, <= 75 KB of shared memory)."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = compiler_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))  # the helper's imports
    cfgs = "128,128,128,64,4,3;128,128,64,64,4,3,None,1,keys"
    proc = subprocess.run([sys.executable, os.path.join(root, "tests", "_indexer_fwd_sm90_compile.py"), cfgs], cwd=root, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == 2 and "FAILED" not in proc.stdout, proc.stdout

    def field(line, name):
        return int(re.search(rf"\b{name}=(\d+)", line).group(1))

    tiles, keys = rows
    assert field(keys, "stack") == 0 and field(keys, "STL") == 0, keys
    assert field(keys, "regs") <= 168 and field(keys, "smem") <= 75 * 1024, keys
    assert field(keys, "SHFL") * 3 < field(tiles, "SHFL"), (tiles, keys)


def test_keys_major_first_for_the_dsa_family_only():
    """The measured winner (runs an H200 run) is the untuned choice where it was measured: an MQA
    teacher with >= 128 heads (a 128-row tile is one token's heads); other MQA teachers try it last."""
    def dims(H, D, HK=1, N=64):
        shapes = [(1, H, N, D), (1, HK, N, D), (1, 64, N, 128), (1, 1, N, 128), (1, 64, N)]
        return check_indexer_inputs(*[torch.empty(s, device="meta") for s in shapes], scale=0.1)

    dsa = idx_configs._new_fwd_candidates(dims(128, 576), False, 132)
    assert dsa[0] == IndexerConfig(teacher_rows=128, indexer_rows=128, block_n=128, block_d=64, num_warps=4, num_stages=3, variant="keys_lpt")  # short: one key split
    pl = idx_plan._plan(dims(128, 576), dsa[0], "fwd")
    assert (pl["BLOCK_T"], pl["HB"], pl["BLOCK_N"], pl["variant"]) == (1, 128, 128, "keys_lpt")
    # from 8K keys on: splits of 4096 keys (an H200 run), at most 16 (bounded extra memory per token)
    for n, splits, per in ((8192, 2, 4096), (16384, 4, 4096), (65536, 16, 4096), (131072, 16, 8192)):
        first = idx_configs._new_fwd_candidates(dims(128, 576, N=n), False, 132)[0]
        assert first == IndexerConfig(teacher_rows=128, indexer_rows=128, block_n=128, block_d=64, num_warps=4, num_stages=3, splits=splits, variant="keys_lpt")
        assert idx_plan._key_splits(dims(128, 576, N=n), idx_plan._plan(dims(128, 576, N=n), first, "fwd")) == (splits, per)
    small = idx_configs._new_fwd_candidates(dims(16, 64), False, 132)
    assert small[0] == IndexerConfig(teacher_rows=128, indexer_rows=128, block_n=128, block_d=64, num_warps=4, num_stages=3) and dsa[0] in small
