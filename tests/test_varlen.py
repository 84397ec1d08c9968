"""streamkl_gpu.attention_kl_varlen (interpreter on CPU): packed sequences through the VARLEN kernels.

The kernels run the same tiles per sequence as ``attention_kl`` does on that sequence alone (tile
starts relative to the sequence, the same two stages, the same merge order), so without split-K
the packed forward and every gradient are *bitwise* equal to ``attention_kl`` run sequence by
sequence; with split-K the key splits follow ``max_seqlen_k`` instead (another merge order) and
the tolerance rule applies against the float64 reference.
"""
import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import streamkl_gpu
import streamkl_ref
from streamkl_gpu.devtools import bounds as _interpreter_bounds
from streamkl_gpu.attention import varlen as _varlen

from _gpu_helpers import GRAD_NAMES, assert_close, same_precision

pytestmark = pytest.mark.usefixtures("poison")

SETTINGS = {"s1": (False, False, True, True), "s2": (True, True, False, False), "both": (True,) * 4}
MODES = {"fused": dict(bwd_mode="fused"), "separate": dict(bwd_mode="separate"),
         "deterministic": dict(deterministic=True)}


def pack(lens, H=2, HK1=1, HK2=2, D1=16, D2=8, seed=0, dtype=torch.float32):
    """Random packed inputs for ``lens = [(n_q, n_k), ...]``: q/k tensors and cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
    xs = [torch.randn(s, generator=gen).to(dtype)
          for s in ((tq, H, D1), (tk, HK1, D1), (tq, H, D2), (tk, HK2, D2))]
    cu_q = torch.tensor([0] + list(np.cumsum([a for a, _ in lens])), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum([b for _, b in lens])), dtype=torch.int32)
    return xs, cu_q, cu_k, max((a for a, _ in lens), default=0), max((b for _, b in lens), default=0)


def run_varlen(xs, cu_q, cu_k, mq, mk, train, g, **kw):
    ins = [x.clone().requires_grad_(t) for x, t in zip(xs, train)]
    kl = streamkl_gpu.attention_kl_varlen(*ins, cu_q, cu_k, mq, mk, **kw)
    if any(train):
        kl.backward(g)
    return kl.detach(), {n: x.grad for n, x in zip(GRAD_NAMES, ins)}


def run_per_sequence(xs, cu_q, cu_k, train, g, **kw):
    """attention_kl on each sequence alone ([1, H, n, D] views, empty ones included), packed
    back into [total, ...]."""
    kl = torch.full(xs[0].shape[:2], float("nan"))
    grads = {n: torch.full_like(x, float("nan")) for n, x in zip(GRAD_NAMES, xs)}
    for i in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        ins = [x[sl].transpose(0, 1)[None].clone().requires_grad_(t)
               for x, sl, t in zip(xs, (rows, keys, rows, keys), train)]
        out = streamkl_gpu.attention_kl(*ins, **kw)
        kl[rows] = out[0].T.detach()
        if any(train):
            out.backward(g[rows].T[None])
            for n, x, sl, t in zip(GRAD_NAMES, ins, (rows, keys, rows, keys), train):
                if t:
                    grads[n][sl] = x.grad[0].transpose(0, 1)
    return kl, {n: (grads[n] if t else None) for n, t in zip(GRAD_NAMES, train)}


def assert_bitwise(ours, theirs):
    kl, grads = ours
    kl_ref, grads_ref = theirs
    assert torch.equal(kl, kl_ref), (kl - kl_ref).abs().max()
    for n in GRAD_NAMES:
        if grads_ref[n] is None:
            assert grads[n] is None, n
        else:
            assert torch.equal(grads[n], grads_ref[n]), (n, (grads[n] - grads_ref[n]).abs().max())


# packings: (n_q, n_k) per sequence, zero-length and length-1 sequences, N_Q != N_K
seq_lens = st.tuples(st.sampled_from([0, 1, 2, 5, 17]), st.sampled_from([0, 1, 3, 16, 17]))
heads = st.sampled_from([(1, 1, 1), (2, 1, 2), (4, 2, 1)])


@given(lens=st.lists(seq_lens, min_size=1, max_size=3), h=heads, dims=st.sampled_from([(16, 16), (16, 8), (8, 32)]),
       causal=st.booleans(), setting=st.sampled_from(list(SETTINGS)), mode=st.sampled_from(list(MODES)),
       seed=st.integers(0, 2**16))
@example(lens=[(5, 0), (0, 3), (1, 1), (24, 17), (13, 30)], h=(4, 2, 1), dims=(16, 8), causal=True,
         setting="both", mode="fused", seed=0)
@example(lens=[(17, 17), (1, 30)], h=(2, 1, 2), dims=(8, 32), causal=False, setting="s1",
         mode="deterministic", seed=1)
def test_equals_attention_kl_per_sequence(lens, h, dims, causal, setting, mode, seed):
    H, HK1, HK2 = h
    xs, cu_q, cu_k, mq, mk = pack(lens, H, HK1, HK2, *dims, seed=seed)
    train = SETTINGS[setting]
    g = torch.randn(xs[0].shape[:2], generator=torch.Generator().manual_seed(seed + 1))
    kw = dict(causal=causal, split_k=1, **MODES[mode])
    ours = run_varlen(xs, cu_q, cu_k, mq, mk, train, g, **kw)
    assert_bitwise(ours, run_per_sequence(xs, cu_q, cu_k, train, g, **kw))
    if mode == "deterministic":  # bitwise repeatable
        assert_bitwise(run_varlen(xs, cu_q, cu_k, mq, mk, train, g, **kw), ours)


@pytest.mark.parametrize("split_k,causal", [(2, False), (3, True)])
def test_split_k_matches_reference(split_k, causal):
    lens = [(3, 40), (0, 5), (9, 0), (1, 33), (16, 16)]
    xs, cu_q, cu_k, mq, mk = pack(lens, 4, 2, 1, 16, 8, seed=split_k)
    x64 = [x.double().numpy() for x in xs]
    kl, lse1_bits, lse2_bits = _varlen._kl_varlen_fwd_op(*xs, cu_q, cu_k, mq, mk, causal, 0.25, 0.35,
                                                          split_k, "auto", False)
    ref = streamkl_ref.attention_kl_varlen(*x64, cu_q.numpy(), cu_k.numpy(), mq, mk, causal=causal,
                                           scale1=0.25, scale2=0.35, return_lse=True)
    same = [torch.zeros_like(kl)] + [torch.full_like(kl, -np.inf) for _ in range(2)]
    for i, (nq, nk) in enumerate(lens):  # float32 PyTorch, sequence by sequence
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if nq and nk:
            seq = [x[sl].transpose(0, 1)[None] for x, sl in zip(xs, (rows, keys, rows, keys))]
            same[0][rows] = same_precision(seq, None, causal=causal, scale1=0.25, scale2=0.35)[0][0].T
    assert_close("kl", kl, ref[0], same[0], dtype=torch.float32)
    for name, ours, want in (("lse1", lse1_bits, ref[1]), ("lse2", lse2_bits, ref[2])):
        finite = np.isfinite(want)
        assert (torch.isinf(ours).numpy() == ~finite).all(), name
        nats = (ours * streamkl_ref._scores.LN2).numpy()
        np.testing.assert_allclose(nats[finite], want[finite], rtol=2e-6, atol=2e-6, err_msg=name)
    # gradients after a split forward: the saved LSEs feed the backward
    g = torch.randn(kl.shape, generator=torch.Generator().manual_seed(7))
    _, grads = run_varlen(xs, cu_q, cu_k, mq, mk, (True,) * 4, g, causal=causal, split_k=split_k)
    gref = streamkl_ref.attention_kl_varlen_grad(*x64, cu_q.numpy(), cu_k.numpy(), mq, mk,
                                                 g.double().numpy(), causal=causal)
    _, gsame = run_per_sequence(xs, cu_q, cu_k, (True,) * 4, g, causal=causal, split_k=1)
    for name in GRAD_NAMES:
        assert_close(name, grads[name], gref[name], gsame[name], dtype=torch.float32)


def test_heaviest_query_tiles_first_give_the_same_bits(monkeypatch):
    """A causal packed batch launches each sequence's last query tiles (the most keys) first, as
    the dense forward does: KL and LSEs equal the query order's bitwise, and the forced query
    order reaches the kernel."""
    from streamkl_gpu._core.forcing import forcing

    orders = []
    real = _varlen.kernel_call

    def spy(fn, grid):
        call = real(fn, grid)

        def record(*args, **kw):
            if fn is _varlen._fwd._kl_fwd_kernel:
                orders.append(kw["HEAVY_FIRST"])
            return call(*args, **kw)
        return record

    monkeypatch.setattr(_varlen, "kernel_call", spy)
    xs, cu_q, cu_k, mq, mk = pack([(40, 45), (5, 5), (33, 17)], 2, 1, 2, 16, 8, seed=3)
    heavy = _varlen._kl_varlen_fwd_op(*xs, cu_q, cu_k, mq, mk, True, 0.25, 0.35, 1, "auto", False)
    launched_heavy, orders[:] = set(orders), []
    with forcing(attention_triton_fwd_order="query"):
        query = _varlen._kl_varlen_fwd_op(*xs, cu_q, cu_k, mq, mk, True, 0.25, 0.35, 1, "auto", False)
    assert launched_heavy == {True} and set(orders) == {False}
    for name, a, b in zip(("kl", "lse1", "lse2"), heavy, query):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("variant", ["trans+fold", "tma+trans+fold+rows+heavy"])
@pytest.mark.parametrize("setting,mode,causal", [("s1", "separate", True), ("s2", "fused", True),
                                                 ("both", "separate", False), ("both", "separate", True),
                                                 ("s1", "fused", False),
                                                 ("s1", "deterministic", True)])
def test_new_kernel_forms_equal_attention_kl_per_sequence(monkeypatch, variant, setting, mode, causal):
    """The packed backward runs the dense kernels' pointer-load forms (the key-major dK tile with
    folded row factors, the folded dQ kernel, causal: heaviest query tiles first): every
    gradient bitwise what ``attention_kl`` gives on each sequence alone under the same variant,
    and those forms do reach the packed launches (the TMA, rows and reduce parts are the dense
    path's only)."""
    monkeypatch.setenv("STREAMKL_BWD_VARIANT", variant)
    seen = []
    real = _varlen.kernel_call

    def spy(fn, grid):
        call = real(fn, grid)

        def record(*args, **kw):
            if fn in (_varlen._bwd._kl_bwd_dk_kernel, _varlen._bwd._kl_bwd_dq_kernel):
                seen.append((fn.__name__, kw.get("TRANS"), kw["FOLD"], kw.get("HEAVY_FIRST")))
            return call(*args, **kw)
        return record

    monkeypatch.setattr(_varlen, "kernel_call", spy)
    xs, cu_q, cu_k, mq, mk = pack([(13, 17), (0, 4), (17, 17), (5, 1)], 4, 2, 1, 16, 8, seed=11)
    train = SETTINGS[setting]
    g = torch.randn(xs[0].shape[:2], generator=torch.Generator().manual_seed(12))
    kw = dict(causal=causal, split_k=1, **MODES[mode])
    ours = run_varlen(xs, cu_q, cu_k, mq, mk, train, g, **kw)
    assert_bitwise(ours, run_per_sequence(xs, cu_q, cu_k, train, g, **kw))
    assert ("_kl_bwd_dk_kernel", True, True, None) in seen
    heavy = causal and "heavy" in variant
    assert (mode == "fused") == all(name != "_kl_bwd_dq_kernel" for name, *_ in seen)
    assert all(tuple(f) == (None, True, heavy) for name, *f in seen if name == "_kl_bwd_dq_kernel")


def test_packed_candidates_put_the_new_forms_first(monkeypatch):
    """On the GPU (not the interpreter's one config) D <= 128 tries the key-major dK and the
    folded dQ first (causal: heaviest query tiles first), at the dense rules' tiles of one side or
    of both; wider heads keep the old configs alone."""
    from streamkl_gpu.attention import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.delenv("STREAMKL_BWD_VARIANT", raising=False)
    dk = configs.varlen_bwd_candidates(128, False, "dk", fused=False, causal=True)
    dq = configs.varlen_bwd_candidates(128, False, "dq", fused=False, causal=True)
    assert dk[0].variant == "trans+fold" and dq[0].variant == "fold+heavy"
    assert {c.variant for c in dk[1:]} == {"ptr"} and {c.variant for c in dq[1:]} == {"ptr"}
    assert configs.varlen_bwd_candidates(128, False, "dq", causal=False)[0].variant == "fold"
    both_dk = configs.varlen_bwd_candidates(128, True, "dk", fused=True)
    both_dq = configs.varlen_bwd_candidates(128, True, "dq", causal=True)
    assert (both_dk[0].variant, both_dk[0].block_m, both_dk[0].block_n, both_dk[0].num_warps) == ("trans+fold", 32, 64, 4)
    assert (both_dq[0].variant, both_dq[0].block_m, both_dq[0].block_n) == ("fold+heavy", 64, 32)
    assert {c.variant for c in both_dk[1:] + both_dq[1:]} == {"ptr"}
    assert {c.variant for c in configs.varlen_bwd_candidates(256, False, "dq", causal=True)} == {"ptr"}
    assert {c.variant for c in configs.varlen_bwd_candidates(128, False, "dk", ieee=True)} == {"ptr"}
    monkeypatch.setenv("STREAMKL_BWD_VARIANT", "tma+fold")  # packed tensors take no TMA descriptors
    with pytest.raises(ValueError, match="needs TMA-capable inputs"):
        configs.varlen_bwd_candidates(128, False, "dq", causal=True)
    monkeypatch.setenv("STREAMKL_BWD_VARIANT", "trans+fold")
    assert {c.variant for c in configs.varlen_bwd_candidates(128, False, "dk")} == {"trans+fold"}


def test_nan_in_one_sequence_never_reaches_another():
    """NaN in sequence 1's queries and keys (and in the storage around the packed tensors):
    every output and gradient of sequences 0 and 2 is bitwise the clean run's."""
    lens = [(9, 12), (7, 5), (11, 20)]
    xs, cu_q, cu_k, mq, mk = pack(lens, 2, 1, 2, 16, 8, seed=4)
    g = torch.randn(xs[0].shape[:2], generator=torch.Generator().manual_seed(5))

    def in_nan_storage(x):  # a strided view inside a NaN buffer: rows and dims around it are NaN
        buf = torch.full((x.shape[0] + 8, x.shape[1], x.shape[2] + 5), float("nan"), dtype=x.dtype)
        view = buf[4:4 + x.shape[0], :, 2:2 + x.shape[2]]
        view.copy_(x)
        return view

    for causal, mode in ((True, "fused"), (True, "deterministic"), (False, "separate")):
        kw = dict(causal=causal, **MODES[mode])
        clean = run_varlen(xs, cu_q, cu_k, mq, mk, (True,) * 4, g, **kw)
        dirty_xs = [in_nan_storage(x) for x in xs]
        for x, sl in zip(dirty_xs, (slice(9, 16), slice(12, 17)) * 2):
            x.data[sl.start + 2] = float("nan")  # one row / key of sequence 1
        ins = [x.detach().requires_grad_() for x in dirty_xs]
        kl = streamkl_gpu.attention_kl_varlen(*ins, cu_q, cu_k, mq, mk, **kw)
        kl.backward(g)
        others_q = torch.cat([torch.arange(0, 9), torch.arange(16, 27)])
        others_k = torch.cat([torch.arange(0, 12), torch.arange(17, 37)])
        assert torch.equal(kl.detach()[others_q], clean[0][others_q]), (causal, mode)
        assert torch.isnan(kl.detach()[9:16]).any()  # and it does reach its own sequence
        for name, x in zip(GRAD_NAMES, ins):
            idx = others_q if name.startswith("dq") else others_k
            assert torch.equal(x.grad[idx], clean[1][name][idx]), (name, causal, mode)


@pytest.mark.parametrize("tma", [True], indirect=True)
def test_tma_keys(tma):
    """Keys through TMA descriptors over the packed [1, H_K, total_k, D] views: bitwise the
    per-sequence TMA forward, and a tile that runs into the next sequence (NaN there) or past
    total_k (NaN storage after the tensor) leaves the other sequences' rows bitwise unchanged."""
    lens = [(9, 20), (5, 7), (18, 13)]
    xs, cu_q, cu_k, mq, mk = pack(lens, 2, 1, 2, 16, 16, seed=8)
    g = torch.randn(xs[0].shape[:2], generator=torch.Generator().manual_seed(9))
    for causal in (False, True):
        kw = dict(causal=causal, split_k=1, bwd_mode="separate")
        clean = run_varlen(xs, cu_q, cu_k, mq, mk, (True,) * 4, g, **kw)
        assert_bitwise(clean, run_per_sequence(xs, cu_q, cu_k, (True,) * 4, g, **kw))
        dirty = []
        for x in xs:  # aligned views (TMA-eligible) of buffers with NaN rows after the tensor
            buf = torch.full((x.shape[0] + 16, *x.shape[1:]), float("nan"))
            buf[:x.shape[0]] = x
            dirty.append(buf[:x.shape[0]])
        dirty[1][20 + 3] = float("nan")  # a key of sequence 1 (k1)
        dirty[3][20 + 3] = float("nan")  # (k2)
        kl, _ = run_varlen(dirty, cu_q, cu_k, mq, mk, (False,) * 4, g, **kw)
        others = torch.cat([torch.arange(0, 9), torch.arange(14, 32)])
        assert torch.equal(kl[others], clean[0][others]), causal


def test_empty_and_zero_length_sequences():
    xs, cu_q, cu_k, mq, mk = pack([(0, 4), (0, 0)])
    kl, grads = run_varlen(xs, cu_q, cu_k, mq, mk, (True,) * 4, torch.zeros(0, 2))
    assert kl.shape == (0, 2) and kl.dtype == torch.float32
    assert grads["dq1"].shape == (0, 2, 16) and torch.equal(grads["dk2"], torch.zeros(4, 2, 8))
    # queries with no keys anywhere: KL 0, zero gradients
    xs, cu_q, cu_k, mq, mk = pack([(3, 0), (2, 0)])
    kl, grads = run_varlen(xs, cu_q, cu_k, mq, mk, (True,) * 4, torch.ones(5, 2), causal=True)
    assert torch.equal(kl, torch.zeros(5, 2)) and torch.equal(grads["dq2"], torch.zeros(5, 2, 8))
    # batch = 0
    xs, cu_q, cu_k, mq, mk = pack([])
    assert streamkl_gpu.attention_kl_varlen(*xs, cu_q, cu_k, 0, 0).shape == (0, 2)


def good():
    return pack([(3, 5), (4, 2)])


@pytest.mark.parametrize("change,pattern", [
    (dict(cu_q=torch.tensor([0, 3, 7])), r"cu_seqlens_q must have dtype torch.int32, got torch.int64"),
    (dict(cu_k=torch.tensor([[0, 5, 7]], dtype=torch.int32)), r"cu_seqlens_k must be 1-D"),
    (dict(cu_k=torch.tensor([0, 7], dtype=torch.int32)), r"cu_seqlens_q has 3 entries but cu_seqlens_k has 2"),
    (dict(cu_q=torch.tensor([0, 3, 7], dtype=torch.int32, device="meta")), r"cu_seqlens_q is on meta"),
    (dict(cu_q=[0, 3, 7]), r"cu_seqlens_q must be a torch.Tensor"),
    (dict(mq=2.5), r"max_seqlen_q must be a non-negative integer"),
    (dict(q1=torch.zeros(1, 7, 2, 16)), r"q1 must have 3 dimensions \[total, H, D\]"),
    (dict(k1=torch.zeros(7, 1, 16, dtype=torch.float16)), r"k1 has dtype torch.float16 but q1 has torch.float32"),
    (dict(q2=torch.zeros(7, 2, 8, dtype=torch.float64)), r"q2 has dtype torch.float64"),
])
@pytest.mark.parametrize("check_seqlens", [True, False])
def test_bad_input_always_raises(change, pattern, check_seqlens):
    xs, cu_q, cu_k, mq, mk = good()
    args = dict(q1=xs[0], k1=xs[1], q2=xs[2], k2=xs[3], cu_q=cu_q, cu_k=cu_k, mq=mq, mk=mk)
    args.update(change)
    with pytest.raises(ValueError, match=pattern):
        streamkl_gpu.attention_kl_varlen(args["q1"], args["k1"], args["q2"], args["k2"], args["cu_q"],
                                         args["cu_k"], args["mq"], args["mk"], check_seqlens=check_seqlens)


BAD_VALUES = [
    (dict(cu_q=[1, 3, 7]), r"cu_seqlens_q must start at 0"),
    (dict(cu_k=[0, 6, 5]), r"cu_seqlens_k must be non-decreasing"),
    (dict(cu_q=[0, 3, 9]), r"cu_seqlens_q must end at the number of packed rows \(7\), got 9"),
    (dict(mk=4), r"cu_seqlens_k: sequence 0 has length 5 > max_seqlen_k = 4"),
]


@pytest.mark.parametrize("change,pattern", BAD_VALUES)
def test_bad_seqlens_values_raise_when_checked(change, pattern):
    xs, cu_q, cu_k, mq, mk = good()
    cu = dict(cu_q=cu_q, cu_k=cu_k)
    cu.update({k: torch.tensor(v, dtype=torch.int32) for k, v in change.items() if k.startswith("cu")})
    with pytest.raises(ValueError, match=pattern):
        streamkl_gpu.attention_kl_varlen(*xs, cu["cu_q"], cu["cu_k"], mq, change.get("mk", mk))


def test_unchecked_seqlens_are_clamped_never_read_out_of_bounds():
    """check_seqlens=False with cu_seqlens past the totals, negative or decreasing: each sequence's
    bounds are clamped into [0, total] (end >= start), so nothing is read or written out of bounds.
    The inputs are views into a NaN buffer, so a read outside them would show as NaN."""
    lens = [(3, 5), (4, 2), (6, 6)]
    xs, cu_q, cu_k, mq, mk = pack(lens, seed=2)
    nan_views = []
    for x in xs:
        buf = torch.full((x.shape[0] + 64, *x.shape[1:]), float("nan"))
        buf[32:32 + x.shape[0]] = x
        nan_views.append(buf[32:32 + x.shape[0]])
    i32 = dict(dtype=torch.int32)
    for causal in (False, True):
        # past the totals and negative: the result is the clamped packing's
        got = run_varlen(nan_views, torch.tensor([-4, 3, 99, 120], **i32), torch.tensor([0, 5, 70, 50], **i32),
                         16, 16, (True,) * 4, torch.ones(13, 2), causal=causal, check_seqlens=False)
        want = run_varlen(xs, torch.tensor([0, 3, 13, 13], **i32), torch.tensor([0, 5, 13, 13], **i32),
                          16, 16, (True,) * 4, torch.ones(13, 2), causal=causal)
        assert_bitwise(got, want)
        # decreasing (sequences overlap): garbage in, but every value finite (nothing read outside).
        # Overlapping sequences write the same rows from two programs: a data race by construction
        # (the race check found it), so only the bounds are checked here
        with _interpreter_bounds.checked(races=False):
            kl, grads = run_varlen(nan_views, torch.tensor([0, 9, 5, 13], **i32), torch.tensor([0, 9, 4, 13], **i32),
                                   16, 16, (True,) * 4, torch.ones(13, 2), causal=causal, check_seqlens=False)
        assert torch.isfinite(kl).all() and all(torch.isfinite(v).all() for v in grads.values())


def test_torch_compile_fullgraph_matches_eager():
    """A training step over a packed batch traces with no graph break (check_seqlens=False)."""
    xs, cu_q, cu_k, mq, mk = pack([(5, 7), (0, 2), (9, 9)], 4, 2, 1, 16, 32, seed=3)

    def step(q1, k1, q2, k2):
        kl = streamkl_gpu.attention_kl_varlen(q1, k1, q2, k2, cu_q, cu_k, mq, mk, causal=True,
                                              check_seqlens=False)
        return (kl * torch.linspace(0.5, 1.5, kl.shape[0])[:, None]).mean()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        train = (False, False, True, True)
        ins = [x.clone().requires_grad_(t) for x, t in zip(xs, train)]
        loss = fn(*ins)
        loss.backward()
        results.append((loss.detach(), [x.grad for x in ins]))
    (l_e, g_e), (l_c, g_c) = results
    assert torch.equal(l_e, l_c)
    for name, a, b in zip(GRAD_NAMES, g_e, g_c):
        assert (a is None and b is None) or torch.equal(a, b), name


def test_exported_from_package():
    assert "attention_kl_varlen" in streamkl_gpu.__all__
    assert streamkl_gpu.attention_kl_varlen is _varlen.attention_kl_varlen


def test_a_forced_forward_tile_runs_and_keeps_the_result():
    """The forcing hook ``attention_varlen_fwd_config`` (how a benchmark times one packed-forward
    tile): another tile runs (its programs cover other rows and keys per tile) and gives the same KL
    within the float32 rounding of another summation order; anything but a FwdConfig is an error."""
    from streamkl_gpu._core.forcing import forcing
    from streamkl_gpu.attention.configs import FwdConfig

    xs, cu_q, cu_k, mq, mk = pack([(21, 21), (0, 5), (40, 33)], seed=3)
    base = streamkl_gpu.attention_kl_varlen(*xs, cu_q, cu_k, mq, mk, causal=True)
    tile = FwdConfig(block_m=32, block_n=32, num_warps=1, num_stages=1)
    with forcing(attention_varlen_fwd_config=tile):
        forced = streamkl_gpu.attention_kl_varlen(*xs, cu_q, cu_k, mq, mk, causal=True)
    torch.testing.assert_close(forced, base, rtol=1e-5, atol=1e-6)
    with forcing(attention_varlen_fwd_config=(32, 32)), pytest.raises(ValueError, match="FwdConfig"):
        streamkl_gpu.attention_kl_varlen(*xs, cu_q, cu_k, mq, mk, causal=True)
