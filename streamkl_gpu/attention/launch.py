"""Host side of the attention-KL launches: buffers, grids, tuned configs, the split-K combine.

``forward`` returns ``(kl in nats, lse1, lse2 in bits)``; ``backward`` the four gradients (None
for a side that is not trained). Both take resolved float scales (``api`` checks the arguments).
"""
from __future__ import annotations

import copy
import itertools
import os
from dataclasses import replace

import torch

from streamkl_ref._checks import check_inputs

from streamkl_gpu.attention.triton import fwd as _fwd
from streamkl_gpu._core import forcing as _forcing
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core.launcher import ahead_allowed, compile_ahead, compiling_ahead
from streamkl_gpu._core.launcher import launch as fast_launch
from streamkl_gpu.attention.gluon.dispatch import device_capability, fwd_backend, gluon_forward, use_gluon
from streamkl_gpu._core.checks import check_bwd_mode, check_tensors, compute_view, head_pad, is_empty, strides
from streamkl_gpu._core.runtime import LOG2E, LazyModule, TensorDescriptor, cdiv, fresh, interpreting, n_sm, tma_ok
from streamkl_gpu._core.tuning import UnusableConfig, autotune_enabled, bucket, pick
from streamkl_gpu.attention.configs import (BWD_TMA_MIN_KEYS, TMA_MIN_KEYS, auto_bwd_mode, bwd_streams, bwd_variant,
                                          bwd_variant_candidates, fused_fits, fwd_candidates, one_tile_backward,
                                          split_choices, stores_dq_whole, tuning_slice)

# the backward's kernels and dispatch, imported at a training call's first use (a forward-only
# first call does without them)
_bwd = LazyModule("streamkl_gpu.attention.triton.bwd", globals(), "_bwd")
_gluon_bwd_dispatch = LazyModule("streamkl_gpu.attention.gluon.bwd_dispatch", globals(), "_gluon_bwd_dispatch")


def _empty_forward(dims, device):
    """Empty in, empty out; no keys: KL 0 and LSE -inf for every row (docs/api.md, "Empty inputs")."""
    shape = (dims.B, dims.H, dims.NQ)
    kl = torch.zeros(shape, dtype=torch.float32, device=device)
    lse = torch.full(shape, float("-inf"), dtype=torch.float32, device=device)
    return kl, lse, lse.clone()


_PLAN_TOKENS = itertools.count()


class _TritonForward:
    """One Triton forward config bound to a call signature: grid, integer arguments and
    constexprs computed once, so a call only allocates and launches.

    ``cfg``: a :class:`~streamkl_gpu.attention.configs.FwdConfig`. ``key``: the call's plan
    signature (inputs' shapes, strides, dtypes, alignment, flags), which with ``cfg`` fixes every
    launch argument's specialisation but the outputs' alignment: the launches then skip Triton's
    binder (``_fast_launch``). None (tuning, proxies): the binder or a derived key."""

    __slots__ = ("grid", "ints", "constexprs", "warps", "stages", "boxes", "part_shape", "combine", "key")

    def __init__(self, cfg, dims, causal, d1_pad, d2_pad, in_strides, ieee1, ieee2, key=None, order="heavy"):
        block_m, block_n, warps, stages, use_tma = cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.use_tma
        n_splits = cfg.splits
        BH = dims.B * dims.H
        key_tiles = cdiv(dims.NK, block_n)
        splits = min(n_splits, key_tiles)
        keys_per_split = cdiv(key_tiles, splits) * block_n
        splits = cdiv(dims.NK, keys_per_split)
        self.grid = (cdiv(dims.NQ, block_m), BH, splits)
        self.ints = (*in_strides, dims.H, dims.NQ, dims.NK, dims.D1, dims.D2, dims.group1, dims.group2,
                     keys_per_split, splits, dims.scale1 * LOG2E, dims.scale2 * LOG2E)
        self.constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, D1_PAD=d1_pad, D2_PAD=d2_pad,
                               CAUSAL=causal, SPLIT=splits > 1, IEEE1=ieee1, IEEE2=ieee2, USE_TMA=use_tma,
                               NO_CONTRACT=not interpreting(),
                               HEAVY_FIRST=causal and splits == 1 and order == "heavy")
        self.warps, self.stages = warps, stages
        # the keys' descriptors (the inputs' shapes and strides are the signature's)
        self.boxes = ((_BoundDescriptor((dims.B, dims.HK1, dims.NK, dims.D1), in_strides[4:8], (1, 1, block_n, d1_pad)),
                       _BoundDescriptor((dims.B, dims.HK2, dims.NK, dims.D2), in_strides[12:16], (1, 1, block_n, d2_pad)))
                      if use_tma else None)
        self.part_shape = (5, splits, BH, dims.NQ) if splits > 1 else None
        rows = BH * dims.NQ
        self.combine = ((cdiv(rows, 256), 1, 1), (rows, splits)) if splits > 1 else None
        # a token per bound plan stands for (signature, cfg): cheaper to hash on every call
        self.key = None if key is None else ("fwd", next(_PLAN_TOKENS))

    def __call__(self, q1, k1, q2, k2, outs):
        kl, lse1_bits, lse2_bits = outs
        k1_desc = k2_desc = None
        if self.boxes is not None:
            k1_desc, k2_desc = self.boxes[0](k1), self.boxes[1](k2)
        part = kl if self.part_shape is None else fresh(self.part_shape, torch.float32, kl.device)
        fast_launch(_fwd._kl_fwd_kernel, self.grid,
                    (q1, k1, q2, k2, k1_desc, k2_desc, kl, lse1_bits, lse2_bits, part) + self.ints,
                    self.constexprs, self.warps, self.stages, self.key, (kl, lse1_bits, lse2_bits, part))
        if self.combine is not None:
            grid, (rows, splits) = self.combine
            fast_launch(_fwd._kl_combine_kernel, grid, (part, kl, lse1_bits, lse2_bits, rows, splits),
                        dict(BLOCK=256), 4, 3, self.key, (part, kl, lse1_bits, lse2_bits))


