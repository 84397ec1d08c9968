"""Which forward runs: the Gluon kernel (Hopper, ``_gluon_fwd``) or the portable Triton one.

``use_gluon`` is a pure function of the problem (sizes, dtypes, strides, alignment, device
capability, split-K), testable on CPU. The override: ``FWD_BACKEND`` in this module (tests,
benchmarks) or else the environment variable ``STREAMKL_FWD_BACKEND``: ``auto`` (default),
``triton`` (never Gluon) or ``gluon`` (Gluon or a ``ValueError`` saying why not: a forced path
never falls back silently, so a test of the Gluon path cannot pass on the Triton one).

The Gluon import is guarded: triton builds without Gluon (or with an older API) leave
``GLUON_AVAILABLE`` False and every problem on the Triton path.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from streamkl_gpu._core import env as _env
from streamkl_gpu._core import runtime as _runtime

try:
    from streamkl_gpu.attention.gluon import fwd_sm90 as _gluon_fwd
    from streamkl_gpu.attention.gluon import fwd_sm90_launch as _gluon_fwd_launch
except Exception as exc:  # no triton.experimental.gluon, or an API this kernel does not know
    _gluon_fwd = None
    GLUON_IMPORT_ERROR: Optional[str] = f"{type(exc).__name__}: {exc}"
else:
    GLUON_IMPORT_ERROR = None

GLUON_AVAILABLE = _gluon_fwd is not None

BACKENDS = _env.BACKENDS
ENV_VAR = "STREAMKL_FWD_BACKEND"
FWD_BACKEND: Optional[str] = None  # module override; None: read ENV_VAR (default "auto")

GLUON_CAPABILITY = (9, 0)  # wgmma + TMA + setmaxnreg: sm_90 only (sm_100 has no wgmma)
GLUON_DTYPES = (torch.float16, torch.bfloat16)
GLUON_HEAD_DIMS = (64, 128)  # per side; other head dims stay on the Triton path
# Automatic choice only from these sizes on (forced "gluon" ignores them). H200, 2026-12-01
# (bench/results/2026-12-01_h200_unknown/gluon_timing.log, B=1, H=32, D=128 bf16): at 1K
# keys Gluon 0.094 ms vs Triton 0.072 (launch-bound); at 2K 0.179 vs 0.201; 4K 0.652 vs 0.750.
GLUON_MIN_KEYS = 2048
GLUON_MIN_QUERIES = 128  # one CTA holds 128 query rows
# Enough CTAs to fill the GPU without splitting keys. H200, 2026-12-01 (r3_gluon_timing.log):
# B=1, H=32, N=2K (512 CTAs, 3.9 per SM): Gluon 0.179 ms, tuned Triton (split choices) 0.201;
# N_Q=16, N_K=32K (32 CTAs): Gluon 0.655, split Triton 0.140.
GLUON_MIN_CTAS_PER_SM = 2


def fwd_backend() -> str:
    """The forward backend asked for: ``FWD_BACKEND`` if set, else ``$STREAMKL_FWD_BACKEND``."""
    return _env.backend(ENV_VAR, FWD_BACKEND)


def _tma_legal(shape_strides, element_size: int, data_ptr: int) -> Optional[str]:
    strides = tuple(shape_strides)
    if strides[-1] != 1:
        return "the last (head) dim is not contiguous"
    if data_ptr % 16:
        return "the base address is not 16-byte aligned"
    for st in strides[:-1]:
        if st <= 0 or (st * element_size) % 16 or st * element_size >= 2 ** 40:
            return f"stride {st} is not a positive multiple of 16 bytes below 2^40"
    return None


def gluon_unsupported(dims, dtypes: Sequence[torch.dtype], strides: Sequence[Sequence[int]],
                      device_capability, split: bool, data_ptrs: Sequence[int] = (0, 0, 0, 0)) -> Optional[str]:
    """Why the Gluon forward cannot take this problem (a sentence), or None when it can.

    ``dtypes``, ``strides``, ``data_ptrs``: of q1, k1, q2, k2. ``device_capability``: the CUDA
    ``(major, minor)`` or None (CPU, interpreter). ``split``: split-K was chosen (short query
    blocks): the Triton path's split kernel and merge take it.
    """
    if not GLUON_AVAILABLE:
        return f"triton.experimental.gluon is not usable here ({GLUON_IMPORT_ERROR})"
    if device_capability is None or tuple(device_capability) != GLUON_CAPABILITY:
        return f"the Gluon forward needs an sm_90 GPU, got capability {device_capability}"
    if split:
        return "split-K (few query blocks) runs on the Triton path"
    for name, dt in zip(("q1", "k1", "q2", "k2"), dtypes):
        if dt not in GLUON_DTYPES:
            return f"{name} has dtype {dt}; the Gluon forward takes float16 and bfloat16"
    for name, d in (("q1", dims.D1), ("q2", dims.D2)):
        if d not in GLUON_HEAD_DIMS:
            return f"{name} has head dim {d}; the Gluon forward takes {GLUON_HEAD_DIMS}"
    for name, dt, st, ptr in zip(("q1", "k1", "q2", "k2"), dtypes, strides, data_ptrs):
        why = _tma_legal(st, torch.empty((), dtype=dt).element_size(), int(ptr))
        if why:
            return f"{name} cannot be read through a TMA descriptor: {why}"
    return None


def use_gluon(dims, dtypes, strides, device_capability, split: bool, data_ptrs=(0, 0, 0, 0),
              backend: Optional[str] = None, split_explicit: bool = False, n_sm: int = 132) -> bool:
    """True: run the Gluon forward. ``backend`` (default :func:`fwd_backend`): ``"triton"`` is
    always False; ``"gluon"`` is True or raises ``ValueError`` with the reason; ``"auto"`` is True
    when the kernel takes the problem and it is large enough (``GLUON_MIN_KEYS``/``_QUERIES``).

    ``split``: the Triton path would consider splitting the keys (short query blocks);
    ``split_explicit``: the caller asked for it (``split_k=n``). Forced ``"gluon"`` overrides only
    the automatic split (the kernel then makes one pass over the keys). ``"auto"`` overrides it
    too when the Gluon kernel alone has ``GLUON_MIN_CTAS_PER_SM * n_sm`` CTAs (``n_sm``: the
    device's SMs); fewer, and the split Triton kernel takes the problem.
    """
    backend = fwd_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        return False
    ctas = -(-dims.NQ // 128) * dims.B * dims.H
    if not split_explicit and (backend == "gluon" or ctas >= GLUON_MIN_CTAS_PER_SM * n_sm):
        split = False
    why = gluon_unsupported(dims, dtypes, strides, device_capability, split, data_ptrs)
    if backend == "gluon":
        if why:
            raise ValueError(f"{ENV_VAR}=gluon, but {why}")
        return True
    return why is None and dims.NK >= GLUON_MIN_KEYS and dims.NQ >= GLUON_MIN_QUERIES


def device_capability(device):
    """CUDA ``(major, minor)`` of ``device``, None for anything else."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


_PICKED: dict = {}  # tuning key -> the chosen candidate (what pick found; skips its slicing work)


def gluon_forward(q1, k1, q2, k2, causal, scale1, scale2, out=None, dims=None):
    """(kl nats, lse1_bits, lse2_bits) from the Gluon kernel with a tuned launch configuration
    (``fwd_sm90_launch.candidates``, timed once per shape bucket by ``_tuning.pick``, on a bounded
    slice of long problems like the Triton path); see ``fwd_sm90_launch.gluon_forward``.
    ``dims``: the checked sizes, when the caller has them."""
    if _gluon_fwd is None:
        raise RuntimeError(f"the Gluon forward is not available: {GLUON_IMPORT_ERROR}")
    from streamkl_gpu._core.tuning import autotune_enabled, bucket, pick
    from streamkl_gpu.attention.configs import tuning_slice

    if dims is None:
        from streamkl_ref._checks import check_inputs

        dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    if out is None:
        out = tuple(torch.empty((dims.B, dims.H, dims.NQ), dtype=torch.float32, device=q1.device) for _ in range(3))

    def runner(xs, outs, quick_first=False):
        return lambda cfg: _gluon_fwd_launch.gluon_forward(*xs, causal, scale1, scale2, out=outs, config=cfg,
                                                           quick_first=quick_first)

    launch = runner((q1, k1, q2, k2), out, quick_first=not autotune_enabled())
    key = ("gluon_fwd", dims.D1, dims.D2, q1.dtype, q2.dtype, bool(causal), bucket(dims.NQ), bucket(dims.NK),
           bucket(dims.B * dims.H), dims.group1 > 1, dims.group2 > 1)
    cand = _PICKED.get(key)
    if cand is None:
        proxy = None
        sliced = tuning_slice(dims, causal)
        if sliced is not None and autotune_enabled():  # time the candidates on a bounded slice (long N)
            nq, nk = sliced
            pouts = tuple(torch.empty((dims.B, dims.H, nq), dtype=torch.float32, device=q1.device)
                          for _ in range(3))
            proxy = runner((q1[:, :, :nq], k1[:, :, :nk], q2[:, :, :nq], k2[:, :, :nk]), pouts)
        trio = _gluon_fwd_launch.trio_class(dims.D1, dims.D2, causal, dims.NQ, dims.NK, q1.dtype, q2.dtype,
                                            dims.group1 > 1 or dims.group2 > 1)
        cand = pick(key, _gluon_fwd_launch.candidates(dims.D1, dims.D2, trio), launch, proxy, q1.device)
        if autotune_enabled():  # untuned picks are not remembered
            _PICKED[key] = cand
    launch(cand)
    return out
