"""Tensor checks shared by every streamkl_gpu entry point. Every input error is a ``ValueError``
that names the argument (docs/api.md). The shape rules themselves live in ``streamkl_ref._checks``
(one home, shared with the references); this module adds what only tensors have: dtypes,
devices, the interpreter, and the conversion of scale arguments."""
from __future__ import annotations

from numbers import Real

import numpy as np
import torch

from streamkl_ref._checks import check_inputs

from streamkl_gpu._core.runtime import interpreting, next_power_of_2

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
BWD_MODES = ("auto", "fused", "separate")


def check_causal(causal) -> bool:
    """``causal`` must be a ``bool`` (or ``numpy.bool_``): a string, None or a tensor is an error,
    never silently truthy."""
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    raise ValueError(f"causal must be a bool, got {causal!r} of type {type(causal).__name__}")


def scale_value(scale, name: str):
    """A scale argument as a Python float (or None): Python and NumPy numbers, and CPU 0-dim
    tensors (read once, no device sync). The range check is ``resolve_scale``'s."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if scale.device.type != "cpu":
            raise ValueError(
                f"{name} is a tensor on {scale.device}: pass a Python float (no gradient flows to a "
                "scale, and reading a GPU tensor would synchronise the device on every call)")
        if scale.requires_grad:  # as on CUDA: a scale gets no gradient, so asking for one is an error
            raise ValueError(f"{name} is a tensor that requires grad: pass a Python float or a tensor "
                             "without requires_grad (no gradient flows to a scale)")
        if scale.ndim != 0 or not (scale.dtype.is_floating_point or scale.dtype in (torch.int32, torch.int64)):
            raise ValueError(f"{name} must be a number or a 0-dim CPU tensor, got a tensor of shape "
                             f"{list(scale.shape)} and dtype {scale.dtype}")
        return float(scale.item())
    if isinstance(scale, (np.generic, np.ndarray)) and np.ndim(scale) == 0 and not isinstance(scale, np.bool_):
        if np.issubdtype(np.asarray(scale).dtype, np.number):
            return float(scale)
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise ValueError(f"{name} must be a positive finite real number or None, got {scale!r}")
    return scale


_CHECKED: dict = {}  # inputs that passed, by shapes, dtypes, devices and scales: their Dims


def check_tensors(q1, k1, q2, k2, scale1, scale2):
    """Validate the four attention-KL inputs; returns their ``Dims`` (scales resolved).

    A combination of shapes, dtypes, devices and (number) scales that passed once is remembered,
    so repeated calls skip the rules (the host cost of a small call is mostly such Python)."""
    if not (isinstance(q1, torch.Tensor) and isinstance(k1, torch.Tensor) and isinstance(q2, torch.Tensor)
            and isinstance(k2, torch.Tensor)):
        for name, t in (("q1", q1), ("k1", k1), ("q2", q2), ("k2", k2)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    key = None
    if type(scale1) in _PLAIN_SCALES and type(scale2) in _PLAIN_SCALES:
        key = (q1.shape, k1.shape, q2.shape, k2.shape, q1.dtype, k1.dtype, q2.dtype, k2.dtype,
               q1.device, k1.device, q2.device, k2.device, scale1, scale2)
        dims = _CHECKED.get(key)
        if dims is not None:
            return dims
    dims = _check_tensors_uncached(q1, k1, q2, k2, scale1, scale2)
    if key is not None:
        if len(_CHECKED) >= 4096:
            _CHECKED.clear()
        _CHECKED[key] = dims
    return dims


_PLAIN_SCALES = (type(None), float, int)


def _check_tensors_uncached(q1, k1, q2, k2, scale1, scale2):
    dims = check_inputs(q1, k1, q2, k2, scale1=scale_value(scale1, "scale1"), scale2=scale_value(scale2, "scale2"))
    device = q1.device
    if k1.device != device or q2.device != device or k2.device != device:
        raise ValueError(
            "q1, k1, q2, k2 must be on one device, got "
            + ", ".join(f"{n}: {t.device}" for n, t in (("q1", q1), ("k1", k1), ("q2", q2), ("k2", k2)))
        )
    if device.type == "cpu" and not interpreting():
        raise ValueError(
            "the inputs are CPU tensors, but the Triton kernels need a GPU. To run them on CPU "
            "(slowly, for testing), set the environment variable TRITON_INTERPRET=1 before "
            "importing streamkl_gpu."
        )
    for side, (qn, kn, q, k) in enumerate((("q1", "k1", q1, k1), ("q2", "k2", q2, k2)), start=1):
        if q.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{qn} has dtype {q.dtype}; supported: float16, bfloat16, float32")
        if k.dtype != q.dtype:
            raise ValueError(f"{kn} has dtype {k.dtype} but {qn} has {q.dtype}: q and k of side {side} must match")
    for name, d in (("q1", dims.D1), ("q2", dims.D2)):
        if d > MAX_HEAD_DIM:
            raise ValueError(f"{name} has head dim {d}; the kernels support head dims up to {MAX_HEAD_DIM}")
    return dims


def check_split_k(split_k):
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be None or a positive integer, got {split_k!r}")
    return split_k


def check_bwd_mode(bwd_mode):
    if not isinstance(bwd_mode, str) or bwd_mode not in BWD_MODES:
        raise ValueError(f"bwd_mode must be 'auto', 'fused' or 'separate', got {bwd_mode!r}")
    return bwd_mode


def check_flag(value, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be a bool, got {value!r} of type {type(value).__name__}")


def head_pad(d: int) -> int:
    """The tile width of a head dim: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(d))


def strides(t):
    return tuple(t.stride())


def compute_view(t):
    """The interpreter multiplies bf16 bit patterns in tl.dot; bf16 -> fp32 is exact, so compute in fp32 there."""
    if t.dtype == torch.bfloat16 and interpreting():
        return t.float()
    return t


def is_empty(dims) -> bool:
    """No row or no key: the launch is skipped (empty in, empty out; no keys: KL 0, LSE -inf)."""
    return dims.B == 0 or dims.H == 0 or dims.NQ == 0 or dims.NK == 0
