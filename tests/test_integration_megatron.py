"""streamkl_gpu.integrations.megatron.dsa_indexer_loss against Megatron-Core 0.16.1 itself.

Megatron-Core's ``compute_dsa_indexer_loss`` (dense and sparse, top-k sets without -1 slots,
which that version cannot take) on the index scores its own ``DSAIndexer._compute_index_scores``
makes, with the causal mask ``DSAttention`` adds: loss and gradients of the indexer's q, weights
and k. The options 0.16.1 lacks (``query_valid_rows``, ``calculate_per_token_loss``, -1 slots,
an MQA key) against ``dense_reference``, Megatron's later definition materialised in float64
(itself checked against 0.16.1 where the two overlap). Tensor parallelism: two gloo ranks
(spawned processes, tests/_megatron_tp_worker.py) equal one, each computing sq / 2 rows.
Kernels under the Triton interpreter on CPU. Tolerances: the project's rule
(``streamkl_ref.testing.tolerance``), scaled by the fp32 dense computation's error.
"""
from __future__ import annotations

import functools
import math
import os
import re
import sys
import tempfile
import time
import types
import warnings

import pytest
import torch
import torch.multiprocessing as mp

from streamkl_ref.testing import relative_error, tolerance
from streamkl_gpu.integrations.megatron import dsa_indexer_loss, tp_row_chunks

sys.path.insert(0, os.path.dirname(__file__))
import _megatron_tp_worker as tp_worker  # noqa: E402

INDEXER = tp_worker.INDEXER
NO_TP = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))  # Megatron's pg_collection, TP = 1
EPS = 1e-10  # Megatron's INDEXER_LOSS_EPS
TIMEOUT_S = 300


@functools.lru_cache(maxsize=None)
def megatron_dsa():
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed" and the like
        warnings.simplefilter("ignore")
        from megatron.core.transformer.experimental_attention_variant import dsa
    return dsa


def megatron_loss(case, t):
    """Megatron-Core 0.16.1: the index scores as DSAttention.forward makes them (its indexer's
    ``_compute_index_scores`` plus the causal float mask), then ``compute_dsa_indexer_loss``."""
    dsa = megatron_dsa()
    ins = {n: t[n].clone().requires_grad_(True) for n in INDEXER}
    sq = t["query"].shape[0]
    index_scores = dsa.DSAIndexer._compute_index_scores(None, ins["q"], ins["weights"], ins["k"])
    causal = torch.triu(torch.full((sq, sq), float("-inf")), diagonal=1)
    index_scores = index_scores + causal
    key = t["key"].expand(-1, -1, t["query"].shape[2], -1)  # 0.16.1 needs a key head per query head
    loss = dsa.compute_dsa_indexer_loss(index_scores, t["topk_indices"].long(), t["query"], key, case["scale"],
                                        case["coeff"], case["sparse"], NO_TP)
    loss.backward()
    return loss.detach(), {n: ins[n].grad for n in INDEXER}


