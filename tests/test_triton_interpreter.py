"""streamkl_gpu._core.triton_interpreter: the interpreter's scalar tensors convert to an index
through ``int(data.squeeze())``. Triton 3.6's interpreter did ``int(data)``, which recent NumPy
(2.4.6 on the CPU machine) refuses for the one-element arrays a computed loop bound holds: every
interpreted kernel with such a loop raised and ``streamkl verify --device cpu`` failed every case."""
import numpy as np
import pytest

from streamkl_gpu._core import triton_interpreter

interpreter = pytest.importorskip("triton.runtime.interpreter")


class _Scope:  # what the interpreter's _LangPatchScope records and sets
    def __init__(self):
        self.changes = []

    def set_attr(self, obj, name, value):
        self.changes.append((obj, name, getattr(obj, name, None)))
        setattr(obj, name, value)


class _Handle:
    def __init__(self, data):
        self.data = data


def test_a_one_element_array_indexes_after_the_install(monkeypatch):
    def patch_as_triton_3_6(tensor, scope):  # the conversion triton 3.6's patch step installs
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_as_triton_3_6)

    class Tensor:
        def __init__(self, data):
            self.handle = _Handle(data)

    interpreter._patch_lang_tensor(Tensor, _Scope())
    try:
        int(np.array([3]))
    except TypeError:  # a NumPy that converts 0-dimensional arrays only: the failure, before the install
        with pytest.raises(TypeError):
            range(Tensor(np.array([3], dtype=np.int32)).__index__())
    assert triton_interpreter.install() and triton_interpreter.install()  # idempotent: wrapped once
    scope = _Scope()
    interpreter._patch_lang_tensor(Tensor, scope)
    assert list(range(0, Tensor(np.array([7], dtype=np.int32)), 3)) == [0, 3, 6]
    assert Tensor(np.array(5, dtype=np.int64)).__index__() == 5  # 0-dimensional, as before
    assert [name for _, name, _ in scope.changes] == ["__index__", "__index__"]  # restorable in order


def test_a_computed_loop_bound_runs_under_the_interpreter():
    """The forward's key loops (bounds computed per query tile) in a fresh process with
    TRITON_INTERPRET=1: a causal call runs and matches the float64 reference."""
    import os
    import subprocess
    import sys

    code = """
import torch, streamkl_gpu
q = torch.randn(1, 2, 40, 16); k = torch.randn(1, 2, 40, 16)
kl = streamkl_gpu.attention_kl(q, k, q * 0.5, k, causal=True)
import numpy as np, streamkl_ref
ref = streamkl_ref.attention_kl(*(x.double().numpy() for x in (q, k, q * 0.5, k)), causal=True)
assert kl.shape == (1, 2, 40) and np.allclose(kl.numpy(), ref, rtol=1e-4, atol=1e-5), abs(kl.numpy() - ref).max()
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
