"""The chunk design's keys-major gradient kernel (``indexer/triton/chunk_grad_keys.py``) under the
interpreter: forced first in the chunk design's gradient tiles, the training step's loss and
gradients against float64 at odd shapes (MQA and GQA teachers, batch 2, N_Q != N_K causal, empty
rows, relu off, per-row weights, several chunks and key tiles), against the row-major kernel, and
NaN isolation. Each test checks that the keys-major kernel ran and the row-major one did not."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from streamkl_gpu.indexer import configs as idx_configs
from streamkl_gpu.indexer.training import chunk as idx_chunk
from streamkl_gpu.indexer.triton import bwd as _indexer_bwd
from streamkl_gpu.indexer.triton import chunk_grad_keys as _keys

from test_gpu_indexer import make
from test_indexer_training_paths import CASES, NAMES, _assert_close, _reference, _step


@pytest.fixture
def launched(monkeypatch):
    """The gradient kernels the chunk design launched, by name ("keys" / "rows")."""
    seen = []
    real = idx_chunk.kernel_call

    def spy(fn, grid):
        if fn is _keys._chunk_grad_keys_kernel:
            seen.append("keys")
        elif fn is _indexer_bwd._indexer_bwd_dq_kernel:
            seen.append("rows")
        return real(fn, grid)
    monkeypatch.setattr(idx_chunk, "kernel_call", spy)
    monkeypatch.setattr(idx_chunk, "PCHUNK_TOKENS", 8)  # several chunks of tokens
    return seen


_LISTED = idx_configs.chunk_gradient_candidates


def _force(monkeypatch, order):
    monkeypatch.setattr(idx_configs, "chunk_gradient_candidates", lambda ieee, dims, o="rule", first=None: _LISTED(ieee, dims, order))


def test_the_interpreter_lists_a_keys_major_tile():
    """Under the interpreter the chunk design tries its one config, then the same as keys-major."""
    from test_indexer_shape_rules import _dims
    listed = idx_configs.chunk_gradient_candidates(False, _dims("gqa"))
    assert listed == [idx_configs.INTERPRETER_CONFIG, replace(idx_configs.INTERPRETER_CONFIG, variant="keys")]
    assert idx_configs.chunk_gradient_candidates(False, _dims("gqa"), "keys_first") == listed[::-1]


@pytest.mark.parametrize("shape,causal,reduction,relu", CASES)
@pytest.mark.parametrize("with_lse", [False, True])
def test_keys_major_gradient_matches_float64(monkeypatch, poison, launched, shape, causal, reduction, relu, with_lse):
    monkeypatch.setenv("STREAMKL_INDEXER_TRAINING", "chunk")  # (a GQA teacher with lse takes another design)
    _force(monkeypatch, "keys_first")
    xs = make(*shape, seed=sum(shape) + 7)
    kw = dict(causal=causal, relu=relu)
    if with_lse:
        import streamkl_ref
        _, _, lse = streamkl_ref.indexer_kl(*[x.double().numpy() for x in xs], return_lse=True, **kw)
        kw["lse"] = torch.from_numpy(lse).float()
    loss, grads = _step(xs, reduction, **kw)
    assert launched and set(launched) == {"keys"}, launched
    _assert_close(loss, grads, *_reference(xs, shape, causal, relu, reduction))


@pytest.mark.parametrize("shape,causal,reduction,relu", CASES[:2])
def test_keys_major_gradient_takes_row_weights(monkeypatch, poison, launched, shape, causal, reduction, relu):
    _force(monkeypatch, "keys_first")
    xs = make(*shape, seed=sum(shape) + 11)
    gen = torch.Generator().manual_seed(5)
    row_weights = torch.rand((shape[0], shape[3]), generator=gen) * 2.0
    row_weights[:, ::3] = 0.0  # masked rows
    loss, grads = _step(xs, reduction, causal=causal, relu=relu, row_weights=row_weights)
    assert set(launched) == {"keys"}, launched
    _assert_close(loss, grads, *_reference(xs, shape, causal, relu, reduction, row_weights=row_weights))


@pytest.mark.parametrize("tma", [False, True], indirect=True)
def test_keys_major_equals_row_major(monkeypatch, launched, tma):
    """Both gradient kernels on the same inputs (tma: the q_idx / k_idx tiles by TMA descriptors):
    the same numbers up to fp32 summation order."""
    shape = (2, 8, 2, 19, 23, 16, 4, 1, 16)
    xs = make(*shape, seed=3)
    out = {}
    for order in ("rows_first", "keys_first"):
        _force(monkeypatch, order)
        launched.clear()
        out[order] = _step(xs, "sum", causal=True)
        assert set(launched) == {"rows" if order == "rows_first" else "keys"}, (order, launched)
    (loss_r, grads_r), (loss_k, grads_k) = out["rows_first"], out["keys_first"]
    assert torch.equal(loss_r, loss_k)  # the forward is the same kernel
    for name in NAMES:
        assert torch.allclose(grads_k[name], grads_r[name], rtol=1e-5, atol=1e-6), name


def test_keys_major_nan_isolation(monkeypatch, launched):
    """Causal, N_K - N_Q = 3 (row t sees keys <= t + 3). A NaN weight of row 5 reaches row 5's
    gradients and the dk_idx of keys 0..8 (those row 5 sees) only: keys 9.. equal the clean run's
    (row 5's NaN weight times a zero coefficient must not reach them in the causal band). A NaN
    in indexer key 20 reaches rows 17.. only."""
    _force(monkeypatch, "keys_first")
    xs = make(1, 4, 2, 21, 24, 16, 2, 1, 8, seed=92)
    _, clean = _step(xs, "sum", causal=True)
    assert set(launched) == {"keys"}, launched

    def close(a, b):
        return torch.isfinite(a).all() and torch.allclose(a, b, rtol=1e-5, atol=1e-7)

    bad_w = [x.clone() for x in xs]
    bad_w[4][0, 1, 5] = float("nan")  # weights of indexer head 1, row 5
    _, dirty = _step(bad_w, "sum", causal=True)
    others = [t for t in range(21) if t != 5]
    for name in ("dq_idx", "dweights"):
        assert close(dirty[name][:, :, others], clean[name][:, :, others]), name
        assert torch.isnan(dirty[name][:, :, 5]).all(), name
    assert close(dirty["dk_idx"][0, 0, 9:], clean["dk_idx"][0, 0, 9:])
    assert torch.isnan(dirty["dk_idx"][0, 0, :9]).all()

    bad_k = [x.clone() for x in xs]
    bad_k[3][0, 0, 20, 3] = float("nan")  # indexer key 20: rows 17.. see it
    _, dirty = _step(bad_k, "sum", causal=True)
    for name in ("dq_idx", "dweights"):
        assert close(dirty[name][:, :, :17], clean[name][:, :, :17]), name
        assert torch.isnan(dirty[name][:, :, 17:]).all(), name


def test_branch_layout_variant_is_listed_first_on_request():
    """The forcing order "branch_first" puts the rule's keys-major tile in the variant "keys_branch"
    first, then the default list; the default order never lists that variant."""
    from test_indexer_shape_rules import _dims
    dims = _dims("gqa")
    listed = idx_configs.chunk_gradient_candidates(False, dims, "branch_first")
    assert listed[0] == replace(idx_configs.INTERPRETER_CONFIG, variant="keys_branch")
    assert listed[1:] == idx_configs.chunk_gradient_candidates(False, dims)
    assert all(c.variant != "keys_branch" for c in idx_configs.chunk_gradient_candidates(False, dims))


@pytest.mark.parametrize("shape,causal,reduction,relu", CASES[:3])
def test_branch_layout_variant_matches_float64(monkeypatch, poison, launched, shape, causal, reduction, relu):
    """The variant with the first product under a branch: the same loss and gradients as float64."""
    monkeypatch.setenv("STREAMKL_INDEXER_TRAINING", "chunk")
    _force(monkeypatch, "branch_first")
    seen = []
    real = idx_chunk.kernel_call

    def spy(fn, grid):
        call = real(fn, grid)
        return lambda *a, **kw: seen.append(kw.get("BRANCH_LAYOUT")) or call(*a, **kw)
    monkeypatch.setattr(idx_chunk, "kernel_call", spy)
    xs = make(*shape, seed=sum(shape) + 11)
    loss, grads = _step(xs, reduction, causal=causal, relu=relu)
    assert launched and set(launched) == {"keys"} and seen.count(True) == len(launched), (launched, seen)
    _assert_close(loss, grads, *_reference(xs, shape, causal, relu, reduction))


def test_no_dk_diagnostic_leaves_out_dk_alone(monkeypatch, launched):
    """The timing-only variant "no_dk" (forcing indexer_chunk_gradient_parts): the keys-major kernel
    without each key tile's dk share: dk_idx comes out 0, the loss and the other gradients equal
    the whole kernel's; an unknown name raises."""
    from streamkl_gpu._core.forcing import forcing
    _force(monkeypatch, "keys_first")
    xs = make(2, 8, 2, 19, 23, 16, 4, 1, 16, seed=4)
    loss, grads = _step(xs, "sum", causal=True)
    with forcing(indexer_chunk_gradient_parts="no_dk"):
        loss_n, grads_n = _step(xs, "sum", causal=True)
    assert set(launched) == {"keys"}, launched
    assert torch.equal(loss, loss_n)
    assert grads["dk_idx"].abs().sum() > 0 and torch.count_nonzero(grads_n["dk_idx"]) == 0
    for name in ("dq_idx", "dweights"):
        assert torch.equal(grads_n[name], grads[name]), name
    with pytest.raises(ValueError, match="indexer_chunk_gradient_parts"):
        with forcing(indexer_chunk_gradient_parts="no_dq"):
            _step(xs, "sum", causal=True)


@pytest.mark.parametrize("variant", ["keys", "keys_lpt"])
@pytest.mark.parametrize("shape,causal,reduction,relu", CASES[:2])
def test_storing_forward_keys_major_and_lpt_match_float64(monkeypatch, poison, launched, variant, shape, causal,
                                                          reduction, relu):
    """The chunk design's storing forward on keys-major tiles, in token order and with the longest
    rows first (``lpt``, the plain forward's rule variant at DSA-like teachers), then the keys-major
    gradient kernel (itself LPT when causal): the loss and gradients against float64."""
    from streamkl_gpu.indexer.training import store as idx_store
    monkeypatch.setenv("STREAMKL_INDEXER_TRAINING", "chunk")
    _force(monkeypatch, "keys_first")
    forced = replace(idx_configs.INTERPRETER_CONFIG, variant=variant)
    monkeypatch.setattr(idx_configs, "storing_forward_candidates", lambda *a, **kw: [forced])
    metas = []
    real_meta = idx_store._pstore_meta
    monkeypatch.setattr(idx_store, "_pstore_meta", lambda pl: metas.append(real_meta(pl)) or metas[-1])
    xs = make(*shape, seed=sum(shape) + 23)
    loss, grads = _step(xs, reduction, causal=causal, relu=relu)
    assert metas and all(m["KEYS_MAJOR"] and m["LPT"] == (variant == "keys_lpt") for m in metas), metas
    assert set(launched) == {"keys"}, launched
    _assert_close(loss, grads, *_reference(xs, shape, causal, relu, reduction))