def dense_reference(case, t, dtype=torch.float64, documents=None):
    """Megatron-Core's later compute_dsa_indexer_loss (masked softmax, -1 slots, query_valid_rows,
    calculate_per_token_loss), every score matrix materialised in ``dtype``; (loss, grads).
    ``documents``: packed-sequence bounds ``[0, e1, ..., sq]`` (a row sees its own document only)."""
    ins = {n: t[n].to(dtype).requires_grad_(True) for n in INDEXER}
    query, key = t["query"].to(dtype), t["key"].to(dtype)
    sq, b, n_heads, _ = query.shape
    key = key.expand(-1, -1, n_heads, -1)
    valid = torch.ones(sq, sq, dtype=torch.bool).tril()
    if documents is not None:
        doc = torch.bucketize(torch.arange(sq), torch.tensor(documents[1:]), right=True)
        valid = valid & (doc[:, None] == doc[None, :])
    valid = valid.expand(b, sq, sq)
    if case["sparse"]:
        topk = t["topk_indices"].long()
        chosen = torch.zeros(b, sq, sq + 1, dtype=torch.bool)  # column sq: the -1 slots
        chosen.scatter_(-1, torch.where(topk >= 0, topk, sq), True)
        valid = valid & chosen[..., :sq]
    neg = torch.tensor(float("-inf"), dtype=dtype)
    scores = torch.einsum("sbhd,tbhd->bhst", query, key) * case["scale"]
    probs = torch.softmax(torch.where(valid[:, None], scores, neg), dim=-1)
    probs = torch.where(valid[:, None], probs, 0.0).nan_to_num(0.0)  # an empty row: all zero
    target = probs.sum(dim=1)
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(EPS)
    logits = (torch.relu(torch.einsum("sbhd,tbd->sbht", ins["q"], ins["k"])) * ins["weights"][..., None]).sum(2)
    logits = logits.transpose(0, 1)
    live = valid | ~valid.any(-1, keepdim=True)  # an empty row is computed unmasked, then set to 0
    log_pred = torch.log_softmax(torch.where(live, logits, neg), dim=-1)
    terms = torch.where(valid, target * (torch.log(target.clamp_min(EPS)) - torch.where(valid, log_pred, 0.0)), 0.0)
    rows = terms.sum(-1)
    count = b * sq
    if t["query_valid_rows"] is not None:
        rows = rows * t["query_valid_rows"].to(dtype)
        count = t["query_valid_rows"].sum().clamp_min(1)
    loss = rows.sum() * case["coeff"] if case.get("per_token") else rows.sum() / count * case["coeff"]
    loss.backward()
    return loss.detach(), {n: ins[n].grad for n in INDEXER}


def streamed(case, t):
    return tp_worker.call(case, t, pg_collection=NO_TP)


BASE = dict(seed=0, sq=12, b=2, np=4, hn=16, h=3, d=8, topk=5, scale=0.25, coeff=0.7, sparse=False)


def megatron_topk(case, t):
    """Top-k sets as Megatron's DSAIndexer.forward_with_scores picks them (no -1 slots; early
    rows list keys past their diagonal, which the causal mask drops)."""
    dsa = megatron_dsa()
    sq = case["sq"]
    scores = dsa.DSAIndexer._compute_index_scores(None, t["q"], t["weights"], t["k"])
    scores = scores + torch.triu(torch.full((sq, sq), float("-inf")), diagonal=1)
    return scores.topk(min(case["topk"], sq), dim=-1)[1]


def assert_matches(name, got, want, same_precision, ref):
    """got within the project's tolerance of ``want`` and of the float64 ``ref``, the tolerance
    scaled by the fp32 dense computation's own error (``same_precision`` vs ``ref``)."""
    tol = tolerance(relative_error(same_precision, ref), "float32")
    for other, what in ((want, "the comparison"), (ref, "the float64 reference")):
        err = relative_error(got, other)
        assert err <= tol, f"{name}: error {err:.3e} against {what} > tolerance {tol:.3e}"


@pytest.mark.parametrize("sparse,mqa", [(False, False), (True, True)], ids=["dense", "sparse-mqa"])
def test_equals_megatron_core(sparse, mqa):
    case = dict(BASE, sparse=sparse, mqa=mqa, seed=1 + sparse)
    t = tp_worker.make_case(case)
    t["topk_indices"] = megatron_topk(case, t)
    loss, grads = streamed(case, t)
    meg_loss, meg_grads = megatron_loss(case, t)
    ref_loss, ref_grads = dense_reference(case, t)
    assert relative_error(meg_loss, ref_loss) < 1e-5  # the reference is Megatron's definition
    assert_matches("loss", loss, meg_loss, meg_loss, ref_loss)
    for n in INDEXER:
        assert relative_error(meg_grads[n], ref_grads[n]) < 1e-4, n
        assert_matches(f"d{n}", grads[n], meg_grads[n], meg_grads[n], ref_grads[n])


