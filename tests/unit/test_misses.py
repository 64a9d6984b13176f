"""Planner misses (NOTE [Planner misses]): reported when an estimate is exceeded or admission refuses, replayable."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

import reference_trainer as rt
from reference_trainer import admission, misses, planner
from validation.trainers import trainer_with_policy

_OPTIONS = rt.ForwardOptions(backward_state="retain", corrections=())
_REAL = planner.analytic_saved_bytes


def _under_estimate(config, batch, seq_len, **options):  # a stand-in estimator: half the real one
    return _REAL(config, batch, seq_len, **options) // 2


@contextlib.contextmanager
def _stand_in() -> Iterator[None]:
    """The stand-in as the estimator: in the plan and in admission's measured/analytic scale alike."""
    with (
        mock.patch.object(planner, "analytic_saved_bytes", _under_estimate),
        mock.patch.object(admission, "analytic_saved_bytes", _under_estimate),
    ):
        yield


def _trainer(**limits) -> rt.Trainer:
    trainer = trainer_with_policy(lora=rt.LoRAConfig(rank=4), **limits)
    return trainer


def _inputs(seed: int) -> list[rt.ForwardInput]:
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(seed))
    return [rt.ForwardInput(row[:-1].clone(), row[1:].clone()) for row in tokens]


def _two_forwards(trainer: rt.Trainer) -> None:
    for seed in (1, 2):  # one shape class: the second forward is estimated with the first one's measured scale
        outputs = trainer.forward(_inputs(seed), options=_OPTIONS)
        trainer.backward(-sum(o.target_logprobs.sum() for o in outputs))


def test_an_under_estimating_estimator_misses_once_and_the_miss_replays_to_its_estimate() -> None:
    seen: list[rt.PlannerMiss] = []
    trainer = _trainer()
    with _stand_in(), rt.observe_planner_misses(seen.append):
        _two_forwards(trainer)
        assert [m.kind for m in seen] == ["saved_bytes_exceeded"]  # the second forward learned the scale
        miss = seen[0]
        assert miss.measured > miss.estimate and rt.replay_estimate(miss.inputs) == miss.estimate
    assert rt.replay_estimate(miss.inputs) != miss.estimate  # the replay recomputes: the real estimator differs
    assert miss.inputs["batch"] == 2 and miss.inputs["seq_len"] == 16 and miss.inputs["lora"]["rank"] == 4


def test_the_real_estimator_misses_nothing_and_no_observer_sees_nothing() -> None:
    seen: list[rt.PlannerMiss] = []
    with rt.observe_planner_misses(seen.append):
        _two_forwards(_trainer())
    assert seen == []
    with _stand_in():
        _two_forwards(_trainer())  # no observer in force: nothing is reported, nothing raises
    assert seen == []


def test_a_refusal_is_a_miss_with_the_refused_forwards_estimate() -> None:
    seen: list[rt.PlannerMiss] = []
    trainer = _trainer(memory_limit_bytes=1)
    with rt.observe_planner_misses(seen.append), pytest.raises(rt.MemoryAdmissionError) as refused:
        trainer.forward(_inputs(1), options=_OPTIONS)
    assert [(m.kind, m.raised) for m in seen] == [("refused", str(refused.value))]
    assert rt.replay_estimate(seen[0].inputs) == seen[0].estimate > 0


