"""streamkl_gpu forward kernels vs streamkl_ref (Triton interpreter on CPU; fp32 and fp16).

bf16 is checked on the GPU (bench/bench_gpu.py, streamkl verify): the interpreter's bf16 dot
is wrong, so under it the kernels compute bf16 inputs in fp32.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import streamkl_gpu
from streamkl_gpu import api
from streamkl_gpu._core import runtime as _runtime
from streamkl_ref._checks import check_inputs

from _gpu_helpers import assert_close, make_inputs, reference, same_precision

pytestmark = pytest.mark.usefixtures("poison")

SHAPES = [
    # B, H, HK1, HK2, NQ, NK, D1, D2, causal
    pytest.param(1, 2, 2, 2, 21, 37, 16, 16, False, id="ragged"),
    pytest.param(2, 2, 2, 2, 1, 1, 16, 16, False, id="n=1"),
    pytest.param(1, 2, 2, 2, 1, 1, 16, 16, True, id="n=1-causal"),
    pytest.param(1, 4, 2, 4, 19, 23, 32, 16, False, id="gqa-side1-d1>d2"),
    pytest.param(1, 4, 4, 1, 17, 29, 16, 24, False, id="gqa-side2-d1<d2"),
    pytest.param(1, 2, 1, 2, 13, 40, 16, 16, True, id="causal-nq<nk"),
    pytest.param(1, 2, 2, 1, 40, 13, 16, 16, True, id="causal-nq>nk-empty-rows"),
    pytest.param(1, 2, 2, 2, 32, 32, 8, 40, True, id="causal-square-d8"),
    pytest.param(1, 1, 1, 1, 5, 33, 80, 96, False, id="d80-d96"),
]


@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("B,H,HK1,HK2,NQ,NK,D1,D2,causal", SHAPES)
def test_forward_matches_reference(B, H, HK1, HK2, NQ, NK, D1, D2, causal, dtype, tma):
    xs = make_inputs(B, H, HK1, HK2, NQ, NK, D1, D2, dtype=dtype, seed=NQ * 31 + NK)
    kl, lse1, lse2 = streamkl_gpu.attention_kl_with_lse(*xs, causal=causal)
    assert kl.dtype == torch.float32 and kl.shape == (B, H, NQ)
    ref_kl, ref_lse1, ref_lse2, _ = reference(xs, causal=causal)
    same_kl, _ = same_precision(xs, None, causal=causal)
    assert_close("kl", kl, ref_kl, same_kl, dtype=dtype)
    finite = np.isfinite(ref_lse1)
    for name, ours, ref in (("lse1", lse1, ref_lse1), ("lse2", lse2, ref_lse2)):
        assert np.array_equal(np.isfinite(ours.numpy()), finite), name
        assert_close(name, ours.numpy()[finite], ref[finite], None, dtype=dtype, floor=2e-6)
    if causal and NQ > NK:  # rows with no visible key: KL 0, LSE -inf (the convention)
        assert (kl[..., : NQ - NK] == 0).all()
        assert torch.isneginf(lse1[..., : NQ - NK]).all() and torch.isneginf(lse2[..., : NQ - NK]).all()


@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"], indirect=True)
@pytest.mark.parametrize("block", [(16, 32), (32, 16), (64, 16)], indirect=True)
@pytest.mark.parametrize("causal", [False, True])
def test_other_tile_shapes(block, causal, tma):
    """The two-stage (whole tiles / masked band) split must hold for any BLOCK_M, BLOCK_N."""
    xs = make_inputs(1, 2, 1, 2, 45, 70, 16, 32, seed=3)
    kl = streamkl_gpu.attention_kl(*xs, causal=causal)
    ref_kl, *_ = reference(xs, causal=causal)
    same_kl, _ = same_precision(xs, None, causal=causal)
    assert_close("kl", kl, ref_kl, same_kl, dtype=torch.float32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_k_equals_one_pass(splits, causal):
    xs = make_inputs(1, 2, 2, 1, 5, 150, 16, 16, seed=splits)
    one = streamkl_gpu.attention_kl(*xs, causal=causal, split_k=1)
    split = streamkl_gpu.attention_kl(*xs, causal=causal, split_k=splits)
    ref_kl, *_ = reference(xs, causal=causal)
    same_kl, _ = same_precision(xs, None, causal=causal)
    assert_close("kl split", split, ref_kl, same_kl, dtype=torch.float32)
    assert_close("kl split vs one pass", split, one.double().numpy(), None, dtype=torch.float32)


@pytest.mark.parametrize("block", [(16, 16)], indirect=True)
@pytest.mark.parametrize("NQ, NK", [(45, 70), (70, 45), (48, 48)])
def test_heaviest_query_tiles_first_give_the_same_bits(block, NQ, NK):
    """The Triton forward launches a causal problem's last query tiles (the most keys) first:
    each row is still one program's, so KL and LSEs equal the query order's bitwise; a forced
    order is part of the plan's signature; an unknown order is an error."""
    from streamkl_gpu._core.forcing import forcing
    from streamkl_gpu.attention import launch

    xs = make_inputs(1, 2, 1, 2, NQ, NK, 16, 16, seed=NQ + NK)
    heavy = streamkl_gpu.attention_kl_with_lse(*xs, causal=True)
    with forcing(attention_triton_fwd_order="query"):
        query = streamkl_gpu.attention_kl_with_lse(*xs, causal=True)
    orders = {plan.constexprs["HEAVY_FIRST"] for plan in launch._PLANS.values()
              if isinstance(plan, launch._TritonForward) and plan.constexprs["CAUSAL"]
              and plan.constexprs["BLOCK_M"] == 16 and not plan.constexprs["SPLIT"]}
    assert orders == {True, False}
    for name, a, b in zip(("kl", "lse1", "lse2"), heavy, query):
        assert torch.equal(a, b), name
    ref_kl, *_ = reference(xs, causal=True)
    same_kl, _ = same_precision(xs, None, causal=True)
    assert_close("kl", heavy[0], ref_kl, same_kl, dtype=torch.float32)
    with forcing(attention_triton_fwd_order="sideways"), pytest.raises(ValueError, match="heavy"):
        streamkl_gpu.attention_kl(*xs, causal=True)


