"""A conformance suite for anyone's attention-KL kernel (``check_attention_kl``).

The same battery, float64 reference and tolerance rule that gate streamkl's own kernels
(``streamkl verify``), pointed at *your* callable::

    from streamkl_ref.testing import assert_attention_kl_conforms
    assert_attention_kl_conforms(my_kl, device="cuda", dtypes=("float32", "bfloat16"))

``fn(q1, k1, q2, k2, *, causal, scale1, scale2)`` receives torch tensors on ``device`` in the
case's dtype (``requires_grad`` set when ``grads=True``) and returns ``KL(P1 ‖ P2)`` per query
row (``returns="rows"``), or its sum or mean over all rows. Conventions (docs/api.md): layout
``[B, H, N, D]`` (``layout="bnhd"``: ``[B, N, H, D]``, rows returned as ``[B, N_Q, H]``); GQA
query head ``h`` reads key head ``h // (H / H_K)``; ``scale=None`` means ``1/sqrt(D)``;
``causal`` is bottom-right aligned (``causal_align="top-left"`` for SDPA's ``is_causal``: see
:func:`check_attention_kl` for how the suite handles ``N_Q != N_K`` then); results in nats.

The tolerance rule (:func:`tolerance`), FlashAttention's: an output passes when its error against
the float64 reference is at most ``C_TOL`` times the error that the same math, done densely in
PyTorch at the inputs' own precision (:func:`attention_kl_torch`), makes against that reference,
plus a floor per dtype. Errors are relative Frobenius norms (:func:`relative_error`).

This module imports torch only inside its functions: ``import streamkl_ref`` (and this module)
works without it; calling a check needs it.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np

__all__ = [
    "C_TOL", "FLOOR", "ZERO_GRAD_TOL", "tolerance", "relative_error",
    "KL_ROUNDING_ULPS", "ROW_STAT_EPS", "kl_row_floor", "indexer_row_floor", "kl_error_and_tolerance", "case_generator",
    "Case", "ATTENTION_CASES", "GPU_ATTENTION_CASES", "LARGE_ATTENTION_CASES", "CASE_SETS", "attention_cases",
    "Row", "Report", "check_attention_kl", "assert_attention_kl_conforms",
    "attention_kl_torch", "attention_kl_torch_chunked", "causal_mask",
    "SUPPORT_KEYS",
    "IndexerCase", "INDEXER_CASES", "GPU_INDEXER_CASES", "LARGE_INDEXER_CASES", "indexer_cases", "INDEXER_SUPPORT_KEYS",
    "check_indexer_kl", "assert_indexer_kl_conforms", "indexer_kl_torch",
]

# ---------------------------------------------------------------------------------------------
# The tolerance rule (one home: streamkl verify, tests/_gpu_helpers.py and users' checks use it)
# ---------------------------------------------------------------------------------------------
C_TOL = 3.0
FLOOR = {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3, "float64": 1e-12}
# where the exact gradient is 0: a few fp32 roundings of O(1) terms
ZERO_GRAD_TOL = 1e-5
TOLERANCE_RULE = f"error <= {C_TOL} * error(same-precision dense PyTorch vs float64) + floor[dtype] {FLOOR}"


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in FLOOR:
        raise ValueError(f"dtype must be one of {sorted(FLOOR)}, got {dtype!r}")
    return name


def tolerance(same_precision_error: float, dtype, *, ratio: float = C_TOL, floor: Optional[float] = None) -> float:
    """The project's tolerance: ``ratio * same_precision_error + floor[dtype]``.

    ``same_precision_error``: the relative error against the float64 reference of the same math
    done densely at the inputs' precision (:func:`attention_kl_torch` with
    ``compute_dtype=dtype``); ``dtype``: a torch dtype or its name (``"float32"``, ``"float16"``,
    ``"bfloat16"``, ``"float64"``). The floor covers what the dense computation happens to get
    exactly right (rounding errors of a good kernel are not bounded by those of another order).
    """
    base = float(same_precision_error)
    if not base >= 0.0:  # NaN or negative
        raise ValueError(f"same_precision_error must be a non-negative number, got {same_precision_error!r}")
    return ratio * base + (FLOOR[_dtype_name(dtype)] if floor is None else float(floor))


# The KL near 0. A kernel forms each row's KL as a difference of terms the size of the logits
# (acc/l1 ~ E_P1[S1 - S2], LSE1, LSE2), kept in float32 (the row statistics of every kernel, for
# half inputs too): its rounding is absolute, about u * (|LSE1| + |LSE2| + |acc/l1|), however
# small the KL. Where the KL is 0 (one key) or tiny, no relative rule holds; each row gets this
# absolute allowance (docs/conformance.md, "The tolerance rule", derives it).
ROW_STAT_EPS = {"float32": 2.0 ** -24, "float16": 2.0 ** -24, "bfloat16": 2.0 ** -24, "float64": 2.0 ** -53}
KL_ROUNDING_ULPS = 8.0


def kl_row_floor(lse1, lse2, kl, dtype) -> np.ndarray:
    """Per-row absolute allowance of a KL row: ``KL_ROUNDING_ULPS * u * (1 + |LSE1| + |LSE2| +
    |KL + LSE1 - LSE2|)``, ``u`` the unit roundoff of float32 row statistics (float64's for
    float64); the last term is ``|acc/l1|``, the ``1`` the relative rounding of the sums ``l_t``
    (``ln(l (1 + d)) = ln l + d``). Rows that see no key (``LSE = -inf``) get 0: their KL is
    exactly 0."""
    lse1, lse2, kl = (np.asarray(_to_numpy(x), dtype=np.float64) for x in (lse1, lse2, kl))
    with np.errstate(invalid="ignore"):
        mag = 1.0 + np.abs(lse1) + np.abs(lse2) + np.abs(kl + lse1 - lse2)
    return np.where(np.isfinite(lse1) & np.isfinite(lse2), KL_ROUNDING_ULPS * ROW_STAT_EPS[_dtype_name(dtype)] * mag,
                    0.0)


def kl_error_and_tolerance(got, ref, same, row_floor, dtype) -> tuple:
    """``(error, tolerance)`` of KL rows: both on the scale ``S = max(‖ref‖, ‖row_floor‖)``, so
    the row passes iff ``‖got − ref‖ <= C_TOL ‖same − ref‖ + floor[dtype]·S + ‖row_floor‖``
    (``same``: the same-precision dense result). With ``‖ref‖`` well above the allowance this is
    :func:`tolerance` on relative errors plus ``‖row_floor‖/‖ref‖``; where the reference is 0 it
    is the absolute allowance alone."""
    a, r, s = (np.asarray(_to_numpy(x), dtype=np.float64) for x in (got, ref, same))
    if a.shape != r.shape:
        raise ValueError(f"shapes differ: {a.shape} vs reference {r.shape}")
    f = float(np.linalg.norm(np.asarray(row_floor, dtype=np.float64)))
    scale = max(float(np.linalg.norm(r)), f, 1e-300)
    err = math.inf if not np.isfinite(a).all() else float(np.linalg.norm(a - r)) / scale
    same_err = float(np.linalg.norm(s - r)) / scale if np.isfinite(s).all() else math.inf
    return err, tolerance(same_err, dtype) + f / scale


def relative_error(x, ref) -> float:
    """Relative Frobenius error ``‖x − ref‖ / ‖ref‖`` in float64; ``inf`` if ``x`` is not finite.

    A (numerically) all-zero reference is compared on a ``1e-12 · sqrt(n)`` scale, so 0/0 and
    tiny/tiny do not read as failures.
    """
    a = _to_numpy(x)
    r = np.asarray(_to_numpy(ref), dtype=np.float64)
    if a.shape != r.shape:
        raise ValueError(f"shapes differ: {a.shape} vs reference {r.shape}")
    if not np.isfinite(a).all():
        return math.inf
    denom = max(float(np.linalg.norm(r)), 1e-12 * math.sqrt(max(r.size, 1)))
    return float(np.linalg.norm(a - r)) / denom


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        return x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# The dense PyTorch formula (what everyone writes; the same-precision baseline of the rule)
# ---------------------------------------------------------------------------------------------
def causal_mask(n_q: int, n_k: int, device=None):
    """Bottom-right causal mask, ``True`` where key j is visible to query i: ``j <= i + (N_K - N_Q)``."""
    import torch

    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + (n_k - n_q)


def _expand_kv(k, h: int):
    # GQA: query head h reads key head h // (H // H_K)
    return k.repeat_interleave(h // k.shape[1], dim=1) if k.shape[1] != h else k


def attention_kl_torch(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None,
                       compute_dtype=None):
    """KL(P1 || P2) per query row, ``[B, H, N_Q]`` in ``compute_dtype``, fully materialised.

    Plain PyTorch, differentiable through autograd. Scores are formed in ``compute_dtype``
    (default: torch.float32) from the inputs cast to it. Masked entries are -inf on both sides
    and contribute exactly 0; rows with no visible key give 0. (NaN isolation: the forward of a
    row never sees an invisible key's NaN, but autograd's matmul backward multiplies the masked
    zeros by it, so gradients are not isolated; see docs/conformance.md.)
    """
    import torch

    from ._checks import check_flag, check_inputs

    causal = check_flag(causal, "causal")

    dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    compute_dtype = torch.float32 if compute_dtype is None else compute_dtype
    return _torch_rows(q1, k1, q2, k2, dims, causal, compute_dtype, 0, dims.NQ)


def _torch_rows(q1, k1, q2, k2, dims, causal, compute_dtype, row_offset, n_q_total):
    import torch

    H = dims.H
    s1 = dims.scale1 * (q1.to(compute_dtype) @ _expand_kv(k1, H).to(compute_dtype).transpose(-1, -2))
    s2 = dims.scale2 * (q2.to(compute_dtype) @ _expand_kv(k2, H).to(compute_dtype).transpose(-1, -2))
    empty = None
    if causal:
        n_q = q1.shape[2]
        i = torch.arange(row_offset, row_offset + n_q, device=q1.device)[:, None]
        j = torch.arange(dims.NK, device=q1.device)[None, :]
        visible = j <= i + (dims.NK - n_q_total)
        # rows with no visible key: keep them unmasked for the arithmetic (no all -inf row, so no
        # NaN, also not in autograd) and set their KL to the convention's 0 below
        empty = ~visible.any(-1)
        visible = visible | empty[:, None]
        s1 = s1.masked_fill(~visible, float("-inf"))
        s2 = s2.masked_fill(~visible, float("-inf"))
    logp1 = torch.log_softmax(s1, dim=-1)
    logp2 = torch.log_softmax(s2, dim=-1)
    p1 = logp1.exp()
    # 0 * log(0/.) = 0: the log-ratio of masked entries (p1 == 0) is replaced by 0 before the
    # product, so neither the value nor its autograd ever touches -inf - -inf
    log_ratio = torch.where(p1 > 0, logp1 - logp2, torch.zeros((), dtype=p1.dtype, device=p1.device))
    kl = (p1 * log_ratio).sum(-1)
    if empty is not None:
        kl = kl.masked_fill(empty, 0.0)
    return kl


def attention_kl_torch_chunked(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None,
                               compute_dtype=None, chunk=1024):
    """The same, over query chunks of ``chunk`` rows (what users do today to avoid OOM)."""
    import torch

    from ._checks import check_flag, check_inputs

    causal = check_flag(causal, "causal")

    dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    compute_dtype = torch.float32 if compute_dtype is None else compute_dtype
    out = []
    for start in range(0, dims.NQ, chunk):
        sl = slice(start, start + chunk)
        out.append(_torch_rows(q1[:, :, sl], k1, q2[:, :, sl], k2, dims, causal, compute_dtype,
                               start, dims.NQ))
    return torch.cat(out, dim=-1)


# ---------------------------------------------------------------------------------------------
# The battery
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One attention-KL problem of the battery (inputs: standard normal × ``amplitude``).

    ``plant``: ``None``, ``"keys"`` (NaN in key ``plant_at`` of ``k1``, +inf in key
    ``plant_at + 3`` of ``k2``) or ``"queries"`` (NaN in query row ``plant_at`` of ``q1`` and
    ``q2``); planted cases also hand the tensors over as views into NaN-filled buffers wider in
    N and D, so a load that ignores its mask reads NaN. Only the outputs the planted values
    cannot reach are compared (the isolation contract of docs/api.md).
    ``split_k``: used by ``streamkl verify`` for streamkl's own kernels only.
    """

    name: str
    B: int
    H: int
    HK1: int
    HK2: int
    NQ: int
    NK: int
    D1: int
    D2: int
    causal: bool = False
    scale1: Optional[float] = None
    scale2: Optional[float] = None
    split_k: Optional[int] = None
    amplitude: float = 1.0
    plant: Optional[str] = None
    plant_at: int = 0
    quick: bool = False
    why: str = ""  # what the case is there to catch

    @property
    def shapes(self) -> dict:
        return {"q1": [self.B, self.H, self.NQ, self.D1], "k1": [self.B, self.HK1, self.NK, self.D1],
                "q2": [self.B, self.H, self.NQ, self.D2], "k2": [self.B, self.HK2, self.NK, self.D2]}

    def features(self) -> dict:
        """What an implementation must support to be checked on this case."""
        return {"gqa": self.HK1 != self.H or self.HK2 != self.H, "d1_ne_d2": self.D1 != self.D2,
                "nq_ne_nk": self.NQ != self.NK, "causal": self.causal,
                "head_dims": sorted({self.D1, self.D2})}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shapes"] = self.shapes
        return d


