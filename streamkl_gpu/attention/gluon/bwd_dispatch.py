"""Which backward runs: the Gluon kernel (Hopper, ``_gluon_bwd``) or the portable Triton ones.

``gluon_bwd_unsupported`` is a pure function of the problem (sizes, dtypes, strides, alignment,
device capability, trained sides, mode), testable on CPU. The override: ``BWD_BACKEND`` in this
module (tests, benchmarks) or else the environment variable ``STREAMKL_BWD_BACKEND``: ``auto``
(default), ``triton`` (never Gluon) or ``gluon`` (Gluon or a ``ValueError`` saying why not: a
forced path never falls back silently, so a test of the Gluon path cannot pass on the Triton one).

With ``GLUON_BWD_AUTO`` (on), ``auto`` runs the Gluon backward where it was measured faster than
the Triton kernels (:func:`auto_takes`): one trained side (settings 1 and 2), ``bwd_mode="auto"``,
not deterministic, from ``GLUON_BWD_MIN_KEYS`` keys and ``GLUON_BWD_MIN_QUERIES`` query rows. On an
H100 (dQ by TMA reduce-adds): the training step 0.83-0.91x the Triton one's time at 8K and 16K,
causal and not (bench/results/2026-12-06_h100_c32c559/gluon_bwd_dq.csv), and under the
no-regression rule 0.79-0.92x on the step grid (4K, 8K, GQA, D = 64, fp16;
bench/results/2026-12-06_h100_79636d9/compare_summary.csv); with both sides trained, one launch
per side, 1.07-1.18x, so both sides stay on the Triton kernels. The Gluon import is guarded:
triton builds without Gluon leave ``GLUON_BWD_AVAILABLE`` False and every problem on the Triton path.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from streamkl_gpu._core import env as _env
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu.attention.gluon.dispatch import GLUON_CAPABILITY, _tma_legal, device_capability

try:
    from streamkl_gpu.attention.gluon import bwd_sm90_launch as _gluon_bwd
except Exception as exc:  # no triton.experimental.gluon, or an API this kernel does not know
    _gluon_bwd = None
    GLUON_BWD_IMPORT_ERROR: Optional[str] = f"{type(exc).__name__}: {exc}"
else:
    GLUON_BWD_IMPORT_ERROR = None

GLUON_BWD_AVAILABLE = _gluon_bwd is not None

BACKENDS = _env.BACKENDS
ENV_VAR = "STREAMKL_BWD_BACKEND"
BWD_BACKEND: Optional[str] = None  # module override; None: read ENV_VAR (default "auto")

GLUON_BWD_DTYPES = (torch.float16, torch.bfloat16)
GLUON_BWD_HEAD_DIMS = (64, 128)  # D1 = D2, one of these
# "auto" picks Gluon for one trained side from these sizes (module docstring). With its dQ added by
# fp32 vector atomics it was slower than the Triton pair (1.08-1.14x the step on an H100,
# bench/results/2026-12-06_h100_db14c85/gluon_bwd.csv; 3-7 % on an H200, bench/results/2026-12-01_h200_2a98499/gluon_bwd.csv).
# With the TMA reduce-adds the shortest timed against them is 4096 keys (0.88-0.92x); from 2048 to
# 4096 keys it is taken untimed, as the Gluon forward is from 2048 keys.
GLUON_BWD_AUTO = True
GLUON_BWD_MIN_KEYS = 2048  # with GLUON_BWD_AUTO: the sizes from which it is taken
GLUON_BWD_MIN_QUERIES = 128


def bwd_backend() -> str:
    """The backward backend asked for: ``BWD_BACKEND`` if set, else ``$STREAMKL_BWD_BACKEND``."""
    return _env.backend(ENV_VAR, BWD_BACKEND)


def gluon_bwd_unsupported(dims, dtypes: Sequence[torch.dtype], strides: Sequence[Sequence[int]], device_capability,
                          train1: bool, train2: bool, bwd_mode: str = "auto", deterministic: bool = False,
                          data_ptrs: Sequence[int] = (0, 0, 0, 0)) -> Optional[str]:
    """Why the Gluon backward cannot take this problem (a sentence), or None when it can.

    ``dtypes``, ``strides``, ``data_ptrs``: of q1, k1, q2, k2. ``device_capability``: the CUDA
    ``(major, minor)`` or None (CPU, interpreter). ``bwd_mode``, ``deterministic``: the API's
    arguments (the Gluon kernel adds dQ with atomics: it is a "fused", non-deterministic path).
    Both sides trained: one launch per side (``try_gluon_backward``).
    """
    if not GLUON_BWD_AVAILABLE:
        return f"triton.experimental.gluon is not usable here ({GLUON_BWD_IMPORT_ERROR})"
    if device_capability is None or tuple(device_capability) != GLUON_CAPABILITY:
        return f"the Gluon backward needs an sm_90 GPU, got capability {device_capability}"
    if not (train1 or train2):
        return "no side is trained"
    if deterministic:
        return "deterministic=True: the Gluon backward adds dQ with atomics"
    if bwd_mode == "separate":
        return "bwd_mode='separate' asks for no dQ atomics; the Gluon backward is a fused kernel"
    for name, dt in zip(("q1", "k1", "q2", "k2"), dtypes):
        if dt not in GLUON_BWD_DTYPES:
            return f"{name} has dtype {dt}; the Gluon backward takes float16 and bfloat16"
    if len(set(dtypes)) != 1:
        return f"q1, k1, q2, k2 have dtypes {tuple(dtypes)}; the Gluon backward takes one dtype for all four"
    if dims.D1 != dims.D2 or dims.D1 not in GLUON_BWD_HEAD_DIMS:
        return f"head dims D1={dims.D1}, D2={dims.D2}; the Gluon backward takes D1 = D2 in {GLUON_BWD_HEAD_DIMS}"
    for name, dt, st, ptr in zip(("q1", "k1", "q2", "k2"), dtypes, strides, data_ptrs):
        why = _tma_legal(st, dt.itemsize, int(ptr))
        if why:
            return f"{name} cannot be read through a TMA descriptor: {why}"
    return None


def auto_takes(dims, train1, train2, bwd_mode="auto", deterministic=False) -> bool:
    """The ``auto`` rule's cheap part (no strides or device): ``GLUON_BWD_AUTO``, one trained side,
    ``bwd_mode="auto"``, not deterministic, at least ``GLUON_BWD_MIN_KEYS`` keys and
    ``GLUON_BWD_MIN_QUERIES`` query rows."""
    return (GLUON_BWD_AUTO and train1 != train2 and bwd_mode == "auto" and not deterministic
            and dims.NK >= GLUON_BWD_MIN_KEYS and dims.NQ >= GLUON_BWD_MIN_QUERIES)


def use_gluon_bwd(dims, dtypes, strides, device_capability, train1, train2, bwd_mode="auto", deterministic=False,
                  data_ptrs=(0, 0, 0, 0), backend: Optional[str] = None) -> bool:
    """True: run the Gluon backward. ``backend`` (default :func:`bwd_backend`): ``"triton"`` is
    always False; ``"gluon"`` is True or raises ``ValueError`` with the reason; ``"auto"`` is True
    for a problem the kernel takes that :func:`auto_takes`."""
    backend = bwd_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" or (backend == "auto" and not auto_takes(dims, train1, train2, bwd_mode, deterministic)):
        return False
    why = gluon_bwd_unsupported(dims, dtypes, strides, device_capability, train1, train2, bwd_mode, deterministic,
                                data_ptrs)
    if backend == "gluon":
        if why:
            raise ValueError(f"{ENV_VAR}=gluon, but {why}")
        return True
    return why is None


def try_gluon_backward(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, dims, train1, train2, bwd_mode,
                       deterministic, strides_of):
    """``_launch.backward``'s hook: (dq1, dk1, dq2, dk2) from the Gluon kernel when the dispatch
    takes the problem, else None (the Triton path runs). ``g``, ``kl``, ``lse*_bits``: contiguous
    fp32 [B, H, N_Q]; ``strides_of``: ``_checks.strides``."""
    backend = bwd_backend()
    if backend == "triton" or (backend == "auto" and not auto_takes(dims, train1, train2, bwd_mode, deterministic)):
        return None  # no further host work on the Triton path
    inputs = (q1, k1, q2, k2)
    if not use_gluon_bwd(dims, tuple(t.dtype for t in inputs), tuple(strides_of(t) for t in inputs),
                         device_capability(q1.device), train1, train2, bwd_mode, deterministic,
                         tuple(t.data_ptr() for t in inputs), backend=backend):
        return None
    grads = [None, None, None, None]
    for side, trained in ((1, train1), (2, train2)):  # both sides (forced): one launch per side (8 products, not 6)
        if trained:
            grads[2 * side - 2: 2 * side] = _gluon_bwd.gluon_backward(
                g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, dims.scale1, dims.scale2, side)
    return tuple(grads)