TRITON_FWD_ORDERS = ("heavy", "query")  # the Triton forward's causal query-tile orders (forcing)


def triton_fwd_order():
    """The query-tile order of the Triton forward: the forced ``attention_triton_fwd_order``, or
    ``"heavy"`` (the default)."""
    order = _forcing.forced("attention_triton_fwd_order") or "heavy"  # (forced None: the default)
    if order not in TRITON_FWD_ORDERS:
        raise ValueError(f"attention_triton_fwd_order must be one of {TRITON_FWD_ORDERS} or None, got {order!r}")
    return order


def _bind_forward(cfg, q1, k1, q2, k2, dims, causal, d1_pad, d2_pad, key=None):
    strides_in = (*strides(q1), *strides(k1), *strides(q2), *strides(k2))
    return _TritonForward(cfg, dims, causal, d1_pad, d2_pad, strides_in,
                          q1.dtype == torch.float32, q2.dtype == torch.float32, key, triton_fwd_order())


def _fwd_runner(q1, k1, q2, k2, dims, causal, outs, d1_pad, d2_pad):
    """``launch(cfg)`` for one problem (what the tuner times): binds ``cfg`` and runs it."""
    def launch(cfg):
        _bind_forward(cfg, q1, k1, q2, k2, dims, causal, d1_pad, d2_pad)(q1, k1, q2, k2, outs)
    return launch


def _fwd_outputs(dims, device, one_buffer=True, keep_lse=True):
    """kl, lse1_bits, lse2_bits: three [B, H, N_Q] views of one fresh buffer (one allocation), or
    three buffers (a custom op's outputs may not alias each other). ``keep_lse=False`` (a call that
    hands out only its KL): a fresh KL and, for a small call, the LSE scratch (``_lse_scratch``)."""
    shape = (dims.B, dims.H, dims.NQ)
    if not keep_lse:
        scratch = _lse_scratch(shape, device)
        if scratch is not None:
            return (fresh(shape, torch.float32, device), *scratch)
    if not one_buffer:
        return tuple(fresh(shape, torch.float32, device) for _ in range(3))
    return fresh((3, *shape), torch.float32, device).unbind(0)


# The LSEs of a small call that hands out only its KL (``attention_kl`` without gradients, e.g. a
# decoding step): the kernels write them and nothing reads them, so they go to one scratch pair per
# device and shape, made once, and the call allocates its KL alone (the forward at B = H = N_Q = 1,
# N_K = 64: 24.3 against 27.5 us host time on an H100, docs/performance.md, "Host time"). The pair
# is the 2nd and 3rd of three rows, as in the one-buffer layout: the LSE pointers keep that
# layout's alignment, and with it the kernels' specialisation (no second compile beside a training
# call at the same shape). Entries are never freed (a freed buffer could be handed out again while
# a kernel on another stream still writes it), so they are bounded: at most LSE_SCRATCH_ENTRIES of
# at most LSE_SCRATCH_ROWS rows (3 MiB).
_LSE_SCRATCH: dict = {}
LSE_SCRATCH_ROWS = 1 << 12
LSE_SCRATCH_ENTRIES = 64


def _lse_scratch(shape, device):
    """(lse1_bits, lse2_bits) scratch of ``shape`` on ``device``, or None (too many rows, or full)."""
    pair = _LSE_SCRATCH.get((shape, device))
    if pair is None:
        if shape[0] * shape[1] * shape[2] > LSE_SCRATCH_ROWS or len(_LSE_SCRATCH) >= LSE_SCRATCH_ENTRIES:
            return None
        pair = _LSE_SCRATCH[(shape, device)] = torch.empty((3, *shape), dtype=torch.float32, device=device).unbind(0)[1:]
    return pair


# Launch plans, per call signature: what depends only on shapes, strides, dtypes, alignment and
# flags is decided once (candidates, tuning, the backend) and reused by every later call with
# that signature, so a call's host work is the checks, the allocations and the launches.
_PLANS: dict = {}
_MAX_PLANS = 4096
GLUON = "gluon"  # the forward plan that runs the Gluon kernel instead of a Triton config


def _signature(kind, dims, flags, q1, k1, q2, k2):
    """What a plan is bound to: the problem's sizes, flags and settings, and the inputs' dtypes,
    strides, alignment and device (written out: a generator over the inputs cost more). One device:
    ``check_tensors`` has found all four inputs on q1's."""
    return (kind, dims, flags, (_runtime.env("STREAMKL_AUTOTUNE"), _runtime.INTERPRETER_BLOCK, _runtime.INTERPRETER_TMA),
            q1.dtype, k1.dtype, q2.dtype, k2.dtype, q1.stride(), k1.stride(), q2.stride(), k2.stride(),
            q1.data_ptr() % 16, k1.data_ptr() % 16, q2.data_ptr() % 16, k2.data_ptr() % 16, q1.device)


def _remember(sig, plan):
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[sig] = plan
    return plan


def forward(q1, k1, q2, k2, causal, scale1, scale2, split_k, dims=None, one_buffer=True, keep_lse=True):
    """(kl in nats, lse1, lse2 in bits), float32 [B, H, N_Q]. ``dims``: already checked inputs;
    ``one_buffer=False``: three separate output tensors (for the custom op); ``keep_lse=False``: the
    caller keeps only the KL (the LSEs returned may be scratch that later calls overwrite)."""
    if dims is None:
        dims = check_tensors(q1, k1, q2, k2, scale1, scale2)
    if is_empty(dims):
        return _empty_forward(dims, q1.device)
    (q1, k1, q2, k2), sig = _kernel_inputs(q1, k1, q2, k2, causal, split_k, dims)
    return _run_forward(sig, q1, k1, q2, k2, causal, split_k, dims, q1.device, one_buffer, keep_lse=keep_lse)


