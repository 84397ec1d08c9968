"""The forcing hook: the one documented way for a benchmark or a test to force a launch choice and to
see what ran, without assigning to private names.

    from streamkl_gpu._core.forcing import forcing

    with forcing(attention_fwd_variant="no_exp") as ran:   # a diagnostic variant (devtools.diagnostics)
        streamkl_gpu.attention_kl(q1, k1, q2, k2)
    kernel = ran.last("attention_fwd_sm90").kernel         # the compiled kernel (its SASS: kernel.asm["sass"])

Forcible choices (keyword arguments of :func:`forcing`; unknown names raise ``ValueError``):

- ``attention_fwd_variant``: a variant of the Hopper Gluon forward, one of
  ``streamkl_gpu.devtools.diagnostics.ATTENTION_FWD_VARIANTS``: a complete one
  (``ATTENTION_FWD_COMPLETE_VARIANTS``: ``"lazy_vote"`` and ``"lazy_max"``, what runs unforced
  without and with a causal mask, or ``"eager_max"``, the fold with the row maxima on every tile)
  or a diagnostic one (deliberately wrong results: they explain the kernel's time, they are never
  a candidate).
- ``attention_triton_fwd_order``: the order in which the portable Triton forward (fp32, split-K, head
  dims or GPUs without the Gluon kernel; packed sequences) launches a causal one-pass problem's query tiles:
  ``"heavy"`` (the default, also for None: the last tiles, which see the most keys, first) or
  ``"query"`` (tile 0 first). Bitwise the same results either way.
- ``attention_varlen_fwd_config``: a ``FwdConfig`` (``attention/configs.py``; ``fwd_candidates``
  lists the GPU's) the packed-sequence forward launches untimed instead of its pick, so a benchmark
  can time one tile; correct with any tile (the key tiles sum in another order).
- ``indexer_accumulate_parts``: a timing-only variant of the indexer's accumulating forward, one of
  ``streamkl_gpu.devtools.diagnostics.INDEXER_ACCUMULATE_PARTS`` (incomplete gradients).
- ``indexer_storing_forward_order``: the order in which the indexer's chunk design tries its
  storing forward's tiles (it takes the first that fits, untimed): ``"forward_rule"`` (the
  default, also for None: the forward's candidates with the plain forward's shape rule for the
  teacher family first, ``indexer/configs.py SHAPE_RULES``, the GQA kernel with the flags
  ``STORING_FORWARD_GQA_FLAGS``) or ``"candidates"`` (the list as it stands, no flags), either
  with ``+flag`` suffixes of the GQA kernel (``"forward_rule+wm"``: only those flags), so a
  benchmark can time the chunk design with another tile or form (correct either way).
- ``indexer_storing_forward_backend``: ``"gluon"`` (the Hopper Gluon kernel,
  ``indexer/gluon/fwd_sm90.py``; a ``ValueError`` says why where it does not apply) or
  ``"triton"``: the chunk design's storing forward, over ``STREAMKL_INDEXER_BACKEND`` and the
  default rule (``indexer/host.py use_gluon_store``); correct either way.
- ``indexer_chunk_gradient_order``: the order in which the chunk design tries its gradient
  kernel's tiles: ``"rule"`` (the default, also for None: ``CHUNK_GRADIENT_RULES``' tile first),
  ``"rows_first"`` (the row-major tiles first), ``"keys_first"`` (the keys-major tiles first,
  ``indexer/triton/chunk_grad_keys.py``) or ``"branch_first"`` (the rule's keys-major tile in its
  variant with the first product under a branch, timed and no faster): ``indexer/configs.py
  chunk_gradient_candidates``; correct either way.
- ``indexer_chunk_gradient_config``: an ``IndexerConfig`` the chunk design tries first for its
  gradient kernel (variant ``"keys"``: the keys-major kernel), so a benchmark can time one tile.
- ``indexer_teacher_lse_config``: the teacher-LSE pass (what a call without ``lse`` runs first,
  ``indexer/teacher_lse.py``): ``"gluon"`` (the Hopper Gluon pass, ``indexer/gluon/lse_sm90.py``; a
  ``ValueError`` says why where it does not apply), ``"triton"`` (the Triton pass, its own pick),
  or a Triton launch config launched untimed instead of the tuner's pick: a short name of one of
  the GPU's ``"lse"`` candidates (``indexer/configs.py lse_config_name``, e.g.
  ``"tiles_128x128_w4s3"`` or ``"qreg_128x64_w8s3"``; ``lse_config_names(dims)`` lists them; an
  unknown name raises ``ValueError`` with the list) or an ``IndexerConfig``; correct either way.
- ``indexer_chunk_gradient_parts``: a timing-only variant of the chunk design's keys-major gradient
  kernel, one of ``streamkl_gpu.devtools.diagnostics.INDEXER_CHUNK_GRADIENT_PARTS`` (``"no_dk"``:
  no dk_idx share per key tile; dk_idx comes out 0).

Every Gluon launch inside the block is recorded in the yielded :class:`Record` (kernel name, the
compiled kernel, its constexprs). Outside a ``forcing`` block nothing is recorded and nothing is
forced: the library's own choices run. Blocks nest; the innermost choice of a name wins.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

CHOICES = ("attention_fwd_variant", "attention_triton_fwd_order", "attention_varlen_fwd_config", "indexer_accumulate_parts",
           "indexer_storing_forward_order", "indexer_storing_forward_backend",
           "indexer_chunk_gradient_order", "indexer_chunk_gradient_config", "indexer_teacher_lse_config",
           "indexer_chunk_gradient_parts")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel's name, the compiled kernel, its constexpr arguments."""
    name: str
    kernel: Any
    meta: dict


@dataclasses.dataclass
class Record:
    """What ran inside a ``forcing`` block, in launch order."""
    launches: list = dataclasses.field(default_factory=list)

    def last(self, name: str) -> Launch:
        """The latest launch of kernel ``name`` (``LookupError`` if none ran)."""
        for launch in reversed(self.launches):
            if launch.name == name:
                return launch
        raise LookupError(f"no launch of {name!r} was recorded (ran: {sorted({x.name for x in self.launches})})")


_STACK: list = []  # (choices, record) of the open blocks, innermost last


@contextlib.contextmanager
def forcing(**choices):
    """Force the given choices inside the block and record its Gluon launches (see the module)."""
    unknown = sorted(set(choices) - set(CHOICES))
    if unknown:
        raise ValueError(f"forcing() knows {CHOICES}, got {unknown}")
    record = Record()
    _STACK.append((choices, record))
    try:
        yield record
    finally:
        _STACK.remove((choices, record))


def forced(name: str, default: Optional[Any] = None):
    """The innermost forced value of choice ``name``, or ``default`` (one list walk when forcing)."""
    if not _STACK:  # outside every block (what a call's signature asks on every call)
        return default
    for choices, _ in reversed(_STACK):
        if name in choices:
            return choices[name]
    return default


def record(name: str, kernel, **meta) -> None:
    """Note a launch in every open block's record (nothing when no block is open)."""
    if _STACK:
        launch = Launch(name, kernel, meta)
        for _, rec in _STACK:
            rec.launches.append(launch)
