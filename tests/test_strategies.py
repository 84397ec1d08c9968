"""streamkl_ref.strategies: the public Hypothesis strategies draw what they promise, and the
planting strategy states the isolation contract the reference's forward keeps."""
import subprocess
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings

import streamkl_ref
from streamkl_ref.strategies import PROFILES, logit_scale, planted_problems, problems, register_profiles, shapes

ROOT = Path(__file__).resolve().parents[1]


def test_import_streamkl_ref_needs_neither_hypothesis_nor_torch():
    code = "import sys, streamkl_ref; bad = {'hypothesis', 'torch'} & set(sys.modules); assert not bad, bad; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_profiles_are_registered_by_name():
    assert register_profiles() == ["streamkl-ci", "streamkl-dev", "streamkl-thorough"]
    assert settings.get_profile("streamkl-ci").derandomize is True
    assert PROFILES["ci"].max_examples == 12 and PROFILES["thorough"].max_examples == 500


@given(shapes(gqa=False, d1_ne_d2=False, nq_ne_nk=False))
def test_shapes_keep_out_what_is_turned_off(s):
    assert s.HK1 == s.H == s.HK2 and s.D1 == s.D2 and s.NQ == s.NK


@given(shapes())
def test_shapes_are_valid_gqa(s):
    assert s.H % s.HK1 == 0 and s.H % s.HK2 == 0 and min(s.NQ, s.NK, s.D1, s.D2, s.B) >= 1


@settings(max_examples=40)
@given(problems(extreme=True, max_d=4))
def test_extreme_problems_are_valid_inputs(p):
    kl = streamkl_ref.attention_kl(*p.inputs, **p.kw)
    assert np.all(np.isfinite(kl)) and np.all(kl >= -1e-9 * (1 + logit_scale(p)))


@given(planted_problems())
def test_planted_values_never_reach_the_rows_that_cannot_see_them(pp):
    clean_kl, clean_l1, clean_l2 = streamkl_ref.attention_kl(*pp.clean.inputs, return_lse=True, **pp.clean.kw)
    kl, l1, l2 = streamkl_ref.attention_kl(*pp.planted.inputs, return_lse=True, **pp.planted.kw)
    ok = pp.rows_ok
    for got, want in ((kl, clean_kl), (l1, clean_l1), (l2, clean_l2)):
        np.testing.assert_array_equal(got[..., ok], want[..., ok])
    planted = np.concatenate([x.ravel() for x in pp.planted.inputs])
    assert not np.isfinite(planted).all()  # something was planted
    clean = np.concatenate([x.ravel() for x in pp.clean.inputs])
    assert np.isfinite(clean).all()  # and the clean problem kept its values


def test_the_docs_property_example_runs_against_an_isolating_torch_formula():
    """docs/conformance.md section 6, verbatim but for the function under test."""
    import re

    import pytest

    import _conformance_impls as impls

    text = (ROOT / "docs" / "conformance.md").read_text()
    block = re.search(r"## 6\..*?```python\n(.*?)```", text, re.S).group(1)
    scope = {"my_kl": impls.correct_isolating}
    exec(compile(block, "docs/conformance.md", "exec"), scope)  # defines the test
    scope["test_invisible_values_never_reach_a_row"]()
    scope["my_kl"] = impls.zero_times_nan  # and it catches a 0 * NaN leak
    with pytest.raises(AssertionError):
        scope["test_invisible_values_never_reach_a_row"]()
