"""The bounds-checked interpreter (streamkl_gpu.devtools.bounds): an access outside the
launch's tensors raises, as the GPU would fault; in-bounds and masked-off accesses pass; the
suite's launches run checked (tests/conftest.py); the indexer's chunk design at the H200's launch
plan, which faulted there in runs an H200 run/an H200 run, stays inside its tensors."""
from __future__ import annotations

import os
import re

import pytest
import torch

# The checker patches the Triton interpreter; with TRITON_INTERPRET unset (a GPU machine) these
# kernels compile for the GPU and nothing here is checked. tests/conftest.py sets the variable on
# every machine without nvidia-smi, so CI runs this file.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="checks the Triton interpreter: needs TRITON_INTERPRET=1 (set on CPU machines)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from streamkl_gpu.devtools import bounds as bounds  # noqa: E402
from streamkl_gpu._core import runtime as _runtime  # noqa: E402


@triton.jit
def _copy(X, Y, N, LOAD_EXTRA: tl.constexpr, STORE_EXTRA: tl.constexpr, ATOMIC_EXTRA: tl.constexpr,
          BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N + LOAD_EXTRA, other=0.0)
    tl.store(Y + offs, x, mask=offs < N + STORE_EXTRA)
    tl.atomic_add(Y + offs, x, mask=offs < N + ATOMIC_EXTRA)


@triton.jit
def _desc_copy(X_DESC, Y, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, X_DESC.load([0]))


def _run(x, y, load=0, store=0, atomic=0):
    _copy[(1,)](x, y, x.numel(), LOAD_EXTRA=load, STORE_EXTRA=store, ATOMIC_EXTRA=atomic, BLOCK=16)


def test_the_suite_runs_checked():
    assert bounds.installed() and bounds._races_on == (os.environ.get("STREAMKL_INTERPRETER_RACES", "1") == "1")
    before = bounds.stats()
    _run(torch.arange(10.0), torch.zeros(10))
    after = bounds.stats()
    assert after["launches"] == before["launches"] + 1
    assert after["checked_accesses"] - before["checked_accesses"] == 30  # 10 loads, 10 stores, 10 atomics


def test_the_public_names():
    import streamkl_gpu

    assert streamkl_gpu.bounds_checked is bounds.checked and streamkl_gpu.OutOfBoundsAccess is bounds.OutOfBoundsAccess
    with pytest.raises(streamkl_gpu.OutOfBoundsAccess):
        with streamkl_gpu.bounds_checked():
            _run(torch.arange(10.0), torch.zeros(10), load=1)
    assert bounds.installed()  # the suite's own check outlives the block


def test_in_bounds_and_masked_lanes_pass():
    x, y = torch.arange(10.0), torch.zeros(10)
    _run(x, y)  # 16 lanes, 6 masked off: nothing outside
    assert torch.equal(y, 2 * x)


@pytest.mark.parametrize("op,kw", [("load", dict(load=1)), ("store", dict(store=1)), ("atomic", dict(atomic=3))])
def test_one_element_past_the_end_is_caught(op, kw):
    with pytest.raises(bounds.OutOfBoundsAccess, match=rf"_copy: {op} of {max(kw.values())} element"):
        _run(torch.arange(10.0), torch.zeros(10), **kw)


@triton.jit
def _load_from(X, Y, START, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + START + offs))


def test_an_access_before_the_start_is_caught():
    with pytest.raises(bounds.OutOfBoundsAccess, match=r"load of 1 element.*4 bytes before the start of X"):
        _load_from[(1,)](torch.arange(16.0), torch.zeros(16), -1, BLOCK=16)
    _load_from[(1,)](torch.arange(16.0), torch.zeros(16), 0, BLOCK=16)


def test_the_view_not_its_storage_is_the_bound():
    """A view into a larger buffer: reading past the view is a bug even though the memory exists
    (the GPU's caching allocator would not fault either: the interpreter is stricter)."""
    buf = torch.arange(32.0)
    with pytest.raises(bounds.OutOfBoundsAccess, match=r"of X \(\(10,\) float32\)"):
        _run(buf[:10], torch.zeros(10), load=1)
    _run(buf[:11], torch.zeros(11))  # the same access inside an 11-element view passes


