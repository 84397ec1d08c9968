"""The custom ops' eager calls (streamkl_gpu/_core/custom_ops.py): in eager mode the indexer's entry
points and packed sequences run the ops' own functions without the dispatcher, bitwise the numbers
of the dispatched ops, and a first training step imports no ``torch._dynamo``.

Kernels under the Triton interpreter on CPU (tests/conftest)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from streamkl_gpu import attention_kl_varlen, indexer_kl, indexer_kl_topk
from streamkl_gpu._core import custom_ops

from test_nn_losses import indexer_inputs, topk_sets


def _dispatched(monkeypatch):
    """Every call through the custom op's dispatcher, as under torch.compile (patching
    torch.compiler.is_compiling instead would leave torch._dynamo, if first imported meanwhile,
    without its special case for the real function)."""
    monkeypatch.setattr(custom_ops, "call", lambda op, *args: op(*args))


def _step(fn, leaves, g_seed=3):
    out = fn()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(g_seed))
    (out * g).sum().backward()
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return out.detach().clone(), grads


def _indexer_leaves(seed=0):
    xs = indexer_inputs(seed=seed)
    return xs[:2], [t.clone().requires_grad_(True) for t in xs[2:]]


def _lse(q, k):
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    return s.masked_fill(~causal, float("-inf")).logsumexp(-1).float()


CASES = {
    # the plain forward and the recomputing backward (per-row losses)
    "rows": lambda t, s: indexer_kl(*t, *s, causal=True),
    # the chunk design (a scalar with lse), and the step that computes the teacher LSEs first
    "mean_lse": lambda t, s: indexer_kl(*t, *s, causal=True, lse=_lse(*t), reduction="mean"),
    "sum_no_lse": lambda t, s: indexer_kl(*t, *s, causal=True, reduction="sum"),
    "topk": lambda t, s: indexer_kl_topk(*t, *s, topk_sets(9, 9, 4, 1), causal=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_eager_equals_the_dispatched_op_bitwise(case, monkeypatch):
    teacher, leaves = _indexer_leaves()
    eager = _step(lambda: CASES[case](teacher, leaves), leaves)
    _dispatched(monkeypatch)
    op = _step(lambda: CASES[case](teacher, leaves), leaves)
    assert torch.equal(eager[0], op[0]), case
    for a, b in zip(eager[1], op[1]):
        assert torch.equal(a, b), case


def test_varlen_eager_equals_the_dispatched_op_bitwise(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    lens = [5, 9]
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    xs = [torch.randn(14, 2, 8, generator=gen) for _ in range(4)]
    leaves = [xs[2].requires_grad_(True), xs[3].requires_grad_(True)]

    def run():
        return attention_kl_varlen(*xs, cu, cu, max(lens), max(lens), causal=True)

    eager = _step(run, leaves)
    _dispatched(monkeypatch)
    op = _step(run, leaves)
    assert torch.equal(eager[0], op[0])
    assert all(torch.equal(a, b) for a, b in zip(eager[1], op[1]))


def test_no_grad_calls_record_nothing():
    from streamkl_gpu.indexer.api import _indexer_fwd_op

    teacher, leaves = _indexer_leaves()
    with torch.no_grad():
        out = indexer_kl(*teacher, *leaves, causal=True)
    assert not out.requires_grad
    kl = custom_ops.call(_indexer_fwd_op, *teacher, *[t.detach() for t in leaves], None, True, 0.25, True)[0]
    assert not kl.requires_grad


def test_a_first_training_step_imports_no_dynamo():
    """The dispatcher's first eager call imports torch._dynamo (1 s and more): the eager path does not."""
    code = (
        "import sys, torch\n"
        "from test_nn_losses import indexer_inputs\n"
        "import streamkl_gpu\n"
        "xs = indexer_inputs()\n"
        "leaves = [t.requires_grad_(True) for t in xs[2:]]\n"
        "streamkl_gpu.indexer_kl(*xs[:2], *leaves, causal=True).sum().backward()\n"
        "streamkl_gpu.indexer_kl(*xs[:2], *leaves, causal=True, reduction='mean').backward()\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
        "print('ok')\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=here, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