def _kernel_inputs(q1, k1, q2, k2, causal, split_k, dims):
    """The inputs as the kernels read them (bf16 computed in fp32 under the interpreter:
    ``compute_view``) and the forward's plan signature."""
    if interpreting():
        q1, k1, q2, k2 = (compute_view(t) for t in (q1, k1, q2, k2))
    return (q1, k1, q2, k2), _signature("fwd", dims, (causal, split_k, fwd_backend(), triton_fwd_order()),
                                        q1, k1, q2, k2)


def _forward_plan(sig, q1, k1, q2, k2, causal, split_k, dims):
    """The forward's plan under its signature ``sig`` (bound at the signature's first call)."""
    plan = _PLANS.get(sig)
    if plan is None:
        d1_pad, d2_pad = head_pad(dims.D1), head_pad(dims.D2)
        cfg = _forward_config(q1, k1, q2, k2, dims, causal, split_k, d1_pad, d2_pad)
        plan = _remember(sig, cfg if cfg is GLUON else
                         _bind_forward(cfg, q1, k1, q2, k2, dims, causal, d1_pad, d2_pad, key=sig))
    return plan


def _run_forward(sig, q1, k1, q2, k2, causal, split_k, dims, device, one_buffer=True, plan=None, keep_lse=True):
    """The forward's launches under its plan signature ``sig``; ``plan``: that signature's plan,
    when the caller holds it (a training binding)."""
    if plan is None:
        plan = _forward_plan(sig, q1, k1, q2, k2, causal, split_k, dims)
    outs = _fwd_outputs(dims, device, one_buffer, keep_lse)
    if plan is GLUON:  # the Hopper kernel (_gluon_fwd), chosen by _gluon_dispatch.use_gluon
        gluon_forward(q1, k1, q2, k2, causal, dims.scale1, dims.scale2, out=outs, dims=dims)
    else:
        plan(q1, k1, q2, k2, outs)
    return outs


def _forward_config(q1, k1, q2, k2, dims, causal, split_k, d1_pad, d2_pad):
    """The forward's launch config for this signature: candidates pruned by shape, then tuned."""
    device = q1.device
    d_pad = max(d1_pad, d2_pad)
    ieee = q1.dtype == torch.float32 or q2.dtype == torch.float32
    tma = tma_ok(k1) and tma_ok(k2) and (interpreting() or dims.NK >= TMA_MIN_KEYS)
    if split_k is not None and (not isinstance(split_k, int) or isinstance(split_k, bool) or split_k < 1):
        raise ValueError(f"split_k must be None or a positive integer, got {split_k!r}")
    splits = split_choices(dims, ieee, d_pad, n_sm(device)) if split_k is None else (split_k,)
    inputs = (q1, k1, q2, k2)
    if use_gluon(dims, tuple(t.dtype for t in inputs), tuple(strides(t) for t in inputs), device_capability(device),
                 max(splits) > 1, tuple(t.data_ptr() for t in inputs), split_explicit=split_k is not None,
                 n_sm=n_sm(device)):
        return GLUON
    # one pass: the usual tiles; split keys (short query blocks): the split kernel's small query tiles
    candidates = [replace(c, splits=s) for s in splits for c in fwd_candidates(dims, d_pad, s > 1, ieee, tma, causal)]
    if len(candidates) == 1:
        return candidates[0]
    launch = _fwd_runner(q1, k1, q2, k2, dims, causal, _fwd_outputs(dims, device), d1_pad, d2_pad)
    proxy = None
    sliced = tuning_slice(dims, causal)
    if sliced is not None:  # time the candidates on a bounded slice (first call at long N)
        nq, nk = sliced
        pdims = replace(dims, NQ=nq, NK=nk)
        views = (q1[:, :, :nq], k1[:, :, :nk], q2[:, :, :nq], k2[:, :, :nk])
        proxy = _fwd_runner(*views, pdims, causal, _fwd_outputs(pdims, device), d1_pad, d2_pad)
    key = ("fwd", dims.D1, dims.D2, q1.dtype, q2.dtype, causal, tma,
           bucket(dims.NQ), bucket(dims.NK), bucket(dims.B * dims.H), dims.group1 > 1, dims.group2 > 1,
           "auto" if split_k is None else split_k)
    # several key splits to choose among exist only where the splits are timed (no derived rule
    # for them yet: configs.split_choices); then the whole product is timed, tiles included
    return pick(key, candidates, launch, proxy, device, ruled=len(splits) == 1)


def _desc(t, block_rows, d_pad):
    """A TMA descriptor of a [B, H, N, D] tensor with [1, 1, block_rows, d_pad] blocks (rows past N
    and dims past D read as zeros; a reduce-add drops them)."""
    return _descriptor(t, t.shape, t.stride(), (1, 1, block_rows, d_pad))


_DESC_TEMPLATES: dict = {}  # (shape, strides, dtype, block) -> a checked descriptor without a base


def _descriptor(t, shape, strides_, block):
    """``TensorDescriptor(t, shape, strides_, block)``. Its checks (block shape, strides' alignment)
    depend only on the key, so they run once per key: later calls copy the checked template and set
    the base (the base's own 16-byte alignment is checked per call; an unaligned one takes the
    constructor, which raises as before). Saves ~20 us per descriptor, nine of them per backward."""
    key = (tuple(shape), tuple(strides_), t.dtype, tuple(block))
    template = _DESC_TEMPLATES.get(key)
    if template is None or t.data_ptr() % 16:
        desc = TensorDescriptor(t, list(shape), list(strides_), list(block))
        if len(_DESC_TEMPLATES) < _MAX_PLANS:
            template = copy.copy(desc)
            template.base = None  # the template must not keep a tensor alive
            _DESC_TEMPLATES[key] = template
        return desc
    desc = object.__new__(TensorDescriptor)  # a copy of the checked template (0.3 us; copy.copy 2 us)
    desc.__dict__.update(template.__dict__)
    desc.base = t
    return desc


