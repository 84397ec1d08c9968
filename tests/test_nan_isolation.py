"""streamkl_gpu kernels (Triton interpreter): values a row cannot see never reach it.

docs/math.md, "Invisible keys never reach a row", for every kernel entry point: the forward (one pass,
split-K, keys through TMA descriptors), the fused backward (dQ by atomics), the separate one,
``deterministic=True`` (GQA dK per query head, summed in order), each setting, GQA. NaN/±inf
planted in keys past a row's causal frontier, in query rows (the empty rows of ``N_Q > N_K``
included), in upstream-gradient rows, and in the storage just past ``N_K``, ``D`` and the heads
(the inputs are strided views into NaN-filled buffers, so a load that forgets its mask reads NaN),
and, for packed sequences (``attention_kl_varlen``), in the other sequences,
leave every output the poisons cannot reach *bitwise* equal to the clean run (the interpreter
runs programs one after another, so even the atomics add in a fixed order); where a NaN does
reach a row or key it gives NaN there; dK of a key no row sees is exactly 0. The model of what a
poison may reach is ``_nan_cases.taint``.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import streamkl_gpu
from _nan_cases import (
    NanCase,
    assert_all_nan,
    assert_same_bits,
    assert_unseen_keys_zero,
    nan_cases,
    packed_nan_cases,
    packed_visible,
    padded_view,
    reported_case_key7,
    reported_case_key40,
    taint,
)
from streamkl_gpu._core import runtime as _runtime

pytestmark = [pytest.mark.usefixtures("poison"), pytest.mark.filterwarnings("ignore::RuntimeWarning")]

SETTINGS = {"s1": (False, False, True, True), "s2": (True, True, False, False), "both": (True, True, True, True)}
GRADS = ("dq1", "dk1", "dq2", "dk2")
# (bwd_mode, deterministic): every backward path of the kernels
BWD_PATHS = [("fused", False), ("separate", False), ("auto", True)]
DTYPES = [torch.float32, torch.float16]  # the interpreter's tl.dot is wrong for bf16 (the host upcasts it anyway)


@contextlib.contextmanager
def runtime_setting(name, value):
    """Set ``streamkl_gpu._core.runtime.<name>`` inside the block (the conftest fixtures, for one example)."""
    old = getattr(_runtime, name)
    setattr(_runtime, name, value)
    try:
        yield
    finally:
        setattr(_runtime, name, old)


def torch_views(case: NanCase, arrays, dtype, tma_aligned=False):
    """The four inputs as strided views into NaN-filled buffers (``case.pad`` larger on each
    axis); with ``tma_aligned`` the padded head dim is rounded up to a 16-byte row, so the keys
    qualify for the TMA path."""
    per_row = 16 // torch.tensor([], dtype=dtype).element_size()
    out = []
    for x in arrays[:4]:
        pad = case.pad
        if tma_aligned:
            pb, ph, pn, pd = pad
            pad = (pb, ph, pn, pd + (-(x.shape[-1] + pd)) % per_row)
        out.append(padded_view(torch.from_numpy(x).to(dtype), pad, case.layout,
                               lambda s: torch.full(s, math.nan, dtype=dtype), lambda v: v.transpose(1, 2)))
    return out


def contiguous(arrays, dtype):
    return [torch.from_numpy(x).to(dtype) for x in arrays[:4]]


def run(inputs, g, *, causal, train=None, **kw):
    """Forward (kl, lse1, lse2) and, with ``train``, the gradients asked for (others None)."""
    if train is None:
        return [t.numpy() for t in streamkl_gpu.attention_kl_with_lse(*inputs, causal=causal, **kw)], None
    ins = [x.detach().requires_grad_(t) for x, t in zip(inputs, train)]
    kl, lse1, lse2 = streamkl_gpu.attention_kl_with_lse(*ins, causal=causal, **kw)
    kl.backward(torch.from_numpy(g).to(torch.float32))
    grads = {n: x.grad.numpy() for n, x, t in zip(GRADS, ins, train) if t}
    return [t.detach().numpy() for t in (kl, lse1, lse2)], grads


def check(case, out, clean, grads=None, clean_grads=None):
    t = taint(case)
    for what, x, c in zip(("kl", "lse1", "lse2"), out, clean):
        assert_same_bits(what, x, c, t.rows_fwd)
    assert_all_nan("kl", out[0], t.rows_fwd_nan)
    if grads is not None:
        check_grads(t, grads, clean_grads)


def check_grads(t, grads, clean_grads):
    """Unreached gradient rows / keys bitwise clean, NaN-reached ones all NaN, unseen keys 0."""
    reach = {"dq1": (t.rows_bwd, t.rows_bwd_nan), "dq2": (t.rows_bwd, t.rows_bwd_nan),
             "dk1": (t.keys1, t.keys1_nan), "dk2": (t.keys2, t.keys2_nan)}
    assert set(grads) == set(clean_grads)
    for what, x in grads.items():
        reached, reached_nan = reach[what]
        assert_same_bits(what, x, clean_grads[what], reached)
        assert_all_nan(what, x, reached_nan)
        if what.startswith("dk"):
            assert_unseen_keys_zero(what, x, t.unseen_keys)


# Each example runs the kernels twice under the interpreter (about 0.3-1.5 s of CPU): a third of
# the profile's examples (ci: 4 per test plus the pinned ones, ~40 s in all on one core).
FEW = settings(max_examples=max(3, settings.default.max_examples // 3))
cases = nan_cases(max_bh=4)

KEY7 = reported_case_key7()
KEY40 = reported_case_key40()
# NaN query rows / upstream gradients in the diagonal tile: dK of the keys past their frontier
# (3..19 for row 2, 6..19 for row 5) must stay clean: the dS^T Q leak of the report
DIAGONAL_ROWS = NanCase(NQ=20, NK=20, D1=8, D2=8, causal=True, seed=5,
                        query_poison=((1, 0, 0, 2, 0, math.nan),), grad_poison=((0, 0, 5, math.nan),))
EMPTY_ROWS = NanCase(H=2, HK1=1, HK2=2, NQ=37, NK=9, D1=5, D2=12, causal=True, seed=3,
                     key_poison=((1, 0, 0, 8, 4, math.nan), (2, 0, 1, 6, 0, -math.inf)),
                     query_poison=((1, 0, 0, 2, 1, math.nan), (2, 0, 1, 30, 3, math.inf)),
                     grad_poison=((0, 1, 0, math.nan),), pad=(1, 1, 7, 3), layout="bnhd")


@FEW
@given(cases, st.sampled_from([None, 1, 2, 3]), st.booleans(), st.sampled_from(DTYPES))
@example(KEY7, 1, False, torch.float32)
@example(reported_case_key7(side=2), 1, True, torch.float32)
@example(KEY40, 1, False, torch.float32)
@example(reported_case_key40(side=1), 2, True, torch.float16)
@example(EMPTY_ROWS, 3, True, torch.float32)
def test_forward(case, split_k, tma, dtype):
    clean = case.clean(np.float16 if dtype == torch.float16 else np.float32)
    bad = case.poisoned(clean)
    with runtime_setting("INTERPRETER_TMA", tma):
        views = torch_views(case, bad, dtype, tma_aligned=tma)
        if tma:  # the keys really take the TMA path
            assert _runtime.tma_ok(views[1]) and _runtime.tma_ok(views[3])
        out, _ = run(views, None, causal=case.causal, split_k=split_k)
        ref, _ = run(contiguous(clean, dtype), None, causal=case.causal, split_k=split_k)
    check(case, out, ref)


@pytest.mark.parametrize("bwd_mode,deterministic", BWD_PATHS, ids=["fused", "separate", "deterministic"])
@FEW
@given(case=cases, setting=st.sampled_from(list(SETTINGS)), dtype=st.sampled_from(DTYPES))
@example(case=KEY7, setting="both", dtype=torch.float32)
@example(case=KEY40, setting="both", dtype=torch.float32)
@example(case=EMPTY_ROWS, setting="both", dtype=torch.float32)
@example(case=DIAGONAL_ROWS, setting="both", dtype=torch.float32)
def test_backward(bwd_mode, deterministic, case, setting, dtype):
    clean = case.clean(np.float16 if dtype == torch.float16 else np.float32)
    bad = case.poisoned(clean)
    kw = dict(causal=case.causal, train=SETTINGS[setting], bwd_mode=bwd_mode, deterministic=deterministic)
    out, grads = run(torch_views(case, bad, dtype), bad[4], **kw)
    ref, ref_grads = run(contiguous(clean, dtype), clean[4], **kw)
    check(case, out, ref, grads, ref_grads)


@pytest.mark.parametrize("case,first", [(KEY7, 7), (KEY40, 40)], ids=["n8-key7", "n64-key40"])
def test_reported_cases(case, first):
    """Stated plainly: N = 8, NaN in key 7 -> only row 7 is NaN; N = 64, NaN in key 40 -> only rows
    40..63; in the KL and in every dq row (before the fix: every row of the tile)."""
    bad = case.poisoned(case.clean())
    out, grads = run(contiguous(bad, torch.float32), bad[4], causal=True, train=SETTINGS["both"])
    expected = np.arange(case.NQ) >= first
    assert np.array_equal(np.isnan(out[0][0, 0]), expected)
    for name in ("dq1", "dq2"):
        assert np.array_equal(np.isnan(grads[name][0, 0]).any(axis=-1), expected), name


# Packed sequences: NaN in one sequence never reaches another. Two sequences of 9 + 14 rows and
# 12 + 11 keys: a NaN key of sequence 0 and a NaN query row of sequence 1 (non-causal: each
# taints its own sequence only), in a 16 x 16 tile that straddles both; a key-only sequence at
# the end (no row sees its keys: dk exactly 0).
PACKED = (NanCase(H=2, HK1=1, HK2=2, NQ=23, NK=27, D1=8, D2=8, causal=False, seed=9,
                  key_poison=((1, 0, 0, 5, 2, math.nan),), query_poison=((2, 0, 1, 12, 0, math.nan),),
                  pad=(0, 1, 5, 3)),
          [0, 9, 23, 23], [0, 12, 23, 27])


def packed(x: np.ndarray, pad, dtype, nan_storage):
    """``[1, H, N, D]`` -> the packed ``[N, H, D]``; with ``nan_storage`` a strided view into a
    NaN buffer larger by ``pad`` (rows, heads, dims)."""
    t = torch.from_numpy(x[0]).to(dtype).transpose(0, 1)
    if not nan_storage:
        return t.contiguous()
    _, ph, pn, pd = pad
    buf = torch.full((t.shape[0] + pn, t.shape[1] + ph, t.shape[2] + pd), math.nan, dtype=dtype)
    view = buf[:t.shape[0], :t.shape[1], :t.shape[2]]
    view.copy_(t)
    return view


@FEW
@given(packed_case=packed_nan_cases(max_bh=4), setting=st.sampled_from(list(SETTINGS)),
       path=st.sampled_from(BWD_PATHS))
@example(packed_case=PACKED, setting="both", path=("fused", False))
@example(packed_case=PACKED, setting="both", path=("auto", True))
def test_varlen(packed_case, setting, path):
    case, cu_q, cu_k = packed_case
    bwd_mode, deterministic = path
    clean = case.clean()
    bad = case.poisoned(clean)
    train = SETTINGS[setting]
    cu = [torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k)]
    max_q, max_k = max(np.diff(cu_q)), max(np.diff(cu_k))

    def run_packed(arrays, nan_storage):
        ins = [packed(x, case.pad, torch.float32, nan_storage).requires_grad_(t) for x, t in zip(arrays, train)]
        kl = streamkl_gpu.attention_kl_varlen(*ins, *cu, int(max_q), int(max_k), causal=case.causal,
                                              bwd_mode=bwd_mode, deterministic=deterministic)
        kl.backward(torch.from_numpy(arrays[4][0].T.copy()).to(torch.float32))
        # back to the padded layout of the taint model: [1, H, N] and [1, H, N, D]
        grads = {n: x.grad.transpose(0, 1)[None].numpy() for n, x, t in zip(GRADS, ins, train) if t}
        return kl.detach().T[None].numpy(), grads

    kl, grads = run_packed(bad, True)
    clean_kl, clean_grads = run_packed(clean, False)
    t = taint(case, packed_visible(cu_q, cu_k, case.causal))
    assert_same_bits("kl", kl, clean_kl, t.rows_fwd)
    assert_all_nan("kl", kl, t.rows_fwd_nan)
    check_grads(t, grads, clean_grads)
