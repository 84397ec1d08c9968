"""attention_kl's contract: clear errors on bad input, torch.compile without graph breaks."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import streamkl_gpu

from _gpu_helpers import GRAD_NAMES, make_inputs
from _compiler_env import compiler_env

ROOT = Path(__file__).resolve().parents[1]


def good():
    return make_inputs(1, 4, 2, 1, 8, 12, 16, 32)


@pytest.mark.parametrize("mutate,pattern", [
    (lambda x: x.__setitem__(0, x[0][0]), r"q1 must have 4 dimensions"),
    (lambda x: x.__setitem__(1, torch.randn(2, 2, 12, 16)), r"k1 has batch size 2"),
    (lambda x: x.__setitem__(2, torch.randn(1, 2, 8, 32)), r"q2 has 2 query heads"),
    (lambda x: x.__setitem__(2, torch.randn(1, 4, 9, 32)), r"q2 has 9 query rows"),
    (lambda x: x.__setitem__(3, torch.randn(1, 1, 13, 32)), r"k2 has 13 key rows"),
    (lambda x: x.__setitem__(1, torch.randn(1, 3, 12, 16)), r"k1 has 3 key heads"),
    (lambda x: x.__setitem__(1, torch.randn(1, 2, 12, 8)), r"k1 has head dim 8, but q1 has 16"),
    (lambda x: x.__setitem__(1, x[1].half()), r"k1 has dtype torch.float16 but q1 has torch.float32"),
    (lambda x: x.__setitem__(2, x[2].double()), r"q2 has dtype torch.float64"),
    (lambda x: x.__setitem__(0, x[0].to("meta")), r"one device"),
    (lambda x: x.__setitem__(0, x[0].numpy()), r"q1 must be a torch.Tensor"),
], ids=["ndim", "batch", "heads", "n_q", "n_k", "gqa", "head-dim", "dtype-within-side",
        "float64", "device", "not-a-tensor"])
def test_bad_input_raises_named_error(mutate, pattern):
    xs = good()
    mutate(xs)
    with pytest.raises(ValueError, match=pattern):
        streamkl_gpu.attention_kl(*xs)


def test_head_dim_too_large():
    xs = make_inputs(1, 1, 1, 1, 4, 4, 300, 16)
    with pytest.raises(ValueError, match=r"q1 has head dim 300; the kernels support head dims up to 256"):
        streamkl_gpu.attention_kl(*xs)


@pytest.mark.parametrize("kw,pattern", [
    (dict(scale1=0.0), r"scale1 must be positive"),
    (dict(scale2=float("nan")), r"scale2 must be positive"),
    (dict(scale1="1"), r"scale1 must be a positive finite real"),
    (dict(split_k=0), r"split_k must be None or a positive integer"),
    (dict(bwd_mode="fast"), r"bwd_mode must be 'auto', 'fused' or 'separate'"),
])
def test_bad_options(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        streamkl_gpu.attention_kl(*good(), **kw)




def test_cpu_tensors_without_interpreter_say_how_to_enable_it():
    code = ("import torch, streamkl_gpu\n"
            "x = torch.randn(1, 1, 4, 16)\n"
            "try:\n    streamkl_gpu.attention_kl(x, x, x, x)\n"
            "except ValueError as e:\n    print('ERR', e)\n")
    env = compiler_env()
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert "ERR" in out.stdout, out.stdout + out.stderr
    assert "TRITON_INTERPRET=1" in out.stdout


def test_bf16_under_interpreter_is_computed_exactly_in_fp32():
    """The interpreter's bf16 dot is wrong; bf16 inputs are upcast (exactly) there."""
    xs = make_inputs(1, 2, 2, 2, 9, 17, 16, 16, dtype=torch.bfloat16)
    ins = [x.clone().requires_grad_(True) for x in xs]
    kl = streamkl_gpu.attention_kl(*ins)
    kl.sum().backward()
    ref = streamkl_gpu.attention_kl(*(x.float() for x in xs))
    assert torch.equal(kl, ref)
    assert all(x.grad.dtype == torch.bfloat16 for x in ins)


def test_torch_compile_fullgraph_matches_eager():
    """A training step that calls attention_kl traces with no graph break, same loss and grads."""
    xs = make_inputs(1, 4, 2, 1, 12, 20, 16, 32, seed=3)

    def step(q1, k1, q2, k2):
        kl = streamkl_gpu.attention_kl(q1, k1, q2, k2, causal=True)
        return (kl * torch.linspace(0.5, 1.5, kl.shape[-1])).mean()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        train = (False, False, True, True)  # setting 1: only the student side learns
        ins = [x.clone().requires_grad_(t) for x, t in zip(xs, train)]
        loss = fn(*ins)
        loss.backward()
        results.append((loss.detach(), [x.grad for x in ins]))
    (l_e, g_e), (l_c, g_c) = results
    assert torch.equal(l_e, l_c)
    for name, a, b in zip(GRAD_NAMES, g_e, g_c):
        if a is None:
            assert b is None, name
        else:
            assert torch.equal(a, b), name
