"""Megatron-Core's DSA indexer loss, streamed: a drop-in for ``compute_dsa_indexer_loss``.

Megatron-Core (``megatron/core/transformer/experimental_attention_variant/dsa.py``) materialises
the indexer's scores ``[b, sq, sk]`` and the teacher's attention ``[b, np, sq, sk]`` in fp32 to
form its KL loss. :func:`dsa_indexer_loss` takes the tensors those scores are made from, in
Megatron's layouts, and returns the same scalar through :func:`streamkl_gpu.indexer_kl` (dense)
or :func:`streamkl_gpu.indexer_kl_topk` (``sparse_loss``), never holding an ``sq x sk`` buffer::

    # Megatron-Core
    index_scores = indexer._compute_index_scores(q, weights, k) + causal_mask
    loss = compute_dsa_indexer_loss(index_scores, topk_indices, query, key, softmax_scale,
                                    loss_coeff, sparse_loss, pg_collection)
    # streamed
    loss = dsa_indexer_loss(q, weights, k, topk_indices, query, key, softmax_scale,
                            loss_coeff, sparse_loss, pg_collection)

What it computes (Megatron-Core's definition, with its later options): per query row ``t``, the
target ``p_t`` = the mean over all ``np`` teacher heads of ``softmax(softmax_scale * query_h . key)``
over the keys row ``t`` sees (causal; with ``sparse_loss``, also in ``topk_indices[:, t]``), the
prediction ``softmax(sum_j weights_j relu(q_j . k))`` over the same keys, and
``loss = loss_coeff * sum_t valid_t KL(p_t || prediction_t) / count``, where ``count`` is
``b * sq``, or the number of valid rows with ``query_valid_rows``, or 1 with
``calculate_per_token_loss`` (the sum; Megatron divides by the token count later). Megatron adds
``1e-10`` inside its logarithms; the streamed loss is the exact KL (the difference is below fp32
resolution unless a prediction underflows).

Masks: Megatron's default causal mask is top-left (key ``j`` visible to row ``i`` iff ``j <= i``);
streamkl's is bottom-right; they agree when ``sq == sk``, which is required. An explicit
additive ``mask`` and packed-sequence bounds (``varlen_starts``/``varlen_ends``/``key_positions``)
raise ``ValueError``: call the function once per document on its slices (docs/integrations.md).

Tensor parallelism (teacher heads split over the TP group, the indexer replicated, as in
Megatron-Core): the target needs every head of a row, so each rank receives every head of
``sq / TP`` rows by one all-to-all of ``query`` (and one all-gather of ``key`` when it has a head
per query head; an MQA key is replicated and does not travel) and computes those rows only:
:func:`tp_row_chunks` (2 TP chunks, rank ``r`` takes chunks ``r`` and ``2 TP - 1 - r``, which
balances causal work). The row sums are all-reduced, so every rank returns the full loss, and
the gradients of ``q``, ``weights``, ``k`` are all-reduced in the backward, so every rank's
replicated indexer gets the full gradient, as with Megatron's function.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["dsa_indexer_loss", "tp_row_chunks"]

_LOOP_OVER_DOCUMENTS = (
    "call dsa_indexer_loss once per document [s, e) on its slices (q[s:e], weights[s:e], k[s:e], "
    "query[s:e], key[s:e], and topk_indices[:, s:e] - s with keys outside the document set to -1) "
    "with calculate_per_token_loss=True, add the results and divide by the number of rows "
    "(see docs/integrations.md)")


def tp_row_chunks(sq: int, tp_size: int, tp_rank: int) -> list:
    """The query rows rank ``tp_rank`` of ``tp_size`` computes, as ``[(start, stop), ...]``.

    The rows are cut into ``2 * tp_size`` near-equal chunks (boundaries ``i * sq // (2 tp_size)``);
    rank ``r`` takes chunks ``r`` and ``2 tp_size - 1 - r`` (an early and a late one: equal
    causal work per rank). Empty chunks (``sq < 2 tp_size``) are left out."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, tp_size), got tp_rank={tp_rank}, tp_size={tp_size}")
    if tp_size == 1:
        return [(0, sq)] if sq > 0 else []
    n = 2 * tp_size
    bounds = [i * sq // n for i in range(n + 1)]
    chunks = [(bounds[c], bounds[c + 1]) for c in (tp_rank, n - 1 - tp_rank)]
    return [(a, b) for a, b in chunks if b > a]


def _tp_group(pg_collection):
    """(group, size, rank) from Megatron's ProcessGroupCollection (its ``.tp``), a ProcessGroup,
    or None (no TP). A group of size 1 runs no collective."""
    group = getattr(pg_collection, "tp", pg_collection)
    if group is None:
        return None, 1, 0
    size = group.size() if callable(getattr(group, "size", None)) else None
    if size == 1:
        return None, 1, 0
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("pg_collection names a process group, but torch.distributed is not initialised")
    return group, dist.get_world_size(group), dist.get_rank(group)


class _AllReduceGrads(torch.autograd.Function):
    """Identity forward; the backward sums the gradients over the group (Megatron's
    ``copy_to_tensor_model_parallel_region``): each rank computes its rows' share of the
    replicated indexer's gradient, the sum is the full gradient on every rank."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for g in grads:
            if g is not None:
                g = g.contiguous()
                dist.all_reduce(g, group=ctx.group)
            out.append(g)
        return (None, *out)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward (Megatron's ``reduce_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, group, x):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return None, g


def _shape_error(name, t, want):
    return ValueError(f"{name} must be {want}, got shape {list(t.shape)}")


def _check(q, weights, k, topk_indices, query, key, sparse_loss, mask, varlen_starts, varlen_ends,
           key_positions, query_valid_rows):
    for name, t in (("q", q), ("weights", weights), ("k", k), ("query", query), ("key", key)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if mask is not None:
        raise ValueError(
            "an explicit additive mask is not supported: dsa_indexer_loss applies Megatron's default "
            "causal mask (top-left, sq == sk; pass mask=None). For a block-diagonal (document) mask, "
            + _LOOP_OVER_DOCUMENTS)
    if varlen_starts is not None or varlen_ends is not None or key_positions is not None:
        raise ValueError("packed sequences (varlen_starts / varlen_ends / key_positions) are not supported: "
                         + _LOOP_OVER_DOCUMENTS)
    if query.dim() != 4:
        raise _shape_error("query", query, "[sq, b, np, hn] (a packed THD tensor is not supported: "
                           + _LOOP_OVER_DOCUMENTS + ")")
    sq, b, n_heads, hn = query.shape
    if key.dim() != 4 or key.shape[1] != b or key.shape[3] != hn or key.shape[2] not in (1, n_heads):
        raise _shape_error("key", key, f"[sk, b={b}, np={n_heads} or 1, hn={hn}]")
    sk = key.shape[0]
    if sq != sk:
        raise ValueError(
            f"sq = {sq} query rows but sk = {sk} keys: Megatron's default causal mask is top-left "
            "(key j visible to row i iff j <= i) and streamkl's is bottom-right; they agree only for "
            "sq == sk, which dsa_indexer_loss requires")
    if q.dim() != 4 or q.shape[:2] != (sq, b):
        raise _shape_error("q", q, f"[sq={sq}, b={b}, h, d] (the indexer's queries)")
    h = q.shape[2]
    if weights.shape != (sq, b, h):
        raise _shape_error("weights", weights, f"[sq={sq}, b={b}, h={h}] (the indexer's head weights)")
    if k.dim() != 3 or k.shape[:2] != (sk, b) or k.shape[2] != q.shape[3]:
        raise _shape_error("k", k, f"[sk={sk}, b={b}, d={q.shape[3]}] (the indexer's keys)")
    if sparse_loss:
        if not isinstance(topk_indices, torch.Tensor):
            raise ValueError("sparse_loss=True needs topk_indices, a [b, sq, topk] integer tensor")
        if topk_indices.dim() != 3 or topk_indices.shape[:2] != (b, sq):
            raise _shape_error("topk_indices", topk_indices, f"[b={b}, sq={sq}, topk]")
    valid = None
    if query_valid_rows is not None:
        valid = query_valid_rows.to(device=q.device, dtype=torch.bool)
        if valid.dim() == 1 and valid.shape[0] == sq:
            valid = valid.unsqueeze(0)
        if valid.dim() != 2 or valid.shape[1] != sq or valid.shape[0] not in (1, b):
            raise _shape_error("query_valid_rows", query_valid_rows, f"[sq={sq}], [1, sq] or [b={b}, sq]")
        valid = valid.expand(b, sq)
    return sq, b, valid


def _gather_teacher(query, key, rows_of, group, world, rank):
    """(query rows of this rank with every head ``[n, b, np, hn]``, key with every head)."""
    if world == 1:
        return query, key  # one chunk: every row
    mine = rows_of(rank)
    sends = [query[rows_of(j)].contiguous() for j in range(world)]
    recv = [query.new_empty((len(mine),) + tuple(query.shape[1:])) for _ in range(world)]
    dist.all_to_all(recv, sends, group=group)
    query_rows = torch.cat(recv, dim=2)  # heads in rank order: rank j holds heads [j np_l, (j+1) np_l)
    if key.shape[2] == query.shape[2]:  # a key head per query head: split over the group as well
        parts = [torch.empty_like(key) for _ in range(world)]
        dist.all_gather(parts, key.contiguous(), group=group)
        key = torch.cat(parts, dim=2)
    return query_rows, key  # a one-head key (np_local > 1) is MQA: the same on every rank


def dsa_indexer_loss(q, weights, k, topk_indices, query, key, softmax_scale, loss_coeff, sparse_loss,
                     pg_collection=None, mask=None, varlen_starts=None, varlen_ends=None,
                     key_positions=None, query_valid_rows=None, calculate_per_token_loss=False, *,
                     use_relu=True):
    """The scalar Megatron-Core's ``compute_dsa_indexer_loss`` returns, streamed.

    Megatron's arguments in its order, with ``index_scores`` replaced by what it is made of (the
    arguments of ``DSAIndexer._compute_index_scores``):

    Args:
        q: indexer queries ``[sq, b, h, d]``. weights: ``[sq, b, h]`` (Megatron's scale factors
            ``h ** -0.5 * softmax_scale`` already folded in). k: indexer keys ``[sk, b, d]``.
            Differentiable; fp16, bf16 or fp32.
        topk_indices: ``[b, sq, topk]`` int32/int64, read with ``sparse_loss`` only (``None`` is
            fine otherwise). ``-1`` marks an unused slot; a key past the row's diagonal is
            dropped, as Megatron's causal mask drops it. Each key at most once per row.
        query: teacher queries ``[sq, b, np, hn]`` (this rank's heads under TP). key: teacher
            keys ``[sk, b, np, hn]``, or ``[sk, b, 1, hn]`` for one key head shared by every
            query head (MQA; under TP with one local query head, a one-head key is that head's
            own, split over the group like ``query``). The teacher is a constant: no gradient.
        softmax_scale: the teacher's score scale. loss_coeff: the factor on the loss.
        sparse_loss: the KL over each row's ``topk_indices`` (``True``) or over every causal key.
        pg_collection: Megatron's ``ProcessGroupCollection`` (its ``tp`` group is used), a
            ``torch.distributed`` process group, or ``None``: the group the teacher heads are
            split over (every rank passes the same indexer tensors and ``topk_indices``).
        mask, varlen_starts, varlen_ends, key_positions: must be ``None`` (``ValueError``
            otherwise: only Megatron's default causal mask is supported; loop over documents).
        query_valid_rows: optional ``[sq]``, ``[1, sq]`` or ``[b, sq]`` (bool): rows to count;
            the others add nothing, and the mean is over the valid rows.
        calculate_per_token_loss: return ``loss_coeff`` times the sum over rows (Megatron's
            per-token loss mode), not the mean.
        use_relu: the indexer's ReLU (``False``: ``I = sum_j weights_j q_j . k``).

    Returns:
        a float32 scalar, the same on every rank of the group.
    """
    from .. import indexer_kl, indexer_kl_topk

    sq, b, valid = _check(q, weights, k, topk_indices, query, key, sparse_loss, mask, varlen_starts,
                          varlen_ends, key_positions, query_valid_rows)
    group, world, rank = _tp_group(pg_collection)
    if sq < 2 * world:  # every rank needs rows: its backward joins the gradients' all-reduce
        raise ValueError(f"sq = {sq} rows cannot be split over {world} ranks (2 chunks each): sq >= {2 * world} is needed")

    def rows_of(r):
        return torch.cat([torch.arange(s, e, device=query.device) for s, e in tp_row_chunks(sq, world, r)]
                         or [torch.zeros(0, dtype=torch.long, device=query.device)])

    query_rows, key = _gather_teacher(query.detach(), key.detach(), rows_of, group, world, rank)
    if world > 1 and torch.is_grad_enabled() and any(t.requires_grad for t in (q, weights, k)):
        q, weights, k = _AllReduceGrads.apply(group, q, weights, k)

    total = torch.zeros((), dtype=torch.float32, device=q.device)
    offset = 0
    for start, stop in tp_row_chunks(sq, world, rank):
        n = stop - start
        # rows [start, stop) against the key prefix [0, stop): bottom-right causal there is the
        # global top-left mask (row start + i sees keys j <= start + i)
        teacher_q = query_rows[offset:offset + n].permute(1, 2, 0, 3)
        teacher_k = key[:stop].permute(1, 2, 0, 3)
        index_q = q[start:stop].permute(1, 2, 0, 3)
        index_k = k[:stop].permute(1, 0, 2).unsqueeze(1)
        index_w = weights[start:stop].permute(1, 2, 0)
        options = dict(causal=True, scale=float(softmax_scale), relu=use_relu)
        # the chunk's summed loss, the valid-row mask as row weights: a scalar reduction lets the
        # dense loss's training step form the whole gradient in its forward
        options.update(reduction="sum", row_weights=None if valid is None else valid[:, start:stop].float())
        if sparse_loss:
            sets = topk_indices[:, start:stop]
            rows = torch.arange(start, stop, device=sets.device).view(1, n, 1)
            sets = sets.masked_fill(sets > rows, -1)  # past the diagonal (or past the prefix): unused
            chunk_loss = indexer_kl_topk(teacher_q, teacher_k, index_q, index_k, index_w, sets, **options)
        else:
            chunk_loss = indexer_kl(teacher_q, teacher_k, index_q, index_k, index_w, **options)
        total = total + chunk_loss
        offset += n
    if world > 1:
        total = _SumOverGroup.apply(group, total)
    if not calculate_per_token_loss:
        count = float(b * sq) if valid is None else valid.sum().to(torch.float32).clamp_min(1.0)
        total = total / count
    return total * loss_coeff