def test_auto_split_rule():
    dims = check_inputs(*make_inputs(1, 32, 32, 32, 1, 1, 16, 16))
    # 32 one-row programs cannot fill 132 SMs: split; 64 blocks of rows x 32 heads can
    big_k = type(dims)(**{**dims.__dict__, "NK": 131072})
    assert api.auto_split_k(big_k, 16, 128, 132) > 1
    many_q = type(dims)(**{**dims.__dict__, "NQ": 8192, "NK": 8192})
    assert api.auto_split_k(many_q, 128, 64, 132) == 1
    short = type(dims)(**{**dims.__dict__, "NK": 64})  # too few key tiles to split
    assert api.auto_split_k(short, 16, 128, 132) == 1


def test_deterministic_bitwise():
    xs = make_inputs(1, 2, 2, 2, 20, 50, 16, 16, seed=9)
    for split in (1, 3):
        a = streamkl_gpu.attention_kl(*xs, split_k=split)
        b = streamkl_gpu.attention_kl(*xs, split_k=split)
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_tma_path_equals_pointer_path(causal):
    """Keys read through TMA descriptors (zero-filled past N_K and D) give the pointer path's bits."""
    xs = make_inputs(2, 4, 2, 1, 37, 53, 80, 16, dtype=torch.float16, seed=9)
    old = _runtime.INTERPRETER_TMA
    try:
        _runtime.INTERPRETER_TMA = False
        ptr = streamkl_gpu.attention_kl(*xs, causal=causal)
        _runtime.INTERPRETER_TMA = True
        assert _runtime.tma_ok(xs[1]) and _runtime.tma_ok(xs[3])
        via_tma = streamkl_gpu.attention_kl(*xs, causal=causal)
    finally:
        _runtime.INTERPRETER_TMA = old
    assert torch.equal(ptr, via_tma)


def test_tma_eligibility():
    """TMA needs unit stride in D and 16-byte aligned base and strides; anything else uses pointers."""
    old = _runtime.INTERPRETER_TMA
    try:
        _runtime.INTERPRETER_TMA = True
        k = torch.zeros(2, 3, 40, 16)
        assert _runtime.tma_ok(k)
        assert _runtime.tma_ok(torch.zeros(2, 40, 3, 16).transpose(1, 2))  # [B, N, H, D] view
        assert not _runtime.tma_ok(torch.zeros(2, 3, 40, 17)[..., :16])  # row stride 68 bytes
        assert not _runtime.tma_ok(torch.zeros(2, 3, 16, 40).transpose(2, 3))  # D not unit-stride
        assert not _runtime.tma_ok(torch.zeros(2 * 3 * 40 * 16 + 1)[1:].view(2, 3, 40, 16))  # base +4 bytes
        assert not _runtime.tma_ok(torch.zeros(1, 1, 40, 16).expand(2, 3, 40, 16))  # stride 0
        _runtime.INTERPRETER_TMA = False
        assert not _runtime.tma_ok(k)
    finally:
        _runtime.INTERPRETER_TMA = old


def test_any_strides_transposed_layout():
    """A [B, N, H, D] tensor viewed as [B, H, N, D] works without a copy, same result."""
    gen = torch.Generator().manual_seed(5)
    q1 = torch.randn(1, 20, 2, 16, generator=gen).transpose(1, 2)
    k1 = torch.randn(1, 30, 2, 16, generator=gen).transpose(1, 2)
    q2 = torch.randn(1, 20, 2, 32, generator=gen).transpose(1, 2)
    k2 = torch.randn(1, 30, 1, 32, generator=gen).transpose(1, 2)
    assert not q1.is_contiguous()
    strided = streamkl_gpu.attention_kl(q1, k1, q2, k2, causal=True)
    dense = streamkl_gpu.attention_kl(*(t.contiguous() for t in (q1, k1, q2, k2)), causal=True)
    assert torch.equal(strided, dense)


