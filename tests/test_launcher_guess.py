"""streamkl_gpu.devtools.launcher_guess: with a Triton that builds no launcher per kernel (CI's 3.9)
it says so and stops; with one that does (the GPU image's 3.6) it compares the sources of a small
call's kernels (a wider run is committed under bench/results/)."""
import os
import subprocess
import sys

from _compiler_env import compiler_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_check_runs_or_says_there_is_nothing_to_check():
    """CI's Triton builds no launcher per kernel: the tool says so and exits non-zero. A Triton that
    does (3.6) compares the sources of a small setting-1 step's kernels, and every one must match."""
    from streamkl_gpu._core import triton_launchers
    proc = subprocess.run([sys.executable, "-m", "streamkl_gpu.devtools.launcher_guess", "attn:256:s1"], cwd=ROOT,
                          env=compiler_env(), capture_output=True, text=True, timeout=600)
    if triton_launchers._builder() is None:
        assert proc.returncode != 0 and "builds no launcher per kernel: nothing to check" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        total = proc.stdout.strip().splitlines()[-1].split()
        assert total[0] == total[2] != "0", proc.stdout[-500:]


def test_no_spec_prints_the_usage():
    from streamkl_gpu.devtools import launcher_guess
    assert launcher_guess.main([]) == 2
