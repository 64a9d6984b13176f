"""The staleness rule (NOTE [Staleness], docs/semantics.md#staleness): the bound through the trainer, and ``check_age``
on hand-built versions for the cases the trainer cannot reach."""

from __future__ import annotations

import pytest
import torch

import reference_trainer as rt
from reference_trainer.staleness import check_age, staleness
from tests.support import NO_CORRECTION, assert_grads_unchanged, grad_snapshot, make_trainer, sequence, train_step


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_staleness_beyond_bound_raises_and_changes_nothing(bound: int) -> None:
    trainer = make_trainer("full", dropout=0.0)
    ids, tgt = sequence(2)
    options = rt.ForwardOptions(max_gradient_staleness=bound, corrections=())
    old = trainer.forward(rt.ForwardInput(ids, tgt), options=options)
    for step in range(bound + 1):
        train_step(trainer, seed=300 + step)
    # Leave committed gradients in place so "unchanged" is a real check.
    fresh = trainer.forward(rt.ForwardInput(ids, tgt), options=NO_CORRECTION)
    trainer.backward(-fresh.target_logprobs.sum())
    before = grad_snapshot(trainer)
    with pytest.raises(rt.StaleGradientError) as info:
        trainer.backward(-old.target_logprobs.sum())
    error = info.value
    assert isinstance(error, rt.GradientCommitError)
    assert (error.checkpoint, error.staleness, error.bound) == ("policy", bound + 1, bound)
    assert (error.forward_revision, error.current_revision) == (1 - 1, bound + 1)
    for fact in (
        "'policy'",
        f"staleness {bound + 1}",
        f"max_gradient_staleness={bound}",
        "forward revision 0",
        f"current revision {bound + 1}",
    ):
        assert fact in str(error)
    assert_grads_unchanged(trainer, before)
    assert trainer.live_records() == 0, "the stale record is released"


def test_default_bound_is_two() -> None:
    trainer = make_trainer("lora", dropout=0.0)
    ids, tgt = sequence(3)
    outs = [trainer.forward(rt.ForwardInput(ids, tgt), options=NO_CORRECTION) for _ in range(2)]
    for step in range(2):
        train_step(trainer, seed=400 + step)
    trainer.backward(-outs[0].target_logprobs.sum())  # staleness 2: allowed
    train_step(trainer, seed=402)
    with pytest.raises(rt.StaleGradientError):
        trainer.backward(-outs[1].target_logprobs.sum())  # staleness 3: refused


def test_strict_bound_rejects_any_step_in_between() -> None:
    trainer = make_trainer("lora", dropout=0.0, options=rt.ForwardOptions(max_gradient_staleness=0, corrections=()))
    ids, tgt = sequence(4)
    out = trainer.forward(rt.ForwardInput(ids, tgt))
    train_step(trainer, seed=500)
    before = grad_snapshot(trainer)
    with pytest.raises(rt.StaleGradientError) as info:
        trainer.backward(-out.target_logprobs.sum())
    assert info.value.staleness == 1 and info.value.bound == 0
    assert_grads_unchanged(trainer, before)


def test_optim_step_rechecks_accumulated_origins() -> None:
    """A gradient committed fresh under bound 0 may not be applied after another step."""
    trainer = make_trainer("full", dropout=0.0)
    ids, tgt = sequence(5)
    out = trainer.forward(
        rt.ForwardInput(ids, tgt), options=rt.ForwardOptions(max_gradient_staleness=0, corrections=())
    )
    trainer.backward(-out.target_logprobs.sum())
    trainer.optim_step()  # applies it: fine
    params = {n: p.detach().clone() for n, p in trainer.checkpoint("policy").named_parameters()}
    with pytest.raises(rt.StaleGradientError):
        trainer.optim_step()  # the same gradient again, now one revision old
    for n, p in trainer.checkpoint("policy").named_parameters():
        assert torch.equal(p, params[n])
    assert trainer.checkpoint("policy").revision == 1


def test_a_version_newer_than_the_checkpoint_is_refused() -> None:
    """Rule 2's lower bound (staleness >= 0): unreachable through the trainer, where revisions only grow."""
    trainer = make_trainer("full", dropout=0.0)
    checkpoint = trainer.checkpoint("policy")
    ahead = rt.CheckpointVersion("policy", checkpoint.generation, checkpoint.revision + 1)
    with pytest.raises(rt.StaleGradientError) as info:
        check_age(checkpoint, ahead, 2)
    assert info.value.staleness == -1
    check_age(checkpoint, checkpoint.version, 0)  # the same version is fresh


@pytest.mark.parametrize("bound", [0, 1, 2, 3])
def test_check_age_accepts_exactly_the_ages_from_zero_to_the_bound(bound: int) -> None:
    """Rules 1-2 in closed form: at current revision 2, a forward at revision r has age 2 - r."""
    trainer = make_trainer("full", dropout=0.0)
    for step in range(2):
        train_step(trainer, seed=600 + step)
    checkpoint = trainer.checkpoint("policy")
    for forward_revision in range(4):
        version = rt.CheckpointVersion("policy", checkpoint.generation, forward_revision)
        age = 2 - forward_revision
        assert staleness(checkpoint, version) == age
        if 0 <= age <= bound:
            check_age(checkpoint, version, bound)
        else:
            with pytest.raises(rt.StaleGradientError) as info:
                check_age(checkpoint, version, bound)
            assert (info.value.staleness, info.value.bound, info.value.current_revision) == (age, bound, 2)


def test_another_generation_is_a_replaced_checkpoint_whatever_the_revisions() -> None:
    """Rule 3 comes before the age: a fresh revision and an impossible one of another generation are both replaced."""
    checkpoint = make_trainer("full", dropout=0.0).checkpoint("policy")
    for revision in (checkpoint.revision, checkpoint.revision + 5):
        older = rt.CheckpointVersion("policy", checkpoint.generation - 1, revision)
        with pytest.raises(rt.CheckpointReplacedError) as info:
            check_age(checkpoint, older, 2)
        assert (info.value.forward_generation, info.value.current_generation) == (
            checkpoint.generation - 1,
            checkpoint.generation,
        )