class _BoundDescriptor:
    """A descriptor of a bound plan: shape, strides and block fixed, so its checks run once (the
    first call's, through ``_descriptor``); a call copies the checked template and sets the base.
    ``check``: a per-call buffer, whose base alignment is checked on every call (an unaligned one
    takes the constructor, which raises); without it the base is an input, whose alignment is part
    of the plan's signature."""

    __slots__ = ("shape", "strides", "block", "check", "template")

    def __init__(self, shape, strides_, block, check=False):
        self.shape, self.strides, self.block, self.check = tuple(shape), tuple(strides_), tuple(block), check
        self.template = None

    def __call__(self, t):
        template = self.template
        if template is None or (self.check and t.data_ptr() % 16):
            desc = _descriptor(t, self.shape, self.strides, self.block)
            self.template = _DESC_TEMPLATES.get((self.shape, self.strides, t.dtype, self.block))
            return desc
        desc = object.__new__(TensorDescriptor)
        desc.__dict__.update(template.__dict__)
        desc.base = t
        return desc


_SIDE_STREAMS: dict = {}  # device index -> the second stream of the separate backward


def _side_stream(dims, device):
    """A second stream for the separate backward's dQ kernel, or None (bwd_streams: off, CPU)."""
    if device.type != "cuda" or interpreting() or not bwd_streams(dims, n_sm(device)):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE_STREAMS.get(index)
    if side is None:
        side = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return side


def _launch_opts(parts):
    """Compile options named by variant parts: "rN" caps the registers per thread at N (ptxas
    .maxnreg), e.g. so that two 8-warp CTAs share an SM (N = 128)."""
    regs = [int(p[1:]) for p in parts if p[:1] == "r" and p[1:].isdigit()]
    return {"maxnreg": regs[-1]} if regs else {}


def _backward_proxy(sliced, dims, q1, k1, q2, k2, g, kl, lse1_bits, lse2_bits):
    """The problem the backward's candidates are timed on when the whole one is past
    TUNING_WORK_LIMIT (``tuning_slice``): the first ``n_q`` query rows and the keys they see, as
    views of the inputs, with their row values copied contiguous ([B, H, n_q], what the kernels
    index). The forward slices the same way; timing the whole problem instead ran every candidate
    twice at full size (13 backward passes at N = 1M before the first real one)."""
    nq, nk = sliced
    rows = [t[:, :, :nq].contiguous() for t in (g, kl, lse1_bits, lse2_bits)]
    return dict(dims=replace(dims, NQ=nq, NK=nk), q1=q1[:, :, :nq], k1=k1[:, :, :nk], q2=q2[:, :, :nq],
                k2=k2[:, :, :nk], g=rows[0], kl=rows[1], lse1_bits=rows[2], lse2_bits=rows[3])


def _backward_signature(dims, causal, train1, train2, bwd_mode, deterministic, q1, k1, q2, k2):
    return _signature("bwd", dims, (causal, train1, train2, bwd_mode, deterministic, _runtime.env("STREAMKL_BWD_STREAMS"),
                                    bwd_variant()), q1, k1, q2, k2)


# The backward's first call at a new signature compiles its kernels (two or three, seconds each).
# A training forward starts compiling them on a background thread (_core/launcher.compile_ahead)
# while its own kernel compiles, so a first forward + backward costs about the compile time of
# the slower of the two instead of their sum. Only where the backward's configs are untimed (the
# shape rule's: nothing to measure ahead of time), on either backward (the Gluon one compiles only
# there too, on stand-in gradient buffers), at any size: the thread's launches only compile, so
# the backward's row inputs and gradient buffers are small stand-ins there (``_stand_in``: a
# kernel specialises on a pointer's 16-byte alignment, never on what it points to) and compiling
# ahead allocates nothing the size of the problem (the real gradient buffers there would hold a
# forward's memory for nothing, and would bound compiling ahead to small problems, leaving a long
# one's forward and backward compiles one after the other).
_BACKWARD_AHEAD: dict = {}  # backward signature -> the thread compiling its kernels


def _stand_in(dtype, device):
    """A buffer for a launch that only compiles (a compile-ahead thread): 16-byte aligned, tiny."""
    return torch.empty(16, dtype=dtype, device=device)


def compile_backward_ahead(q1, k1, q2, k2, causal, dims, train1, train2, bwd_mode, deterministic, sig=None):
    """Start compiling the kernels of the backward this training call will run, unless they are
    known already (its plan is bound) or would be timed. The backward joins the thread before it
    looks its plan up. ``STREAMKL_COMPILE_AHEAD=0`` turns it off. ``sig``: the backward's plan
    signature, when the caller has it."""
    if (q1.device.type != "cuda" or not ahead_allowed()
            or not (train1 or train2) or is_empty(dims) or autotune_enabled(ruled=True)):
        return
    if sig is None:
        sig = _backward_signature(dims, causal, train1, train2, bwd_mode, deterministic, q1, k1, q2, k2)
    if sig in _PLANS or sig in _BACKWARD_AHEAD:
        return
    g, kl, lse1_bits, lse2_bits = (_stand_in(torch.float32, q1.device) for _ in range(4))
    _BACKWARD_AHEAD[sig] = compile_ahead(
        lambda: backward(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, dims.scale1, dims.scale2,
                         train1, train2, bwd_mode, deterministic, dims=dims), q1.device)


class TrainingBinding:
    """What a training call needs, decided once per forward signature and backward settings
    (:func:`training_forward`): the forward's plan, the backward's plan signature and, from the
    first backward on, its bound plan. A later call's forward then launches without looking its
    plan up, and its backward without forming its signature, asking the Gluon backward's
    dispatch or joining a compile."""

    __slots__ = ("fwd", "bwd_sig", "plan")

    def __init__(self, fwd, bwd_sig):
        self.fwd, self.bwd_sig, self.plan = fwd, bwd_sig, None


_BINDINGS: dict = {}  # (forward signature, gradient flags, backward settings) -> TrainingBinding


