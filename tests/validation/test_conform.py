"""The conformance suite (``validation.conform``): each check catches its purpose-built wrong adapter by name,
the right adapter passes the same check, unclaimed capabilities are not applicable, broken adapters are refused.

Wrong adapters live in ``conform_wrong.py`` beside this file (a module, as an
outside adapter is). Shapes are the spec's tiny defaults; the *processes*
check spawns two gloo processes, so it is ``slow``, with a fast sibling that
judges in-process shares of the job.
"""

from __future__ import annotations

from pathlib import Path

import conform_wrong as wrong
import pytest
import torch

from validation.conform import FAILED, NOT_APPLICABLE, PASSED, AdapterError, ConformSpec, conform, conform_record
from validation.conform.adapters.plain import NaiveAsyncAdapter, SnapshotAsyncAdapter, SyncAdapter
from validation.conform.checks import splits, stale, sync
from validation.conform.oracle import compare, tolerance
from validation.conform.processes import judge_processes, rank_rows, run_job
from validation.conform.protocol import require_protocol
from validation.conform.resume import resume
from validation.evidence import checks_of

SPEC = ConformSpec()


def test_sync_passes_the_plain_loop_and_catches_unmasked_logprobs() -> None:
    assert sync(SyncAdapter, SPEC).status == PASSED
    verdict = sync(wrong.UnmaskedLogprobs, SPEC)
    assert verdict.status == FAILED
    assert verdict.reason.startswith("step 0: the gradient is not the oracle's at the live weights: worst element")
    assert verdict.evidence["worst"]["error"] > verdict.evidence["worst"]["tolerance"]


def test_sync_catches_logprobs_rounded_through_float16_at_the_float32_tolerance() -> None:
    """Within 3x of the tolerance (2.6x here, at its parameter's scale): a tolerance loosened threefold lets it pass."""
    verdict = sync(wrong.Float16Logprobs, SPEC)
    assert verdict.status == FAILED and verdict.evidence["worst"]["error"] < 3 * verdict.evidence["worst"]["tolerance"]


def test_sync_judges_each_parameter_at_its_own_scale() -> None:
    """The norm weight's gradient is far below the largest: 5% off it passed at the global scale."""
    verdict = sync(wrong.ScaledNormGradient, SPEC)
    assert verdict.status == FAILED
    worst = verdict.evidence["worst"]
    assert worst["parameter"] == "model.layers.0.post_attention_layernorm.weight"
    assert worst["error"] == pytest.approx(0.05 * abs(worst["oracle"]) / worst["scale"], rel=1e-3)


def test_a_parameter_scale_is_floored_at_a_thousandth_of_the_largest() -> None:
    oracle = {
        "big": torch.ones(3, dtype=torch.float64),
        "tiny": torch.full((2,), 1e-9, dtype=torch.float64),
        "small": torch.full((2,), 1e-2, dtype=torch.float64),
    }
    noise = compare({**oracle, "tiny": oracle["tiny"] * 2}, oracle, 1e-4)  # 1e-9 off, against a floor of 1e-3
    assert noise.ok and noise.parameter == "tiny" and noise.scale == 1e-3 and noise.error == pytest.approx(1e-6)
    short = compare({**oracle, "small": oracle["small"] * 0.95}, oracle, 1e-4)
    assert not short.ok and short.parameter == "small" and short.error == pytest.approx(0.05)


def test_the_tolerance_is_the_one_docs_conform_md_states_for_each_dtype() -> None:
    stated = {torch.float32: 1.2e-4, torch.float64: 2.3e-13, torch.bfloat16: 0.088, torch.float16: 0.031}
    page = (Path(__file__).parents[2] / "docs" / "conform.md").read_text()
    assert "(float32 1.2e-4, float64 2.3e-13, bfloat16 0.088, float16 0.031)" in page
    for dtype, value in stated.items():
        assert tolerance(dtype) == pytest.approx(value, rel=0.02), dtype


def test_sync_catches_an_optimizer_that_ignores_the_spec_lr() -> None:
    verdict = sync(wrong.DoubledLearningRate, SPEC)
    assert verdict.status == FAILED and "optim_step did not move the weights as AdamW(lr=0.01" in verdict.reason


@pytest.mark.parametrize(
    "changed",
    [{"weight_decay": 0.0}, {"betas": (0.9, 0.99)}, {"lr": 1.01e-2}],
    ids=["no-weight-decay", "beta2-0.99", "lr-1.01x"],
)
def test_sync_judges_the_update_so_each_off_spec_adamw_setting_fails(changed: dict) -> None:
    """The update is ~lr of the weights: judged at the weights' scale these passed (eps 1e-3, beta1 0.8 and Adam's
    L2 decay were caught even so)."""
    verdict = sync(wrong.off_spec_adamw(**changed), SPEC)
    assert verdict.status == FAILED and "optim_step did not move the weights as AdamW" in verdict.reason, verdict.reason


