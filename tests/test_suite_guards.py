"""The suite-wide guards of tests/conftest.py are on: fresh kernel outputs start as NaN (an element
a kernel fails to write cannot pass in any test), and under the interpreter every launch is
bounds- and race-checked (tests/test_interpreter_bounds.py tests the checker itself)."""
import os

import torch

from streamkl_gpu.devtools import bounds as _interpreter_bounds
from streamkl_gpu._core import runtime as _runtime


def test_fresh_outputs_start_as_nan():
    if os.environ.get("STREAMKL_TEST_POISON", "1") == "1":
        assert _runtime.POISON_FRESH
        assert torch.isnan(_runtime.fresh((3, 2), torch.float32, "cpu")).all()


def test_interpreted_launches_are_checked():
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert _interpreter_bounds.installed()
