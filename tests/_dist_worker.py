"""Worker processes for tests/test_distributed.py: one spawned process per rank (gloo, CPU).

The kernels run under the Triton interpreter, which must be chosen before any kernel module is
imported: this module sets TRITON_INTERPRET=1 first thing (a spawned child starts afresh).
Each worker runs a list of sub-cases inside one process group (a spawn costs seconds; a case
under the interpreter, a fraction) and saves what it got for the parent to compare.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import datetime  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def positions(layout, rank, world, n):
    """Global token indices rank ``rank`` holds, in its local order (written out independently
    of the module under test)."""
    if layout == "contiguous":
        per = n // world
        return list(range(rank * per, (rank + 1) * per))
    per = n // (2 * world)
    first, second = rank, 2 * world - 1 - rank
    return list(range(first * per, (first + 1) * per)) + list(range(second * per, (second + 1) * per))


def make_case(case):
    """Full-sequence inputs and upstream gradient of one case (the same on every rank)."""
    gen = torch.Generator().manual_seed(case["seed"])
    B, H, HK1, HK2, N, D1, D2 = (case[k] for k in ("B", "H", "HK1", "HK2", "N", "D1", "D2"))
    shapes = [(B, H, N, D1), (B, HK1, N, D1), (B, H, N, D2), (B, HK2, N, D2)]
    xs = [torch.randn(s, generator=gen) for s in shapes]
    g = torch.rand((B, H, N), generator=gen)
    return xs, g


def run_case(case, rank, world):
    from streamkl_gpu import distributed

    xs, g = make_case(case)
    idx = torch.tensor(positions(case["layout"], rank, world, case["N"]))
    train = case["train"]
    shards = [x.index_select(2, idx).clone().requires_grad_(t) for x, t in zip(xs, train)]
    distributed.reset_comm_log()
    kl = distributed.attention_kl(*shards, causal=case["causal"], layout=case["layout"],
                                  scale1=case.get("scale1"), scale2=case.get("scale2"),
                                  bwd_mode=case.get("bwd_mode", "auto"),
                                  deterministic=case.get("deterministic", False))
    out = {"kl": kl.detach().clone(), "idx": idx}
    if any(train):
        (kl * g.index_select(2, idx)).sum().backward()
        for name, x in zip(("dq1", "dk1", "dq2", "dk2"), shards):
            out[name] = None if x.grad is None else x.grad.clone()
    sent = {}
    for op, _, nbytes in distributed.comm_log():
        sent[op] = sent.get(op, 0) + nbytes
    out["sent"] = sent
    return out


def run_error(case, rank, world):
    """Every rank calls with (possibly rank-dependent) bad arguments; returns the error text."""
    from streamkl_gpu import distributed

    xs, _ = make_case(case)
    idx = torch.tensor(positions("contiguous", rank, world, case["N"]))
    shards = [x.index_select(2, idx).clone() for x in xs]
    kw = dict(causal=True, layout="contiguous")
    bad = case["bad"]
    mine = rank == case.get("bad_rank", rank)  # the rank(s) that differ
    if bad == "scale1" and mine:
        kw["scale1"] = 0.3
    elif bad == "causal" and mine:
        kw["causal"] = False
    elif bad == "layout" and mine:
        kw["layout"] = "zigzag"
    elif bad == "length" and mine:
        shards = [s[:, :, :-2] for s in shards]
    elif bad == "dtype" and mine:
        shards[2], shards[3] = shards[2].half(), shards[3].half()
    elif bad == "heads" and mine:
        shards[1] = shards[1][:, :1]
    elif bad == "requires_grad" and mine:
        shards[3].requires_grad_(True)
    elif bad == "head_dim" and mine:  # invalid on this rank alone (k1's D differs from q1's)
        shards[1] = shards[1][..., :-1]
    elif bad == "nq_nk" and mine:  # fewer key rows than query rows on this rank
        shards[1], shards[3] = shards[1][:, :, :-1], shards[3][:, :, :-1]
    elif bad == "device" and mine:  # a device the gloo group cannot use
        shards = [s.to("meta") for s in shards]
    elif bad == "zigzag_odd":  # every rank: N/W odd, so N is not divisible by 2W
        shards = [s[:, :, :-1] for s in shards]
        kw["layout"] = "zigzag"
    elif bad == "layout_name":
        kw["layout"] = "ring"
    elif bad == "not_tensor" and mine:
        shards[0] = shards[0].tolist()
    try:
        distributed.attention_kl(*shards, **kw)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def worker(rank, world, init_file, cases, out_dir):
    from streamkl_gpu._core import runtime as _runtime

    _runtime.POISON_FRESH = True  # fresh buffers start as NaN: an unwritten key row cannot pass
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = []
    try:
        for case in cases:
            if case["kind"] == "error":
                results.append(run_error(case, rank, world))
            else:
                results.append(run_case(case, rank, world))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
