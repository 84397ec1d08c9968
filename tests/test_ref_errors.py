"""Bad input is rejected with a ValueError naming the argument; NaN propagates to the rows it
reaches and nowhere else (never a silent 0)."""
import numpy as np
import pytest

from streamkl_ref.strategies import make_problem
from streamkl_ref import (
    attention_kl,
    attention_kl_grad,
    attention_kl_grad_tiled,
    attention_kl_mp,
    attention_kl_online,
    initial_state,
)

pytestmark = pytest.mark.filterwarnings("error")  # NaN propagates quietly, without invalid-value warnings


def _inputs(B=1, H=4, HK1=2, HK2=1, NQ=3, NK=5, D1=3, D2=2):
    p = make_problem(seed=40, B=B, H=H, HK1=HK1, HK2=HK2, NQ=NQ, NK=NK, D1=D1, D2=D2)
    return list(p.inputs)


def _call(fn, q1, k1, q2, k2, **kw):
    B, H, NQ = q1.shape[0], q1.shape[1], q1.shape[2]
    rows = np.zeros((B, H, NQ)) if q1.ndim == 4 else np.zeros(3)
    if fn is attention_kl_grad:
        return fn(q1, k1, q2, k2, rows, **kw)
    if fn is attention_kl_grad_tiled:
        return fn(q1, k1, q2, k2, rows, rows, rows, rows, **kw)
    return fn(q1, k1, q2, k2, **kw)


FUNCTIONS = [attention_kl, attention_kl_mp, attention_kl_online, attention_kl_grad, attention_kl_grad_tiled]


def _bad_shapes():
    q1, k1, q2, k2 = _inputs()
    return {
        "q1 3-D": ((q1[0], k1, q2, k2), "q1"),
        "k1 5-D": ((q1, k1[None], q2, k2), "k1"),
        "k1 batch": ((q1, np.concatenate([k1, k1]), q2, k2), "k1"),
        "q2 heads": ((q1, k1, q2[:, :2], k2), "q2"),
        "q2 rows": ((q1, k1, q2[:, :, :2], k2), "q2"),
        "k2 keys": ((q1, k1, q2, k2[:, :, :4]), "k2"),
        "k1 heads not dividing H": ((q1, np.concatenate([k1, k1[:, :1]], axis=1), q2, k2), "k1"),
        "k2 head dim": ((q1, k1, q2, k2[..., :1]), "k2"),
        "k1 head dim": ((q1, k1[..., :2], q2, k2), "k1"),
        "q1 complex": ((q1 + 1j, k1, q2, k2), "q1"),
        "k2 strings": ((q1, k1, q2, np.full(k2.shape, "x")), "k2"),
    }


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", sorted(_bad_shapes()))
def test_bad_shapes_name_the_argument(fn, case):
    args, name = _bad_shapes()[case]
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        _call(fn, *args)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("kw, name", [
    ({"scale1": 0.0}, "scale1"), ({"scale1": -1.0}, "scale1"), ({"scale2": float("nan")}, "scale2"),
    ({"scale2": float("inf")}, "scale2"), ({"scale1": "0.5"}, "scale1"), ({"scale2": True}, "scale2"),
])
def test_bad_scales_name_the_argument(fn, kw, name):
    with pytest.raises(ValueError, match=name):
        _call(fn, *_inputs(), **kw)


@pytest.mark.parametrize("fn", [attention_kl_online, attention_kl_grad_tiled], ids=lambda f: f.__name__)
@pytest.mark.parametrize("kw, name", [
    ({"block_q": 0}, "block_q"), ({"block_k": -3}, "block_k"), ({"block_q": 2.0}, "block_q"),
    ({"block_k": True}, "block_k"), ({"dtype": np.float16}, "dtype"), ({"dtype": "int32"}, "dtype"),
])
def test_bad_tiling_options_name_the_argument(fn, kw, name):
    with pytest.raises(ValueError, match=name):
        _call(fn, *_inputs(), **kw)


