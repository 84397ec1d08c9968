"""The teacher-LSE pass (``indexer/teacher_lse.py``) under the interpreter: every form of its kernel
against float64 and against the default form, and the forcing hook that selects a candidate by
name (``indexer_teacher_lse_config``) for a benchmark."""
from __future__ import annotations

import math

import pytest
import torch

from streamkl_gpu._core.forcing import forcing
from streamkl_gpu.indexer import configs as idx_configs
from streamkl_gpu.indexer.plan import IndexerConfig
from streamkl_gpu.indexer.teacher_lse import teacher_lse
from streamkl_ref._checks import check_indexer_inputs

from test_gpu_indexer import make


def _reference(q, k, causal, scale):
    """float64 per-head LSEs, natural log, bottom-right causal, -inf for a row with no visible key."""
    B, H, NQ, _ = q.shape
    HK, NK = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(H // HK, dim=1)
    s = scale * torch.einsum("bhtd,bhsd->bhts", q.double(), kk)
    if causal:
        vis = torch.arange(NK)[None, :] <= torch.arange(NQ)[:, None] + (NK - NQ)
        s = s.masked_fill(~vis, float("-inf"))
    return torch.logsumexp(s, dim=-1)


def _lse(xs, causal, scale, config=None):
    if config is None:
        return teacher_lse(*xs, causal=causal, scale=scale)
    with forcing(indexer_teacher_lse_config=config):
        return teacher_lse(*xs, causal=causal, scale=scale)


def _assert_lse(got, want):
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert torch.equal(got[~finite], want[~finite].float())
    assert (got[finite].double() - want[finite]).abs().max() <= 1e-5


QREG = [IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=16, num_warps=1, num_stages=1,
                      variant=variant) for variant in ("qreg", "qreg_lpt")]
# (B, H, H_K, N_Q, N_K, D, H_I, H_KI, D_I): D = 40 is three 16-wide chunks, the last masked at D
SHAPES = [(1, 4, 1, 13, 21, 40, 2, 1, 16), (2, 6, 2, 11, 9, 24, 2, 1, 16)]


@pytest.mark.parametrize("config", QREG, ids=lambda c: c.variant)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_resident_q_matches_float64_and_the_default(shape, causal, config):
    """The "qreg" forms (q rows loaded once, before the key loop) at tiny odd shapes: N_Q != N_K,
    head dims not a multiple of the D chunk, MQA and GQA (groups of 3 in 4-head chunks)."""
    xs = make(*shape, seed=sum(shape))
    scale = 0.3
    want = _reference(xs[0], xs[1], causal, scale)
    got = _lse(xs, causal, scale, config)
    _assert_lse(got, want)
    assert (got - _lse(xs, causal, scale)).nan_to_num(posinf=0.0, neginf=0.0).abs().max() <= 1e-5


@pytest.mark.parametrize("tma", [True], indirect=True)
def test_resident_q_through_tma_descriptors(tma):
    """The "qreg" form with its q chunks and key chunks through TMA descriptors (the Hopper path)."""
    xs = make(1, 6, 2, 11, 13, 40, 3, 1, 16, seed=29)
    _assert_lse(_lse(xs, True, 0.25, QREG[0]), _reference(xs[0], xs[1], True, 0.25))


def test_a_gpu_candidate_forced_by_name_at_a_small_shape():
    """A GPU tile named through the hook runs under the interpreter too (128 rows of 8 heads x 16
    tokens, 64-key tiles, D = 40 in one masked 64-wide chunk)."""
    xs = make(1, 8, 1, 19, 23, 40, 2, 1, 16, seed=31)
    dims = check_indexer_inputs(*xs)
    assert "qreg_128x64_w8s3" in idx_configs.lse_config_names(dims)
    _assert_lse(_lse(xs, True, 0.2, "qreg_128x64_w8s3"), _reference(xs[0], xs[1], True, 0.2))