def test_a_reinterpreted_tensor_is_its_tensor():
    """triton.reinterpret's wrapper (another dtype over the same bytes) counts as its tensor."""
    x = torch.arange(10, dtype=torch.int32)
    y = torch.zeros(10, dtype=torch.int32)
    _copy[(1,)](triton.reinterpret(x, tl.uint32), y, 10, LOAD_EXTRA=0, STORE_EXTRA=0, ATOMIC_EXTRA=0, BLOCK=16)
    assert torch.equal(y, 2 * x)
    with pytest.raises(bounds.OutOfBoundsAccess, match=r"of X \(\(10,\) int32\)"):
        _copy[(1,)](triton.reinterpret(x, tl.uint32), y, 10, LOAD_EXTRA=1, STORE_EXTRA=0, ATOMIC_EXTRA=0, BLOCK=16)


def test_a_descriptor_larger_than_its_tensor_is_caught():
    """A TMA descriptor whose shape claims more than the tensor holds: the interpreter masks by the
    descriptor's shape, so without the checker the load reads past the tensor silently."""
    x = torch.arange(8.0)
    desc = _runtime.TensorDescriptor(x, [16], [1], [16])
    with pytest.raises(bounds.OutOfBoundsAccess, match=r"load of 8 element"):
        _desc_copy[(1,)](desc, torch.zeros(16), BLOCK=16)
    ok = _runtime.TensorDescriptor(x, [8], [1], [16])  # the true shape: the rest pads with zeros
    y = torch.full((16,), -1.0)
    _desc_copy[(1,)](ok, y, BLOCK=16)
    assert torch.equal(y, torch.cat([x, torch.zeros(8)]))


def test_the_chunk_design_at_the_h200_plan_stays_in_bounds(monkeypatch):
    """The indexer's chunk design (STREAMKL_INDEXER_PSTORE=chunk) faulted on the H200 at N=192
    (runs an H200 run: illegal memory access). Here it runs the H200's plan (DSA-like heads, the
    keys-major storing forward's tile on 4 warps, the student backward's tile, TMA descriptors,
    several chunks) under the checker: no access leaves its tensors, and the loss is the
    reference's. So the fault is not an indexing error the interpreter can see."""
    import streamkl_ref
    from streamkl_gpu.indexer.training import chunk as idx_chunk
    from streamkl_gpu.indexer import configs as idx_configs
    from streamkl_gpu.indexer.plan import IndexerConfig

    H, D, HI, DI, N = 128, 576, 64, 128, 40
    plans = {"pstore": [IndexerConfig(teacher_rows=128, indexer_rows=128, block_n=128, block_d=64, num_warps=4, num_stages=3, variant="keys")], "bwd": [IndexerConfig(teacher_rows=128, indexer_rows=128, block_n=64, block_d=64, num_warps=8, num_stages=2)]}
    orig = idx_configs._candidates
    monkeypatch.setattr(idx_configs, "_candidates",
                        lambda kind, ieee, dims=None, n_sm=132, **kw: plans.get(kind) or orig(kind, ieee, dims, n_sm, **kw))
    monkeypatch.setattr(idx_chunk, "PCHUNK_TOKENS", 16)  # three chunks (16, 16, 8 tokens)
    monkeypatch.setattr(_runtime, "INTERPRETER_TMA", True)
    g = torch.Generator().manual_seed(3)
    rnd = lambda *s, std=1.0: (std * torch.randn(s, generator=g)).to(torch.float16)  # noqa: E731
    xs = [rnd(1, H, N, D), rnd(1, 1, N, D), rnd(1, HI, N, DI), rnd(1, 1, N, DI), rnd(1, HI, N, std=(HI * DI) ** -0.5)]
    scale = 192 ** -0.5
    x64 = [x.double().numpy() for x in xs]
    kl_ref, _, lse_t = streamkl_ref.indexer_kl(*x64, return_lse=True, causal=True, scale=scale)
    before = bounds.stats()["launches"]
    total, lse_idx, dq1, dk1, dw1 = idx_chunk._forward_full(*xs, torch.from_numpy(lse_t).float(), True, scale, True)
    assert bounds.stats()["launches"] - before == 6  # a storing forward and a gradient kernel per chunk
    assert abs(total.item() - kl_ref.sum()) <= 1e-3 * abs(kl_ref.sum())
    assert all(torch.isfinite(t).all() for t in (dq1, dk1, dw1))


@triton.jit
def _desc_reduce(X_DESC, V, BLOCK: tl.constexpr):
    X_DESC.atomic_add([0], tl.load(V + tl.arange(0, BLOCK)))


