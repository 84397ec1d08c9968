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


def test_top_level_help_names_the_verify_gate_and_its_impl_option(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "--impl MODULE:FUNCTION" in out and "--version" in out


def test_version_prints_the_package_torch_and_triton_versions(capsys):
    from importlib import metadata

    import streamkl_ref

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith(f"streamkl {streamkl_ref.__version__} (")
    for package in ("torch", "triton"):
        try:
            want = metadata.version(package)
        except metadata.PackageNotFoundError:
            want = "not installed"
        assert f"{package} {want}" in out


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


# --- the status of a tile is the row's; the KL formula of every mode; shapes; quiet pipes ----
def _trace(capsys, *argv):
    code, out, err = run(capsys, "trace", "--json", *argv)
    assert code == 0, err
    return json.loads(out)


def test_status_is_the_rows_not_the_query_blocks(capsys):
    # non-causal, N_Q = 5 with block_q = 4: the second query block has 3 padding rows; row 4
    # still sees every key of every tile (N_K = 8 = 2 tiles of 4)
    trace = _trace(capsys, "--nq", "5", "--nk", "8", "--block-q", "4", "--block-k", "4")
    for row in trace["rows"]:
        assert [(t["status"], t["keys_seen"]) for t in row["tiles"]] == [("whole", 4), ("whole", 4)], row["row"]
    # causal: per row, the keys seen add up to the keys the row sees; a tile is whole only when
    # the row sees all block_k columns, skipped only when the kernel skipped it
    trace = _trace(capsys, "--causal", "--nq", "7", "--nk", "9", "--block-q", "3", "--block-k", "2")
    assert trace["tiles_skipped"] > 0
    for row in trace["rows"]:
        assert sum(t["keys_seen"] for t in row["tiles"]) == row["visible_keys"]
        for t in row["tiles"]:
            first, last = t["key_start"], t["key_start"] + 2  # the tile's columns
            seen = sum(1 for j in range(first, last) if j < 9 and j <= row["row"] + 9 - 7)
            if t["status"] != "skipped":
                assert t["keys_seen"] == seen
                assert (t["status"] == "whole") == (seen == 2)
            else:
                assert seen == 0
    # the row with the diagonal tile whole for itself, masked for the block: row 6 sees keys 0-8
    row6 = next(r for r in trace["rows"] if r["row"] == 6)
    assert [t["status"] for t in row6["tiles"]] == ["whole"] * 4 + ["masked"]  # key 9 is past N_K
    _, text, _ = run(capsys, "trace", "--nq", "5", "--nk", "8")
    for name, meaning in cli.STATUS_LEGEND.items():
        assert f"  {name:<8}{meaning}" in text
    assert "whole 4/4" in text and "masked" not in text.split("tiles per")[1]


def _evaluate(expression: str) -> float:
    """The arithmetic of a printed line such as ``-2.16/5.99 + ln(3.4/5.9)`` (numbers, + - * /,
    ln, log2 and nothing else)."""
    import ast
    import math
    tree = ast.parse(expression.replace("ln(", "log(").strip(), mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub,
               ast.Constant, ast.Call, ast.Name, ast.Load)
    assert all(isinstance(node, allowed) for node in ast.walk(tree)), expression
    return eval(compile(tree, "<printed>", "eval"), {"__builtins__": {}}, {"log": math.log, "log2": math.log2})


@pytest.mark.parametrize("accumulator", ["plain", "max_referenced"])
@pytest.mark.parametrize("base2", [False, True])
def test_kl_comes_out_of_the_five_numbers_in_every_mode(capsys, accumulator, base2):
    argv = ["--nq", "3", "--nk", "7", "--seed", "5", "--accumulator", accumulator] + (["--base2"] if base2 else [])
    trace = _trace(capsys, *argv)
    formula = trace["kl_formula"]
    assert formula == cli.kl_formula(accumulator, base2)
    if base2:  # bits, then times ln 2
        assert formula["kl"].startswith("KL_bits = ") and "log2(l2/l1)" in formula["kl"]
        assert "2^(s1_j - m1)" in formula["acc"] and formula["nats"] == "KL = ln(2) * KL_bits (nats)"
    else:
        assert formula["kl"].startswith("KL = ") and "ln(l2/l1)" in formula["kl"] and formula["nats"] is None
        assert "exp(s1_j - m1)" in formula["acc"] and "log2" not in " ".join(v for v in formula.values() if v)
    assert ("(s1_j - m1) - (s2_j - m2)" in formula["acc"]) == (accumulator == "max_referenced")
    for row in trace["rows"]:
        assert abs(row["finish"]["kl_nats"] - row["kl_online"]) <= 1e-13 * max(1.0, abs(row["kl_online"]))

    _, text, _ = run(capsys, "trace", *argv)
    assert f"accumulator {accumulator}: {formula['acc']}" in text
    assert text.count(f"KL from the last state: {formula['lse']}; {formula['kl']}") == 3
    final = {int(l.split()[0]): float(l.split()[1]) for l in text[text.index("final KL"):].splitlines()[2:]}
    name = "KL_bits" if base2 else "KL"
    lines = text.splitlines()
    checked = 0
    for i, line in enumerate(lines):
        if not line.startswith(f"  {name} = "):
            continue
        # "  KL = <arithmetic on the printed state> = <value> nats|bits": the printed numbers
        # (12 digits) put through the printed formula give the printed value
        lhs, value = line.split(" = ", 1)[1].rsplit(" = ", 1)
        value = float(value.split()[0])
        assert abs(_evaluate(lhs) - value) <= 1e-9 * max(1.0, abs(value)), line
        row = int(next(l for l in reversed(lines[:i]) if l.startswith("row ")).split()[1])
        nats = value
        if base2:
            nats_line = lines[i + 1]
            assert nats_line.startswith("  KL = ln(2) * KL_bits (nats): ln(2) * ")
            nats = float(nats_line.rsplit(" = ", 1)[1].split()[0])
            assert abs(nats - value * 0.6931471805599453) <= 1e-11 * max(1.0, abs(nats))
        assert abs(nats - final[row]) <= 1e-11 * max(1.0, abs(nats))
        checked += 1
    assert checked == 3


def test_a_row_that_sees_no_key_says_so(capsys):
    _, text, _ = run(capsys, "trace", "--causal", "--nq", "4", "--nk", "2", "--rows", "0")
    assert "KL of the row: it sees no key (m1 = -inf): KL = 0 and LSE = -inf by definition" in text


def test_json_records_shapes_and_options(capsys):
    trace = _trace(capsys, "--nq", "3", "--nk", "5", "--d1", "6", "--d2", "2", "--seed", "4", "--block-q", "2",
                   "--block-k", "3", "--causal", "--base2", "--accumulator", "max_referenced", "--dps", "30",
                   "--rows", "1-2")
    assert trace["shapes"] == {"q1": [1, 1, 3, 6], "k1": [1, 1, 5, 6], "q2": [1, 1, 3, 2], "k2": [1, 1, 5, 2],
                               "kl": [1, 1, 3]}
    assert trace["params"] == {"nq": 3, "nk": 5, "d1": 6, "d2": 2, "seed": 4, "block_q": 2, "block_k": 3,
                               "causal": True, "base2": True, "dps": 30, "accumulator": "max_referenced",
                               "rows": [1, 2]}
    assert np.array(trace["inputs"]["k1"]).shape == (5, 6)
    assert trace["status_legend"] == cli.STATUS_LEGEND


def test_output_cut_short_by_the_reader_ends_quietly():
    """`streamkl trace --json | head`: the reader goes away; no BrokenPipeError traceback."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "streamkl_ref", "trace", "--json", "--nq", "48", "--nk", "48"],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()  # like head: read a little, then close the pipe
    proc.stdout.close()     # the output (~1 MB) is far more than a pipe holds: the writer hits EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == "", err
