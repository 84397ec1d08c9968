"""The conformance suite against streaming kernels (tests/_streaming_impls.py: docs/math.md's
recurrence as a float32 PyTorch loop over key tiles): a correct one passes the default battery at
every seed and with either grouping of the last step; one that gets any single rescale of the
recurrence wrong fails it at every seed, at every tile size up to 128."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _streaming_impls as si
from streamkl_ref.testing import (
    ATTENTION_CASES,
    INDEXER_CASES,
    Case,
    check_attention_kl,
    check_indexer_kl,
)

FWD_ONLY = {"nan_isolation": "forward"}  # autograd through the loop is not NaN-isolated
SEEDS = range(10)
# the default battery's rows with several key tiles at every block size up to 128
MULTI_TILE = tuple(c for c in ATTENTION_CASES if c.NK > 2 * max(si.BLOCKS))
INDEXER_MULTI_TILE = tuple(c for c in INDEXER_CASES if c.NK > 2 * max(si.BLOCKS))


def test_the_default_battery_has_several_tiles_at_every_block_up_to_128():
    for cases in (MULTI_TILE, INDEXER_MULTI_TILE):
        assert len(cases) >= 2
        assert any(c.causal for c in cases) and any(not c.causal for c in cases)


@pytest.mark.parametrize("finish", si.FINISHES)
@pytest.mark.parametrize("block", si.BLOCKS)
def test_a_correct_streaming_kernel_passes_the_default_battery_at_seeds_0_to_9(block, finish):
    """The one-key case's KL is exactly 0, and the boxed grouping (``acc/l1 + LSE2 - LSE1``) leaves a
    rounding of the logits' size there: the absolute allowance of a KL row covers it. Gradients at
    seed 0 (autograd through the tile loop is the slow part; the property below draws more), the
    forward at all ten."""
    fn = si.variant(block, finish)
    for seed in SEEDS:
        report = check_attention_kl(fn, supports=FWD_ONLY, seed=seed, grads=seed == 0)
        assert report.passed, f"seed {seed}\n{report.table(report.failed)}"
        assert {r.case for r in report.rows} == {c.name for c in ATTENTION_CASES}


@pytest.mark.parametrize("bug", sorted(si.BUGS))
def test_a_streaming_kernel_with_one_rescale_wrong_fails_at_every_seed_and_block(bug):
    for block in si.BLOCKS:
        fn = si.variant(block, "lse", bug)
        for seed in SEEDS:
            # the battery's own inputs for these rows: a case's inputs depend on the seed and its name only
            report = check_attention_kl(fn, supports=FWD_ONLY, seed=seed, grads=False, cases=MULTI_TILE)
            failed = {r.case for r in report.failed}
            assert failed, f"{bug} at block {block} passed at seed {seed}"
            kl_rows = [r for r in report.failed if r.quantity == "kl"]
            assert kl_rows and all(r.error > 100 * r.tolerance for r in kl_rows)  # by far, not by rounding
            assert all("case: " in line for line in report.table(report.failed).splitlines()[1:])


def test_a_case_draws_the_same_inputs_alone_as_in_the_battery():
    from streamkl_ref.testing import case_generator
    import torch

    case = MULTI_TILE[0]
    a = torch.randn(3, generator=case_generator(4, case))
    assert torch.equal(a, torch.randn(3, generator=case_generator(4, case)))
    assert not torch.equal(a, torch.randn(3, generator=case_generator(5, case)))
    assert not torch.equal(a, torch.randn(3, generator=case_generator(4, MULTI_TILE[1])))


def test_the_small_cases_alone_miss_the_rescale_bugs_at_block_128():
    """Why the multi-tile rows exist: with at most 70 keys, a 128-key tile holds every key of a row."""
    small = tuple(c for c in ATTENTION_CASES if c.NK <= 128 and c.plant is None)
    for bug in ("acc_not_rescaled", "acc_side2_factor", "l1_not_rescaled", "l2_not_rescaled"):
        assert check_attention_kl(si.variant(128, "split", bug), grads=False, cases=small).passed, bug


@settings(max_examples=8, deadline=None)  # on top of the loaded profile (ci: derandomised)
@given(
    block=st.sampled_from(si.BLOCKS),
    finish=st.sampled_from(si.FINISHES),
    seed=st.integers(0, 2 ** 16),
    nq=st.integers(1, 12),
    nk=st.integers(1, 300),
    heads=st.sampled_from([(2, 2, 2), (4, 1, 2), (4, 4, 1)]),
    dims=st.sampled_from([(16, 16), (8, 24)]),
    causal=st.booleans(),
    scales=st.sampled_from([(None, None), (4.0, 3.0), (0.5, 2.0)]),
)
def test_property_a_correct_streaming_kernel_conforms_on_any_shape_and_seed(block, finish, seed, nq, nk, heads,
                                                                             dims, causal, scales):
    case = Case("drawn", 1, *heads, nq, nk, *dims, causal=causal, scale1=scales[0], scale2=scales[1])
    report = check_attention_kl(si.variant(block, finish), cases=[case], seed=seed)
    assert report.passed, report.table(report.failed)


# ---- the indexer loss, streamed (a first pass for the teacher's per-head LSEs, a second for the KL)
@pytest.mark.parametrize("block", si.BLOCKS)
def test_a_correct_streaming_indexer_loss_passes_the_default_battery_at_seeds_0_to_9(block):
    fn = si.indexer_variant(block)
    for seed in SEEDS:
        report = check_indexer_kl(fn, supports=FWD_ONLY, seed=seed, grads=seed == 0)
        assert report.passed, f"seed {seed}\n{report.table(report.failed)}"


@pytest.mark.parametrize("bug", sorted(si.INDEXER_BUGS))
def test_a_streaming_indexer_loss_with_one_rescale_wrong_fails_at_every_seed_and_block(bug):
    for block in si.BLOCKS:
        for seed in SEEDS:
            report = check_indexer_kl(si.indexer_variant(block, bug), seed=seed, grads=False,
                                      cases=INDEXER_MULTI_TILE)
            assert report.failed and all(r.error > 100 * r.tolerance for r in report.failed), (bug, block, seed)
