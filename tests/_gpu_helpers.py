"""Shared helpers for the streamkl_gpu tests (kernels under the Triton interpreter on CPU).

One error-ratio helper compares every output and gradient by name (flash-linear-attention's
pattern) with FlashAttention's tolerance rule: the kernel's error against the float64 reference
must be at most ``ratio`` times the error that the same math makes densely in PyTorch at the
inputs' precision (``streamkl_gpu.naive``), plus a floor.
"""
from __future__ import annotations

import math

import numpy as np
import torch

import streamkl_ref
from streamkl_gpu.naive import attention_kl_naive
from streamkl_ref import testing

NAMES = ("q1", "k1", "q2", "k2")
GRAD_NAMES = ("dq1", "dk1", "dq2", "dk2")
# the project's rule, one home: streamkl_ref.testing.tolerance (C_TOL, FLOOR)
FLOOR = {torch.float32: testing.FLOOR["float32"], torch.float16: testing.FLOOR["float16"]}
RATIO = testing.C_TOL


def rel_err(x, ref) -> float:
    """Relative Frobenius error; a (numerically) all-zero reference is compared on a 1e-12 scale."""
    x = torch.as_tensor(x).detach().double().cpu()
    ref = torch.as_tensor(ref, dtype=torch.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    if not torch.isfinite(x).all():
        return math.inf
    denom = max(ref.norm().item(), 1e-12 * math.sqrt(max(ref.numel(), 1)))
    return ((x - ref).norm() / denom).item()


def assert_close(name, ours, ref, same_precision, *, dtype, ratio=RATIO, floor=None):
    """ours vs the float64 ``ref``, within ``ratio * err(same_precision) + floor``."""
    floor = FLOOR[dtype] if floor is None else floor
    err = rel_err(ours, ref)
    base = rel_err(same_precision, ref) if same_precision is not None else 0.0
    tol = ratio * base + floor
    assert err <= tol, f"{name}: error {err:.3e} > tolerance {tol:.3e} (same-precision eager {base:.3e})"
    return err


def make_inputs(B, H, HK1, HK2, NQ, NK, D1, D2, *, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, H, NQ, D1), (B, HK1, NK, D1), (B, H, NQ, D2), (B, HK2, NK, D2)]
    return [(scale * torch.randn(s, generator=gen)).to(dtype) for s in shapes]


def reference(xs, g=None, **kw):
    """float64 references from streamkl_ref: (kl, lse1, lse2) and, with ``g``, the gradient dict."""
    x64 = [x.double().numpy() for x in xs]
    kl, lse1, lse2 = streamkl_ref.attention_kl(*x64, return_lse=True, **kw)
    grads = None if g is None else streamkl_ref.attention_kl_grad(*x64, g.double().numpy(), **kw)
    return kl, lse1, lse2, grads


def same_precision(xs, g, *, train=(True, True, True, True), **kw):
    """The dense PyTorch computation at the inputs' own precision: its KL and gradients."""
    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, train)]
    kl = attention_kl_naive(*ins, compute_dtype=xs[0].dtype, **kw)
    if g is not None and any(train):
        kl.backward(g.to(kl.dtype))
    return kl.detach(), {n: (x.grad if t else None) for n, x, t in zip(GRAD_NAMES, ins, train)}


def finite_rows_mask(kl: np.ndarray) -> np.ndarray:
    return np.isfinite(kl)