# Tiny on purpose (CPU, Triton interpreter): ragged against every tile size, N = 1, GQA on each
# side, D1 != D2, causal with N_Q < N_K and N_Q > N_K, large logits, NaN planting.
ATTENTION_CASES = (
    Case("ragged", 1, 2, 2, 2, 21, 37, 16, 16, quick=True,
         why="N not a multiple of any tile: a mask off by one on the last tile"),
    Case("gqa1_d1>d2", 1, 4, 2, 4, 19, 23, 32, 16, quick=True,
         why="GQA on side 1 (h // (H/H_K), not h % H_K); D1 != D2"),
    Case("gqa2_d1<d2", 1, 4, 4, 1, 17, 29, 16, 24, why="MQA on side 2; D1 < D2"),
    Case("causal_nq<nk", 1, 2, 1, 2, 13, 40, 16, 16, causal=True, quick=True,
         why="bottom-right causal (chunked prefill / decode): top-left differs here"),
    Case("causal_nq>nk", 1, 2, 2, 1, 40, 13, 16, 16, causal=True,
         why="the first N_Q - N_K rows see no key: KL 0, gradient 0"),
    Case("causal_square", 2, 2, 2, 2, 24, 24, 16, 16, causal=True,
         why="causal, N_Q == N_K: the one case top-left and bottom-right agree"),
    Case("n=1", 2, 2, 2, 2, 1, 1, 16, 16, why="one key: KL exactly 0, gradient exactly 0"),
    Case("decode_splitk", 1, 2, 1, 1, 3, 70, 16, 16, split_k=3, why="few queries, many keys"),
    Case("large_logits", 1, 2, 2, 2, 18, 33, 16, 16, scale1=4.0, scale2=3.0,
         why="logits ~ +-60: LSE ~ 60 needs fp32 (bf16 spacing there is 0.25)"),
    Case("nan_keys", 1, 2, 1, 2, 24, 24, 16, 16, causal=True, plant="keys", plant_at=10, quick=True,
         why="NaN/inf in keys a row cannot see, and past N_K and D: never reach that row (no 0*NaN)"),
    Case("nan_queries", 1, 2, 2, 1, 24, 24, 16, 16, causal=True, plant="queries", plant_at=16,
         why="NaN in a query row never reaches dk of keys that row cannot see"),
    # streaming: several key tiles at every tile size up to 128 (3 tiles of 128, 5 of 64, 19 of
    # 16), so the running maxima rise after the first tile in most rows
    Case("tiles_300", 1, 2, 1, 2, 16, 300, 16, 16,
         why="300 keys, several tiles at every block up to 128: a rescale of acc, l1 or l2 skipped "
             "or by the other side's factor, or a running max not written back"),
    Case("tiles_causal_large", 1, 2, 2, 1, 12, 280, 16, 16, causal=True, scale1=4.0, scale2=3.0,
         why="causal across tiles with logits ~ +-60: the rescale factors are far from 1 and the "
             "frontier falls inside the last tile"),
)
GPU_ATTENTION_CASES = ATTENTION_CASES + (
    Case("big_d128_d64", 2, 4, 2, 1, 300, 500, 128, 64,
         why="head dims 128 and 64, hundreds of rows and keys: many query and key tiles"),
    Case("big_causal", 2, 4, 4, 2, 500, 300, 128, 64, causal=True,
         why="causal with N_Q > N_K at size: empty rows, the frontier through many tiles"),
    Case("d80_d96_causal", 1, 4, 2, 4, 257, 389, 80, 96, causal=True,
         why="head dims that are not powers of two (padded tiles), causal, ragged"),
    Case("decode_splitk_1x4096", 1, 8, 2, 8, 1, 4096, 128, 128,
         why="decode: one query against 4096 keys (split-K, long accumulation)"),
)
LARGE_ATTENTION_CASES = GPU_ATTENTION_CASES[len(ATTENTION_CASES):]
CASE_SETS = ("default", "large", "all")
PLANT_PAD = (3, 5)  # planted cases: buffers this much longer in N and wider in D, NaN-filled


def case_generator(seed: int, case):
    """The torch CPU generator of one case's inputs: seeded by ``seed`` and the case's name, so a
    case gets the same inputs whichever other cases run with it (a failing case re-run alone, with
    ``cases=[that_case]``, sees exactly the inputs it failed on)."""
    import zlib

    import torch

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(case.name.encode())) % 2 ** 63)


