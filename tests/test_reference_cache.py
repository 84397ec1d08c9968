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