def training_forward(q1, k1, q2, k2, causal, dims, split_k, train1, train2, bwd_mode, deterministic):
    """:func:`forward` for a call whose backward follows: ``(kl, lse1_bits, lse2_bits), binding``.
    The binding's key holds everything the backward's plan depends on beyond the forward's
    signature (the gradient flags, the mode, and the backward's environment settings)."""
    if is_empty(dims):
        return _empty_forward(dims, q1.device), None
    (q1, k1, q2, k2), sig = _kernel_inputs(q1, k1, q2, k2, causal, split_k, dims)
    key = (sig, train1, train2, bwd_mode, deterministic, _gluon_bwd_dispatch.bwd_backend(),
           _runtime.env("STREAMKL_BWD_STREAMS"), bwd_variant())
    binding = _BINDINGS.get(key)
    if binding is None:
        if len(_BINDINGS) >= _MAX_PLANS:
            _BINDINGS.clear()
        bwd_sig = _backward_signature(dims, causal, train1, train2, bwd_mode, deterministic, q1, k1, q2, k2)
        # a new signature: the backward's kernels compile beside the forward's
        compile_backward_ahead(q1, k1, q2, k2, causal, dims, train1, train2, bwd_mode, deterministic, sig=bwd_sig)
        binding = TrainingBinding(_forward_plan(sig, q1, k1, q2, k2, causal, split_k, dims), bwd_sig)
        _BINDINGS[key] = binding
    return _run_forward(sig, q1, k1, q2, k2, causal, split_k, dims, q1.device, plan=binding.fwd), binding


def _empty_backward(dims, q1, k1, q2, k2, train1, train2):
    """Zero gradients (no visible key anywhere) or empty ones (no row, no key)."""
    def zeros(train, x):
        return torch.zeros_like(x) if train else None
    return zeros(train1, q1), zeros(train1, k1), zeros(train2, q2), zeros(train2, k2)


def _contiguous_strides(shape):
    """The strides of a new tensor of ``shape`` (what ``fresh`` and ``torch.zeros`` return)."""
    return tuple(torch.empty(shape, device="meta").stride())