def test_bad_row_arrays_and_settings_name_the_argument():
    q1, k1, q2, k2 = _inputs()
    good, bad = np.zeros((1, 4, 3)), np.zeros((1, 4, 2))
    with pytest.raises(ValueError, match="grad_kl"):
        attention_kl_grad(q1, k1, q2, k2, bad)
    for position, name in enumerate(("grad_kl", "lse1", "lse2", "kl")):
        rows = [good] * 4
        rows[position] = bad
        with pytest.raises(ValueError, match=name):
            attention_kl_grad_tiled(q1, k1, q2, k2, *rows)
    for settings in [(), ("3",), ("1", "x"), 12]:
        with pytest.raises(ValueError, match="settings"):
            attention_kl_grad_tiled(q1, k1, q2, k2, good, good, good, good, settings=settings)
    with pytest.raises(ValueError, match="dps"):
        attention_kl_mp(q1, k1, q2, k2, dps=10)
    with pytest.raises(ValueError, match="dtype"):
        initial_state((2,), np.int64)


def _forward_variants(p):
    yield "dense", attention_kl(*p.inputs, **p.kw)
    yield "mp", attention_kl_mp(*p.inputs, **p.kw)
    for dtype in (np.float64, np.float32):
        for base2 in (False, True):
            yield f"online {dtype.__name__} base2={base2}", attention_kl_online(
                *p.inputs, **p.kw, block_q=2, block_k=2, dtype=dtype, base2=base2).kl


def test_nan_in_a_query_poisons_exactly_its_row():
    p = make_problem(seed=41, NQ=4, NK=5, causal=True)
    p.q1[0, 1, 2, 0] = np.nan
    for name, kl in _forward_variants(p):
        assert np.isnan(kl[0, 1, 2]), name
        others = np.ones(kl.shape, bool)
        others[0, 1, 2] = False
        assert np.all(np.isfinite(kl[others])), name


def test_nan_in_a_key_poisons_the_rows_that_see_it():
    # causal, N_Q = N_K = 5: key 3 is seen by rows 3 and 4 only; GQA: k2 head 0 is read by heads 0, 1
    p = make_problem(seed=42, H=2, HK1=1, HK2=1, NQ=5, NK=5, causal=True)
    p.k2[0, 0, 3, 1] = np.nan
    for name, kl in _forward_variants(p):
        assert np.all(np.isnan(kl[0, :, 3:])), name
        assert np.all(np.isfinite(kl[0, :, :3])), name


def test_nan_reaches_the_gradients_it_touches():
    p = make_problem(seed=43, H=1, HK1=1, HK2=1, NQ=4, NK=4)
    p.q2[0, 0, 1, 0] = np.nan
    g = np.ones((1, 1, 4))
    kl, lse1, lse2 = attention_kl(*p.inputs, **p.kw, return_lse=True)
    for grads in (attention_kl_grad(*p.inputs, g, **p.kw),
                  attention_kl_grad_tiled(*p.inputs, g, lse1, lse2, kl, **p.kw, block_q=2, block_k=3)):
        for key in ("dq1", "dq2"):
            assert np.all(np.isnan(grads[key][0, 0, 1])), key  # the poisoned row
            assert np.all(np.isfinite(grads[key][0, 0, [0, 2, 3]])), key  # the other rows
        assert np.all(np.isnan(grads["dk1"])) and np.all(np.isnan(grads["dk2"]))  # row 1 sees every key
    # a NaN upstream gradient poisons its row's gradients (never a silent 0)
    g_nan = np.ones((1, 1, 4))
    g_nan[0, 0, 3] = np.nan
    clean = make_problem(seed=43, H=1, HK1=1, HK2=1, NQ=4, NK=4)
    grads = attention_kl_grad(*clean.inputs, g_nan, **clean.kw)
    assert np.all(np.isnan(grads["dq2"][0, 0, 3])) and np.all(np.isfinite(grads["dq2"][0, 0, :3]))


NON_BOOLS = ["False", None, 1, 0.0]