def test_sync_catches_staleness_zero_that_runs_one_step_off_policy() -> None:
    verdict = sync(wrong.OneStepOffPolicy, SPEC)
    assert verdict.status == FAILED and verdict.reason.startswith("step 1: the gradient is not the oracle's")


def test_stale_passes_snapshots_and_catches_the_in_place_update_of_naive_async() -> None:
    right = stale(SnapshotAsyncAdapter, SPEC)
    assert right.status == PASSED and set(right.evidence["per_staleness"]) == {1, 2}
    measured = right.evidence["adapter_measurements"]
    assert measured["peak_snapshot_bytes"] == 2 * measured["live_parameter_bytes"]  # two forwards pending at k = 1
    verdict = stale(NaiveAsyncAdapter, SPEC)
    assert verdict.status == FAILED
    assert "staleness 1: the gradient is not the oracle's at the forward's weights (revision 0)" in verdict.reason
    assert "the backward ran through weights updated after the forward" in verdict.reason
    assert verdict.evidence["against_live"]["error"] > verdict.evidence["against_live"]["tolerance"]
    assert verdict.evidence["diagnosis"] == "updated_weights"
    assert verdict.evidence["against_live"]["error"] < verdict.evidence["worst"]["error"]


def test_stale_says_not_staleness_when_the_live_weights_oracle_is_no_nearer() -> None:
    verdict = stale(wrong.Float16StaleLogprobs, SPEC)
    assert verdict.status == FAILED and verdict.evidence["diagnosis"] == "not_staleness"
    assert "the backward ran through weights updated" not in verdict.reason and "so not staleness" in verdict.reason
    assert verdict.evidence["against_live"]["error"] >= verdict.evidence["worst"]["error"]


def test_stale_refuses_to_pass_when_the_weights_did_not_move() -> None:
    verdict = stale(SnapshotAsyncAdapter, ConformSpec(lr=1e-12))
    assert verdict.status == FAILED and "vacuous" in verdict.reason


def test_stale_asks_the_live_and_forward_oracles_to_differ_by_twice_the_tolerance() -> None:
    """lr 6e-7 moves the oracle by 1.5 tolerances (the separation is linear in lr here): vacuous; 1e-2 is not."""
    verdict = stale(SnapshotAsyncAdapter, ConformSpec(lr=6e-7, max_staleness=1))
    tol = tolerance(torch.float32)
    assert verdict.status == FAILED and "within twice the tolerance" in verdict.reason
    assert tol < verdict.evidence["worst"]["error"] <= 2 * tol


def test_splits_names_the_ratio_of_a_per_micro_batch_mean() -> None:
    assert splits(SyncAdapter, SPEC).status == PASSED
    assert splits(SnapshotAsyncAdapter, SPEC).status == PASSED  # accumulates its copies' gradients
    verdict = splits(wrong.MeanOverMicroBatches, SPEC)
    assert verdict.status == FAILED and verdict.evidence["arm"] == "2 micro-batches"
    assert verdict.evidence["ratio"] == pytest.approx(0.5, rel=1e-4)
    assert "as 2 micro-batches the gradient of model." in verdict.reason and "is 0.5 x the oracle's" in verdict.reason


def test_splits_names_the_ratio_of_the_worst_parameter_not_of_all() -> None:
    """One small parameter 5% short: over all parameters the factor reads ~1; its own reads 0.95."""
    verdict = splits(wrong.ScaledNormGradient, SPEC)
    assert verdict.status == FAILED and verdict.evidence["ratio"] == pytest.approx(0.95, rel=1e-4)
    assert "the gradient of model.layers.0.post_attention_layernorm.weight is 0.95 x" in verdict.reason


def test_an_adapter_that_raises_keeps_the_cause_of_a_many_line_message() -> None:
    verdict = conform("conform_wrong:RaisesAtStep", SPEC, checks=("sync",)).verdict("sync")
    assert verdict.status == FAILED and verdict.reason.startswith(
        "the adapter raised RuntimeError: a rank raised ... ValueError: the optimizer state is on another device"
    )
    assert verdict.evidence["message"].count("\n") == 3


def test_splits_catches_a_trainer_that_keeps_one_forward_pending() -> None:
    verdict = splits(wrong.OneRecordAtATime, SPEC)
    assert verdict.status == FAILED and verdict.evidence["arm"] == "4 separate forward calls, one backward"