def test_plain_inputs_replay_what_the_estimator_gave_for_every_input() -> None:
    config = rt.ModelConfig.tiny(dtype=torch.bfloat16, dropout=0.1)
    estimator = dict(
        batch=3,
        seq_len=40,
        snapshot_bytes=123,
        staging_bytes=456,
        saved_scale=1.7,
        measured_seconds_per_token=3e-6,
        transfer_bytes_per_second=2e9,
        scores_saved=True,
        lora=rt.LoRAConfig(rank=8, targets=("q_proj", "v_proj")),
        dropout_active=False,
        autocast=torch.float16,
    )
    expected = planner.estimate_forward_cost(config, **estimator).saved_bytes
    plain = rt.PlannerMiss("refused", misses.plain_inputs(config, estimator), expected, None, "x").as_dict()["inputs"]
    assert json.loads(json.dumps(plain)) == plain  # plain JSON
    assert rt.replay_estimate(plain) == expected
    for field, other in (
        ("saved_scale", None),
        ("lora", None),
        ("dropout_active", True),
        ("seq_len", 41),
        ("autocast", None),
    ):
        changed = misses.plain_inputs(config, {**estimator, field: other})
        assert rt.replay_estimate(changed) != expected, field  # each input matters: the replay reads it
    fp32 = misses.plain_inputs(config.replace(dtype=torch.float32), estimator)
    assert rt.replay_estimate(fp32) != expected  # and the dtype


class _OutOfMemory:
    """A stand-in allocator failure: a forward hook on the first decoder layer raises ``torch.OutOfMemoryError``
    on its ``fail_on``-th call (1: the forward, 2: a replay at backward), after dropout has drawn."""

    TEXT = "CUDA out of memory. Tried to allocate 2.00 GiB (a stand-in)"

    def __init__(self, trainer: rt.Trainer, fail_on: int) -> None:
        self.calls, self.fail_on = 0, fail_on
        trainer.model.model.layers[0].register_forward_hook(self)

    def __call__(self, module, args, output) -> None:
        self.calls += 1
        if self.calls == self.fail_on:
            raise torch.OutOfMemoryError(self.TEXT)


def _state(trainer: rt.Trainer) -> tuple:
    policy = trainer.checkpoint("policy")
    return (trainer.live_records(), torch.get_rng_state(), [p.grad for p in policy.parameters()], policy.revision)


def test_an_allocation_failure_in_a_forward_is_one_miss_replayed_to_its_estimate_and_changes_nothing() -> None:
    seen: list[rt.PlannerMiss] = []
    trainer = trainer_with_policy(rt.ModelConfig.tiny(dropout=0.1), lora=rt.LoRAConfig(rank=4))
    pending = trainer.forward(_inputs(1), options=_OPTIONS)  # a record the failed call must leave as it was
    before = _state(trainer)
    _OutOfMemory(trainer, fail_on=1)
    with rt.observe_planner_misses(seen.append), pytest.raises(torch.OutOfMemoryError, match="stand-in"):
        trainer.forward(_inputs(2), options=_OPTIONS)
    after = _state(trainer)
    assert after[0] == before[0] and torch.equal(after[1], before[1]) and after[2:] == before[2:], "state changed"
    assert [(m.kind, m.raised) for m in seen] == [("allocation_failed", _OutOfMemory.TEXT)]
    assert seen[0].estimate > 0 and rt.replay_estimate(seen[0].inputs) == seen[0].estimate
    assert seen[0].inputs["batch"] == 2 and seen[0].inputs["dropout_active"] is True
    trainer.backward(-sum(o.target_logprobs.sum() for o in pending))  # the pending record still backpropagates


def test_an_allocation_failure_in_a_replay_is_a_miss_with_its_forwards_estimate() -> None:
    seen: list[rt.PlannerMiss] = []
    trainer = _trainer()
    outputs = trainer.forward(_inputs(1), options=rt.ForwardOptions(backward_state="replay", corrections=()))
    _OutOfMemory(trainer, fail_on=1)  # installed after the forward: its first call is the replay
    with rt.observe_planner_misses(seen.append), pytest.raises(rt.GradientCommitError, match="stand-in"):
        trainer.backward(-sum(o.target_logprobs.sum() for o in outputs))
    assert [m.kind for m in seen] == ["allocation_failed"]
    assert seen[0].estimate == outputs[0].decision.saved_bytes == rt.replay_estimate(seen[0].inputs)
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())