def test_the_tma_reduce_shim_is_checked_too():
    """tests/_tma_reduce_shim.py adds the descriptor reduce the interpreter lacks; its accesses go
    through the same check (an oversized descriptor is caught, the true one adds in bounds)."""
    from _tma_reduce_shim import install

    install()
    x, v = torch.zeros(8), torch.ones(16)
    with pytest.raises(bounds.OutOfBoundsAccess, match=r"_desc_reduce: tma reduce of 8 element"):
        _desc_reduce[(1,)](_runtime.TensorDescriptor(x, [16], [1], [16]), v, BLOCK=16)
    _desc_reduce[(1,)](_runtime.TensorDescriptor(x, [8], [1], [16]), v, BLOCK=16)
    assert torch.equal(x, torch.ones(8))


def test_verify_impl_fails_user_kernels_with_memory_bugs(tmp_path):
    """`streamkl verify --impl` on CPU: a user's Triton kernel with an off-by-one load, or with a
    plain load-add-store into one address from every program, fails its cases with the checker's
    message, though its numbers are right; the in-bounds, race-free twin passes."""
    import json

    from test_conformance import _cli as _verify_cli  # the command line in a fresh process

    out = tmp_path / "r.json"
    bad = _verify_cli("--impl", "_conformance_impls:triton_reads_past_q1", "--quick", "--no-grad", "--json", str(out))
    assert bad.returncode == 1, bad.stdout[-2000:] + bad.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    failed = [r for r in rows if not r["pass"]]
    assert failed and all("outside every tensor argument" in (r.get("why") or "") for r in failed), failed[:2]
    racy = _verify_cli("--impl", "_conformance_impls:triton_sums_q1_racily", "--quick", "--no-grad", "--json", str(out))
    assert racy.returncode == 1, racy.stdout[-2000:] + racy.stderr[-2000:]
    failed = [r for r in json.loads(out.read_text())["rows"] if not r["pass"]]
    assert failed and all("touched by several programs" in (r.get("why") or "") for r in failed), failed[:2]
    good = _verify_cli("--impl", "_conformance_impls:triton_reads_q1_in_bounds", "--quick", "--no-grad")
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
    assert " 0 failed" in good.stdout


@triton.jit
def _shared_writes(X, Y, MODE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if MODE == 0:  # each program its own slice
        tl.store(Y + pid * BLOCK + offs, tl.load(X + pid * BLOCK + offs))
    if MODE == 1:  # every program stores the same slice
        tl.store(Y + offs, tl.load(X + pid * BLOCK + offs))
    if MODE == 2:  # atomic adds from every program into one slice
        tl.atomic_add(Y + offs, tl.load(X + pid * BLOCK + offs))
    if MODE == 3:  # program 1 reads the slice program 0 writes
        if pid == 0:
            tl.store(Y + offs, tl.load(X + offs))
        else:
            tl.store(Y + BLOCK + offs, tl.load(Y + offs))
    if MODE == 4:  # program 0 reads a slice the others add into
        if pid == 0:
            tl.store(Y + BLOCK + offs, tl.load(Y + offs))
        else:
            tl.atomic_add(Y + offs, tl.load(X + offs))


@pytest.mark.parametrize("mode,race", [(0, None), (1, "store, program (1, 0, 0) store"), (2, None),
                                       (3, "store, program (1, 0, 0) load"), (4, "load, program (1, 0, 0) atomic")])
def test_data_races_between_programs(mode, race):
    """With races=True a launch whose programs share an address, one with a plain store (or an
    atomic beside a plain load), raises DataRace naming the programs; disjoint slices and atomic
    adds alone pass. With races=False, the same launches pass (the interpreter's order is fixed)."""
    x = torch.arange(32.0)
    with bounds.checked(races=True):
        before = bounds.stats()["race_checked_launches"]
        if race is None:
            _shared_writes[(2,)](x, torch.zeros(32), MODE=mode, BLOCK=16)
        else:
            with pytest.raises(bounds.DataRace, match=r"_shared_writes: 16 address\(es\).*" + re.escape(f"program (0, 0, 0) {race}")):
                _shared_writes[(2,)](x, torch.zeros(32), MODE=mode, BLOCK=16)
        assert bounds.stats()["race_checked_launches"] == before + 1
    with bounds.checked(races=False):  # bounds only: the same launch passes
        _shared_writes[(2,)](x, torch.zeros(32), MODE=mode, BLOCK=16)