class _TritonBackward:
    """The backward's kernels for one (dK, dQ) config pair bound to a call signature, like
    :class:`_TritonForward`: buffers' shapes and dtypes, grids, integer arguments, constexprs and
    descriptor templates are computed once, so a call allocates, puts its tensors into the
    descriptors and launches: the rows pre-pass (``_bwd._kl_bwd_rows_kernel``: the dK kernel's
    per-row constants, once per row, read through a descriptor), the dK kernel (with the fused dQ,
    or) then the dQ kernel.

    ``key``: the call's plan signature; with the configs it fixes every launch argument's
    specialisation but the alignment of the per-call tensors, which each call adds to a token of
    the plan (a direct launch, ``_core/launcher.py``). None (the tuner's candidates): the binder or
    a derived key. ``side``: the second stream of the separate backward's dQ kernel, or None."""

    __slots__ = ("mode", "cfg_dk", "cfg_dq", "device", "fused", "side", "token", "dk1", "dk2", "dq1", "dq2",
                 "sum1", "sum2", "finish_shapes", "dk_grid", "dk_ints", "dk_constexprs", "dq_grid", "dq_ints",
                 "dq_constexprs", "dk_tma", "dq_tma", "rows", "rows_grid", "rows_args", "rows_constexprs",
                 "rows_desc", "dq1_desc", "dq2_desc", "reduce_dq")

    def __init__(self, mode, cfg_dk, cfg_dq, dims, causal, train1, train2, deterministic, q1, k1, q2, k2,
                 side=None, key=None):
        self.mode, self.cfg_dk, self.cfg_dq = mode, cfg_dk, cfg_dq
        fused = self.fused = mode == "fused"
        self.device, self.side = q1.device, side
        self.token = None if key is None else ("bwd", next(_PLAN_TOKENS))
        d1_pad, d2_pad = head_pad(dims.D1), head_pad(dims.D2)
        ieee1, ieee2 = q1.dtype == torch.float32, q2.dtype == torch.float32
        both = train1 and train2
        B, H, NQ, NK, BH = dims.B, dims.H, dims.NQ, dims.NK, dims.B * dims.H

        # the outputs, as (shape, dtype, zeroed) or None. dK: direct (one query head per key head),
        # fp32 atomics into the key head (GQA, default) or per-query-head fp32 buffers summed in a
        # fixed order (GQA, deterministic); dQ: fp32 atomics (fused) or direct (separate)
        def dk_buffer(train, k, group, d):
            if not train:
                return None, False
            if group == 1:
                return ((B, H, NK, d), k.dtype, False), False
            if deterministic:
                return ((B, H, NK, d), torch.float32, False), False
            return ((B, k.shape[1], NK, d), torch.float32, True), True

        # the fused dK kernel stores dQ whole (DQ_STORE) where its grid's one key tile holds every
        # key and it visits every query row
        parts = cfg_dk.variant.split("+")
        store_dq = fused and "reduce" not in parts and stores_dq_whole(NQ, NK, causal, cfg_dk.block_n)

        def dq_buffer(train, q, d):
            if not train:
                return None
            return ((B, H, NQ, d), torch.float32, True) if fused and not store_dq else ((B, H, NQ, d), q.dtype, False)

        self.dk1, dk1_atomic = dk_buffer(train1, k1, dims.group1, dims.D1)
        self.dk2, dk2_atomic = dk_buffer(train2, k2, dims.group2, dims.D2)
        self.dq1, self.dq2 = dq_buffer(train1, q1, dims.D1), dq_buffer(train2, q2, dims.D2)
        # per-query-head dK buffers: each group summed in order (``finish``)
        self.sum1 = self.dk1 is not None and self.dk1[0][1] != dims.HK1
        self.sum2 = self.dk2 is not None and self.dk2[0][1] != dims.HK2
        self.finish_shapes = ((B, dims.HK1, dims.group1, NK, dims.D1), (B, dims.HK2, dims.group2, NK, dims.D2))

        def s3(spec):  # strides b, h, n of a buffer (last dim contiguous); the placeholder's: zeros
            return _contiguous_strides(spec[0])[:3] if spec is not None else (0, 0, 0)

        in_strides = (*strides(q1), *strides(k1), *strides(q2), *strides(k2))
        sizes = (H, NQ, NK, dims.D1, dims.D2, dims.group1, dims.group2,
                 dims.scale1 * LOG2E, dims.scale2 * LOG2E, dims.scale1, dims.scale2)

        def tma_descs(cfg):  # the operand tiles' descriptors (their alignment is in the signature)
            return (_BoundDescriptor(q1.shape, q1.stride(), (1, 1, cfg.block_m, d1_pad)),
                    _BoundDescriptor(k1.shape, k1.stride(), (1, 1, cfg.block_n, d1_pad)),
                    _BoundDescriptor(q2.shape, q2.stride(), (1, 1, cfg.block_m, d2_pad)),
                    _BoundDescriptor(k2.shape, k2.stride(), (1, 1, cfg.block_n, d2_pad)))

        use_tma = "tma" in parts
        self.reduce_dq = reduce_dq = fused and "reduce" in parts
        # |g| in the exponentials, four packed row constants (_bwd._gexp_factors): both sides, separate
        gexp = "gexp" in parts and "pack" in parts and both and not fused
        self.dk_grid = (cdiv(NK, cfg_dk.block_n), BH, 1)
        self.dk_ints = in_strides + s3(self.dk1) + s3(self.dk2) + s3(self.dq1) + s3(self.dq2) + sizes
        self.dk_constexprs = dict(
            BLOCK_M=cfg_dk.block_m, BLOCK_N=cfg_dk.block_n, D1_PAD=d1_pad, D2_PAD=d2_pad, CAUSAL=causal,
            TRAIN1=train1, TRAIN2=train2, FUSED_DQ=fused, DK1_ATOMIC=dk1_atomic, DK2_ATOMIC=dk2_atomic,
            IEEE1=ieee1, IEEE2=ieee2,
            USE_TMA=use_tma, TRANS="trans" in parts, FOLD="fold" in parts, DQ_REDUCE=reduce_dq,
            ROWS="rows" in parts, ROWS_PACKED="pack" in parts, POLY=int("poly" in parts), DQ_STORE=store_dq,
            GEXP=gexp, **_launch_opts(parts))
        self.dk_tma = tma_descs(cfg_dk) if use_tma else None
        # the rows pre-pass: planes [6, B*H, N_Q] (one TMA load of [1, 1, BLOCK_M] per value) or,
        # "pack", [B*H, N_Q, 8] rows (one load of [1, BLOCK_M, 4], or 8 with both settings, per query tile;
        # "gexp": [B*H, N_Q, 4] rows, one load of [1, BLOCK_M, 4])
        self.rows = self.rows_desc = None
        if "rows" in parts:
            self.rows_grid = (cdiv(BH * NQ, 1024), 1, 1)
            row_scales = (dims.scale1 * LOG2E, dims.scale2 * LOG2E, dims.scale1, dims.scale2)
            if "pack" in parts:
                self.rows = (BH, NQ, 4 if gexp else 8)
                self.rows_args = (BH * NQ, NQ, 0, 0) + row_scales
                self.rows_constexprs = dict(BLOCK=1024, PACKED=True, GEXP=gexp)
                self.rows_desc = _BoundDescriptor(self.rows, _contiguous_strides(self.rows),
                                                  (1, cfg_dk.block_m, 8 if both and not gexp else 4), check=True)
            else:
                pitch = cdiv(NQ, 4) * 4  # 16-byte rows for the descriptor
                self.rows = (6, BH, pitch)
                self.rows_args = (BH * NQ, NQ, pitch, BH * pitch) + row_scales
                self.rows_constexprs = dict(BLOCK=1024)
                self.rows_desc = _BoundDescriptor((6, BH, NQ), _contiguous_strides(self.rows), (1, 1, cfg_dk.block_m),
                                                  check=True)
        # the fused dQ's reduce-add into its fp32 buffer
        self.dq1_desc = self.dq2_desc = None
        if reduce_dq:
            if self.dq1 is not None:
                self.dq1_desc = _BoundDescriptor(self.dq1[0], _contiguous_strides(self.dq1[0]),
                                                 (1, 1, cfg_dk.block_m, d1_pad), check=True)
            if self.dq2 is not None:
                self.dq2_desc = _BoundDescriptor(self.dq2[0], _contiguous_strides(self.dq2[0]),
                                                 (1, 1, cfg_dk.block_m, d2_pad), check=True)
        self.dq_grid = self.dq_ints = self.dq_constexprs = self.dq_tma = None
        if not fused:
            parts = cfg_dq.variant.split("+")
            use_tma = "tma" in parts
            self.dq_grid = (cdiv(NQ, cfg_dq.block_m), BH, 1)
            self.dq_ints = in_strides + s3(self.dq1) + s3(self.dq2) + sizes
            self.dq_constexprs = dict(
                BLOCK_M=cfg_dq.block_m, BLOCK_N=cfg_dq.block_n, D1_PAD=d1_pad, D2_PAD=d2_pad, CAUSAL=causal,
                TRAIN1=train1, TRAIN2=train2, IEEE1=ieee1, IEEE2=ieee2,
                USE_TMA=use_tma, FOLD="fold" in parts, HEAVY_FIRST=causal and "heavy" in parts,
                POLY=int("poly" in parts), **_launch_opts(parts))
            self.dq_tma = tma_descs(cfg_dq) if use_tma else None

    def launch(self, q1, k1, q2, k2, g, kl, lse1_bits, lse2_bits):
        """Allocate the gradient buffers and launch; returns them raw (dq1, dk1, dq2, dk2)."""
        device = self.device
        buffer = _stand_in_buffer if compiling_ahead() else _buffer  # (nothing launches there)
        dk1 = None if self.dk1 is None else buffer(self.dk1, device)
        dk2 = None if self.dk2 is None else buffer(self.dk2, device)
        dq1 = None if self.dq1 is None else buffer(self.dq1, device)
        dq2 = None if self.dq2 is None else buffer(self.dq2, device)
        dummy = kl  # placeholder pointer for outputs a launch does not write
        t_dk1, t_dk2 = (dk1 if dk1 is not None else dummy), (dk2 if dk2 is not None else dummy)
        t_dq1, t_dq2 = (dq1 if dq1 is not None else dummy), (dq2 if dq2 is not None else dummy)
        rows_in = (lse1_bits, lse2_bits, kl, g)
        # the launches' keys: the plan's token and the per-call tensors' alignment (computed once
        # for the three launches, so none is passed to the launcher to derive it again). The
        # gradient buffers are this call's own allocations, whose blocks the allocators align far
        # past 16 bytes (STREAMKL_FAST_LAUNCH_CHECK=1 derives every argument's alignment anyway)
        key = None if self.token is None else (self.token, tuple([t.data_ptr() % 16 == 0 for t in rows_in]))
        descs = {}
        if self.dk_tma is not None:
            d_q1, d_k1, d_q2, d_k2 = self.dk_tma
            descs = dict(Q1_DESC=d_q1(q1), K1_DESC=d_k1(k1), Q2_DESC=d_q2(q2), K2_DESC=d_k2(k2))
        if self.rows is not None:  # the per-row constants, once per row (_bwd._kl_bwd_rows_kernel)
            rows = buffer((self.rows, torch.float32, False), device)
            fast_launch(_bwd._kl_bwd_rows_kernel, self.rows_grid, rows_in + (rows,) + self.rows_args,
                        self.rows_constexprs, 4, 3, None if key is None else (key, rows.data_ptr() % 16 == 0))
            descs["ROWS_DESC"] = self.rows_desc(rows)
        if self.reduce_dq:
            descs.update(DQ1_DESC=self.dq1_desc(dq1) if dq1 is not None else None,
                         DQ2_DESC=self.dq2_desc(dq2) if dq2 is not None else None)
        side = self.side
        if side is not None:  # the dQ kernel beside the dK kernel (configs.bwd_streams): forked here
            side.wait_stream(torch.cuda.current_stream(device))
        fast_launch(_bwd._kl_bwd_dk_kernel, self.dk_grid,
                    (q1, k1, q2, k2, lse1_bits, lse2_bits, kl, g, t_dk1, t_dk2, t_dq1, t_dq2) + self.dk_ints,
                    self.dk_constexprs, self.cfg_dk.num_warps, self.cfg_dk.num_stages, key,
                    runtime=descs)
        if not self.fused:
            if side is None:
                self._launch_dq(q1, k1, q2, k2, g, kl, lse1_bits, lse2_bits, t_dq1, t_dq2, key)
            else:
                with torch.cuda.stream(side):
                    self._launch_dq(q1, k1, q2, k2, g, kl, lse1_bits, lse2_bits, t_dq1, t_dq2, key)
                torch.cuda.current_stream(device).wait_stream(side)  # joined before anything reads dQ or frees an input
        return dq1, dk1, dq2, dk2

    def _launch_dq(self, q1, k1, q2, k2, g, kl, lse1_bits, lse2_bits, t_dq1, t_dq2, key):
        descs = {}
        if self.dq_tma is not None:
            d_q1, d_k1, d_q2, d_k2 = self.dq_tma
            descs = dict(Q1_DESC=d_q1(q1), K1_DESC=d_k1(k1), Q2_DESC=d_q2(q2), K2_DESC=d_k2(k2))
        fast_launch(_bwd._kl_bwd_dq_kernel, self.dq_grid,
                    (q1, k1, q2, k2, lse1_bits, lse2_bits, kl, g, t_dq1, t_dq2) + self.dq_ints,
                    self.dq_constexprs, self.cfg_dq.num_warps, self.cfg_dq.num_stages, key,
                    runtime=descs)

    def __call__(self, q1, k1, q2, k2, g, kl, lse1_bits, lse2_bits, out_dtypes):
        """The four gradients in the inputs' dtypes (``out_dtypes``), None for a side not trained."""
        dq1, dk1, dq2, dk2 = self.launch(q1, k1, q2, k2, g, kl, lse1_bits, lse2_bits)
        if compiling_ahead():  # stand-ins: nothing to finish
            return None, None, None, None
        if self.sum1:  # per-query-head buffer: sum each group in order
            dk1 = dk1.view(self.finish_shapes[0]).sum(dim=2)
        if self.sum2:
            dk2 = dk2.view(self.finish_shapes[1]).sum(dim=2)
        # a conversion only where the buffer's dtype is not the input's (fp32 buffers, compute views)
        dq1_t, dk1_t, dq2_t, dk2_t = out_dtypes
        return (dq1 if dq1 is None or dq1.dtype == dq1_t else dq1.to(dq1_t),
                dk1 if dk1 is None or dk1.dtype == dk1_t else dk1.to(dk1_t),
                dq2 if dq2 is None or dq2.dtype == dq2_t else dq2.to(dq2_t),
                dk2 if dk2 is None or dk2.dtype == dk2_t else dk2.to(dk2_t))


