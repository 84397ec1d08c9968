"""streamkl_gpu.distributed.attention_kl on 2 and 3 gloo ranks (spawned processes, CPU, kernels
under the Triton interpreter) against single-process streamkl_gpu.attention_kl on the whole
sequence: forward and every gradient within float32 rounding (the summation order of dK
differs), both layouts, causal and not, GQA and D1 != D2; and every error case, including
arguments that differ across ranks (every rank must raise ValueError, none may hang).

One spawn per world size runs all its sub-cases (tests/_dist_worker.py); the tests read its results.
"""
import functools
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

import streamkl_gpu

sys.path.insert(0, os.path.dirname(__file__))
import _dist_worker  # noqa: E402

REL_TOL = 1e-5  # max |ours - single process| / max |single process|
TIMEOUT_S = 300  # a hang fails the test instead of stalling CI
GRADS = ("dq1", "dk1", "dq2", "dk2")

BASE = dict(kind="case", seed=1, B=1, H=4, HK1=2, HK2=1, N=24, D1=8, D2=16, train=(True,) * 4)
CASES = {
    2: [dict(BASE, layout=lay, causal=c) for lay in ("zigzag", "contiguous") for c in (True, False)]
    + [  # setting 1 (student side trained only), B = 2, explicit scales, deterministic backward
        dict(BASE, seed=2, B=2, layout="zigzag", causal=True, train=(False, False, True, True),
             scale1=0.4, scale2=0.25, deterministic=True)],
    3: [dict(BASE, seed=3, layout=lay, causal=c) for lay in ("zigzag", "contiguous") for c in (True, False)]
    + [dict(BASE, seed=4, H=2, HK1=1, HK2=2, D1=16, D2=4, layout="contiguous", causal=True,
            bwd_mode="separate")],
}
ERRORS = {  # kind -> (the bad rank's message must contain, the other ranks' message must contain)
    "scale1": ("scale1 differs", "scale1 differs"),
    "causal": ("causal differs", "causal differs"),
    "layout": ("layout differs", "layout differs"),
    "length": ("local sequence length (N/W) differs", "local sequence length (N/W) differs"),
    "dtype": ("q2 dtype differs", "q2 dtype differs"),
    "heads": ("H_K1 differs", "H_K1 differs"),
    "requires_grad": ("k2 requires grad differs", "k2 requires grad differs"),
    "head_dim": ("k1 has head dim", "rejected their arguments"),
    "nq_nk": ("N_Q = N_K", "rejected their arguments"),
    "device": ("runs collectives on cpu tensors only", "rejected their arguments"),
    "not_tensor": ("q1 must be a torch.Tensor", "rejected their arguments"),
    "zigzag_odd": ("N divisible by 2W", "N divisible by 2W"),
    "layout_name": ("layout must be 'zigzag' or 'contiguous'", "layout must be"),
}
ERROR_RANK = {2: 1, 3: 2}  # the rank that passes the odd arguments


def _error_cases(world):
    kinds = ERRORS if world == 2 else ("scale1", "length", "head_dim")
    return [dict(BASE, kind="error", bad=k, bad_rank=ERROR_RANK[world]) for k in kinds]


@functools.lru_cache(maxsize=None)
def _run(world):
    """Spawn ``world`` gloo ranks running every case of that world; return each rank's results."""
    # the valid cases run again after the error cases: a rejected call left no collective behind
    cases = CASES[world] + _error_cases(world) + [CASES[world][0]]
    out_dir = tempfile.mkdtemp(prefix=f"streamkl_cp{world}_")
    ctx = mp.start_processes(_dist_worker.worker, args=(world, os.path.join(out_dir, "init"), cases, out_dir),
                             nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise AssertionError(f"{world} ranks did not finish within {TIMEOUT_S} s (a hang?)")
    finally:
        for p in ctx.processes:  # only the processes this test started
            if p.is_alive():
                p.terminate()
    return cases, [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


@functools.lru_cache(maxsize=None)
def _reference(case_key):
    case = dict(case_key)
    xs, g = _dist_worker.make_case(case)
    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, case["train"])]
    kl = streamkl_gpu.attention_kl(*ins, causal=case["causal"], scale1=case.get("scale1"),
                                   scale2=case.get("scale2"))
    (kl * g).sum().backward()
    return {"kl": kl.detach(), **{n: x.grad for n, x in zip(GRADS, ins)}}


