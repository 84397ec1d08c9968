"""API edges of streamkl_gpu and streamkl_ref: argument types, empty inputs, names.

Every input error is a ValueError naming the argument (docs/api.md, "Errors"); empty inputs give
empty outputs, and no keys give KL 0, LSE -inf and zero gradients, the same in both packages.
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import streamkl_gpu
import streamkl_ref

from _gpu_helpers import make_inputs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bad", ["yes", "False", None, 1, 0, torch.tensor(True), np.array([True])])
def test_causal_must_be_a_bool(bad):
    xs = make_inputs(1, 1, 1, 1, 3, 5, 16, 16)
    with pytest.raises(ValueError, match=r"causal must be a bool"):
        streamkl_gpu.attention_kl(*xs, causal=bad)


def test_causal_accepts_numpy_bool():
    xs = make_inputs(1, 1, 1, 1, 3, 5, 16, 16)
    assert torch.equal(streamkl_gpu.attention_kl(*xs, causal=np.bool_(True)),
                       streamkl_gpu.attention_kl(*xs, causal=True))


@pytest.mark.parametrize("scale", [0.25, np.float32(0.25), np.float64(0.25), torch.tensor(0.25),
                                   torch.tensor(0.25, dtype=torch.float64)])
def test_scales_accept_numbers_and_cpu_scalars(scale):
    xs = make_inputs(1, 2, 1, 2, 4, 6, 16, 16, seed=3)
    ref = streamkl_gpu.attention_kl(*xs, scale1=0.25, scale2=0.25)
    assert torch.equal(streamkl_gpu.attention_kl(*xs, scale1=scale, scale2=scale), ref)


@pytest.mark.parametrize("scale", ["0.5", torch.tensor([0.5]), torch.tensor(True), np.array([0.5]), True, -1.0,
                                   float("nan")])
def test_bad_scales_are_value_errors(scale):
    xs = make_inputs(1, 1, 1, 1, 3, 5, 16, 16)
    with pytest.raises(ValueError, match=r"scale1"):
        streamkl_gpu.attention_kl(*xs, scale1=scale)


def test_cuda_tensor_scale_says_pass_a_float():
    if not torch.cuda.is_available():
        # the check itself needs no GPU: a tensor on the meta device stands for any non-CPU tensor
        scale = torch.tensor(0.5, device="meta")
    else:
        scale = torch.tensor(0.5, device="cuda")
    xs = make_inputs(1, 1, 1, 1, 3, 5, 16, 16)
    with pytest.raises(ValueError, match=r"scale2 is a tensor on .*pass a Python float"):
        streamkl_gpu.attention_kl(*xs, scale2=scale)


def test_deterministic_must_be_a_bool():
    xs = make_inputs(1, 1, 1, 1, 3, 5, 16, 16)
    with pytest.raises(ValueError, match=r"deterministic must be a bool"):
        streamkl_gpu.attention_kl(*xs, deterministic="yes")


@pytest.mark.parametrize("shape", [(0, 2, 5, 7), (2, 2, 0, 7)])  # B = 0, N_Q = 0
def test_empty_in_empty_out(shape, poison):
    B, H, NQ, NK = shape
    xs = [x.requires_grad_() for x in make_inputs(B, H, 1, H, NQ, NK, 16, 8)]
    kl = streamkl_gpu.attention_kl(*xs, causal=True)
    assert kl.shape == (B, H, NQ) and kl.dtype == torch.float32
    kl.sum().backward()
    for x in xs:
        assert x.grad.shape == x.shape and (x.grad == 0).all()
    ref = streamkl_ref.attention_kl(*[x.detach().double().numpy() for x in xs], causal=True)
    assert ref.shape == (B, H, NQ)
    grads = streamkl_ref.attention_kl_grad(*[x.detach().double().numpy() for x in xs],
                                           np.ones((B, H, NQ)), causal=True)
    for name, x in zip(("dq1", "dk1", "dq2", "dk2"), xs):
        assert grads[name].shape == tuple(x.shape) and (grads[name] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_no_keys_give_zero_kl_and_minus_inf_lse(causal, poison):
    xs = [x.requires_grad_() for x in make_inputs(2, 2, 1, 2, 3, 0, 16, 8)]
    kl, lse1, lse2 = streamkl_gpu.attention_kl_with_lse(*xs, causal=causal)
    assert kl.shape == (2, 2, 3) and (kl == 0).all()
    assert (lse1 == float("-inf")).all() and (lse2 == float("-inf")).all()
    kl.sum().backward()
    for x in xs:
        assert x.grad.shape == x.shape and (x.grad == 0).all()
    x64 = [x.detach().double().numpy() for x in xs]
    kl_ref, lse1_ref, lse2_ref = streamkl_ref.attention_kl(*x64, causal=causal, return_lse=True)
    assert (kl_ref == 0).all() and (lse1_ref == -np.inf).all() and (lse2_ref == -np.inf).all()
    online = streamkl_ref.attention_kl_online(*x64, causal=causal, block_q=2, block_k=2)
    assert (np.asarray(online.kl) == 0).all()
    grads = streamkl_ref.attention_kl_grad(*x64, np.ones((2, 2, 3)), causal=causal)
    assert all((grads[n] == 0).all() for n in grads)


def test_reference_converts_torch_tensors():
    xs = make_inputs(1, 2, 1, 2, 4, 6, 16, 8, seed=5)
    from_numpy = streamkl_ref.attention_kl(*[x.double().numpy() for x in xs], causal=True)
    from_torch = streamkl_ref.attention_kl(*[x.requires_grad_() for x in xs], causal=True)
    assert isinstance(from_torch, np.ndarray) and from_torch.dtype == np.float64
    np.testing.assert_array_equal(from_torch, from_numpy)


def test_reference_says_why_it_cannot_convert():
    with pytest.raises(ValueError, match=r"q1 must hold real numbers"):
        streamkl_ref.attention_kl(np.array([["a"]]), None, None, None)


def test_versions_and_public_names():
    assert streamkl_ref.__version__ == streamkl_gpu.__version__
    names = dir(streamkl_gpu)
    assert "attention_kl" in names and "attention_kl_with_lse" in names
    assert not [n for n in names if n.startswith("_") and n != "__version__"], names
    assert "api" not in names and "importlib" not in names


def test_importing_streamkl_ref_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, streamkl_ref; print('torch' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