def _buffer(spec, device):
    shape, dtype, zeroed = spec
    return torch.zeros(shape, dtype=dtype, device=device) if zeroed else fresh(shape, dtype, device)


def _stand_in_buffer(spec, device):
    return _stand_in(spec[1], device)


def backward(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, scale1, scale2,
             train1, train2, bwd_mode, deterministic, dims=None, binding=None):
    """(dq1, dk1, dq2, dk2), None for a side not trained. ``dims``: already checked inputs;
    ``binding``: the :class:`TrainingBinding` that :func:`training_forward` gave the forward."""
    plan = None if binding is None else binding.plan  # bound by an earlier backward of this binding
    if plan is None:  # (a binding is only made for inputs that are not empty)
        if dims is None:
            dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
        if is_empty(dims):
            return _empty_backward(dims, q1, k1, q2, k2, train1, train2)
    out_dtypes = (q1.dtype, k1.dtype, q2.dtype, k2.dtype)
    if interpreting():  # bf16 computed in fp32 there (compute_view)
        q1, k1, q2, k2 = (compute_view(t) for t in (q1, k1, q2, k2))
    if g.dtype != torch.float32:
        g = g.to(torch.float32)
    g = g.contiguous()
    kl, lse1_bits, lse2_bits = kl.contiguous(), lse1_bits.contiguous(), lse2_bits.contiguous()
    if plan is not None:
        return plan(q1, k1, q2, k2, g, kl, lse1_bits, lse2_bits, out_dtypes)
    sig = (binding.bwd_sig if binding is not None else
           _backward_signature(dims, causal, train1, train2, bwd_mode, deterministic, q1, k1, q2, k2))
    if not compiling_ahead():
        ahead = _BACKWARD_AHEAD.pop(sig, None)
        if ahead is not None:  # this signature's kernels are compiling (compile_backward_ahead)
            ahead.join()
    grads = _gluon_bwd_dispatch.try_gluon_backward(g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, causal, dims, train1,
                                                   train2, bwd_mode, deterministic, strides)
    if grads is not None:  # the Hopper kernel (_gluon_bwd), chosen by use_gluon_bwd (STREAMKL_BWD_BACKEND)
        return grads
    plan = _PLANS.get(sig)
    if plan is None:
        plan = _remember(sig, _backward_plan(sig, g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, dims, causal, train1,
                                             train2, bwd_mode, deterministic))
    if binding is not None and not compiling_ahead():
        binding.plan = plan
    return plan(q1, k1, q2, k2, g, kl, lse1_bits, lse2_bits, out_dtypes)


