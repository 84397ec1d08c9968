"""streamkl_gpu.devtools.launcher_guess: with a Triton that builds no launcher per kernel (CI's 3.9)
it says so and stops; with one that does (the GPU image's 3.6) it compares the sources (checked by
hand there, committed under bench/results/)."""
import os
import subprocess
import sys

import pytest

from _compiler_env import compiler_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_per_kernel_launchers_it_says_there_is_nothing_to_check():
    from streamkl_gpu._core import triton_launchers
    if triton_launchers._builder() is not None:
        pytest.skip("this Triton builds a launcher per kernel: the check itself runs (minutes of compiles)")
    proc = subprocess.run([sys.executable, "-m", "streamkl_gpu.devtools.launcher_guess", "attn:256:s1"], cwd=ROOT,
                          env=compiler_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "builds no launcher per kernel: nothing to check" in proc.stderr


def test_no_spec_prints_the_usage():
    from streamkl_gpu.devtools import launcher_guess
    assert launcher_guess.main([]) == 2