def _case_set(which, device, small, large) -> tuple:
    if which not in CASE_SETS:
        raise ValueError(f"cases must be one of {CASE_SETS} or a sequence of cases, got {which!r}")
    if which == "large":
        return large
    if which == "all" or str(device).startswith("cuda"):
        return small + large
    return small


def attention_cases(device: str = "cpu", quick: bool = False, planted: bool = True, which: str = "default") -> tuple:
    """The battery for a device. ``which="default"``: the small cases on CPU (a few hundred keys at
    most: cheap for a dense PyTorch formula and the Triton interpreter), plus the large ones
    (:data:`LARGE_ATTENTION_CASES`) on a GPU; ``"large"``: the large ones only; ``"all"``: both,
    on any device."""
    cases = _case_set(which, device, ATTENTION_CASES, LARGE_ATTENTION_CASES)
    if quick:
        cases = tuple(c for c in cases if c.quick)
    if not planted:
        cases = tuple(c for c in cases if c.plant is None)
    return cases


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
@dataclass
class Row:
    case: str
    dtype: str
    quantity: str
    error: float
    tolerance: float
    status: str  # "pass" | "fail" | "skipped"
    why: str = ""  # what went wrong (or why skipped)
    hint: str = ""  # for a failure: what the symptom usually means and the option that fixes it

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass
class Report:
    """The outcome of a check: ``passed`` is True iff no row failed and at least one passed."""

    rows: list = field(default_factory=list)
    cases: dict = field(default_factory=dict)  # name -> Case.to_dict()
    options: dict = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def failed(self) -> list:
        return [r for r in self.rows if r.status == "fail"]

    @property
    def skipped(self) -> list:
        return [r for r in self.rows if r.status == "skipped"]

    @property
    def passed(self) -> bool:
        return not self.failed and any(r.status == "pass" for r in self.rows)

    def summary(self) -> str:
        n_pass = sum(r.status == "pass" for r in self.rows)
        return f"{n_pass} passed, {len(self.failed)} failed, {len(self.skipped)} skipped"

    def purpose(self, case_name: str) -> str:
        """What a case is there to catch (its ``why``; '' if the report does not know the case)."""
        case = self.cases.get(case_name)
        return (case.get("why") or "") if isinstance(case, dict) else ""

    def table(self, rows: Optional[Iterable[Row]] = None) -> str:
        """Fixed-width text table, one line per row, ``why`` last. A failing row's ``why`` also
        carries its hint and, after ``case:``, what the case is there to catch; an error or
        tolerance that does not apply (a call that raised, a skipped case) reads ``-``."""
        rows = list(self.rows if rows is None else rows)
        if not rows:
            return "(no rows)"
        w_case = max(4, *(len(r.case) for r in rows))
        w_q = max(8, *(len(r.quantity) for r in rows))
        lines = [f"{'case':<{w_case}}  {'dtype':<8}  {'quantity':<{w_q}}  {'error':>9}  {'tolerance':>9}  status   why"]
        hinted = set()  # a hint is printed once per case and dtype
        for r in rows:
            err = "-" if math.isnan(r.error) else f"{r.error:9.2e}"
            tol = "-" if math.isnan(r.tolerance) else f"{r.tolerance:9.2e}"
            why = r.why
            if r.status == "fail":
                purpose = self.purpose(r.case)
                hint = f"hint: {r.hint}" if r.hint and (r.case, r.dtype, r.hint) not in hinted else ""
                hinted.add((r.case, r.dtype, r.hint))
                why = "; ".join(x for x in (r.why, hint, f"case: {purpose}" if purpose else "") if x)
            lines.append(f"{r.case:<{w_case}}  {r.dtype:<8}  {r.quantity:<{w_q}}  {err:>9}  {tol:>9}  "
                         f"{r.status:<7}  {why}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        def num(x):
            return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))

        return {
            "passed": self.passed,
            "summary": self.summary(),
            "tolerance_rule": TOLERANCE_RULE,
            "options": self.options,
            "cases": self.cases,
            "rows": [{**asdict(r), "error": num(r.error), "tolerance": num(r.tolerance),
                      "pass": r.status == "pass"} for r in self.rows],
            "elapsed_s": self.elapsed_s,
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        """Standard JSON (non-finite errors as the strings ``"inf"``, ``"nan"``)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def __str__(self) -> str:
        return self.table() + "\n\n" + self.summary()


# ---------------------------------------------------------------------------------------------
# Claims
# ---------------------------------------------------------------------------------------------
GRAD_NAMES = ("dq1", "dk1", "dq2", "dk2")
INPUT_NAMES = ("q1", "k1", "q2", "k2")
SUPPORT_KEYS = {
    "gqa": "bool: H_K != H on either side (default True)",
    "d1_ne_d2": "bool: head dims of the two sides differ (default True)",
    "nq_ne_nk": "bool: N_Q != N_K (default True)",
    "causal": "bool: causal masking (default True)",
    "head_dims": "iterable of ints: the head dims it takes (default: any)",
    "dtypes": "iterable of dtype names: the input dtypes it takes (default: any)",
    "grad_inputs": "subset of ('q1','k1','q2','k2'): inputs it differentiates (default all four; "
                   "('q2','k2') for a frozen teacher)",
    "nan_isolation": "True (default), 'forward' (forward only) or False: NaN/inf in keys a row "
                     "cannot see never reach it",
}


def _check_supports(supports) -> dict:
    s = {"gqa": True, "d1_ne_d2": True, "nq_ne_nk": True, "causal": True, "head_dims": None,
         "dtypes": None, "grad_inputs": INPUT_NAMES, "nan_isolation": True}
    if supports is None:
        return s
    if not isinstance(supports, dict):
        raise ValueError(f"supports must be a dict or None, got {type(supports).__name__}")
    for key, value in supports.items():
        if key not in s:
            raise ValueError(f"supports: unknown claim {key!r}; known: {sorted(SUPPORT_KEYS)}")
        if key in ("head_dims", "dtypes") and value is not None:
            value = tuple(value)
        if key == "grad_inputs":
            value = tuple(value)
            bad = [v for v in value if v not in INPUT_NAMES]
            if bad:
                raise ValueError(f"supports['grad_inputs'] must name inputs of {INPUT_NAMES}, got {bad}")
        if key == "nan_isolation" and value not in (True, False, "forward"):
            raise ValueError(f"supports['nan_isolation'] must be True, False or 'forward', got {value!r}")
        s[key] = value
    return s


def _unsupported(case: Case, dtype: str, s: dict) -> str:
    """Why a case lies outside the claims ('' if it does not)."""
    f = case.features()
    for key, label in (("gqa", "GQA"), ("d1_ne_d2", "D1 != D2"), ("nq_ne_nk", "N_Q != N_K"),
                       ("causal", "causal")):
        if f[key] and not s[key]:
            return f"outside supports: {label}"
    if s["head_dims"] is not None and not set(f["head_dims"]) <= set(s["head_dims"]):
        return f"outside supports: head dims {f['head_dims']}"
    if s["dtypes"] is not None and dtype not in s["dtypes"]:
        return f"outside supports: dtype {dtype}"
    if case.plant is not None and s["nan_isolation"] is False:
        return "outside supports: NaN isolation not claimed"
    return ""


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------
LAYOUTS = ("bhnd", "bnhd")
CAUSAL_ALIGNS = ("bottom-right", "top-left")
RETURNS = ("rows", "sum", "mean")


def _plant_masks(case: Case):
    """(rows_ok [NQ] bool, keys_ok [NK] bool): the query rows / keys the planted values cannot reach."""
    NQ, NK, off = case.NQ, case.NK, case.NK - case.NQ
    rows_ok = np.ones(NQ, bool)
    keys_ok = np.zeros(NK, bool)  # dk is compared only where stated
    if case.plant == "keys":
        # rows i with i + off < plant_at see none of the planted keys (plant_at, plant_at + 3)
        rows_ok = np.arange(NQ) + off < case.plant_at
    elif case.plant == "queries":
        rows_ok = np.arange(NQ) != case.plant_at
        keys_ok = np.arange(NK) > case.plant_at + off  # keys the planted row cannot see
    return rows_ok, keys_ok


def _check_adapters(layout, causal_align, returns, dtypes):
    """The adapter arguments of the check functions, validated; returns the dtype names."""
    import torch

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if causal_align not in CAUSAL_ALIGNS:
        raise ValueError(f"causal_align must be one of {CAUSAL_ALIGNS}, got {causal_align!r}")
    if returns not in RETURNS:
        raise ValueError(f"returns must be one of {RETURNS}, got {returns!r}")
    if isinstance(dtypes, (str, torch.dtype)):
        dtypes = (dtypes,)
    return [_dtype_name(d) for d in dtypes]


def check_attention_kl(fn: Callable, *, device="cpu", dtypes=("float32",), grads=True, quick=False,
                       layout="bhnd", causal_align="bottom-right", returns="rows", supports=None,
                       cases=None, seed=0) -> Report:
    """Run the battery against ``fn(q1, k1, q2, k2, *, causal, scale1, scale2)``; return a :class:`Report`.

    Args:
        fn: the implementation under test (see the module docstring for its contract).
        device: where its inputs live (``"cpu"``, ``"cuda"``, ...); the battery has larger cases
            on ``cuda``.
        dtypes: input dtypes to run (names or torch dtypes).
        grads: also check ``dq1, dk1, dq2, dk2`` (by ``backward`` with a random upstream
            gradient per row for ``returns="rows"``, ``1`` for a sum, ``1/n`` for a mean).
        quick: the quick subset of the battery.
        layout: ``"bhnd"`` (``[B, H, N, D]``) or ``"bnhd"`` (flash-attn's ``[B, N, H, D]``).
        causal_align: what ``causal=True`` means to ``fn``: ``"bottom-right"`` (streamkl's,
            FlashAttention's) or ``"top-left"`` (SDPA's ``is_causal``). With ``"top-left"`` a
            causal case with ``N_Q == N_K`` is sent as it is (both masks agree); one with
            ``N_Q < N_K`` is translated: the queries are front-padded with ``N_K − N_Q`` zero
            rows (top-left on ``N_K × N_K`` then equals bottom-right on the real rows; zero query
            rows give ``KL = 0`` and contribute nothing to any gradient) and only the real rows
            are compared; one with ``N_Q > N_K`` cannot be expressed and is reported skipped.
        returns: ``"rows"`` (``[B, H, N_Q]``; ``[B, N_Q, H]`` for ``layout="bnhd"``), ``"sum"`` or
            ``"mean"`` (a scalar over all ``B·H·N_Q`` rows).
        supports: the claims of ``fn`` (keys and meanings in :data:`SUPPORT_KEYS`); cases and
            quantities outside them are reported ``skipped``, never ``pass``.
        cases: ``"default"`` (the battery for ``device``: :data:`ATTENTION_CASES` on CPU, with
            :data:`LARGE_ATTENTION_CASES` added on ``cuda``), ``"large"`` (the large cases only),
            ``"all"`` (both, on any device), or your own sequence of :class:`Case`.
            ``quick=True`` keeps the quick ones of the chosen set.
        seed: of the inputs (a non-negative int). Each case draws its inputs from its own torch
            CPU generator, seeded by ``seed`` and the case's name (:func:`case_generator`): the
            same inputs for every dtype, and whichever other cases run. A correct kernel passes
            at every seed.

    Rows that pass compare the output (``kl``) and each gradient with the float64 reference
    (``streamkl_ref.attention_kl``/``attention_kl_grad``) under :func:`tolerance`. A failing row's
    ``why`` says what went wrong; an exception in ``fn`` fails the case with its message.
    """
    import torch

    dnames = _check_adapters(layout, causal_align, returns, dtypes)
    claims = _check_supports(supports)
    if cases is None or isinstance(cases, str):
        cases = attention_cases(device, quick, which=cases or "default")
    cases = tuple(cases)
    report = Report(options={
        "device": str(device), "dtypes": dnames, "grads": bool(grads), "quick": bool(quick),
        "layout": layout, "causal_align": causal_align, "returns": returns, "seed": seed,
        "supports": {k: (list(v) if isinstance(v, tuple) else v) for k, v in claims.items()},
        "fn": getattr(fn, "__qualname__", repr(fn)),
    })
    t0 = time.time()
    for case in cases:
        report.cases[case.name] = case.to_dict()
        gen = case_generator(seed, case)
        base = [case.amplitude * torch.randn(*shape, generator=gen, dtype=torch.float64)
                for shape in case.shapes.values()]
        g_rows = torch.randn(case.B, case.H, case.NQ, generator=gen, dtype=torch.float64)
        for dname in dnames:
            _run_case(fn, case, dname, base, g_rows, report, device=device, grads=grads,
                      layout=layout, causal_align=causal_align, returns=returns, claims=claims)
    _keep_causal_hints_where_alignment_explains(report, cases)
    report.elapsed_s = time.time() - t0
    return report


def _check_reduction(add, case, returns, got, red, same_red, red_floor, dname):
    """One row for a scalar ("sum"/"mean") result: skipped for planted cases (the reduction mixes
    the planted rows in), else its error against the reference under the tolerance rule."""
    if case.plant is not None:
        add(f"kl {returns}", math.nan, math.nan, "skipped",
            f"a {returns} mixes the planted rows in: NaN isolation of the forward is checked with returns='rows'")
        return
    err, tol = kl_error_and_tolerance(got, red, same_red, red_floor, dname)
    add(f"kl {returns}", err, tol, "pass" if err <= tol else "fail",
        "" if err <= tol else f"got {got.item():.9g}, reference {float(red):.9g}")


def _run_case(fn, case, dname, base, g_rows, report, *, device, grads, layout, causal_align, returns, claims):
    import torch

    import streamkl_ref

    def add(quantity, error, tol, status, why="", hint=""):
        row = Row(case.name, dname, quantity, float(error), float(tol), status, why, hint)
        if status == "fail" and not hint:
            row.hint = _hint(case, row, claims, causal_align)
        report.rows.append(row)

    why = _unsupported(case, dname, claims)
    if why:
        add("(all)", math.nan, math.nan, "skipped", why)
        return
    translate = False
    if case.causal and causal_align == "top-left" and case.NQ != case.NK:
        if case.NQ > case.NK:
            add("(all)", math.nan, math.nan, "skipped",
                "top-left causal cannot express bottom-right with N_Q > N_K")
            return
        translate = True
    dtype = getattr(torch, dname)
    xs = [x.to(dtype) for x in base]  # the exact inputs fn sees (rounded to its dtype)
    x64 = [x.double().numpy() for x in xs]
    kw = dict(causal=case.causal, scale1=case.scale1, scale2=case.scale2)
    n_rows = case.B * case.H * case.NQ
    g = {"rows": g_rows, "sum": torch.ones_like(g_rows), "mean": torch.full_like(g_rows, 1.0 / n_rows)}[returns]
    rows_ok, keys_ok = _plant_masks(case) if case.plant else (np.ones(case.NQ, bool), None)

    # float64 reference (on the clean inputs: planted values are invisible to what is compared)
    ref_kl, ref_lse1, ref_lse2 = streamkl_ref.attention_kl(*x64, return_lse=True, **kw)
    row_floor = kl_row_floor(ref_lse1, ref_lse2, ref_kl, dname)
    ref_grad = streamkl_ref.attention_kl_grad(*x64, g.numpy(), **kw) if grads else None
    # the same math at the inputs' precision: the tolerance scale
    want_grad = set(claims["grad_inputs"]) if grads else set()
    same = [x.clone().requires_grad_(n in want_grad) for x, n in zip(xs, INPUT_NAMES)]
    same_kl = attention_kl_torch(*same, compute_dtype=dtype, **kw)
    if want_grad:
        same_kl.backward(g.to(same_kl.dtype))

    # ---- call fn
    leaves, views = _user_inputs(xs, case, layout, translate, device, want_grad)
    call_kw = dict(kw)
    try:
        with _planted_quiet(case):
            out = fn(*views, **call_kw)
    except Exception as exc:  # noqa: BLE001 (reported as the case's failure)
        add("(call)", math.nan, math.nan, "fail", _raised("fn", exc))
        return
    if not isinstance(out, torch.Tensor):
        add("(call)", math.nan, math.nan, "fail", f"fn returned {type(out).__name__}, not a torch tensor")
        return
    rows_sel = (slice(None), slice(None), rows_ok)  # on [B, H, N_Q] (NumPy)

    # ---- forward
    if returns == "rows":
        got = out
        want_shape = (case.B, case.H, case.NQ + (case.NK - case.NQ if translate else 0))
        if layout == "bnhd":
            want_shape = (want_shape[0], want_shape[2], want_shape[1])
        if tuple(out.shape) != want_shape:
            add("kl", math.nan, math.nan, "fail", f"returned shape {list(out.shape)}, expected {list(want_shape)} "
                                              f"({'[B, N_Q, H]' if layout == 'bnhd' else '[B, H, N_Q]'})",
                _shape_hint(out.shape, want_shape, layout))
            return
        if layout == "bnhd":
            got = got.transpose(1, 2)
        if translate:
            got = got[:, :, case.NK - case.NQ:]
        got = _to_numpy(got)
        err, tol = kl_error_and_tolerance(got[rows_sel], ref_kl[rows_sel], _to_numpy(same_kl)[rows_sel],
                                          row_floor[rows_sel], dname)
        qname = "kl" if case.plant is None else f"kl of rows {_ranges(rows_ok)} (unreached)"
        add(qname, err, tol, "pass" if err <= tol else "fail", _why_kl(got, ref_kl, rows_ok, err, tol))
        if case.causal and case.NQ > case.NK:
            empty = got[:, :, : case.NQ - case.NK]
            ok = bool((empty == 0).all())
            add("kl of empty rows == 0", 0.0 if ok else 1.0, 0.0, "pass" if ok else "fail",
                "" if ok else f"rows 0-{case.NQ - case.NK - 1} see no key; got max |KL| "
                              f"{np.abs(empty).max():.3e}")
    else:
        if out.numel() != 1:
            add(returns, math.nan, math.nan, "fail", f"returns={returns!r} but fn returned shape {list(out.shape)}",
                "fn returns rows: returns='rows' (the default; streamkl verify: drop --returns)")
            return
        red = ref_kl.sum() if returns == "sum" else ref_kl.mean()
        same_red = same_kl.sum() if returns == "sum" else same_kl.mean()
        red_floor = row_floor.sum() if returns == "sum" else row_floor.mean()
        got = out.reshape(())
        if translate and returns == "mean":  # fn averaged over N_K rows, N_K - N_Q of them zero
            got = got * (case.NK / case.NQ)
        _check_reduction(add, case, returns, got, red, same_red, red_floor, dname)

    if not grads:
        return
    if case.plant is not None and claims["nan_isolation"] == "forward":
        add("(gradients)", math.nan, math.nan, "skipped", "outside supports: NaN isolation claimed for the forward only")
        return
    # ---- backward
    try:
        if returns == "rows":
            gu = g.to(out.dtype)
            if translate:
                gu = torch.cat([torch.zeros(case.B, case.H, case.NK - case.NQ, dtype=gu.dtype), gu], dim=-1)
            if layout == "bnhd":
                gu = gu.transpose(1, 2)
            with _planted_quiet(case):
                out.backward(gu.to(out.device))
        else:
            scale = (case.NQ / case.NK) if (translate and returns == "mean") else 1.0
            with _planted_quiet(case):
                (out.reshape(()) * scale).backward()
    except Exception as exc:  # noqa: BLE001
        add("(backward)", math.nan, math.nan, "fail", _raised("backward", exc))
        return
    grads_got = _user_grads(leaves, case, layout, translate)
    for name, inp, gname in zip(INPUT_NAMES, same, GRAD_NAMES):
        if name not in want_grad:
            add(gname, math.nan, math.nan, "skipped", f"outside supports: grad_inputs {list(claims['grad_inputs'])}")
            continue
        got_g = grads_got[name]
        ref_g = ref_grad[gname]
        same_g = inp.grad
        if got_g is None:
            add(gname, math.inf, 0.0, "fail", f"no gradient reached {name}")
            continue
        sel, label = _grad_selection(case, name, rows_ok, keys_ok)
        if sel is None:
            continue
        if case.plant is not None:
            gname_q = f"{gname} of {label} (unreached)"
        else:
            gname_q = gname
        ref_sel, got_sel, same_sel = ref_g[sel], _to_numpy(got_g)[sel], _to_numpy(same_g)[sel]
        if not np.any(ref_sel):
            # exactly zero gradient (one key per row): relative error is undefined
            err = float(np.max(np.abs(got_sel))) if got_sel.size else 0.0
            ok = err <= ZERO_GRAD_TOL
            add(f"{gname_q} max|.|", err, ZERO_GRAD_TOL, "pass" if ok else "fail",
                "reference gradient is exactly 0" + ("" if ok else "; got non-zero"))
            continue
        err = relative_error(got_sel, ref_sel)
        tol = tolerance(relative_error(same_sel, ref_sel), dname)
        add(gname_q, err, tol, "pass" if err <= tol else "fail",
            "" if err <= tol else ("not finite" if math.isinf(err) else ""))


@contextlib.contextmanager
def _planted_quiet(case):
    """A planted case computes with NaN and inf on purpose: NumPy's RuntimeWarnings from it (the
    Triton interpreter runs kernels in NumPy) are expected, not news; what reaches the compared
    rows is judged by the report. Other cases keep their warnings."""
    if case.plant is None:
        yield
        return
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _raised(what: str, exc: BaseException) -> str:
    """``fn raised TypeError: ... (at file.py:12 in my_kl)``: the exception and its innermost frame."""
    import traceback

    text = f"{what} raised {type(exc).__name__}: {str(exc)[:300]}"
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        f = frames[-1]
        text += f" (at {f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name})"
    return text


def _shape_hint(shape, want, layout) -> str:
    shape, want = tuple(shape), tuple(want)
    if len(shape) == 0 or (len(shape) == 1 and shape[0] == 1):
        return "fn returns a scalar: returns='sum' or returns='mean' (streamkl verify: --returns sum|mean)"
    if len(shape) == len(want) == 3 and shape == (want[0], want[2], want[1]):
        other = "bhnd" if layout == "bnhd" else "bnhd"
        return f"the rows are in the other order: layout={other!r} (streamkl verify: --layout {other})"
    return ""


def _hint(case, row, claims, causal_align) -> str:
    """What a failing row's symptom usually means, and the option that expresses it ('' if none)."""
    not_finite = "not finite" in row.why
    if case.plant is not None and not_finite:
        if row.quantity.startswith("kl"):
            return ("a value this row cannot see reached it (0 * NaN); not isolating NaN at all: "
                    "supports={'nan_isolation': False}")
        if claims.get("nan_isolation") is True:
            return ("NaN isolated in the forward only (autograd's matmul backward multiplies masked zeros "
                    "by it): supports={'nan_isolation': 'forward'}, --supports '{\"nan_isolation\": \"forward\"}'")
    if not_finite and case.causal and case.NQ > case.NK:
        return "a row that sees no key must give KL 0 and gradient 0 (an all -inf row gives NaN)"
    if case.causal and case.NQ != case.NK and row.quantity.startswith(("kl", "d")):
        if causal_align == "bottom-right":
            return ("causal is bottom-right aligned (j <= i + N_K - N_Q); for a top-left fn (SDPA's "
                    "is_causal): causal_align='top-left', --causal-align top-left")
        return "with causal_align='top-left' the queries are front-padded with N_K - N_Q zero rows"
    return ""


def _keep_causal_hints_where_alignment_explains(report, cases) -> None:
    """The causal-alignment hint stays only when the failures are confined to causal cases with
    N_Q != N_K (where the two alignments differ): a fn that fails elsewhere has another bug."""
    by_name = {c.name: c for c in cases}
    differs = {n for n, c in by_name.items() if c.causal and c.NQ != c.NK}
    if any(r.case not in differs for r in report.failed):
        for r in report.failed:
            if r.case in differs and r.hint.startswith(("causal is bottom-right", "with causal_align")):
                r.hint = ""


def _grad_selection(case, name, rows_ok, keys_ok):
    """Index of the gradient entries to compare, and a label (None: nothing comparable)."""
    if case.plant is None:
        return (Ellipsis,), ""
    if name.startswith("q"):
        return (slice(None), slice(None), rows_ok), f"rows {_ranges(rows_ok)}"
    if case.plant == "queries" and keys_ok.any():
        return (slice(None), slice(None), keys_ok), f"keys {_ranges(keys_ok)}"
    return None, ""  # a NaN key reaches every dk through the rows that see it


def _ranges(mask) -> str:
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return "none"
    parts, start, prev = [], idx[0], idx[0]
    for i in list(idx[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def _why_kl(got, ref, rows_ok, err, tol) -> str:
    if err <= tol:
        return ""
    a = _to_numpy(got)[..., rows_ok]
    r = np.asarray(ref)[..., rows_ok]
    bad = ~np.isfinite(a)
    if bad.any():
        return f"{int(bad.sum())} of {a.size} rows not finite"
    d = np.abs(a - r)
    worst = np.unravel_index(int(np.argmax(d)), d.shape)
    row = np.flatnonzero(rows_ok)[worst[-1]]
    return f"worst [b={worst[0]}, h={worst[1]}, row={row}]: got {a[worst]:.6g}, reference {r[worst]:.6g}"


def _user_inputs(xs, case, layout, translate, device, want_grad):
    """Leaf tensors (what gradients accumulate on) and the views handed to fn, in fn's layout."""
    import torch

    pad_n, pad_d = PLANT_PAD
    leaves, views = {}, []
    for name, x in zip(INPUT_NAMES, xs):
        x = x.clone()
        if translate and name.startswith("q"):  # front-pad N_K - N_Q zero query rows
            x = torch.cat([torch.zeros(x.shape[0], x.shape[1], case.NK - case.NQ, x.shape[3], dtype=x.dtype), x], 2)
        if case.plant == "keys" and name == "k1":
            x[:, :, case.plant_at] = float("nan")
        if case.plant == "keys" and name == "k2":
            x[:, :, case.plant_at + 3] = float("inf")
        if case.plant == "queries" and name.startswith("q"):
            x[:, :, case.plant_at] = float("nan")
        if layout == "bnhd":
            x = x.transpose(1, 2)
        if case.plant is not None:  # a view into a NaN-filled buffer longer in N and wider in D
            n_axis = 2 if layout == "bhnd" else 1
            shape = list(x.shape)
            shape[n_axis] += pad_n
            shape[3] += pad_d
            buf = torch.full(shape, float("nan"), dtype=x.dtype)
            idx = [slice(None)] * 4
            idx[n_axis] = slice(0, x.shape[n_axis])
            idx[3] = slice(0, x.shape[3])
            buf[tuple(idx)] = x
            buf = buf.to(device).requires_grad_(name in want_grad)
            leaves[name] = (buf, tuple(idx))
            views.append(buf[tuple(idx)])
        else:
            leaf = x.contiguous().to(device).requires_grad_(name in want_grad)
            leaves[name] = (leaf, (Ellipsis,))
            views.append(leaf)
    return leaves, views


def _user_grads(leaves, case, layout, translate):
    """Gradients back in ``[B, H, N, D]`` on the real rows (None where none reached a leaf)."""
    out = {}
    for name, (leaf, idx) in leaves.items():
        gr = leaf.grad
        if gr is None:
            out[name] = None
            continue
        gr = gr[idx].detach().to("cpu")
        if layout == "bnhd":
            gr = gr.transpose(1, 2)
        if translate and name.startswith("q"):
            gr = gr[:, :, case.NK - case.NQ:]
        out[name] = gr
    return out


def assert_attention_kl_conforms(fn: Callable, **options) -> Report:
    """:func:`check_attention_kl`, raising ``AssertionError`` with a table of the failing rows.

    Also raises when nothing passed (every case skipped: the claims leave nothing to check).
    Returns the report when it passes.
    """
    report = check_attention_kl(fn, **options)
    _raise_unless_passed(report, "attention KL")
    return report


def _raise_unless_passed(report: Report, what: str) -> None:
    if report.passed:
        return
    if report.failed:
        raise AssertionError(f"{what} does not conform: {report.summary()}\n{report.table(report.failed)}")
    raise AssertionError(f"{what}: no row passed ({report.summary()}): the claims in `supports` leave nothing to check")


# =============================================================================================
# The indexer loss (sparse-attention indexer training, DSA warm-up form; docs/math.md)
# =============================================================================================
def indexer_kl_torch(q, k, q_idx, k_idx, weights, *, causal=False, scale=None, relu=True, compute_dtype=None):
    """``[B, N_Q]`` indexer KL ``KL(p || softmax(I))`` in ``compute_dtype`` (default float32),
    every score matrix materialised: teacher scores per head, softmax, head mean; indexer scores,
    ReLU, weights, log-softmax; KL. Products are formed from the inputs cast to ``compute_dtype``.
    Rows with no visible key give 0. Differentiable through autograd (in ``q_idx, k_idx,
    weights``; the teacher too, if its tensors require grad)."""
    import torch

    from ._checks import check_flag, check_indexer_inputs

    causal, relu = check_flag(causal, "causal"), check_flag(relu, "relu")

    dims = check_indexer_inputs(q, k, q_idx, k_idx, weights, scale=scale)
    cd = torch.float32 if compute_dtype is None else compute_dtype
    kt = k.to(cd).repeat_interleave(dims.H // dims.HK, dim=1)
    ki = k_idx.to(cd).repeat_interleave(dims.HI // dims.HKI, dim=1)
    i = torch.arange(dims.NQ, device=q.device)[:, None]
    j = torch.arange(dims.NK, device=q.device)[None, :]
    visible = (j <= i + (dims.NK - dims.NQ)) if causal else torch.ones_like(i * j, dtype=torch.bool)
    empty = ~visible.any(-1)
    visible = visible | empty[:, None]  # an empty row is computed unmasked, then set to 0
    s = (q.to(cd) @ kt.transpose(-1, -2)) * dims.scale
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).mean(dim=1)  # [B, N_Q, N_K]
    a = q_idx.to(cd) @ ki.transpose(-1, -2)
    act = torch.relu(a) if relu else a
    logits = (weights.to(cd)[..., None] * act).sum(dim=1)
    log_q = torch.log_softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    # 0 log 0 = 0: masked / underflowed entries are selected away before the product
    pos = p > 0
    log_p = torch.log(torch.where(pos, p, torch.ones((), dtype=p.dtype, device=p.device)))
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    kl = torch.where(pos, p * (log_p - torch.where(visible, log_q, zero)), zero).sum(-1)
    return kl.masked_fill(empty, 0.0)


@dataclass(frozen=True)
class IndexerCase:
    """One indexer-loss problem: teacher ``q [B,H,NQ,D]``, ``k [B,HK,NK,D]``; indexer
    ``q_idx [B,HI,NQ,DI]``, ``k_idx [B,HKI,NK,DI]``, ``weights [B,HI,NQ]`` (standard normal ×
    ``amplitude``; weights × ``weight_amplitude``). ``plant`` as in :class:`Case` (keys: NaN in
    teacher key ``plant_at``, +inf in indexer key ``plant_at + 3``; queries: NaN in row
    ``plant_at`` of ``q`` and ``q_idx``)."""

    name: str
    B: int
    H: int
    HK: int
    HI: int
    HKI: int
    NQ: int
    NK: int
    D: int
    DI: int
    causal: bool = False
    scale: Optional[float] = None
    relu: bool = True
    amplitude: float = 1.0
    weight_amplitude: float = 1.0
    plant: Optional[str] = None
    plant_at: int = 0
    quick: bool = False
    why: str = ""

    @property
    def shapes(self) -> dict:
        return {"q": [self.B, self.H, self.NQ, self.D], "k": [self.B, self.HK, self.NK, self.D],
                "q_idx": [self.B, self.HI, self.NQ, self.DI], "k_idx": [self.B, self.HKI, self.NK, self.DI],
                "weights": [self.B, self.HI, self.NQ]}

    def features(self) -> dict:
        return {"gqa": self.HK != self.H or self.HKI != self.HI, "nq_ne_nk": self.NQ != self.NK,
                "causal": self.causal, "head_dims": sorted({self.D, self.DI}), "no_relu": not self.relu}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shapes"] = self.shapes
        return d


INDEXER_CASES = (
    IndexerCase("ragged", 1, 4, 1, 2, 1, 21, 37, 16, 8, quick=True,
                why="N not a multiple of any tile; MQA teacher, MQA indexer"),
    IndexerCase("gqa", 1, 4, 2, 4, 2, 19, 23, 32, 16, quick=True,
                why="GQA on both sides (h // (H/H_K), not h % H_K)"),
    IndexerCase("causal_nq<nk", 1, 2, 1, 2, 1, 13, 40, 16, 8, causal=True, quick=True,
                why="bottom-right causal: top-left differs here"),
    IndexerCase("causal_nq>nk", 1, 2, 2, 2, 2, 40, 13, 16, 8, causal=True,
                why="the first N_Q - N_K rows see no key: KL 0, gradient 0"),
    IndexerCase("causal_square", 2, 2, 1, 2, 1, 24, 24, 16, 8, causal=True, why="causal, N_Q == N_K"),
    IndexerCase("no_relu", 1, 2, 1, 2, 1, 17, 29, 16, 8, relu=False, why="relu=False: I is linear in a"),
    IndexerCase("n=1", 2, 2, 1, 2, 1, 1, 1, 16, 8, why="one key: KL exactly 0, gradient exactly 0"),
    IndexerCase("large_logits", 1, 2, 1, 2, 1, 18, 33, 16, 8, scale=4.0, weight_amplitude=6.0,
                why="teacher logits ~ +-60, indexer logits in the tens"),
    IndexerCase("nan_keys", 1, 2, 1, 2, 1, 24, 24, 16, 8, causal=True, plant="keys", plant_at=10, quick=True,
                why="NaN/inf in keys a row cannot see, and past N_K and D: never reach that row"),
    IndexerCase("nan_queries", 1, 2, 1, 2, 1, 24, 24, 16, 8, causal=True, plant="queries", plant_at=16,
                why="NaN in a query row never reaches dk_idx of keys that row cannot see"),
    # streaming: several key tiles at every tile size up to 128
    IndexerCase("tiles_300", 1, 2, 1, 2, 1, 16, 300, 16, 8,
                why="300 keys, several tiles at every block up to 128: a rescale of the teacher's or "
                    "the indexer's running sums skipped, or a running max not written back"),
    IndexerCase("tiles_causal_large", 1, 2, 1, 2, 1, 12, 280, 16, 8, causal=True, scale=4.0,
                weight_amplitude=6.0,
                why="causal across tiles with large logits: rescale factors far from 1, the frontier "
                    "inside the last tile"),
)
GPU_INDEXER_CASES = INDEXER_CASES + (
    IndexerCase("big_mla_576", 1, 16, 1, 8, 1, 300, 500, 576, 128, causal=True, scale=192 ** -0.5,
                why="an absorbed-MLA teacher (D = 576, its own scale), causal, hundreds of rows and keys"),
    IndexerCase("big_gqa", 2, 8, 2, 4, 1, 257, 389, 128, 64,
                why="GQA teacher, MQA indexer, head dims 128 and 64 at size: many tiles"),
)
LARGE_INDEXER_CASES = GPU_INDEXER_CASES[len(INDEXER_CASES):]
INDEXER_INPUTS = ("q", "k", "q_idx", "k_idx", "weights")
INDEXER_GRADS = {"q_idx": "dq_idx", "k_idx": "dk_idx", "weights": "dweights"}


def indexer_cases(device: str = "cpu", quick: bool = False, planted: bool = True, which: str = "default") -> tuple:
    """The indexer battery for a device; ``which`` as in :func:`attention_cases`."""
    cases = _case_set(which, device, INDEXER_CASES, LARGE_INDEXER_CASES)
    if quick:
        cases = tuple(c for c in cases if c.quick)
    if not planted:
        cases = tuple(c for c in cases if c.plant is None)
    return cases


INDEXER_SUPPORT_KEYS = {
    "gqa": "bool: H_K != H or H_KI != H_I (default True)",
    "nq_ne_nk": "bool: N_Q != N_K (default True)",
    "causal": "bool: causal masking (default True)",
    "no_relu": "bool: relu=False (default True)",
    "head_dims": "iterable of ints: the head dims D and D_I it takes (default: any)",
    "dtypes": "iterable of dtype names (default: any)",
    "grad_inputs": "subset of ('q_idx','k_idx','weights') (default all three)",
    "nan_isolation": "True (default), 'forward' or False",
}


def _check_indexer_supports(supports) -> dict:
    s = {"gqa": True, "nq_ne_nk": True, "causal": True, "no_relu": True, "head_dims": None, "dtypes": None,
         "grad_inputs": tuple(INDEXER_GRADS), "nan_isolation": True}
    if supports is None:
        return s
    if not isinstance(supports, dict):
        raise ValueError(f"supports must be a dict or None, got {type(supports).__name__}")
    for key, value in supports.items():
        if key not in s:
            raise ValueError(f"supports: unknown claim {key!r}; known: {sorted(INDEXER_SUPPORT_KEYS)}")
        if key in ("head_dims", "dtypes", "grad_inputs") and value is not None:
            value = tuple(value)
        if key == "grad_inputs" and any(v not in INDEXER_GRADS for v in value):
            raise ValueError(f"supports['grad_inputs'] must name inputs of {tuple(INDEXER_GRADS)}, got {list(value)}")
        if key == "nan_isolation" and value not in (True, False, "forward"):
            raise ValueError(f"supports['nan_isolation'] must be True, False or 'forward', got {value!r}")
        s[key] = value
    return s


def _indexer_unsupported(case: IndexerCase, dtype: str, s: dict) -> str:
    f = case.features()
    for key, label in (("gqa", "GQA"), ("nq_ne_nk", "N_Q != N_K"), ("causal", "causal"), ("no_relu", "relu=False")):
        if f[key] and not s[key]:
            return f"outside supports: {label}"
    if s["head_dims"] is not None and not set(f["head_dims"]) <= set(s["head_dims"]):
        return f"outside supports: head dims {f['head_dims']}"
    if s["dtypes"] is not None and dtype not in s["dtypes"]:
        return f"outside supports: dtype {dtype}"
    if case.plant is not None and s["nan_isolation"] is False:
        return "outside supports: NaN isolation not claimed"
    return ""


def check_indexer_kl(fn: Callable, *, device="cpu", dtypes=("float32",), grads=True, quick=False,
                     layout="bhnd", causal_align="bottom-right", returns="rows", supports=None,
                     cases=None, seed=0) -> Report:
    """Run the indexer battery against ``fn(q, k, q_idx, k_idx, weights, *, causal, scale, relu)``.

    ``fn`` returns the per-row loss ``[B, N_Q]`` (``returns="rows"``), its sum, or its mean over
    the rows with at least one visible key (``"mean"``: Megatron's reduction). The teacher
    (``q``, ``k``) is a constant: it gets no ``requires_grad``; ``q_idx``, ``k_idx``, ``weights``
    do when ``grads=True``. ``layout="bnhd"``: the four 4-D tensors as ``[B, N, H, D]`` and
    ``weights`` as ``[B, N_Q, H_I]``. ``causal_align``, ``supports`` (keys:
    :data:`INDEXER_SUPPORT_KEYS`), ``cases`` and ``seed`` as in :func:`check_attention_kl` (with
    ``"top-left"``, a causal case with ``N_Q < N_K`` is sent with ``N_K − N_Q`` zero query rows and
    zero weights in front: the student's logits there are 0 and the teacher's uniform, so those
    rows give KL 0 and no gradient). The reference is ``streamkl_ref.indexer_kl`` /
    ``indexer_kl_grad`` in float64; the tolerance :func:`tolerance` against
    :func:`indexer_kl_torch` at the inputs' precision.
    """
    import torch

    dnames = _check_adapters(layout, causal_align, returns, dtypes)
    claims = _check_indexer_supports(supports)
    if cases is None or isinstance(cases, str):
        cases = indexer_cases(device, quick, which=cases or "default")
    cases = tuple(cases)
    report = Report(options={
        "loss": "indexer", "device": str(device), "dtypes": dnames, "grads": bool(grads), "quick": bool(quick),
        "layout": layout, "causal_align": causal_align, "returns": returns, "seed": seed,
        "supports": {k: (list(v) if isinstance(v, tuple) else v) for k, v in claims.items()},
        "fn": getattr(fn, "__qualname__", repr(fn)),
    })
    t0 = time.time()
    for case in cases:
        report.cases[case.name] = case.to_dict()
        gen = case_generator(seed, case)
        base = []
        for name, shape in case.shapes.items():
            amp = case.weight_amplitude if name == "weights" else case.amplitude
            base.append(amp * torch.randn(*shape, generator=gen, dtype=torch.float64))
        g_rows = torch.randn(case.B, case.NQ, generator=gen, dtype=torch.float64)
        for dname in dnames:
            _run_indexer_case(fn, case, dname, base, g_rows, report, device=device, grads=grads, layout=layout,
                              causal_align=causal_align, returns=returns, claims=claims)
    _keep_causal_hints_where_alignment_explains(report, cases)
    report.elapsed_s = time.time() - t0
    return report


def _run_indexer_case(fn, case, dname, base, g_rows, report, *, device, grads, layout, causal_align, returns, claims):
    import torch

    import streamkl_ref

    def add(quantity, error, tol, status, why="", hint=""):
        row = Row(case.name, dname, quantity, float(error), float(tol), status, why, hint)
        if status == "fail" and not hint:
            row.hint = _hint(case, row, claims, causal_align)
        report.rows.append(row)

    why = _indexer_unsupported(case, dname, claims)
    if why:
        add("(all)", math.nan, math.nan, "skipped", why)
        return
    translate = case.causal and causal_align == "top-left" and case.NQ != case.NK
    if translate and case.NQ > case.NK:
        add("(all)", math.nan, math.nan, "skipped", "top-left causal cannot express bottom-right with N_Q > N_K")
        return
    pad_rows = case.NK - case.NQ if translate else 0
    dtype = getattr(torch, dname)
    xs = [x.to(dtype) for x in base]
    x64 = [x.double().numpy() for x in xs]
    kw = dict(causal=case.causal, scale=case.scale, relu=case.relu)
    off = case.NK - case.NQ
    n_keyed = case.B * int(np.sum(np.minimum(np.arange(case.NQ) + off + 1, case.NK) > 0)) if case.causal \
        else case.B * case.NQ  # rows with at least one visible key (Megatron's mean)
    g = {"rows": g_rows, "sum": torch.ones_like(g_rows),
         "mean": torch.full_like(g_rows, 1.0 / max(n_keyed, 1))}[returns]
    rows_ok, keys_ok = _plant_masks(case) if case.plant else (np.ones(case.NQ, bool), None)

    ref_kl, ref_lse_idx, ref_lse_teacher = streamkl_ref.indexer_kl(*x64, return_lse=True, **kw)
    row_floor = indexer_row_floor(ref_lse_idx, ref_lse_teacher, ref_kl, case, dname)
    want_grad = set(claims["grad_inputs"]) if grads else set()
    ref_grad = streamkl_ref.indexer_kl_grad(*x64, g.numpy(), **kw) if want_grad else None
    same = [x.clone().requires_grad_(n in want_grad) for x, n in zip(xs, INDEXER_INPUTS)]
    same_kl = indexer_kl_torch(*same, compute_dtype=dtype, **kw)
    if want_grad:
        same_kl.backward(g.to(same_kl.dtype))

    leaves, views = {}, []
    pad_n, pad_d = PLANT_PAD
    for name, x in zip(INDEXER_INPUTS, xs):
        x = x.clone()
        row_input = name in ("q", "q_idx", "weights")
        if pad_rows and row_input:  # front-pad zero query rows (and zero weights) for top-left
            x = torch.cat([torch.zeros(*x.shape[:2], pad_rows, *x.shape[3:], dtype=x.dtype), x], 2)
        if case.plant == "keys" and name == "k":
            x[:, :, case.plant_at] = float("nan")
        if case.plant == "keys" and name == "k_idx":
            x[:, :, case.plant_at + 3] = float("inf")
        if case.plant == "queries" and name in ("q", "q_idx"):
            x[:, :, pad_rows + case.plant_at] = float("nan")
        if layout == "bnhd":
            x = x.transpose(1, 2)
        requires = name in want_grad
        if case.plant is not None:  # a view into a NaN-filled buffer longer in N (and wider in D)
            n_axis = 2 if layout == "bhnd" else 1
            shape = list(x.shape)
            shape[n_axis] += pad_n
            idx = [slice(None)] * x.ndim
            idx[n_axis] = slice(0, x.shape[n_axis])
            if x.ndim == 4:
                shape[3] += pad_d
                idx[3] = slice(0, x.shape[3])
            buf = torch.full(shape, float("nan"), dtype=x.dtype)
            buf[tuple(idx)] = x
            buf = buf.to(device).requires_grad_(requires)
            leaves[name] = (buf, tuple(idx))
            views.append(buf[tuple(idx)])
        else:
            leaf = x.contiguous().to(device).requires_grad_(requires)
            leaves[name] = (leaf, (Ellipsis,))
            views.append(leaf)
    try:
        with _planted_quiet(case):
            out = fn(*views, **kw)
    except Exception as exc:  # noqa: BLE001
        add("(call)", math.nan, math.nan, "fail", _raised("fn", exc))
        return
    if not isinstance(out, torch.Tensor):
        add("(call)", math.nan, math.nan, "fail", f"fn returned {type(out).__name__}, not a torch tensor")
        return
    rows_sel = (slice(None), rows_ok)
    if returns == "rows":
        want_shape = (case.B, case.NQ + pad_rows)
        if tuple(out.shape) != want_shape:
            add("kl", math.nan, math.nan, "fail", f"returned shape {list(out.shape)}, expected {list(want_shape)} "
                                              "([B, N_Q])", _shape_hint(out.shape, want_shape, layout))
            return
        got = _to_numpy(out)[:, pad_rows:]
        err, tol = kl_error_and_tolerance(got[rows_sel], ref_kl[rows_sel], _to_numpy(same_kl)[rows_sel],
                                          row_floor[rows_sel], dname)
        qname = "kl" if case.plant is None else f"kl of rows {_ranges(rows_ok)} (unreached)"
        add(qname, err, tol, "pass" if err <= tol else "fail", _why_indexer(got, ref_kl, rows_ok, err, tol))
        if case.causal and case.NQ > case.NK:
            empty = got[:, : case.NQ - case.NK]
            ok = bool((empty == 0).all())
            add("kl of empty rows == 0", 0.0 if ok else 1.0, 0.0, "pass" if ok else "fail",
                "" if ok else f"rows 0-{case.NQ - case.NK - 1} see no key; got max |KL| {np.abs(empty).max():.3e}")
    else:
        if out.numel() != 1:
            add(returns, math.nan, math.nan, "fail", f"returns={returns!r} but fn returned shape {list(out.shape)}",
                "fn returns rows: returns='rows' (the default; streamkl verify: drop --returns)")
            return
        red = ref_kl.sum() if returns == "sum" else ref_kl.sum() / max(n_keyed, 1)
        same_red = same_kl.sum() if returns == "sum" else same_kl.sum() / max(n_keyed, 1)
        red_floor = row_floor.sum() if returns == "sum" else row_floor.sum() / max(n_keyed, 1)
        got = out.reshape(())
        if pad_rows and returns == "mean":  # fn averaged over the padded rows too (all have keys)
            got = got * ((case.NQ + pad_rows) * case.B / max(n_keyed, 1))
        _check_reduction(add, case, returns, got, red, same_red, red_floor, dname)
    if not grads:
        return
    if case.plant is not None and claims["nan_isolation"] == "forward":
        add("(gradients)", math.nan, math.nan, "skipped", "outside supports: NaN isolation claimed for the forward only")
        return
    try:
        if returns == "rows":
            gu = g.to(out.dtype)
            if pad_rows:
                gu = torch.cat([torch.zeros(case.B, pad_rows, dtype=gu.dtype), gu], dim=-1)
            with _planted_quiet(case):
                out.backward(gu.to(out.device))
        else:
            scale = (max(n_keyed, 1) / ((case.NQ + pad_rows) * case.B)) if (pad_rows and returns == "mean") else 1.0
            with _planted_quiet(case):
                (out.reshape(()) * scale).backward()
    except Exception as exc:  # noqa: BLE001
        add("(backward)", math.nan, math.nan, "fail", _raised("backward", exc))
        return
    for name, inp in zip(INDEXER_INPUTS, same):
        if name not in INDEXER_GRADS:
            continue
        gname = INDEXER_GRADS[name]
        if name not in want_grad:
            add(gname, math.nan, math.nan, "skipped", f"outside supports: grad_inputs {list(claims['grad_inputs'])}")
            continue
        leaf, idx = leaves[name]
        if leaf.grad is None:
            add(gname, math.inf, 0.0, "fail", f"no gradient reached {name}")
            continue
        gr = leaf.grad[idx].detach().to("cpu")
        if layout == "bnhd":
            gr = gr.transpose(1, 2)
        if pad_rows and name in ("q_idx", "weights"):
            gr = gr[:, :, pad_rows:]
        if case.plant is None:
            sel, label = (Ellipsis,), gname
        elif name == "k_idx":
            if case.plant != "queries" or not keys_ok.any():
                continue  # a planted key reaches every dk_idx through the rows that see it
            sel, label = (slice(None), slice(None), keys_ok), f"{gname} of keys {_ranges(keys_ok)} (unreached)"
        else:
            sel, label = (slice(None), slice(None), rows_ok), f"{gname} of rows {_ranges(rows_ok)} (unreached)"
        ref_sel, got_sel, same_sel = ref_grad[gname][sel], _to_numpy(gr)[sel], _to_numpy(inp.grad)[sel]
        if not np.any(ref_sel):
            err = float(np.max(np.abs(got_sel))) if got_sel.size else 0.0
            ok = err <= ZERO_GRAD_TOL
            add(f"{label} max|.|", err, ZERO_GRAD_TOL, "pass" if ok else "fail",
                "reference gradient is exactly 0" + ("" if ok else "; got non-zero"))
            continue
        err = relative_error(got_sel, ref_sel)
        tol = tolerance(relative_error(same_sel, ref_sel), dname)
        add(label, err, tol, "pass" if err <= tol else "fail", "" if err <= tol else ("not finite" if math.isinf(err) else ""))


def indexer_row_floor(lse_idx, lse_teacher, kl, case, dtype) -> np.ndarray:
    """Per-row absolute allowance of an indexer KL row (as :func:`kl_row_floor`): the loss is
    ``sum p ln p − sum p I + LSE_I``, its terms bounded by ``|LSE_I|``, the teacher's
    ``max_h |LSE_h|`` (inside ``ln p``), ``|E_p I| <= |LSE_I| + KL + ln N_K``; hence
    ``KL_ROUNDING_ULPS * u * (1 + 2|LSE_I| + max_h |LSE_h| + KL + ln N_K)``, 0 for rows with no key."""
    lse_idx, lse_t, kl = (np.asarray(x, dtype=np.float64) for x in (lse_idx, lse_teacher, kl))
    with np.errstate(invalid="ignore"):
        mag = 1.0 + 2.0 * np.abs(lse_idx) + np.abs(lse_t).max(axis=1) + np.abs(kl) + math.log(max(case.NK, 1))
    seen = np.isfinite(lse_idx) & np.isfinite(lse_t).all(axis=1)
    return np.where(seen, KL_ROUNDING_ULPS * ROW_STAT_EPS[_dtype_name(dtype)] * mag, 0.0)


def _why_indexer(got, ref, rows_ok, err, tol) -> str:
    if err <= tol:
        return ""
    a, r = got[:, rows_ok], np.asarray(ref)[:, rows_ok]
    bad = ~np.isfinite(a)
    if bad.any():
        return f"{int(bad.sum())} of {a.size} rows not finite"
    d = np.abs(a - r)
    b, t = np.unravel_index(int(np.argmax(d)), d.shape)
    return f"worst [b={b}, row={np.flatnonzero(rows_ok)[t]}]: got {a[b, t]:.6g}, reference {r[b, t]:.6g}"


def assert_indexer_kl_conforms(fn: Callable, **options) -> Report:
    """:func:`check_indexer_kl`, raising ``AssertionError`` with a table of the failing rows (or
    when nothing passed). Returns the report when it passes."""
    report = check_indexer_kl(fn, **options)
    _raise_unless_passed(report, "indexer KL")
    return report
