"""The float64 references kept between runs (streamkl_ref._testing.reference_cache): a repeated
call returns what the first computed without computing it; any change of inputs, options or
function is a new entry; a damaged entry or an unwritable directory never changes a result; off
by default, and on CPU in ``streamkl verify``."""
import argparse
import os

import numpy as np
import pytest

import streamkl_ref
from streamkl_ref._testing import reference_cache


@pytest.fixture
def cache(tmp_path):
    reference_cache.use(tmp_path / "reference")
    yield tmp_path / "reference"
    reference_cache.use(None)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in ((1, 2, 5, 8), (1, 1, 7, 8), (1, 2, 5, 4), (1, 1, 7, 4))]


def test_a_repeated_reference_is_read_back_not_recomputed(cache):
    calls = []

    def counted(*a, **kw):
        calls.append(1)
        return streamkl_ref.attention_kl(*a, **kw)

    xs = _inputs()
    first = reference_cache.call(counted, *xs, causal=True, return_lse=True)
    again = reference_cache.call(counted, *xs, causal=True, return_lse=True)
    assert len(calls) == 1 and len(os.listdir(cache)) == 1
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(again[0], streamkl_ref.attention_kl(*xs, causal=True))


def test_inputs_options_and_function_each_make_a_new_entry(cache):
    xs = _inputs()
    reference_cache.call(streamkl_ref.attention_kl, *xs, causal=True)
    other = [x.copy() for x in xs]
    other[1][0, 0, 3, 2] += 1e-12  # one bit of one input
    reference_cache.call(streamkl_ref.attention_kl, *other, causal=True)
    reference_cache.call(streamkl_ref.attention_kl, *xs, causal=False)
    reference_cache.call(streamkl_ref.attention_kl, *[x.astype(np.float32) for x in xs], causal=True)
    got = reference_cache.call(streamkl_ref.attention_kl_grad, *xs, np.ones((1, 2, 5)), causal=True)
    assert len(os.listdir(cache)) == 5
    want = streamkl_ref.attention_kl_grad(*xs, np.ones((1, 2, 5)), causal=True)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_a_damaged_entry_is_computed_again(cache):
    xs = _inputs()
    want = reference_cache.call(streamkl_ref.attention_kl, *xs, causal=True)
    (entry,) = os.listdir(cache)
    (cache / entry).write_bytes(b"not a pickle")
    np.testing.assert_array_equal(reference_cache.call(streamkl_ref.attention_kl, *xs, causal=True), want)


