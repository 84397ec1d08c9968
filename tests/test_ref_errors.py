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