def _dims(H, HK, D, n=8192):
    bf = torch.bfloat16
    return check_indexer_inputs(torch.empty(1, H, n, D, dtype=bf), torch.empty(1, HK, n, D, dtype=bf),
                                torch.empty(1, 16, n, 64, dtype=bf), torch.empty(1, 1, n, 64, dtype=bf),
                                torch.empty(1, 16, n, dtype=bf))


def test_names_of_the_candidates():
    """Every GPU candidate has a distinct name; the shape rule's is first (the "qreg" forms, measured
    fastest: configs.SHAPE_RULES); an unknown name lists the names."""
    for dims, first in ((_dims(128, 1, 576), "qreg_128x64_w8s3"), (_dims(32, 8, 128), "qreg_64x64_w4s3_h1")):
        names = idx_configs.lse_config_names(dims)
        assert names[0] == first and len(set(names)) == len(names)
        assert any(n.startswith("tiles_") for n in names)
        for name in names:
            assert idx_configs.lse_config_name(idx_configs.forced_lse_config(name, dims)) == name
        with pytest.raises(ValueError, match=first):
            idx_configs.forced_lse_config("no_such_tile", dims)
    cfg = IndexerConfig(teacher_rows=64, indexer_rows=64, block_n=32, block_d=64, num_warps=4, num_stages=2)
    assert idx_configs.forced_lse_config(cfg, _dims(128, 1, 576)) is cfg


def test_unforced_call_is_the_rule():
    """Outside a forcing block the tuner's pick runs (the interpreter's one config): equal to a
    forced INTERPRETER_CONFIG bit for bit."""
    xs = make(1, 4, 1, 9, 9, 16, 2, 1, 16, seed=3)
    assert torch.equal(_lse(xs, True, 0.5), _lse(xs, True, 0.5, idx_configs.INTERPRETER_CONFIG))
    assert math.isfinite(float(_lse(xs, True, 0.5).max()))


def test_a_pick_that_does_not_fit_the_device_gives_way_to_the_next_candidate(monkeypatch):
    """The rule's "qreg" tiles need a Hopper's shared memory: where the launch is refused (Triton's
    OutOfResources) the next candidate runs, and is remembered for the key; other errors raise."""
    from streamkl_gpu.indexer import teacher_lse as tl_mod

    xs = make(1, 4, 1, 13, 21, 40, 2, 1, 16, seed=7)
    plain = IndexerConfig(teacher_rows=32, indexer_rows=32, block_n=16, block_d=16, num_warps=1, num_stages=1)
    monkeypatch.setattr(idx_configs, "_candidates", lambda kind, ieee, dims, *a: [QREG[0], plain])
    monkeypatch.setattr(tl_mod, "_FITTING", {})
    real = tl_mod.kernel_call
    launched = []

    class OutOfResources(Exception):
        pass

    def refusing(fn, grid):
        def call(*args, **kw):
            launched.append(kw["Q_RESIDENT"])
            if kw["Q_RESIDENT"]:
                raise OutOfResources("out of resource: shared memory, Required: 226304, Hardware limit: 166912")
            return real(fn, grid)(*args, **kw)
        return call

    monkeypatch.setattr(tl_mod, "kernel_call", refusing)
    got = _lse(xs, True, 0.3)
    _assert_lse(got, _reference(xs[0], xs[1], True, 0.3))
    assert launched == [True, False] and list(tl_mod._FITTING.values()) == [plain]
    _lse(xs, True, 0.3)
    assert launched == [True, False, False]  # remembered: the refused tile is not tried again

    def failing(fn, grid):
        def call(*args, **kw):
            raise ValueError("a bug, not a device limit")
        return call

    monkeypatch.setattr(tl_mod, "_FITTING", {})
    monkeypatch.setattr(tl_mod, "kernel_call", failing)
    with pytest.raises(ValueError, match="a bug"):
        _lse(xs, True, 0.3)
