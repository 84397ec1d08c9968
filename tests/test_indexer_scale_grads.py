"""The chunk design's backward (``indexer/training/chunk.py _scaled_grads``, the kernel in
``indexer/triton/scale_grads.py``): its three fp32 gradient buffers times the 0-dim upstream
gradient, cast to each input's dtype in one launch, bitwise ``(g * t).to(dtype)`` (inf, overflow,
ties and subnormals included; NaN stays NaN), for every subset of the gradients a step asks for."""
from __future__ import annotations

import itertools

import pytest
import torch

from streamkl_gpu.indexer.training import chunk as idx_chunk

SHAPES = ((2, 4, 300, 24), (2, 1, 310, 24), (2, 4, 300))  # dq_idx, dk_idx, dweights (3 blocks of 1024 and more)


def _buffers(seed):
    gen = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=gen) * 3 for s in SHAPES]
    flat = ts[0].view(-1)
    # values whose rounding the cast must get right: NaN, infinities, a bf16 overflow, exact ties
    # (even and odd lower halves), a subnormal, negative zero
    flat[:10] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, 1.0 + 2 ** -8,
                              1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 1e-40, -0.0, 65519.0])
    return ts


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,) * 3, (torch.float16, torch.float32, torch.bfloat16),
                                    (torch.float32,) * 3])
@pytest.mark.parametrize("g", [1.0, 0.37, -2.5])
def test_each_gradient_is_bitwise_g_times_the_buffer_in_its_dtype(dtypes, g):
    ts = _buffers(0)
    g = torch.tensor(g)
    for need in itertools.product((True, False), repeat=3):
        parts = [(t, dt) if n else None for t, dt, n in zip(ts, dtypes, need)]
        out = idx_chunk._scaled_grads(g, parts)
        for o, part in zip(out, parts):
            if part is None:
                assert o is None
                continue
            ref = (g * part[0]).to(part[1])
            assert o.dtype == ref.dtype and o.shape == ref.shape
            assert torch.equal(o.view(-1)[1:], ref.view(-1)[1:]), (dtypes, need)  # (index 0: NaN)
            assert o.view(-1)[0].isnan() == ref.view(-1)[0].isnan()  # (NaN bits differ between PyTorch casts)


def test_the_three_gradients_take_one_launch(monkeypatch):
    launches = []
    real = idx_chunk.kernel_call
    monkeypatch.setattr(idx_chunk, "kernel_call", lambda fn, grid: launches.append(grid) or real(fn, grid))
    ts = _buffers(1)
    idx_chunk._scaled_grads(torch.tensor(0.5), [(t, torch.bfloat16) for t in ts])
    assert launches == [(sum(-(-t.numel() // idx_chunk._SCALE_BLOCK) for t in ts),)]