def test_resume_catches_a_save_that_drops_the_pending_gradients() -> None:
    verdict = resume(wrong.SaveWithoutGradients, SPEC)
    assert verdict.status == FAILED
    assert verdict.reason.startswith("saved after call 2 (step 0's backward) and continued from load")  # shrunk


def test_resume_holds_a_bitwise_claim_to_bitwise_equality() -> None:
    verdict = resume(wrong.ResumedOneUlpOff, SPEC)
    assert verdict.status == FAILED and "(bitwise claimed)" in verdict.reason
    assert 0 < verdict.evidence["worst"]["error"] < tolerance(torch.float32)  # within tolerance, but not bitwise


def test_naive_async_fails_stale_and_only_stale() -> None:
    report = conform("naive-async", SPEC, checks=("sync", "stale", "splits", "resume", "processes"))
    assert {v.check: v.status for v in report.verdicts} == {
        "sync": PASSED,
        "stale": FAILED,
        "splits": PASSED,
        "resume": NOT_APPLICABLE,
        "processes": NOT_APPLICABLE,
    }
    assert not report.passed


def test_a_check_the_adapter_does_not_claim_is_not_applicable_never_passed() -> None:
    report = conform("sync", SPEC, checks=("stale", "resume", "processes"))
    assert [(v.status, v.reason) for v in report.verdicts] == [
        (NOT_APPLICABLE, "the adapter does not claim 'stale'"),
        (NOT_APPLICABLE, "the adapter does not claim 'save'"),
        (NOT_APPLICABLE, "the adapter does not claim 'processes'"),
    ]
    assert not report.passed  # nothing ran
    record = conform_record([report], SPEC)
    assert (
        not record["passed"]
        and record["checks"] == {}
        and set(record["skips"]) == {"sync stale", "sync resume", "sync processes"}
    )


def test_the_negative_control_passes_the_record_only_when_it_fails_its_check() -> None:
    naive = conform("naive-async", SPEC, checks=("sync", "stale"))
    record = conform_record([naive], SPEC, negative_controls={"naive-async": "stale"})
    assert record["passed"] and record["checks"] == {
        "naive-async sync": True,
        "naive-async stale fails (negative control)": True,
    }
    snapshot = conform("snapshot-async", SPEC, checks=("stale",))
    control = conform_record([snapshot], SPEC, negative_controls={"snapshot-async": "stale"})
    assert not control["passed"]
    assert next(c.detail for c in checks_of(control) if c.failed).startswith("the negative control passed")
    unclaimed = conform_record(
        [conform("sync", SPEC, checks=("sync", "stale"))], SPEC, negative_controls={"sync": "stale"}
    )
    assert unclaimed["checks"]["sync stale fails (negative control)"] is False  # a control that did not run


@pytest.mark.parametrize("control", [wrong.RaisingStaleBackward, wrong.Float16StaleLogprobs])
def test_a_negative_control_that_fails_stale_for_another_reason_did_not_fire(control: type) -> None:
    """The adapter raised, or its gradient is wrong at every revision: not the in-place update the control stands for."""
    report = conform(f"conform_wrong:{control.__name__}", SPEC, checks=("stale",))
    assert report.verdict("stale").status == FAILED
    record = conform_record([report], SPEC, negative_controls={control.name: "stale"})
    assert record["checks"] == {f"{control.name} stale fails (negative control)": False} and not record["passed"]
    detail = next(c.detail for c in checks_of(record) if c.failed)
    assert detail.startswith("the negative control failed, but not for the reason it stands for: ")


def test_an_adapter_without_a_method_is_refused_naming_it_and_the_fix() -> None:
    with pytest.raises(AdapterError) as caught:
        require_protocol(wrong.MissingBackward())
    assert caught.value.one_line() == (
        "adapter 'missing-backward' is broken: missing method backward (needed: start, "
        "module, forward, backward, optim_step, zero_grad); fix: define backward() as "
        "in docs/conform.md#the-adapter-protocol"
    )


def test_a_forward_of_the_wrong_shape_stops_the_suite_as_a_broken_adapter() -> None:
    with pytest.raises(
        AdapterError,
        match=r"returned a tensor of shape \(4,\), requires_grad=True; expected "
        r"differentiable target log-probs of shape \(4, 8\)",
    ):
        conform("conform_wrong:SummedLogprobs", SPEC, checks=("sync",))


def test_the_ranks_rows_partition_each_batch() -> None:
    assert [rank_rows(SPEC, rank, 2) for rank in range(2)] == [[0, 2], [1, 3]]
    assert rank_rows(SPEC, 0, 1) == [0, 1, 2, 3]


