"""The conformance suite (streamkl_ref.testing) on real code: it rejects each deliberately wrong
implementation with a message naming the case and the quantity, passes correct ones through
every adapter, reports claims honestly (skipped, never passed), and runs from the command line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _conformance_impls as impls
from streamkl_ref import testing
from streamkl_ref.testing import (
    ATTENTION_CASES,
    INDEXER_CASES,
    assert_attention_kl_conforms,
    assert_indexer_kl_conforms,
    attention_cases,
    check_attention_kl,
    check_indexer_kl,
    tolerance,
)

ROOT = Path(__file__).resolve().parents[1]
FWD_ONLY = {"nan_isolation": "forward"}  # the dense formulas isolate NaN in the forward only
CASE_NAMES = {c.name for c in ATTENTION_CASES}


def test_importing_streamkl_ref_and_its_testing_module_never_imports_torch():
    code = ("import sys, streamkl_ref, streamkl_ref.testing; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_tolerance_is_the_rule_and_rejects_bad_arguments():
    assert tolerance(1e-7, "float32") == pytest.approx(3e-7 + 2e-6)
    assert tolerance(1e-3, torch.bfloat16) == pytest.approx(3e-3 + 8e-3)
    assert tolerance(0.0, "float16", ratio=2.0, floor=0.0) == 0.0
    with pytest.raises(ValueError, match="dtype"):
        tolerance(1e-7, "int8")
    with pytest.raises(ValueError, match="same_precision_error"):
        tolerance(float("nan"), "float32")


def test_a_correct_isolating_formula_passes_every_case_with_no_skips():
    report = check_attention_kl(impls.correct_isolating)
    assert report.passed, report.table(report.failed)
    assert not report.skipped
    assert {r.case for r in report.rows} == CASE_NAMES
    # each planted case compared what the planted values cannot reach, gradients included
    planted = {(r.case, r.quantity) for r in report.rows if r.case.startswith("nan_")}
    assert ("nan_keys", "kl of rows 0-9 (unreached)") in planted
    assert ("nan_keys", "dq1 of rows 0-9 (unreached)") in planted
    assert ("nan_queries", "dk2 of keys 17-23 (unreached)") in planted


def test_the_plain_dense_formula_isolates_nan_in_the_forward_but_not_in_the_gradients():
    """A fact about the formula everyone writes (masked_fill + log_softmax): autograd's matmul
    backward multiplies the masked zeros by the NaN key, so dq of rows that never see it is NaN."""
    report = check_attention_kl(impls.correct)
    failed = {(r.case, r.quantity.split(" ")[0]) for r in report.failed}
    assert failed == {("nan_keys", "dq1"), ("nan_keys", "dq2"), ("nan_queries", "dk1"), ("nan_queries", "dk2")}
    assert all("not finite" in r.why for r in report.failed)
    honest = check_attention_kl(impls.correct, supports=FWD_ONLY)
    assert honest.passed, honest.table(honest.failed)
    assert {r.case for r in honest.skipped} == {"nan_keys", "nan_queries"}
    assert all(r.status != "pass" for r in honest.rows if r.case.startswith("nan_") and r.quantity.startswith("d"))


WRONG = [
    # (implementation, a case it must fail on, the quantity named there)
    (impls.top_left, "causal_nq<nk", "kl"),
    (impls.gqa_mod, "gqa1_d1>d2", "kl"),
    (impls.scale_one_over_d, "ragged", "kl"),
    (impls.reverse_kl, "ragged", "kl"),
    (impls.lse_in_bf16, "large_logits", "kl"),
    (impls.zero_times_nan, "nan_keys", "kl of rows 0-9 (unreached)"),
    (impls.detached_teacher, "ragged", "dq1"),
    (impls.ragged_off_by_one, "ragged", "kl"),
]


@pytest.mark.parametrize("fn, case, quantity", WRONG, ids=[w[0].__name__ for w in WRONG])
def test_each_wrong_implementation_fails_naming_the_case_and_the_quantity(fn, case, quantity):
    the_case = [c for c in ATTENTION_CASES if c.name == case]
    with pytest.raises(AssertionError) as info:
        assert_attention_kl_conforms(fn, supports=FWD_ONLY, cases=the_case)
    message = str(info.value)
    assert "does not conform" in message
    line = next((ln for ln in message.splitlines() if ln.startswith(case + " ") and f" {quantity} " in ln), None)
    assert line is not None and " fail " in line, message
    assert "case: " in line  # every failing row names what its case is there to catch


def test_the_wrong_implementations_fail_only_where_their_bug_shows():
    """Each bug is invisible to the cases that cannot see it: the suite needs every one of them."""
    by_fn = {fn.__name__: check_attention_kl(fn, supports=FWD_ONLY) for fn, _, _ in WRONG}
    cases = {name: {r.case for r in rep.failed} for name, rep in by_fn.items()}
    # N_Q == N_K: both masks agree
    assert cases["top_left"] == {"causal_nq<nk", "causal_nq>nk", "tiles_causal_large"}
    assert cases["gqa_mod"] == {"gqa1_d1>d2"}  # h % 1 == h // H: only H_K in (1, H) shows it
    assert cases["zero_times_nan"] == {"nan_keys"}  # without planted NaN the leak multiplies finite numbers
    assert "ragged" in cases["ragged_off_by_one"]
    tiles_divide = [testing.Case("tiles_divide", 1, 2, 2, 2, 16, 32, 16, 16)]  # no padded key to let in
    assert check_attention_kl(impls.ragged_off_by_one, cases=tiles_divide).passed
    detached = by_fn["detached_teacher"]
    assert all(r.status != "fail" for r in detached.rows if not r.quantity.startswith(("dq1", "dk1")))


def test_an_lse_kept_in_bf16_hides_in_bf16_tolerances_except_where_the_logits_are_large():
    """With bf16 inputs the tolerance follows bf16 rounding, so a bf16 LSE passes ordinary cases;
    it shows where LSE ~ 60 (spacing 0.25: large_logits, tiles_causal_large) and where KL must be
    exactly 0 (one key: the absolute allowance assumes float32 row statistics)."""
    report = check_attention_kl(impls.lse_in_bf16, dtypes=("bfloat16",), supports=FWD_ONLY)
    assert {r.case for r in report.failed} == {"large_logits", "n=1", "tiles_causal_large"}
    assert any(r.case == "large_logits" and r.quantity == "kl" for r in report.failed)
    assert check_attention_kl(impls.correct, dtypes=("bfloat16",), supports=FWD_ONLY).passed


@pytest.mark.parametrize("fn, options", [
    (impls.correct_bnhd, {"layout": "bnhd"}),
    (impls.correct_sum, {"returns": "sum"}),
    (impls.correct_mean, {"returns": "mean"}),
    (impls.correct_top_left, {"causal_align": "top-left"}),
], ids=["bnhd", "sum", "mean", "top-left"])
def test_correct_implementations_pass_through_the_adapters(fn, options):
    report = assert_attention_kl_conforms(fn, supports=FWD_ONLY, **options)
    assert report.passed
    if options.get("causal_align") == "top-left":
        skipped = {r.case for r in report.skipped if r.quantity == "(all)"}
        assert skipped == {"causal_nq>nk"}  # N_Q > N_K has no top-left form
        translated = [r for r in report.rows if r.case == "causal_nq<nk"]
        assert translated and all(r.status == "pass" for r in translated)  # front-padded queries


def test_a_mismatched_adapter_fails():
    """Rows in [B, H, N_Q] from a bnhd implementation, or a sum declared as rows, are failures."""
    assert not check_attention_kl(impls.correct, layout="bnhd", supports=FWD_ONLY, quick=True).passed
    report = check_attention_kl(impls.correct_sum, supports=FWD_ONLY, quick=True)
    assert not report.passed and "returned shape" in report.failed[0].why


def test_claims_skip_cases_and_never_pass_them():
    report = check_attention_kl(impls.gqa_mod, supports={"gqa": False, **FWD_ONLY})
    assert report.passed  # the bug lives only in GQA cases, which it does not claim
    gqa_cases = {c.name for c in ATTENTION_CASES if c.features()["gqa"]}
    assert {r.case for r in report.skipped} >= gqa_cases
    assert all(r.status == "skipped" for r in report.rows if r.case in gqa_cases)
    with pytest.raises(AssertionError, match="no row passed"):
        assert_attention_kl_conforms(impls.correct, supports={"dtypes": ["bfloat16"]})
    with pytest.raises(ValueError, match="unknown claim 'gqa_mapping'"):
        check_attention_kl(impls.correct, supports={"gqa_mapping": "div"})
    frozen_teacher = check_attention_kl(impls.correct, supports={"grad_inputs": ("q2", "k2"), **FWD_ONLY},
                                        quick=True)
    assert frozen_teacher.passed and {r.quantity for r in frozen_teacher.skipped} >= {"dq1", "dk1"}


def test_an_exception_and_a_missing_gradient_are_failures_that_say_so():
    def raises(*a, **k):
        raise NotImplementedError("no GQA yet")

    report = check_attention_kl(raises, quick=True)
    assert not report.passed and "NotImplementedError: no GQA yet" in report.failed[0].why

    def no_teacher_grad(q1, k1, q2, k2, **kw):
        return impls.correct(q1.detach(), k1.detach(), q2, k2, **kw)

    report = check_attention_kl(no_teacher_grad, quick=True, supports=FWD_ONLY)
    assert any(r.quantity == "dq1" and r.why == "no gradient reached q1" for r in report.failed)


def test_the_json_report_records_rows_options_and_the_shapes_of_each_case():
    report = check_attention_kl(impls.correct_bnhd, layout="bnhd", quick=True, supports=FWD_ONLY)
    data = json.loads(report.to_json())
    assert data["passed"] is True and data["options"]["layout"] == "bnhd"
    assert set(data["cases"]) == {c.name for c in attention_cases(quick=True)}
    assert data["cases"]["gqa1_d1>d2"]["shapes"]["k1"] == [1, 2, 23, 32]
    row = data["rows"][0]
    assert {"case", "dtype", "quantity", "error", "tolerance", "status", "why", "pass"} <= set(row)


def test_streamkl_gpu_kernels_pass_the_quick_battery_under_the_interpreter():
    report = check_attention_kl(__import__("streamkl_gpu").attention_kl,
                                cases=attention_cases(quick=True, planted=False))
    assert report.passed and not report.skipped, report.table(report.failed)


def test_streamkl_gpu_kernels_isolate_planted_nan():
    """Before the issue-9 §1 fix this failed on nan_keys (kl, dq1, dq2 all NaN: 0·NaN)."""
    cases = [c for c in ATTENTION_CASES if c.plant]
    report = check_attention_kl(__import__("streamkl_gpu").attention_kl, cases=cases)
    assert report.passed, report.table(report.failed)


def test_torch_compile_of_the_dense_formula_conforms():
    """Dynamo capture and AOTAutograd's decompositions (``aot_eager``: no C++ build, which takes
    minutes on CI's 2 cores); the inductor build is run by bench/streamkl_bench/conformance_peers.py (the suite's peers section) and its
    result committed under bench/results/."""
    compiled = torch.compile(impls.correct, dynamic=True, backend="aot_eager")
    cases = [c for c in ATTENTION_CASES if c.name in ("ragged", "causal_nq<nk", "nan_keys")]
    report = check_attention_kl(compiled, cases=cases, supports=FWD_ONLY)
    assert report.passed, report.table(report.failed)


def _cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "streamkl_ref", "verify", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_verify_impl_fails_a_wrong_implementation_and_writes_the_cases(tmp_path):
    """The real command line, in a fresh process."""
    out = tmp_path / "r.json"
    proc = _cli("--impl", "_conformance_impls:gqa_mod", "--quick", "--supports", '{"nan_isolation": "forward"}',
                "--json", str(out))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "gqa1_d1>d2" in proc.stdout and " fail " in proc.stdout
    data = json.loads(out.read_text())
    assert data["passed"] is False and data["impl"] == "_conformance_impls:gqa_mod"
    assert data["cases"]["ragged"]["shapes"]["q1"] == [1, 2, 21, 16]
    assert data["options"]["supports"]["nan_isolation"] == "forward"


def test_cli_verify_impl_passes_a_correct_one_through_the_adapters(capsys):
    from streamkl_gpu.verify import main

    assert main(["--impl", "_conformance_impls:correct_bnhd", "--layout", "bnhd", "--quick", "--no-grad"]) == 0
    assert " 0 failed" in capsys.readouterr().out


def test_cli_verify_usage_errors_exit_2(capsys):
    from streamkl_gpu.verify import main

    assert main(["--layout", "bnhd"]) == 2  # adapter options need --impl
    assert main(["--impl", "no_such_module:fn"]) == 2
    assert main(["--impl", "_conformance_impls:correct", "--dtypes", "int8"]) == 2
    assert main(["--impl", "_conformance_impls:correct", "--supports", "{gqa: no}"]) == 2
    err = capsys.readouterr().err
    assert "needs --impl" in err and "no_such_module" in err and "int8" in err and "not JSON" in err


def test_cli_verify_help_is_plain_text_and_every_option_has_help():
    proc = _cli("--help")
    assert proc.returncode == 0
    assert "``" not in proc.stdout and ":func:" not in proc.stdout and ":mod:" not in proc.stdout
    from streamkl_gpu.verify import build_parser

    actions = build_parser()._actions
    assert len(actions) >= 15
    assert all(a.help and a.help.strip() for a in actions), [a.dest for a in actions if not a.help]
    for a in actions:
        assert all(opt in proc.stdout for opt in a.option_strings)


# ---- the indexer loss
WRONG_INDEXER = [
    (impls.idx_top_left, "causal_nq<nk", "kl"),
    (impls.idx_gqa_mod, "gqa", "kl"),
    (impls.idx_mean_log_probs, "ragged", "kl"),  # a geometric mean of the heads is not the mixture
    (impls.idx_mean_of_head_kls, "ragged", "kl"),  # the same gradient, a different value
    (impls.idx_zero_times_nan, "nan_keys", "kl of rows 0-9 (unreached)"),
    (impls.idx_always_relu, "no_relu", "kl"),
]


@pytest.mark.parametrize("fn, case, quantity", WRONG_INDEXER, ids=[w[0].__name__ for w in WRONG_INDEXER])
def test_each_wrong_indexer_loss_fails_naming_the_case_and_the_quantity(fn, case, quantity):
    report = check_indexer_kl(fn, supports=FWD_ONLY)
    assert {r.case for r in report.failed} <= {c.name for c in INDEXER_CASES}
    with pytest.raises(AssertionError) as info:
        assert_indexer_kl_conforms(fn, supports=FWD_ONLY, cases=[c for c in INDEXER_CASES if c.name == case])
    line = next((ln for ln in str(info.value).splitlines()
                 if ln.startswith(case + " ") and f" {quantity} " in ln), None)
    assert line is not None and " fail " in line and "case: " in line, str(info.value)
    if fn in (impls.idx_zero_times_nan, impls.idx_always_relu, impls.idx_gqa_mod):
        assert {r.case for r in report.failed} == {case}  # invisible to every other case


def test_a_dense_indexer_loss_passes_through_the_adapters_and_isolates_the_forward_only():
    assert_indexer_kl_conforms(impls.idx_correct, supports=FWD_ONLY)
    assert_indexer_kl_conforms(impls.idx_megatron_sum, supports=FWD_ONLY, layout="bnhd", returns="sum")
    report = assert_indexer_kl_conforms(impls.idx_top_left, supports=FWD_ONLY, causal_align="top-left")
    assert {r.case for r in report.skipped if r.quantity == "(all)"} == {"causal_nq>nk"}
    leaky = check_indexer_kl(impls.idx_correct)  # autograd's matmul backward: 0 * NaN
    assert {r.case for r in leaky.failed} == {"nan_keys", "nan_queries"}
    assert all(r.quantity.startswith(("dq_idx", "dk_idx", "dweights")) for r in leaky.failed)


def test_streamkl_gpu_indexer_kernel_conforms_under_the_interpreter():
    from streamkl_gpu import indexer_kl

    report = check_indexer_kl(indexer_kl, quick=True)
    assert report.passed and not report.skipped, report.table(report.failed)

    def megatron_mean(*args, **kw):
        return indexer_kl(*args, reduction="mean", **kw)

    cases = [c for c in INDEXER_CASES if c.name == "causal_nq>nk"]  # mean over rows that see a key
    assert check_indexer_kl(megatron_mean, returns="mean", cases=cases).passed


def test_cli_verify_indexer(capsys):
    from streamkl_gpu.verify import main

    assert main(["--impl", "_conformance_impls:idx_gqa_mod", "--indexer", "--quick",
                 "--supports", '{"nan_isolation": "forward"}']) == 1
    out = capsys.readouterr().out
    assert "gqa " in out and " fail " in out


def test_the_peers_table_in_the_docs_is_rendered_from_the_committed_results():
    from streamkl_bench import conformance_peers  # bench/ is on pytest's pythonpath (pyproject.toml)
    csv_path = ROOT / "bench" / "results" / "2026-12-01_cpu_e155475" / "conformance_peers.csv"
    table = (ROOT / "docs" / "_generated" / "conformance_peers.md").read_text()
    assert table == conformance_peers.render_markdown(csv_path)
    data = json.loads(csv_path.with_suffix(".json").read_text())
    assert data["peers"]["torch_kl_div_inf_mask"]["passed"] is False  # NaN from -inf masks
    assert data["peers"]["torch_kl_div_finite_mask"]["passed"] is True
    assert data["peers"]["fla_fused_kl_div"]["passed"] is True


def test_the_peers_script_runs_and_finds_the_kl_div_nan(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "streamkl_bench.conformance_peers", str(tmp_path),
                           "--device", "cpu", "--quick", "--peers", "torch_kl_div_inf_mask,torch_kl_div_finite_mask"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {ln.split()[0]: ln for ln in proc.stdout.splitlines() if ln.startswith("torch_")}
    assert lines["torch_kl_div_inf_mask"].split()[1] == "False" and "causal_nq<nk:kl" in lines["torch_kl_div_inf_mask"]
    assert lines["torch_kl_div_finite_mask"].split()[1] == "True"
    assert (tmp_path / "conformance_peers.json").exists() and (tmp_path / "conformance_peers.md").exists()


# ---- reports that say what is wrong
def test_failing_rows_carry_a_hint_where_one_applies_and_always_the_cases_purpose():
    scalar = check_attention_kl(impls.correct_sum, quick=True, supports=FWD_ONLY)  # returns declared as rows
    assert scalar.failed and all("--returns sum|mean" in r.hint for r in scalar.failed if r.quantity == "kl")
    leaky = check_attention_kl(impls.correct, cases=[c for c in ATTENTION_CASES if c.plant])
    assert leaky.failed and all("'nan_isolation': 'forward'" in r.hint for r in leaky.failed)
    aligned = check_attention_kl(impls.top_left, supports=FWD_ONLY, grads=False)
    assert aligned.failed and all("causal_align='top-left'" in r.hint for r in aligned.failed)
    # a kernel failing outside the causal cases too has another bug: no alignment hint then
    wrong_scale = check_attention_kl(impls.scale_one_over_d, supports=FWD_ONLY, grads=False)
    assert wrong_scale.failed and not any("causal_align" in r.hint for r in wrong_scale.failed)
    for report in (scalar, leaky, aligned, wrong_scale):
        for line, row in zip(report.table(report.failed).splitlines()[1:], report.failed):
            assert f"case: {report.purpose(row.case)}" in line and report.purpose(row.case)


def test_a_call_failure_shows_the_exception_and_no_error_number():
    def raises(q1, k1, q2, k2, **kw):
        raise TypeError("unexpected keyword argument 'scale1'")

    report = check_attention_kl(raises, quick=True)
    row = report.failed[0]
    assert row.quantity == "(call)" and "TypeError: unexpected keyword argument 'scale1'" in row.why
    assert "in raises" in row.why  # the frame it was raised in
    line = report.table([row]).splitlines()[1]
    assert " -  " in line and "inf" not in line and "0.00e+00" not in line


def test_the_status_word_is_the_same_in_the_table_and_the_json():
    report = check_attention_kl(impls.gqa_mod, quick=True, supports=FWD_ONLY, grads=False)
    header, *lines = report.table().splitlines()
    at = header.index("status")
    words = {ln[at:].split()[0] for ln in lines}
    assert words <= {"pass", "fail", "skipped"} and "fail" in words
    assert {r["status"] for r in json.loads(report.to_json())["rows"]} == {"pass", "fail"}


def test_the_case_sets_and_the_generator_are_named_options():
    assert testing.attention_cases(which="large") == testing.LARGE_ATTENTION_CASES
    assert testing.attention_cases(which="all") == ATTENTION_CASES + testing.LARGE_ATTENTION_CASES
    assert testing.attention_cases("cuda") == testing.GPU_ATTENTION_CASES
    assert testing.indexer_cases(which="large") == testing.LARGE_INDEXER_CASES
    assert all(c.why for c in testing.GPU_ATTENTION_CASES + testing.GPU_INDEXER_CASES)
    with pytest.raises(ValueError, match="cases must be one of"):
        check_attention_kl(impls.correct, cases="huge")
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        check_attention_kl(impls.correct, seed=-1)


def test_cli_verify_impl_picks_the_case_set(tmp_path):
    from streamkl_gpu.verify import main

    out = tmp_path / "r.json"
    assert main(["--impl", "_conformance_impls:correct", "--cases", "large", "--no-grad", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())["cases"]) == {c.name for c in testing.LARGE_ATTENTION_CASES}
    assert main(["--impl", "_streaming_impls:acc_not_rescaled_block128", "--no-grad", "--cases", "default",
                 "--supports", '{"nan_isolation": "forward"}', "--json", str(out)]) == 1
    failed = {r["case"] for r in json.loads(out.read_text())["rows"] if r["status"] == "fail"}
    assert failed and all(name.startswith("tiles_") for name in failed)  # one 128-key tile hides it elsewhere


def test_a_kernel_that_stops_at_d128_declares_its_head_dims_and_the_wide_case_is_skipped():
    """The GPU battery's widest case (head dims 256 and 192) is skipped, not failed, for an
    implementation that lists the head dims it takes (docs/conformance.md, the claims table)."""
    narrow = testing.check_attention_kl(impls.correct, cases="large", grads=False,
                                        supports={"head_dims": list(range(1, 129))})
    status = {r.case: r.status for r in narrow.rows}
    assert status["wide_heads_d256_d192"] == "skipped" and narrow.passed
    assert {s for c, s in status.items() if c != "wide_heads_d256_d192"} == {"pass"}


def test_cli_verify_help_lists_the_claims_and_the_case_sets():
    from streamkl_gpu.verify import build_parser

    text = build_parser().format_help()
    assert all(key in text for key in testing.SUPPORT_KEYS) and "no_relu" in text
    assert "--cases {default,large,all}" in text
