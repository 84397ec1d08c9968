"""The environment of a test's subprocess that compiles or keys real Triton kernels.

On a machine without a GPU the test session runs under the Triton interpreter (the root
``conftest.py`` sets ``TRITON_INTERPRET=1``): JIT functions are interpreted there, and Gluon does
not run at all. A subprocess that compiles for sm_90 (the SASS tests), keys kernels (the key-order
test) or must see the library as a GPU user does starts from the session's environment without
that variable.
"""
from __future__ import annotations

import os


def compiler_env(**extra: str) -> dict:
    """``os.environ`` without ``TRITON_INTERPRET``, ``TRITON_DEFAULT_FP_FUSION`` defaulted to its
    default (triton 3.9 warns when it is unset), then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env.update(extra)
    return env