def test_an_adapter_claiming_save_without_save_and_load_is_refused() -> None:
    with pytest.raises(AdapterError) as caught:
        require_protocol(wrong.SaveClaimedWithoutLoad())
    assert caught.value.one_line().endswith(
        "missing method save, load (needed: start, module, forward, backward, "
        "optim_step, zero_grad, save, load); fix: define save(), load() as in "
        "docs/conform.md#the-adapter-protocol, or drop 'save' from capabilities"
    )


def test_a_module_with_nothing_trainable_is_a_broken_adapter() -> None:
    with pytest.raises(AdapterError, match=r"module\(\) returned a module with no trainable parameter; expected"):
        conform("conform_wrong:FrozenModule", SPEC, checks=("splits",))


@pytest.mark.parametrize("check", [sync, stale, splits])
def test_a_nan_gradient_fails_every_gradient_check_naming_the_element(check) -> None:
    verdict = check(wrong.NaNGradient, SPEC)
    assert verdict.status == FAILED and verdict.evidence["worst"]["error"] == float("inf")
    assert verdict.evidence["worst"]["parameter"] == "model.embed_tokens.weight" and "found nan" in verdict.reason


def test_a_non_finite_found_element_is_an_infinite_error_naming_it_wherever_it_lies() -> None:
    """The comparison every check (resume's too) makes: a NaN or inf never passes, in the first tensor or a later one."""
    oracle = {"a": torch.ones(2, 2, dtype=torch.float64), "b": torch.ones(3, dtype=torch.float64)}
    for name, index, value in (("a", (1, 0), float("nan")), ("b", (2,), float("inf")), ("b", (0,), float("nan"))):
        found = {n: t.clone() for n, t in oracle.items()}
        found[name][index] = value
        worst = compare(found, oracle, 1e-4)
        assert (worst.error, worst.parameter, worst.index, worst.ok) == (float("inf"), name, index, False)
    exact = compare(oracle, oracle, 0.0)
    assert exact.ok and exact.error == 0.0 and exact.parameter in oracle  # a named element even at error 0


def test_a_rank_with_nan_parameters_fails_processes() -> None:
    one = {"w": torch.ones(2, 3, dtype=torch.float64), "b": torch.ones(3, dtype=torch.float64)}
    broken = {**one, "b": torch.tensor([1.0, float("nan"), 1.0], dtype=torch.float64)}
    verdict = judge_processes(one, [one, broken], 1e-4)
    assert verdict.status == FAILED and verdict.evidence["rank"] == 1 and verdict.evidence["worst"]["index"] == [1]


def test_processes_judges_each_rank_against_the_one_process_run() -> None:
    """The fast sibling of the spawned check: shares of the job computed in process, as two ranks would."""
    one = run_job(wrong.NoReduceAcrossProcesses, SPEC, 0, 1)
    assert judge_processes(one, [one, {n: t.numpy() for n, t in one.items()}], 1e-4).status == PASSED
    ranks = [run_job(wrong.NoReduceAcrossProcesses, SPEC, rank, 2) for rank in range(2)]
    verdict = judge_processes(one, ranks, 1e-4)
    assert verdict.status == FAILED and verdict.reason.startswith("at 2 processes rank 0's parameters differ")


@pytest.mark.slow
@pytest.mark.dist
def test_processes_spawned_passes_the_reference_and_catches_a_missing_reduce() -> None:
    assert conform("reference", SPEC, checks=("processes",)).verdicts[0].status == PASSED
    verdict = conform("conform_wrong:NoReduceAcrossProcesses", SPEC, checks=("processes",)).verdicts[0]
    assert verdict.status == FAILED and "at 2 processes rank 0's parameters differ" in verdict.reason
    alone = conform("conform_wrong:UnguardedAllReduce", SPEC, checks=("processes",)).verdicts[0]
    assert alone.status == PASSED, alone.reason  # its one-process run has a process group (of 1) too


def test_the_reference_adapter_backpropagates_stale_forwards_exactly() -> None:
    from validation.conform.adapters.reference import ReferenceAdapter

    assert stale(ReferenceAdapter, SPEC).status == PASSED


@pytest.mark.slow
def test_the_reference_adapter_passes_every_check() -> None:
    report = conform("reference", SPEC)
    assert report.passed and all(v.status == PASSED for v in report.verdicts), report.verdicts
    assert "bitwise equal" in report.verdict("resume").reason


def test_float64_spec_passes_at_its_tighter_tolerance() -> None:
    report = conform("snapshot-async", ConformSpec(dtype="float64"), checks=("sync", "stale"))
    assert report.passed
    assert torch.finfo(torch.float64).eps * 1024 == pytest.approx(report.verdict("sync").evidence["worst"]["tolerance"])