@pytest.mark.parametrize("case", [
    dict(BASE, seed=3, sparse=True, unused_slots=True, valid_rows=True),
    dict(BASE, seed=4, sparse=False, mqa=True, valid_rows=True, per_token=True),
    dict(BASE, seed=5, sparse=True, unused_slots=True, per_token=True),
], ids=["sparse-unused-slots-valid-rows", "dense-mqa-valid-rows-per-token", "sparse-per-token"])
def test_options_megatron_0_16_lacks(case):
    t = tp_worker.make_case(case)
    if case["sparse"]:
        t["topk_indices"][0, 3] = -1  # a row whose set is empty: KL 0, still counted
    loss, grads = streamed(case, t)
    ref_loss, ref_grads = dense_reference(case, t)
    fp32_loss, fp32_grads = dense_reference(case, t, dtype=torch.float32)
    assert_matches("loss", loss, ref_loss, fp32_loss, ref_loss)
    for n in INDEXER:
        assert_matches(f"d{n}", grads[n], ref_grads[n], fp32_grads[n], ref_grads[n])


@pytest.mark.parametrize("valid_rows", [False, True], ids=["all-rows", "valid-rows"])
def test_dense_training_step_forms_the_gradient_in_the_forward(monkeypatch, valid_rows):
    """The dense loss reaches indexer_kl with a scalar reduction (the valid-row mask as row
    weights), so its training step takes the chunk design: the teacher's LSEs by one pass, the
    gradient formed in the forward, and no recomputing backward (the teacher read a third time)."""
    from streamkl_gpu.indexer import host as idx_host
    from streamkl_gpu.indexer.training import chunk as idx_chunk

    calls = []
    full, bwd = idx_chunk._forward_full, idx_host._backward
    monkeypatch.setattr(idx_chunk, "_forward_full", lambda *a: calls.append("full") or full(*a))
    monkeypatch.setattr(idx_host, "_backward", lambda *a, **k: calls.append("recompute") or bwd(*a, **k))
    case = dict(BASE, seed=6, mqa=True, valid_rows=valid_rows)
    t = tp_worker.make_case(case)
    loss, grads = streamed(case, t)
    assert calls and set(calls) == {"full"}, calls
    ref_loss, ref_grads = dense_reference(case, t)
    fp32_loss, fp32_grads = dense_reference(case, t, dtype=torch.float32)
    assert_matches("loss", loss, ref_loss, fp32_loss, ref_loss)
    for n in INDEXER:
        assert_matches(f"d{n}", grads[n], ref_grads[n], fp32_grads[n], ref_grads[n])


def test_packed_documents_loop_from_the_docs():
    """docs/integrations.md's per-document loop equals the block-diagonal causal definition."""
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "integrations.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    code = next(b for b in blocks if "def packed_dsa_indexer_loss" in b)
    namespace = {"dsa_indexer_loss": dsa_indexer_loss}
    exec(code, namespace)
    case = dict(BASE, seed=8, sparse=True, unused_slots=True)  # sparse: the sets' shift to document indices
    t = tp_worker.make_case(case)
    documents = [0, 5, 12]
    ins = {n: t[n].clone().requires_grad_(True) for n in INDEXER}
    loss = namespace["packed_dsa_indexer_loss"](
        ins["q"], ins["weights"], ins["k"], t["topk_indices"], t["query"], t["key"], torch.tensor(documents),
        case["scale"], case["coeff"], case["sparse"])
    loss.backward()
    ref_loss, ref_grads = dense_reference(case, t, documents=documents)
    fp32_loss, fp32_grads = dense_reference(case, t, dtype=torch.float32, documents=documents)
    assert_matches("loss", loss.detach(), ref_loss, fp32_loss, ref_loss)
    for n in INDEXER:
        assert_matches(f"d{n}", ins[n].grad, ref_grads[n], fp32_grads[n], ref_grads[n])


