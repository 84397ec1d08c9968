"""The batteries: :class:`Case` (attention KL) and :class:`IndexerCase` (the indexer loss), the
small CPU sets, the large ones added on a GPU, the named sets and each case's input generator."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np


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
    Case("long_causal_d64", 1, 4, 4, 2, 160, 2100, 64, 64, causal=True,
         why="a training length: 2100 keys (16 tiles of 128 and a ragged one), 160 rows, equal head "
             "dims, GQA on side 2; where a kernel switches to its long-sequence path"),
    Case("wide_heads_d256_d192", 1, 2, 1, 2, 160, 2100, 256, 192, causal=True,
         why="head dims above 128 (256 and 192, padded to 256): the widest tiles, where a backward "
             "tile can outgrow the shared memory; MQA on side 1, causal, a training length"),
)
LARGE_ATTENTION_CASES = GPU_ATTENTION_CASES[len(ATTENTION_CASES):]
CASE_SETS = ("default", "large", "all")
PLANT_PAD = (3, 5)  # planted cases: buffers this much longer in N and wider in D, NaN-filled


def case_generator(seed: int, case):
    """The torch CPU generator of one case's inputs: seeded by ``seed`` and the case's name
    (``case``: a case, or its name), so a case gets the same inputs whichever other cases run with
    it, and in whichever process (a failing case re-run alone, with ``cases=[that_case]``, sees
    exactly the inputs it failed on)."""
    import zlib

    import torch

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    name = case if isinstance(case, str) else case.name
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 63)


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