def test_extreme_logits_no_nan():
    """Scores of order 1e4: finite wherever the math is finite, and as accurate as dense fp32.

    With |S| ~ 1e4 every fp32 score carries an absolute rounding of ~u|S| ~ 1e-3, so the scale
    of the tolerance is the dense fp32 computation's own error (docs/math.md / proofs statement 7).
    """
    xs = make_inputs(1, 2, 2, 2, 17, 33, 16, 16, seed=11)
    for scale in (50.0, 1e3):
        kw = dict(scale1=scale, scale2=scale / 3)
        kl, lse1, lse2 = streamkl_gpu.attention_kl_with_lse(*xs, **kw)
        assert torch.isfinite(kl).all() and torch.isfinite(lse1).all() and torch.isfinite(lse2).all()
        ref_kl, ref_lse1, _, _ = reference(xs, **kw)
        same_kl, _ = same_precision(xs, None, **kw)
        assert_close("kl", kl, ref_kl, same_kl, dtype=torch.float32)
        assert_close("lse1", lse1, ref_lse1, None, dtype=torch.float32, floor=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_one_visible_key_gives_exactly_zero(causal):
    """A row that sees one key has P1 = P2 = 1: KL must be exactly 0, not a rounding residual of
    the score scale (the max's exponent is s - max = 0 exactly; on the GPU this needs the scale
    multiply kept out of the exponent's FFMA)."""
    xs = make_inputs(1, 2, 2, 1, 1 if not causal else 9, 1 if not causal else 9, 32, 16, seed=4)
    xs = [x * 3 for x in xs]  # scores of order 10..100: a residual would be ~1e-6, not 0
    kl = streamkl_gpu.attention_kl(*xs, causal=causal)
    assert (kl[..., 0] == 0).all()  # row 0 sees key 0 only (causal), or the only key


def test_identical_sides_give_zero():
    q, k = make_inputs(1, 2, 2, 2, 19, 41, 16, 16, seed=2)[:2]
    kl = streamkl_gpu.attention_kl(q, k, q, k, causal=True)
    assert kl.abs().max().item() < 1e-5


def test_one_hot_teacher():
    """P1 one-hot (huge teacher scale): KL = -log P2[argmax] - H(P1) stays finite and accurate."""
    xs = make_inputs(1, 1, 1, 1, 9, 25, 16, 16, seed=4)
    kl = streamkl_gpu.attention_kl(*xs, scale1=1e4)
    ref_kl, *_ = reference(xs, scale1=1e4)
    same_kl, _ = same_precision(xs, None, scale1=1e4)
    assert torch.isfinite(kl).all()
    assert_close("kl", kl, ref_kl, same_kl, dtype=torch.float32)


def test_nan_input_poisons_only_its_row():
    xs = make_inputs(1, 2, 2, 2, 16, 24, 16, 16, seed=6)
    xs[0][0, 1, 3, 5] = float("nan")
    kl = streamkl_gpu.attention_kl(*xs)
    assert torch.isnan(kl[0, 1, 3])
    mask = torch.ones_like(kl, dtype=torch.bool)
    mask[0, 1, 3] = False
    assert torch.isfinite(kl[mask]).all()


@given(
    B=st.integers(1, 2), H_mult=st.sampled_from([(1, 1, 1), (2, 1, 2), (4, 2, 1)]),
    NQ=st.integers(1, 40), NK=st.integers(1, 40), D1=st.sampled_from([8, 16, 24]),
    D2=st.sampled_from([16, 32]), causal=st.booleans(), seed=st.integers(0, 2**16),
    split=st.sampled_from([None, 1, 2]),
)
@example(B=1, H_mult=(2, 1, 2), NQ=33, NK=1, D1=8, D2=16, causal=True, seed=0, split=None)
@example(B=1, H_mult=(1, 1, 1), NQ=1, NK=40, D1=16, D2=16, causal=True, seed=1, split=2)
def test_forward_property(B, H_mult, NQ, NK, D1, D2, causal, seed, split):
    H, HK1, HK2 = H_mult
    xs = make_inputs(B, H, HK1, HK2, NQ, NK, D1, D2, seed=seed)
    kl = streamkl_gpu.attention_kl(*xs, causal=causal, split_k=split)
    ref_kl, *_ = reference(xs, causal=causal)
    same_kl, _ = same_precision(xs, None, causal=causal)
    assert not torch.isnan(kl).any()
    assert_close("kl", kl, ref_kl, same_kl, dtype=torch.float32)