def test_rejects_what_it_does_not_support():
    t = tp_worker.make_case(dict(BASE))
    args = [t[n] for n in ("q", "weights", "k", "topk_indices", "query", "key")] + [0.25, 1.0, False]
    with pytest.raises(ValueError, match="sq == sk"):
        short = list(args)
        short[5] = t["key"][:-2]
        short[2] = t["k"][:-2]
        dsa_indexer_loss(*short)
    with pytest.raises(ValueError, match="additive mask is not supported.*once per document"):
        dsa_indexer_loss(*args, mask=torch.zeros(12, 12))
    with pytest.raises(ValueError, match="packed sequences.*once per document"):
        dsa_indexer_loss(*args, varlen_starts=torch.zeros(12, dtype=torch.long), varlen_ends=torch.arange(1, 13))
    with pytest.raises(ValueError, match="THD"):
        thd = list(args)
        thd[4] = t["query"][:, 0]
        dsa_indexer_loss(*thd)
    with pytest.raises(ValueError, match="sparse_loss=True needs topk_indices"):
        dsa_indexer_loss(*args[:3], None, *args[4:8], True)
    with pytest.raises(ValueError, match=r"weights must be \[sq=12, b=2, h=3\]"):
        dsa_indexer_loss(args[0], args[1][..., :2], *args[2:])


def test_row_chunks():
    assert tp_row_chunks(16, 1, 0) == [(0, 16)]
    assert [tp_row_chunks(16, 2, r) for r in range(2)] == [[(0, 4), (12, 16)], [(4, 8), (8, 12)]]
    for sq, world in ((10, 2), (13, 3), (6, 3)):
        rows = [sorted(i for a, b in tp_row_chunks(sq, world, r) for i in range(a, b)) for r in range(world)]
        assert sorted(sum(rows, [])) == list(range(sq))  # a partition of the rows
        assert max(map(len, rows)) - min(map(len, rows)) <= 2  # sq / TP rows each
    with pytest.raises(ValueError):
        tp_row_chunks(8, 2, 2)


TP_CASES = [  # sq = 16: chunks of 4; sq = 10: uneven chunks (0, 2, 5, 7, 10)
    dict(BASE, seed=6, sq=16, sparse=False),
    dict(BASE, seed=7, sq=10, sparse=True, mqa=True, unused_slots=True, valid_rows=True, per_token=True,
         collection=True),
]


@functools.lru_cache(maxsize=None)
def _run_tp(world):
    out_dir = tempfile.mkdtemp(prefix="streamkl_megatron_tp_")
    ctx = mp.start_processes(tp_worker.worker, args=(world, os.path.join(out_dir, "init"), TP_CASES, out_dir),
                             nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                raise AssertionError(f"{world} ranks did not finish within {TIMEOUT_S} s (a hang?)")
    finally:
        for p in ctx.processes:  # only the processes this test started
            if p.is_alive():
                p.terminate()
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


@pytest.mark.parametrize("index", range(len(TP_CASES)), ids=["dense", "sparse-mqa-options"])
def test_tensor_parallel_equals_one_rank_and_splits_rows(index):
    world = 2
    case = TP_CASES[index]
    results = [r[index] for r in _run_tp(world)]
    loss, grads = streamed(case, tp_worker.make_case(case))
    sq = case["sq"]
    for rank, got in enumerate(results):
        # every rank returns the full loss and the replicated indexer's full gradient
        assert relative_error(got["loss"], loss) < 1e-5, (rank, got["loss"], loss)
        for n in INDEXER:
            assert relative_error(got["grads"][n], grads[n]) < 1e-5, (rank, n)
        # rank r computed chunks r and 2W-1-r of 2W: about sq / W rows, nothing else
        bounds = [i * sq // (2 * world) for i in range(2 * world + 1)]
        mine = [(bounds[c], bounds[c + 1]) for c in (rank, 2 * world - 1 - rank)]
        assert got["chunks"] == mine, (rank, got["chunks"])
        assert abs(sum(b - a for a, b in got["chunks"]) - sq / world) <= 1
    covered = sorted(i for got in results for a, b in got["chunks"] for i in range(a, b))
    assert covered == list(range(sq)) and math.isfinite(loss.item())