def _backward_plan(sig, g, q1, k1, q2, k2, kl, lse1_bits, lse2_bits, dims, causal, train1, train2, bwd_mode,
                   deterministic):
    """The backward's bound plan for this signature: the mode, then the dK and dQ configs
    (candidates pruned by shape, tuned where the tuner times them), bound as a keyed plan."""
    device = q1.device
    BH = dims.B * dims.H
    d1_pad, d2_pad = head_pad(dims.D1), head_pad(dims.D2)
    ieee1, ieee2 = q1.dtype == torch.float32, q2.dtype == torch.float32
    both = train1 and train2
    # TMA descriptors for every operand tile (and the fused dQ's reduce-add into its fp32
    # buffer, rows of D * 4 bytes: D % 4 == 0); not for a launch-bound backward (BWD_TMA_MIN_KEYS)
    tma = (all(tma_ok(t) for t in (q1, k1, q2, k2)) and dims.D1 % 4 == 0 and dims.D2 % 4 == 0
           and (interpreting() or dims.NK >= BWD_TMA_MIN_KEYS))
    mode = check_bwd_mode(bwd_mode)
    if deterministic:
        mode = "separate"  # no atomics on dQ
    sliced = tuning_slice(dims, causal)
    few = sliced is not None  # long problems: fewer candidates (each compiles), timed on a bounded slice
    if mode == "auto":  # new_kernels: the TMA variants are candidates (bwd_variant_candidates)
        mode = auto_bwd_mode(dims, n_sm(device), both, tma and not (ieee1 or ieee2))
        if mode == "separate":  # all keys in one tile of the fused dK kernel: that kernel alone
            first = bwd_variant_candidates(max(d1_pad, d2_pad), both, "dk", ieee1 or ieee2, tma, True, few, dims.NQ)[0]
            if one_tile_backward(dims, causal, first.block_n):
                mode = "fused"
    if not fused_fits(max(d1_pad, d2_pad)):
        mode = "separate"  # the fused tiles outgrow the shared memory above D = 128 (configs)
    fused = mode == "fused"
    side = None if fused else _side_stream(dims, device)
    dk_cands = bwd_variant_candidates(max(d1_pad, d2_pad), both, "dk", ieee1 or ieee2, tma, fused, few, dims.NQ)
    dq_cands = bwd_variant_candidates(max(d1_pad, d2_pad), both, "dq", ieee1 or ieee2, tma, fused, few, dims.NQ)
    on = dict(dims=dims, q1=q1, k1=k1, q2=q2, k2=k2, g=g, kl=kl, lse1_bits=lse1_bits, lse2_bits=lse2_bits)
    if sliced is not None and autotune_enabled():  # the problem the candidates are timed on
        on = _backward_proxy(sliced, dims, q1, k1, q2, k2, g, kl, lse1_bits, lse2_bits)

    def run(cfg_dk, cfg_dq):  # one candidate pair, bound without a key (the binder), on ``on``
        plan = _TritonBackward(mode, cfg_dk, cfg_dq, on["dims"], causal, train1, train2, deterministic,
                               on["q1"], on["k1"], on["q2"], on["k2"], side)
        plan.launch(on["q1"], on["k1"], on["q2"], on["k2"], on["g"], on["kl"], on["lse1_bits"], on["lse2_bits"])

    base_key = (dims.D1, dims.D2, q1.dtype, q2.dtype, causal, train1, train2,
                bucket(dims.NQ), bucket(dims.NK), bucket(BH), dims.group1 > 1, dims.group2 > 1,
                tma, bwd_variant())

    def tolerant(launch):
        def attempt(cfg):  # a new variant that fails to compile here is skipped by the tuner
            try:
                return launch(cfg)
            except Exception as exc:
                if cfg.variant == "ptr" or "OutOfResources" in type(exc).__name__:
                    raise
                raise UnusableConfig(f"{cfg}: {type(exc).__name__}: {exc}") from exc
        return attempt

    cfg_dk = pick(("bwd_dk", fused) + base_key, dk_cands, tolerant(lambda c: run(c, dq_cands[0])), device=device)
    cfg_dq = (dq_cands[0] if fused else
              pick(("bwd_dq",) + base_key, dq_cands, tolerant(lambda c: run(cfg_dk, c)), device=device))
    return _TritonBackward(mode, cfg_dk, cfg_dq, dims, causal, train1, train2, deterministic, q1, k1, q2, k2,
                           side, key=sig)