def _key(case):
    return tuple(sorted(case.items()))


def _max_rel(x, ref):
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _case_ids(world):
    return [f"{c['layout']}-{'causal' if c['causal'] else 'full'}-{i}" for i, c in enumerate(CASES[world])]


@pytest.mark.parametrize("world,index", [(w, i) for w in CASES for i in range(len(CASES[w]))],
                         ids=[f"W{w}-{n}" for w in CASES for n in _case_ids(w)])
def test_matches_single_process(world, index):
    cases, results = _run(world)
    case = cases[index]
    ref = _reference(_key(case))
    again = len(cases) - 1 if index == 0 else None  # case 0 ran twice: before and after the errors
    for run in (index, again):
        if run is None:
            continue
        for name in ("kl",) + GRADS:
            if ref[name] is None:
                assert all(res[run].get(name) is None for res in results), f"{name}: a gradient nobody asked for"
                continue
            got = torch.full_like(ref[name], float("nan"))
            for res in results:
                got.index_copy_(2, res[run]["idx"], res[run][name])
            assert torch.isfinite(got).all(), f"{name}: some rows were not returned by any rank"
            err = _max_rel(got, ref[name])
            assert err <= REL_TOL, f"{name}: max relative difference {err:.2e} > {REL_TOL:.0e} (run {run})"


@pytest.mark.parametrize("world,index", [(w, i) for w in CASES for i in range(len(CASES[w]))],
                         ids=[f"W{w}-{n}" for w in CASES for n in _case_ids(w)])
def test_bytes_sent_match_the_docs_formula(world, index):
    """docs/distributed.md: forward (W-1) N/W B (H_K1 D1 e1 + H_K2 D2 e2), backward (W-1) N/W B
    4 H_Kt D_t per side whose keys train, the check (W-1) 23 * 8, as logged by comm_log()."""
    cases, results = _run(world)
    c = cases[index]
    n, e = c["N"] // world, 4  # float32 inputs
    want = {"all_gather keys": (world - 1) * n * c["B"] * (c["HK1"] * c["D1"] + c["HK2"] * c["D2"]) * e,
            "check all_gather": (world - 1) * 23 * 8}
    dk = (world - 1) * n * c["B"] * 4 * (c["HK1"] * c["D1"] * c["train"][1] + c["HK2"] * c["D2"] * c["train"][3])
    if dk:
        want["reduce_scatter dk"] = dk
    for res in results:
        assert res[index]["sent"] == want


@pytest.mark.parametrize("world,kind", [(w, c["bad"]) for w in (2, 3) for c in _error_cases(w)])
def test_errors_raise_on_every_rank(world, kind):
    cases, results = _run(world)
    run = next(i for i, c in enumerate(cases) if c["kind"] == "error" and c["bad"] == kind)
    bad_text, other_text = ERRORS[kind]
    for rank, res in enumerate(results):
        msg = res[run]["error"]
        assert msg is not None, f"rank {rank} did not raise for {kind}"
        want = bad_text if rank == ERROR_RANK[world] else other_text
        assert want in msg, f"rank {rank}: {msg!r} lacks {want!r}"


def test_not_initialised():
    from streamkl_gpu import distributed

    x = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match="not initialised"):
        distributed.attention_kl(x, x, x, x)


@pytest.mark.parametrize("backend,devices", [("gloo", {"cpu"}), ("nccl", {"cuda"}),
                                             ("cpu:gloo,cuda:nccl", {"cpu", "cuda"})])
def test_backend_devices(monkeypatch, backend, devices):
    from streamkl_gpu import distributed

    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: backend)
    assert distributed._backend_devices(None) == devices


def test_submodule_imports():
    code = ("import streamkl_gpu.distributed as d; from streamkl_gpu import distributed as e; "
            "import streamkl_gpu; assert d is e is streamkl_gpu.distributed; "
            "assert callable(d.attention_kl)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_positions(layout, world):
    from streamkl_gpu import distributed

    n = 12 * world
    got = [distributed.shard_positions(n, layout=layout, rank=r, world=world).tolist() for r in range(world)]
    assert got == [_dist_worker.positions(layout, r, world, n) for r in range(world)]
    assert sorted(sum(got, [])) == list(range(n))
    if layout == "zigzag" or world > 1:  # (one contiguous chunk takes any n)
        with pytest.raises(ValueError, match="not divisible"):
            distributed.shard_positions(n + 1, layout=layout, rank=0, world=world)
