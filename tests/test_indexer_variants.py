"""The indexer forward's launch variants (issue 10's performance work) under the interpreter:
key splits merged on the host, and the resident-teacher kernel, each against the float64
reference (streamkl_ref.indexer_kl) and against the one-pass tiled kernel.

Tiny shapes: programs run one after another on CPU. Configs are
``(rows, irows, BLOCK_N, BLOCK_D, warps, stages, hb_max, key_splits, variant)``.
"""
from __future__ import annotations

import pytest
import torch

from streamkl_gpu import _indexer
from streamkl_ref._checks import check_indexer_inputs

from test_gpu_indexer import check_case, make, run


def _with_config(monkeypatch, cfg):
    monkeypatch.setattr(_indexer, "INTERPRETER_CONFIG", cfg)


# (B, H, H_K, N_Q, N_K, D, H_I, H_KI, D_I), causal, lse given, splits
SPLIT_CASES = [
    ((1, 4, 2, 13, 45, 24, 4, 1, 16), True, True, 3),    # N_K > N_Q causal: early splits see all rows
    ((1, 4, 2, 40, 40, 16, 2, 1, 16), True, False, 2),   # square causal: the last split is empty for early blocks
    ((2, 4, 1, 9, 37, 16, 4, 2, 8), False, True, 5),     # more splits asked than key tiles (3)
]


@pytest.mark.parametrize("shape,causal,with_lse,splits", SPLIT_CASES)
def test_key_splits_match_reference(monkeypatch, shape, causal, with_lse, splits):
    _with_config(monkeypatch, (32, 32, 16, 32, 1, 1, None, splits))
    xs = make(*shape, seed=sum(shape) + splits)
    pl = _indexer._plan(check_indexer_inputs(*xs), _indexer.INTERPRETER_CONFIG, "fwd")
    assert _indexer._key_splits(check_indexer_inputs(*xs), pl)[0] > 1
    check_case(xs, with_lse=with_lse, causal=causal, grad=False)


def test_key_splits_equal_one_pass(monkeypatch):
    """Split and merged equals one pass to fp32 rounding, KL and the saved LSE_I alike (the
    backward reads LSE_I); a NaN in one key poisons exactly the rows that see it."""
    xs = make(1, 4, 2, 21, 21, 16, 2, 1, 8, seed=31)
    out = {}
    for splits in (1, 2):
        _with_config(monkeypatch, (32, 32, 16, 32, 1, 1, None, splits))
        kl, lse_idx, _ = _indexer._forward(*xs, None, True, 0.25, True)
        out[splits] = (kl, lse_idx)
    assert torch.allclose(out[1][0], out[2][0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(out[1][1], out[2][1], rtol=1e-6, atol=1e-6)
    bad = [x.clone() for x in xs]
    bad[1][0, 1, 17, 0] = float("nan")  # teacher key 17: rows 17.. see it (square causal)
    kl_bad = _indexer._forward(*bad, None, True, 0.25, True)[0]
    assert torch.isnan(kl_bad[0, 17:]).all()
    assert torch.equal(kl_bad[0, :17], out[2][0][0, :17])


def test_key_splits_gradients(monkeypatch):
    """The backward reads the merged LSE_I: gradients after a split forward match the reference."""
    _with_config(monkeypatch, (32, 32, 16, 32, 1, 1, 1, 3))
    xs = make(1, 4, 2, 11, 40, 16, 2, 1, 16, seed=32)
    check_case(xs, with_lse=True, causal=True, grad=True)