@pytest.mark.parametrize("value", NON_BOOLS, ids=repr)
def test_a_non_bool_causal_is_an_error_in_every_reference(value):
    """``causal="False"`` is truthy: every entry point refuses it with streamkl_gpu's message."""
    import streamkl_ref

    q1, k1, q2, k2 = _inputs()
    B, H, NQ = q1.shape[:3]
    rows = np.zeros((B, H, NQ))
    packed = [x[0].transpose(1, 0, 2) for x in (q1, k1, q2, k2)]
    cu_q, cu_k = np.array([0, NQ], np.int32), np.array([0, k1.shape[2]], np.int32)
    calls = {
        "attention_kl": lambda c: streamkl_ref.attention_kl(q1, k1, q2, k2, causal=c),
        "attention_kl_mp": lambda c: streamkl_ref.attention_kl_mp(q1, k1, q2, k2, causal=c),
        "attention_kl_online": lambda c: streamkl_ref.attention_kl_online(q1, k1, q2, k2, causal=c),
        "attention_kl_grad": lambda c: streamkl_ref.attention_kl_grad(q1, k1, q2, k2, rows, causal=c),
        "attention_kl_grad_tiled": lambda c: streamkl_ref.attention_kl_grad_tiled(q1, k1, q2, k2, rows, rows, rows,
                                                                                  rows, causal=c),
        "attention_kl_varlen": lambda c: streamkl_ref.attention_kl_varlen(*packed, cu_q, cu_k, NQ, k1.shape[2],
                                                                          causal=c),
        "attention_kl_varlen_grad": lambda c: streamkl_ref.attention_kl_varlen_grad(
            *packed, cu_q, cu_k, NQ, k1.shape[2], rows[0].T, causal=c),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"causal must be a bool, got .* of type"):
            call(value)
        call(False)  # a bool is fine
        call(np.bool_(True))


@pytest.mark.parametrize("value", NON_BOOLS, ids=repr)
def test_a_non_bool_causal_or_relu_is_an_error_in_the_indexer_references(value):
    import streamkl_ref

    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 1, 5, 4))
    qi, ki, w = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 1, 5, 4)), rng.standard_normal((1, 2, 3))
    topk = np.zeros((1, 3, 2), np.int64)
    topk[..., 1] = 1
    g = np.zeros((1, 3))
    calls = {
        "indexer_kl": lambda **f: streamkl_ref.indexer_kl(q, k, qi, ki, w, **f),
        "indexer_kl_mp": lambda **f: streamkl_ref.indexer_kl_mp(q, k, qi, ki, w, **f),
        "indexer_kl_online": lambda **f: streamkl_ref.indexer_kl_online(q, k, qi, ki, w, **f),
        "indexer_kl_grad": lambda **f: streamkl_ref.indexer_kl_grad(q, k, qi, ki, w, g, **f),
        "indexer_kl_topk": lambda **f: streamkl_ref.indexer_kl_topk(q, k, qi, ki, w, topk, **f),
        "indexer_kl_topk_grad": lambda **f: streamkl_ref.indexer_kl_topk_grad(q, k, qi, ki, w, topk, g, **f),
    }
    for name, call in calls.items():
        for flag in ("causal", "relu"):
            with pytest.raises(ValueError, match=rf"{flag} must be a bool, got .* of type"):
                call(**{flag: value})
        call(causal=True, relu=np.bool_(False))


def test_no_heads_is_an_error_that_says_so():
    q1, k1, q2, k2 = _inputs()
    with pytest.raises(ValueError, match=r"q1 has 0 query heads; .*H >= 1"):
        attention_kl(q1[:, :0], k1[:, :0], q2[:, :0], k2[:, :0])
    with pytest.raises(ValueError, match=r"k1 has 0 key heads; .*H_K >= 1"):
        attention_kl(q1, k1[:, :0], q2, k2)


def test_the_dense_torch_formulas_refuse_a_non_bool_flag_too():
    import torch

    from streamkl_ref.testing import attention_kl_torch, attention_kl_torch_chunked, indexer_kl_torch

    x = torch.randn(1, 2, 3, 4)
    for fn in (attention_kl_torch, attention_kl_torch_chunked):
        with pytest.raises(ValueError, match=r"causal must be a bool, got 'False' of type str"):
            fn(x, x, x, x, causal="False")
    w = torch.randn(1, 2, 3)
    for flag in ("causal", "relu"):
        with pytest.raises(ValueError, match=rf"{flag} must be a bool"):
            indexer_kl_torch(x, x, x, x, w, **{flag: "yes"})


def test_a_cpu_scale_tensor_that_requires_grad_is_an_error_as_on_cuda():
    import torch

    import streamkl_gpu

    x = torch.randn(1, 2, 3, 16)
    scale = torch.tensor(0.25, requires_grad=True)
    with pytest.raises(ValueError, match=r"scale1 is a tensor that requires grad"):
        streamkl_gpu.attention_kl(x, x, x, x, scale1=scale)
    streamkl_gpu.attention_kl(x, x, x, x, scale1=scale.detach())  # a plain CPU 0-dim tensor is fine
