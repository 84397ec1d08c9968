"""streamkl_gpu.devtools.offline_call: the kernels of one indexer or attention training step, compiled for sm_90
on this CPU (no GPU), with what ptxas made of each. Run in a process of its own (it installs a
stand-in driver; the test session runs under the interpreter)."""
import csv
import json
import os
import subprocess
import sys

from _compiler_env import compiler_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path, **extra_env):
    env = compiler_env(**extra_env)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["STREAMKL_CACHE_DIR"] = str(tmp_path / "streamkl")
    return subprocess.run([sys.executable, "-m", "streamkl_gpu.devtools.offline_call", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)


def test_gqa_training_step_kernels_compile_and_report(tmp_path):
    """A GQA-like step with lse given (the chunk design: the storing forward, the keys-major
    gradient kernel), one without (the same after the LSE pass) and one with lse given under the
    accumulating design (its forward and the backward's two student kernels) are found by the walk
    and compiled; each row has ptxas' registers, Hopper MMA (HGMMA) in every kernel but the split
    merge (the GQA storing forward's wide one by default) and the chunk design's backward (its
    gradients scaled and cast), and the config it was compiled with."""
    out = tmp_path / "census.csv"
    proc = _run(["--csv", str(out), "gqa:256:lse", "gqa:256:nolse"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    every = list(csv.DictReader(open(out)))
    assert len(proc.stdout.strip().splitlines()) == len(every)
    merges = ("_merge_states_kernel", "_merge_states_wide_kernel")  # (no MMA in the key splits' merge)
    assert any(r["kernel"] in merges for r in every), every
    scale = "_scale_cast_kernel"  # the chunk design's backward (no MMA either)
    assert {r["spec"] for r in every if r["kernel"] == scale} == {"gqa:256:lse", "gqa:256:nolse"}, every
    rows = [r for r in every if r["kernel"] not in merges + (scale,)]
    kernels = {spec: [r["kernel"] for r in rows if r["spec"] == spec] for spec in ("gqa:256:lse", "gqa:256:nolse")}
    assert {"_indexer_fwd_gqa_store_kernel", "_chunk_grad_keys_kernel"} <= set(kernels["gqa:256:lse"]), kernels
    assert {"_teacher_lse_kernel", "_indexer_fwd_gqa_store_kernel", "_chunk_grad_keys_kernel"} <= set(
        kernels["gqa:256:nolse"]), kernels
    accumulating = tmp_path / "accumulating.csv"
    proc = _run(["--csv", str(accumulating), "gqa:256:lse"], tmp_path, STREAMKL_INDEXER_TRAINING="accumulate")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows_acc = list(csv.DictReader(open(accumulating)))
    assert {"_indexer_fwd_pacc_kernel", "_indexer_bwd_dq_kernel"} <= {r["kernel"] for r in rows_acc}, rows_acc
    rows += rows_acc
    assert len(proc.stdout.strip().splitlines()) == len(rows_acc)
    for r in rows:
        assert 0 < int(r["registers"]) <= 255 and int(r["hgmma"]) > 0, r
        assert "num_warps=" in r["config"] and int(r["instructions"]) > int(r["hgmma"]), r


LOOP_COUNTS = """
import json, re
from streamkl_gpu.devtools import offline_call, sass
offline_call._stand_in_gpu()
out, found = {}, {}
for spec in ("attn:1024:both", "attn:1024:s1"):  # the walk records the launches; one kernel is compiled
    found[spec] = {fn.fn.__name__: (fn, grid, args, kwargs) for fn, grid, args, kwargs in offline_call._launches(spec)}
    out[spec] = {name: launch[3].get("GEXP") for name, launch in found[spec].items() if "_bwd_" in name}
fn, grid, args, kwargs = found["attn:1024:both"]["_kl_bwd_dk_kernel"]
body = min(sass.main_loops(sass.sass_of(fn.warmup(*args, grid=grid, **kwargs))), key=len)
out["loop"] = {op: sum(bool(re.search(pattern, t)) for t in body) for op, pattern in
               (("lds", r"\\bLDS"), ("local", r"\\b(LDL|STL)\\b"), ("hgmma", r"\\bHGMMA\\b"))}
print(json.dumps(out))
"""


def test_attention_both_sides_step(tmp_path):
    """The attention training step with both sides trained: the walk finds the rows pre-pass, the
    dK and the dQ kernel, the dK kernel and the pre-pass in their "gexp" form (|g| in the
    exponentials; one side trained: not). Compiled, the dK kernel's unmasked query loop reads one
    16-byte group of row constants per query column a thread holds (8 shared-memory loads for the
    32 x 64 tile of 4 warps, where the six constants of the form before took 16) and touches no
    local memory (the form before spilled there: bench/results/2026-12-07_sass-sm90_b840538/bwd_dk_gexp_sass.csv)."""
    env = compiler_env(TRITON_CACHE_DIR=str(tmp_path / "triton"))
    proc = subprocess.run([sys.executable, "-c", LOOP_COUNTS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["attn:1024:both"] == {"_kl_bwd_rows_kernel": True, "_kl_bwd_dk_kernel": True,
                                     "_kl_bwd_dq_kernel": None}, out
    assert out["attn:1024:s1"]["_kl_bwd_dk_kernel"] is False and not any(out["attn:1024:s1"].values()), out
    assert out["loop"] == {"lds": 8, "local": 0, "hgmma": 20}, out


def test_packed_backward_candidates_fit_in_shared_memory(tmp_path):
    """The packed backward's candidates with one side or both trained, separate and fused (the walk
    compiles every one, as a first call with ``STREAMKL_AUTOTUNE=1`` does): each fits Hopper's
    232,448 bytes of shared memory per program (one over it fails at its first launch, and past
    TUNING_WORK_LIMIT the first candidate runs untimed); the key-major, folded dK tile is among them
    and holds less on its stack (spills) than the old pointer-load tile of the same 64 x 128 shape,
    with fewer MMAs and half its exponentials (both warpgroups of the old tile form the whole score
    tile)."""
    out = tmp_path / "census.csv"
    proc = _run(["--csv", str(out), "varlen:256:s1", "varlen:256:s1:fused", "varlen:256:both",
                 "varlen:256:both:fused"], tmp_path, STREAMKL_AUTOTUNE="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = [r for r in csv.DictReader(open(out)) if r["kernel"].startswith("_kl_bwd")]
    assert rows and all(int(r["shared_bytes"]) <= 232448 for r in rows), rows
    for spec in ("varlen:256:s1", "varlen:256:s1:fused"):
        dk = {"TRANS=True" in r["config"]: r for r in rows if r["spec"] == spec and r["kernel"] == "_kl_bwd_dk_kernel"
              and "BLOCK_M=64 BLOCK_N=128" in r["config"]}
        assert set(dk) == {True, False}, (spec, rows)
        assert int(dk[True]["stack_bytes"]) < int(dk[False]["stack_bytes"]), dk
        assert int(dk[True]["hgmma"]) < int(dk[False]["hgmma"]), dk
        assert 2 * int(dk[True]["mufu_ex2"]) <= int(dk[False]["mufu_ex2"]), dk
    for spec in ("varlen:256:both", "varlen:256:both:fused"):  # the both-sides rule's tile, key-major
        assert any(r["spec"] == spec and "TRANS=True" in r["config"] and "BLOCK_M=32 BLOCK_N=64" in r["config"]
                   for r in rows), (spec, rows)


def test_bad_spec_is_a_clear_error(tmp_path):
    proc = _run(["nosuch:256:lse"], tmp_path)
    assert proc.returncode != 0 and "teacher:N:lse|nolse" in proc.stderr, proc.stderr[-2000:]
    proc = _run(["gqa:256:lse:bogus"], tmp_path)  # the call's own error, not an empty census
    assert proc.returncode != 0 and "reduction must be one of" in proc.stderr, proc.stderr[-2000:]
    proc = _run(["attn:256:three"], tmp_path)
    assert proc.returncode != 0 and "attn:N:s1|s2|both[:full]" in proc.stderr, proc.stderr[-2000:]
    proc = _run(["attn:256:s1:fused"], tmp_path)  # a mode is the packed step's option only
    assert proc.returncode != 0 and "varlen:N:s1|s2|both[:full][:fused|separate]" in proc.stderr, proc.stderr[-2000:]
