"""streamkl_gpu._core.triton_keys: a kernel's Triton key is the same whatever the process keyed
before it (Triton 3.6 keyed a kernel without its helper's constexpr globals when no other kernel
had keyed the helper yet; with warm caches ``streamkl verify`` compiled such kernels again)."""
import os
import subprocess
import sys

import pytest

from _compiler_env import compiler_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = '''
import importlib.util, sys
from streamkl_gpu._core import triton_keys
assert triton_keys.install() and triton_keys.install()  # idempotent: wrapped once
path = sys.argv[1]
open(path, "w").write("""
import triton, triton.language as tl
SCALE = tl.constexpr(3)
@triton.jit
def helper(x):
    return x * SCALE
@triton.jit
def kernel_a(p):
    tl.store(p, helper(tl.load(p)))
@triton.jit
def kernel_b(p):
    tl.store(p, helper(tl.load(p)) + 1)
""")
def load(name):  # one source, two module objects: two fresh sets of JIT functions
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
first, second = load("keys_first"), load("keys_second")
first.kernel_b.cache_key  # the helper keyed through another kernel first, in one history only
print("same" if first.kernel_a.cache_key == second.kernel_a.cache_key else "differ")
'''


def test_a_kernels_key_does_not_depend_on_which_kernels_were_keyed_first(tmp_path):
    pytest.importorskip("triton")
    env = compiler_env()  # real JIT functions, keyed, not run
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "kernels.py")], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "same"


INSTALLED = '''
import importlib, sys
importlib.import_module(sys.argv[1])
from triton.runtime.jit import DependenciesFinder
print(getattr(DependenciesFinder._update_hash, "_streamkl_callee_key_first", False))
'''


@pytest.mark.parametrize("module", ["streamkl_gpu.attention.launch", "streamkl_gpu.indexer.api",
                                    "streamkl_gpu._core.gluon_compat"])
def test_the_fix_is_installed_by_what_a_launch_or_an_offline_gluon_compile_imports(module):
    """A fresh process that imports a host module (what any launch imports) or the Gluon compat
    layer (an offline compile, no host) keys kernels with the fix in place."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", INSTALLED, module], capture_output=True, text=True,
                          env=compiler_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "True"