def test_an_unwritable_directory_only_loses_the_saving(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("x")  # the cache directory would have to be under a file: never writable
    reference_cache.use(blocked / "reference")
    try:
        xs = _inputs()
        np.testing.assert_array_equal(reference_cache.call(streamkl_ref.attention_kl, *xs, causal=True),
                                      streamkl_ref.attention_kl(*xs, causal=True))
    finally:
        reference_cache.use(None)


def test_off_by_default_and_for_verify_on_cpu(monkeypatch, tmp_path):
    from streamkl_gpu import verify

    assert reference_cache.directory() is None
    monkeypatch.setenv("STREAMKL_CACHE_DIR", str(tmp_path))
    args = argparse.Namespace(no_reference_cache=False)
    assert verify.reference_directory(args, "cpu") is None
    assert verify.reference_directory(args, "cuda") == os.path.join(str(tmp_path), "reference")
    assert verify.reference_directory(argparse.Namespace(no_reference_cache=True), "cuda") is None
    with pytest.raises(TypeError, match="cannot key"):
        reference_cache.key(streamkl_ref.attention_kl, (object(),), {})


def test_kept_in_restores_the_setting_before_it(tmp_path):
    assert reference_cache.directory() is None
    with reference_cache.kept_in(tmp_path):
        assert reference_cache.directory() == str(tmp_path)
    assert reference_cache.directory() is None


# ---- the tolerance scale: the same-precision dense results (streamkl_ref._testing.same_precision)

def _count_dense(monkeypatch):
    """Patch the dense PyTorch functions that same_precision calls; returns the list of calls."""
    from streamkl_ref._testing import same_precision

    calls = []
    for name in ("attention_kl_torch", "indexer_kl_torch"):
        def counted(*a, _real=getattr(same_precision, name), _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)
        monkeypatch.setattr(same_precision, name, counted)
    return calls


def _bits(report):
    return [(r.case, r.dtype, r.quantity, np.float64(r.error).tobytes(), np.float64(r.tolerance).tobytes(), r.status)
            for r in report.rows]


def _conformance_rows():
    from streamkl_ref import testing

    def kl_sum(*a, **kw):
        return testing.attention_kl_torch(*a, **kw).sum()

    att = [c for c in testing.attention_cases("cpu") if c.name in ("ragged", "causal_nq>nk", "nan_queries")]
    idx = [c for c in testing.indexer_cases("cpu") if c.name in ("ragged", "causal_nq>nk", "nan_keys")]
    dtypes = ("bfloat16", "float32")
    return (_bits(testing.check_attention_kl(testing.attention_kl_torch, dtypes=dtypes, cases=att))
            + _bits(testing.check_attention_kl(kl_sum, dtypes=dtypes, cases=att[:1], returns="sum",
                                               supports={"grad_inputs": ("q2", "k2")}))
            + _bits(testing.check_indexer_kl(testing.indexer_kl_torch, dtypes=dtypes, cases=idx)))


def test_the_conformance_checks_keep_their_tolerance_scale(monkeypatch, tmp_path):
    calls = _count_dense(monkeypatch)
    want = _conformance_rows()  # cache off: computed
    assert calls
    with reference_cache.kept_in(tmp_path):
        first = _conformance_rows()
        n, misses = len(calls), reference_cache.STATS["misses"]
        again = _conformance_rows()
    assert len(calls) == n and reference_cache.STATS["misses"] == misses  # nothing computed again
    assert first == want and again == want  # errors and tolerances bitwise


def test_verify_keeps_the_tolerance_scale_of_attention_and_varlen_cases(monkeypatch, tmp_path):
    from streamkl_gpu import verify
    from streamkl_ref import testing
    from streamkl_ref._testing.report import Report

    case = next(c for c in testing.attention_cases("cpu") if c.name == "ragged")
    packed = ("varlen_small", ((5, 7), (0, 3), (6, 0), (9, 9)), 2, 1, 2, 16, 8, True, None)

    def rows():
        report = Report(options={})
        verify._check_attention_case(case, "bfloat16", 0, "cpu", report)
        verify._check_varlen_case(packed, "bfloat16", 0, "cpu", report)
        return _bits(report)

    calls = _count_dense(monkeypatch)
    want = rows()
    assert calls
    with reference_cache.kept_in(tmp_path):
        first = rows()
        n, misses = len(calls), reference_cache.STATS["misses"]
        again = rows()
    assert len(calls) == n and reference_cache.STATS["misses"] == misses
    assert first == want and again == want


def test_the_tolerance_scale_is_keyed_by_torch_version_and_dtype():
    import torch

    from streamkl_ref._testing.same_precision import attention_kl_same

    xs, g = _inputs(), np.ones((1, 2, 5))
    kw = dict(dtype="bfloat16", causal=True, scale1=None, scale2=None, torch_version=torch.__version__)
    base = reference_cache.key(attention_kl_same, (*xs, g), kw)
    assert reference_cache.key(attention_kl_same, (*xs, g), dict(kw)) == base
    assert reference_cache.key(attention_kl_same, (*xs, g), {**kw, "torch_version": "0.0"}) != base
    assert reference_cache.key(attention_kl_same, (*xs, g), {**kw, "dtype": "float16"}) != base
    with pytest.raises(ValueError, match="torch_version"):  # a result is only ever computed by the torch it names
        attention_kl_same(*xs, g, **{**kw, "torch_version": "0.0"})
