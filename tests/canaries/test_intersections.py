"""The canaries' intersection checks (NOTE [Intersection checks], NOTE [Admission intersections]).

Two kinds of tests. The checks pass on a correct trainer: each names the
mutation of ``canaries/mutations/catalogue.py`` that breaks it (the mutation
suite, tests/canaries/test_mutations.py, proves the check catches it). The
negative controls feed each check a trainer that breaks the invariant
deterministically (a factory or a patch at the public surface).
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

import reference_trainer as rt
from canaries.derivative import intersections as di
from canaries.derivative.gradients import GRADIENT_INTERSECTIONS
from canaries.derivative.intersections import INTERSECTIONS, REFUSED_CALLS, TrainerState, check_refused_call
from canaries.derivative.oracle_pair import CanaryFailure
from canaries.memory.intersections import SCENARIOS, check_checkpoint_budget, check_scenario, held_within_limits
from canaries.presets import preset
from validation.trainers import trainer_with_policy

CPU = preset("cpu").on_this_machine()

# --- the checks pass on a correct trainer ------------------------------------------------------


@pytest.mark.parametrize("name", list(REFUSED_CALLS))
def test_each_refused_call_raises_and_changes_nothing(name: str) -> None:
    """Broken by the mutations flush_before_checks, groups_admitted_one_by_one and optimizer_state_unchecked."""
    assert issubclass(getattr(rt, check_refused_call(CPU, name)), rt.TrainerError)


@pytest.mark.slow  # spawns two ranks; W=2 is judged in the default run by the two-process suite (tests/dist)
def test_logical_ranks_agree_at_w1_and_w2_with_default_options() -> None:
    """Broken by the mutation shared_correction_cache (one when_available cache for every logical rank)."""
    assert di.check_logical_default_options(CPU) >= 2  # stale records compared


def test_fp64_checkpoint_steps_in_fp64() -> None:
    """Broken by the mutation fp32_masters_for_fp64 (FP64 parameters step through FP32 masters)."""
    assert di.check_fp64_lr0_step(CPU) <= 1e-12
    measured = INTERSECTIONS["intersection: FP64 stale scenario matches the FP64 oracle at FP64 tolerance"](CPU)
    assert measured.steps >= 3 and measured.stale_records >= 3


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_admission_scenarios_hold_no_more_than_admitted(name: str) -> None:
    """Broken by the mutations saved_scale_ignores_training and lora_term_uncounted."""
    passed, detail, values = check_scenario(CPU, name)
    assert passed, detail
    assert values["host_limit_bytes"] == values["held_unlimited_bytes"] - 1


@pytest.mark.parametrize("name", list(GRADIENT_INTERSECTIONS))
def test_each_gradient_intersection_holds_on_a_correct_trainer(name: str) -> None:
    """Their negative controls are the mutations flush_assigns, known_norm_without_length and
    busy_counts_every_checkpoint (tests/canaries/test_mutations.py)."""
    GRADIENT_INTERSECTIONS[name](CPU)


def test_when_available_with_dropout_at_lr0_reweights_nothing() -> None:
    """Negative control: the mutation when_available_across_dropout."""
    assert di.check_when_available_dropout(CPU) == 1


def test_the_checkpoints_state_is_in_the_admission_budget() -> None:
    """Negative control: the mutation budget_ignores_checkpoints."""
    passed, detail, values = check_checkpoint_budget(CPU)
    assert passed and "refused" in values, detail
    assert values["checkpoint_state_bytes"] > 0


# --- negative controls (pass with or without the fixes) ------------------------------------------


def grad_zeroing_trainer(config: Any, **limits: Any) -> rt.Trainer:
    """A trainer whose optim_step with a negative lr zeroes .grad in place before it refuses."""

    class Leaky(rt.Trainer):
        def optim_step(self, **kwargs: Any) -> Any:
            if (kwargs.get("lr") or 0) < 0:
                for p in self.checkpoint("policy").parameters():
                    if p.grad is not None:
                        p.grad.zero_()
            return super().optim_step(**kwargs)

    trainer = Leaky(rt.DecoderLM(config.model.replace(dtype=torch.float32), seed=0), **limits)
    trainer.add_checkpoint("policy", full=True, optimizer=rt.AdamWConfig(lr=1e-2), seed=1)
    return trainer


def test_a_refused_call_that_changes_grad_fails_its_check() -> None:
    with pytest.raises(
        CanaryFailure,
        match=r"optim_step\(lr=-1\): refused with ConfigError; expected the state "
        r"unchanged, found: \.grad values changed",
    ):
        check_refused_call(CPU, "optim_step(lr=-1)", make=grad_zeroing_trainer)


def test_trainer_state_names_every_kind_of_change() -> None:
    busy = di.busy_trainer(CPU, di.plain_trainer)
    before = TrainerState.of(busy.trainer)
    assert before.differences(TrainerState.of(busy.trainer)) == []
    torch.rand(1)  # the global RNG advances
    busy.trainer.zero_grad()  # .grad objects and logical-rank buffers go
    kept = busy.trainer.forward(rt.ForwardInput(torch.arange(1, 5)))  # another record, kept pending
    found = " | ".join(before.differences(TrainerState.of(busy.trainer)))
    del kept
    for phrase in (
        "the global RNG advanced",
        ".grad objects replaced",
        "logical-rank sums changed",
        "records or placements changed",
    ):
        assert phrase in found, found


def test_fp64_check_fails_when_fp64_parameters_round_to_fp32() -> None:
    original = rt.Trainer.optim_step

    def rounding_step(self: rt.Trainer, **kwargs: Any) -> Any:
        report = original(self, **kwargs)
        with torch.no_grad():
            for p in self.checkpoint("policy").parameters():
                p.copy_(p.float().double())  # what stepping through FP32 masters does
        return report

    with (
        mock.patch.object(rt.Trainer, "optim_step", rounding_step),
        pytest.raises(CanaryFailure, match="expected every parameter bitwise unchanged"),
    ):
        di.check_fp64_lr0_step(CPU)


def test_held_within_limits_flags_a_record_over_the_host_limit() -> None:
    trainer = trainer_with_policy()
    out = trainer.forward(rt.ForwardInput(torch.arange(1, 9)), options=rt.ForwardOptions(backward_state="offload"))
    held = out.usage.host_bytes
    assert held > 0
    assert held_within_limits(trainer, None, held)[0] is True
    ok, detail = held_within_limits(trainer, None, held - 1)
    assert ok is False and f"{held} B on the host (limit {held - 1})" in detail


def test_every_intersection_is_a_named_check_of_the_quick_profile() -> None:
    names = list(INTERSECTIONS)
    assert len(names) == len(set(names)) == 4 + len(REFUSED_CALLS) + len(GRADIENT_INTERSECTIONS)
    assert all(name.startswith("intersection: ") for name in names)
