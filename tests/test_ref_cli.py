"""The ``streamkl`` command: ``trace`` (table and JSON) and the ``verify`` hand-off."""
import json
import subprocess
import sys
import types

import numpy as np
import pytest

from streamkl_ref.strategies import Problem, kl_tolerance, logit_scale
from streamkl_ref import OnlineState, attention_kl, attention_kl_mp, finalize_state
from streamkl_ref import cli


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def example_inputs(nq, nk, d1, d2, seed):
    """The documented recipe: default_rng(seed).standard_normal, in the order q1, k1, q2, k2."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((1, 1, nq, d1)), rng.standard_normal((1, 1, nk, d1)),
            rng.standard_normal((1, 1, nq, d2)), rng.standard_normal((1, 1, nk, d2)))


def test_trace_table_final_kl_matches_dense(capsys):
    code, out, _ = run(capsys, "trace", "--nq", "5", "--nk", "7", "--d1", "6", "--d2", "3",
                       "--seed", "3", "--block-k", "3", "--causal")
    assert code == 0
    problem = Problem(*example_inputs(5, 7, 6, 3, 3), causal=True)
    kl = attention_kl(*problem.inputs, causal=True)[0, 0]
    tol = kl_tolerance(kl, logit_scale(problem)[0, 0])
    final = out[out.index("final KL"):].splitlines()[2:]
    assert len(final) == 5
    for i, line in enumerate(final):
        fields = line.split()
        assert int(fields[0]) == i
        online, dense, mp = float(fields[1]), float(fields[2]), float(fields[3])
        assert dense == kl[i]  # printed with 17 significant digits: round-trips exactly
        assert abs(online - dense) <= tol[i] and abs(mp - dense) <= tol[i]
    assert out.count("state after each key tile") == 5
    assert "m1" in out and "acc" in out and "masked" in out


def test_trace_json_is_consistent(capsys):
    code, out, _ = run(capsys, "trace", "--json", "--nq", "6", "--nk", "4", "--block-q", "2",
                       "--block-k", "3", "--causal", "--rows", "0,3-5", "--seed", "7")
    assert code == 0
    trace = json.loads(out)  # standard JSON: non-finite numbers are strings
    problem = Problem(*example_inputs(6, 4, 8, 4, 7), causal=True)
    kl, lse1, _ = attention_kl(*problem.inputs, causal=True, return_lse=True)
    kl_mp = attention_kl_mp(*problem.inputs, causal=True)
    tol = kl_tolerance(kl, logit_scale(problem))
    assert [r["row"] for r in trace["rows"]] == [0, 3, 4, 5]
    assert trace["tiles_visited"] + trace["tiles_skipped"] == 3 * 2
    for row in trace["rows"]:
        i = row["row"]
        assert row["kl_dense"] == kl[0, 0, i] and row["kl_mp"] == kl_mp[0, 0, i]
        assert abs(row["kl_online"] - row["kl_dense"]) <= tol[0, 0, i]
        assert len(row["tiles"]) == 2
        last = row["tiles"][-1]  # the last state finalises to the reported online KL
        state = OnlineState(*(np.array([float(last[k])]) for k in OnlineState._fields))
        assert finalize_state(state)[0][0] == row["kl_online"]
    row0 = trace["rows"][0]  # row 0 sees no key (N_Q > N_K, bottom-right causal)
    assert row0["visible_keys"] == 0 and row0["kl_online"] == 0.0 and row0["lse1_dense"] == "-inf"
    assert all(t["status"] == "skipped" and t["m1"] == "-inf" for t in row0["tiles"])
    assert np.isneginf(lse1[0, 0, 0])


def test_trace_is_deterministic_and_base2_says_bits(capsys):
    _, first, _ = run(capsys, "trace", "--base2", "--seed", "11")
    _, second, _ = run(capsys, "trace", "--base2", "--seed", "11")
    _, other, _ = run(capsys, "trace", "--seed", "11")
    assert first == second
    assert "bits (base 2)" in first and "nats (base e)" in other
    # the final KL (nats) does not depend on the base beyond rounding
    kl_b2 = [float(l.split()[1]) for l in first[first.index("final KL"):].splitlines()[2:]]
    kl_e = [float(l.split()[1]) for l in other[other.index("final KL"):].splitlines()[2:]]
    np.testing.assert_allclose(kl_b2, kl_e, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("argv", [["trace", "--rows", "9"], ["trace", "--rows", "a"],
                                  ["trace", "--nq", "0"], ["trace", "--block-k", "-1"], ["nope"]])
def test_trace_bad_options_return_2(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert code == 2 and "error" in err


def test_help_returns_0(capsys):
    code, out, _ = run(capsys, "trace", "--help")
    assert code == 0 and "--block-k" in out


def test_verify_delegates_all_arguments(capsys, monkeypatch):
    seen = []
    fake = types.ModuleType("streamkl_gpu.verify")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "streamkl_gpu.verify", fake)
    code, _, _ = run(capsys, "verify", "--quick", "--help", "x")
    assert code == 3 and seen == [["--quick", "--help", "x"]]


@pytest.mark.parametrize("missing", ["torch", "triton"])
def test_verify_without_gpu_packages_explains_how_to_install(capsys, monkeypatch, missing):
    def import_module(name):
        raise ModuleNotFoundError(f"No module named '{missing}'", name=missing)

    monkeypatch.setattr(cli, "importlib", types.SimpleNamespace(import_module=import_module))
    code, _, err = run(capsys, "verify")
    assert code == 2
    assert repr(missing) in err and "pip install 'streamkl[gpu]'" in err


def test_reference_package_never_imports_torch():
    script = (
        "import sys, io, contextlib\n"
        "import streamkl_ref\n"
        "from streamkl_ref.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['trace', '--nq', '2', '--nk', '3', '--json']) == 0\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'streamkl_gpu'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
