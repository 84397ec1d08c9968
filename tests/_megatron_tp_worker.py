"""Worker processes for tests/test_integration_megatron.py's tensor-parallel test (gloo, CPU).

Every rank builds the same full inputs, keeps its share of the teacher heads (Megatron's tensor
parallelism), calls the drop-in with the group, and saves its loss, its gradients and the rows
each kernel call computed (read off the shapes: a chunk ``[start, stop)`` runs ``stop - start``
query rows against ``stop`` keys). TRITON_INTERPRET is set before anything imports a kernel.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import datetime  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

INDEXER = ("q", "weights", "k")  # the drop-in's differentiable arguments


def make_case(case):
    """Full inputs in Megatron's layouts (every rank and the parent build the same)."""
    gen = torch.Generator().manual_seed(case["seed"])
    sq, b, n_heads, hn, h, d = (case[n] for n in ("sq", "b", "np", "hn", "h", "d"))
    key_heads = 1 if case.get("mqa") else n_heads
    t = {
        "q": torch.randn(sq, b, h, d, generator=gen),
        "weights": 0.5 * torch.randn(sq, b, h, generator=gen),
        "k": torch.randn(sq, b, d, generator=gen),
        "query": torch.randn(sq, b, n_heads, hn, generator=gen),
        "key": torch.randn(sq, b, key_heads, hn, generator=gen),
    }
    topk = torch.stack([torch.randperm(sq, generator=gen)[:case["topk"]] for _ in range(b * sq)])
    topk = topk.view(b, sq, case["topk"])
    if case.get("unused_slots"):
        topk = topk.masked_fill(torch.rand(topk.shape, generator=gen) < 0.3, -1)
    t["topk_indices"] = topk
    t["query_valid_rows"] = (torch.rand(b, sq, generator=gen) < 0.8) if case.get("valid_rows") else None
    return t


def call(case, t, heads=slice(None), pg_collection=None):
    """The drop-in on inputs ``t`` (teacher heads ``heads``); (loss, {name: grad})."""
    from streamkl_gpu.integrations.megatron import dsa_indexer_loss

    ins = {n: t[n].clone().requires_grad_(True) for n in INDEXER}
    key = t["key"] if t["key"].shape[2] == 1 else t["key"][:, :, heads]
    loss = dsa_indexer_loss(ins["q"], ins["weights"], ins["k"], t["topk_indices"], t["query"][:, :, heads], key,
                            case["scale"], case["coeff"], case["sparse"], pg_collection,
                            query_valid_rows=t["query_valid_rows"],
                            calculate_per_token_loss=case.get("per_token", False))
    loss.backward()
    return loss.detach(), {n: ins[n].grad for n in INDEXER}


def run_case(case, rank, world, group):
    import streamkl_gpu

    t = make_case(case)
    per = case["np"] // world
    chunks = []
    originals = {n: getattr(streamkl_gpu, n) for n in ("indexer_kl", "indexer_kl_topk")}

    def recording(fn):
        def wrapped(q, k, *args, **kwargs):
            chunks.append((k.shape[2] - q.shape[2], k.shape[2]))
            return fn(q, k, *args, **kwargs)
        return wrapped

    for name, fn in originals.items():
        setattr(streamkl_gpu, name, recording(fn))
    try:
        # Megatron passes its ProcessGroupCollection; a bare process group works as well
        pgc = types.SimpleNamespace(tp=group) if case.get("collection") else group
        loss, grads = call(case, t, slice(rank * per, (rank + 1) * per), pgc)
    finally:
        for name, fn in originals.items():
            setattr(streamkl_gpu, name, fn)
    return {"loss": loss, "grads": grads, "chunks": chunks}


def worker(rank, world, init_file, cases, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results = [run_case(case, rank, world, dist.group.WORLD) for case in cases]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
