"""Weight publication to a rollout engine: all or nothing at every tensor, compare-and-set, drain and inflight."""

from __future__ import annotations

import pytest
import torch

import reference_trainer as rt
from reference_trainer.rollout.engine import FP32_LOGPROB_TOLERANCE
from reference_trainer.testing import inject_fault
from validation.trainers import trainer_with_policy

PROMPTS = [torch.tensor([5, 9, 2]), torch.tensor([7, 1, 3, 3, 8])]


def _trainer(*, full: bool = False) -> rt.Trainer:
    return trainer_with_policy(lora=None if full else rt.LoRAConfig(rank=4), optimizer=rt.AdamWConfig(lr=0.05))


def _step(trainer: rt.Trainer) -> None:
    """One optimizer step that moves the policy's log-probs well past the FP32 tolerance."""
    tokens = torch.arange(12) % 64
    output = trainer.forward(rt.ForwardInput(input_tokens=tokens), checkpoint="policy")
    trainer.backward(-output.target_logprobs.sum())
    trainer.optim_step()
    trainer.zero_grad()


def _served_state(engine: rt.RolloutEngine) -> tuple[object, dict[str, torch.Tensor], list[torch.Tensor]]:
    """The served version, copies of its tensors and the log-probs it gives two fixed sequences."""
    served = engine._served
    scores = [engine.score(p, torch.tensor([4, 4, 6])) for p in PROMPTS]
    return served.version, {n: t.clone() for n, t in served.tensors.items()}, scores


def _assert_bitwise_unchanged(engine: rt.RolloutEngine, before: tuple, *, outputs: bool = True) -> None:
    """The served version and tensors are as ``before`` (and, with ``outputs``, the log-probs it gives)."""
    served = engine._served
    assert served.version == before[0]
    assert served.tensors.keys() == before[1].keys()
    assert all(torch.equal(served.tensors[n], before[1][n]) for n in served.tensors)
    if outputs:
        assert all(torch.equal(a, b) for a, b in zip(_served_state(engine)[2], before[2]))


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_a_fault_at_every_tensor_leaves_the_engine_serving_the_previous_version_bitwise(full: bool) -> None:
    trainer = _trainer(full=full)
    engine = rt.RolloutEngine(trainer.model)
    trainer.publish(engine, checkpoint="policy")
    _step(trainer)
    before = _served_state(engine)
    count = len(dict(trainer.checkpoint("policy").named_parameters()))
    for index in range(count):
        with inject_fault("weight_publication", index=index), pytest.raises(rt.PublicationError) as failed:
            trainer.publish(engine, checkpoint="policy")
        assert failed.value.tensor == list(dict(trainer.checkpoint("policy").named_parameters()))[index]
        _assert_bitwise_unchanged(engine, before, outputs=False)
    _assert_bitwise_unchanged(engine, before)
    report = trainer.publish(engine, checkpoint="policy")  # the same publication, unfaulted, goes through
    assert report.switched and engine.version == trainer.checkpoint("policy").version
    assert not torch.equal(_served_state(engine)[2][0], before[2][0])


def test_publication_reports_its_size_and_copies_the_weights_when_made() -> None:
    trainer = _trainer()
    engine = rt.RolloutEngine(trainer.model)
    report = trainer.publish(engine, checkpoint="policy")
    checkpoint = trainer.checkpoint("policy")
    assert report.nbytes == checkpoint.trainable_nbytes() == sum(p.numel() * 4 for p in checkpoint.parameters())
    assert report.tensors == len(list(checkpoint.parameters()))
    assert report.previous is None and report.mode == "drain" and report.seconds >= 0
    before = _served_state(engine)
    _step(trainer)  # the trainer's weights move; the engine's do not until the next publication
    _assert_bitwise_unchanged(engine, before)


def test_engine_logprobs_follow_the_published_weights_of_a_full_checkpoint() -> None:
    trainer = _trainer(full=True)
    _step(trainer)
    engine = rt.RolloutEngine(trainer.model)
    trainer.publish(engine, checkpoint="policy")
    logits_fn, _ = trainer.policy("policy")
    for s in engine.generate(PROMPTS, max_new_tokens=4):
        expected = torch.log_softmax(logits_fn(s.tokens[None])[0].double(), -1)[s.prompt.shape[0] - 1 : -1]
        expected = expected.gather(-1, s.completion[:, None]).squeeze(-1)
        assert (s.behaviour_logprobs.double() - expected).abs().max() <= FP32_LOGPROB_TOLERANCE
        assert s.behaviour_revisions.tolist() == [1] * 4


def test_an_older_equal_or_unexpected_version_is_refused_and_changes_nothing() -> None:
    trainer = _trainer()
    engine = rt.RolloutEngine(trainer.model)
    stale = rt.rollout.publication_of(trainer.checkpoint("policy"))
    _step(trainer)
    trainer.publish(engine, checkpoint="policy")
    before = _served_state(engine)
    with pytest.raises(rt.VersionConflictError, match="newer") as older:
        engine.apply(stale)
    assert older.value.live == engine.version
    with pytest.raises(rt.VersionConflictError, match="newer"):
        trainer.publish(engine, checkpoint="policy")  # equal
    _step(trainer)
    with pytest.raises(rt.VersionConflictError, match="expected the engine to serve"):
        trainer.publish(engine, checkpoint="policy", expected=stale.version)
    _assert_bitwise_unchanged(engine, before)
    report = trainer.publish(engine, checkpoint="policy", expected=before[0])  # compare-and-set holds
    assert report.previous == before[0] and engine.version.revision == 2


def test_another_checkpoints_version_and_bad_tensors_are_refused() -> None:
    trainer = _trainer()
    other = trainer.add_checkpoint("other", lora=rt.LoRAConfig(rank=2))
    engine = rt.RolloutEngine(trainer.model)
    _step(trainer)
    trainer.publish(engine, checkpoint="policy")
    before = _served_state(engine)
    with pytest.raises(rt.VersionConflictError):
        trainer.publish(engine, checkpoint="other")
    good = rt.rollout.publication_of(trainer.checkpoint("policy"))
    version = rt.CheckpointVersion("policy", 0, 5)
    poisoned = dict(good.tensors)
    name = next(iter(poisoned))
    poisoned[name] = poisoned[name].clone().fill_(float("nan"))
    with pytest.raises(rt.PublicationError, match="finite") as failed:
        engine.apply(rt.WeightPublication(version, poisoned, good.lora))
    assert failed.value.tensor == name
    with pytest.raises(rt.PublicationError, match="missing"):
        engine.apply(rt.WeightPublication(version, dict(list(good.tensors.items())[1:]), good.lora))
    resized = {**good.tensors, name: good.tensors[name][:1]}
    with pytest.raises(rt.PublicationError, match="shape"):
        engine.apply(rt.WeightPublication(version, resized, good.lora))
    with pytest.raises(rt.ConfigError, match="mode"):
        engine.apply(good, mode="eventually")
    _assert_bitwise_unchanged(engine, before)
    assert other.version.generation == 1


def test_drain_finishes_running_generations_on_the_old_version_then_switches() -> None:
    trainer = _trainer()
    engine = rt.RolloutEngine(trainer.model)
    trainer.publish(engine, checkpoint="policy")
    generation = engine.start(PROMPTS, max_new_tokens=4)
    generation.step()
    _step(trainer)
    report = trainer.publish(engine, checkpoint="policy", mode="drain")
    assert not report.switched and engine.version.revision == 0 and engine.pending_version.revision == 1
    with pytest.raises(rt.EngineBusyError, match="drained"):
        engine.start(PROMPTS, max_new_tokens=1)
    while not generation.done:
        generation.step()
    assert [v.revision for v in generation.versions] == [0, 0, 0, 0]
    assert engine.version.revision == 1 and engine.pending_version is None
    (s, _) = engine.generate(PROMPTS, max_new_tokens=2)
    assert s.behaviour_revisions.tolist() == [1, 1]


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cached", "uncached"])
def test_inflight_tokens_carry_exactly_the_version_that_drew_them(kv_cache: bool) -> None:
    """Each token's version and log-prob against an engine that re-decodes its prefix at the recorded version."""
    trainer = _trainer()
    engine = rt.RolloutEngine(trainer.model, kv_cache=kv_cache)
    reference = {}  # revision -> an engine serving it
    schedule = {2: True, 3: True}  # publish after these many tokens
    trainer.publish(engine, checkpoint="policy")
    reference[0] = rt.RolloutEngine(trainer.model)
    trainer.publish(reference[0], checkpoint="policy")
    generation = engine.start(PROMPTS, max_new_tokens=5, generator=torch.Generator().manual_seed(3))
    while not generation.done:
        generation.step()
        if len(generation.versions) in schedule:
            _step(trainer)
            assert trainer.publish(engine, checkpoint="policy", mode="inflight").switched
            revision = trainer.checkpoint("policy").revision
            reference[revision] = rt.RolloutEngine(trainer.model)
            trainer.publish(reference[revision], checkpoint="policy")
    assert [v.revision for v in generation.versions] == [0, 0, 1, 2, 2]
    for s in generation.samples():
        assert s.behaviour_revisions.tolist() == [0, 0, 1, 2, 2]
        assert s.version.revision == 0  # the oldest token's
        for i, revision in enumerate(s.behaviour_revisions.tolist()):
            prefix = torch.cat((s.prompt, s.completion[:i]))
            redecoded = reference[revision].score(prefix, s.completion[i : i + 1])
            assert (redecoded - s.behaviour_logprobs[i]).abs().max() <= FP32_LOGPROB_TOLERANCE
            others = [reference[r].score(prefix, s.completion[i : i + 1]) for r in reference if r != revision]
            assert all((o - s.behaviour_logprobs[i]).abs().max() > 10 * FP32_LOGPROB_TOLERANCE for o in others)


def test_a_publication_holds_the_weights_of_its_version_even_when_applied_after_a_step() -> None:
    trainer = _trainer()
    early = rt.RolloutEngine(trainer.model)
    trainer.publish(early, checkpoint="policy")
    publication = rt.rollout.publication_of(trainer.checkpoint("policy"))
    _step(trainer)
    late = rt.RolloutEngine(trainer.model)
    late.apply(publication)  # made at revision 0, applied after the step to revision 1
    assert late.version.revision == 0
    assert torch.equal(_served_state(late)[2][0], _served_state(early)[2][0])


def test_a_cancelled_generation_no_longer_holds_a_drained_publication_back() -> None:
    trainer = _trainer()
    engine = rt.RolloutEngine(trainer.model)
    trainer.publish(engine, checkpoint="policy")
    running = engine.start(PROMPTS, max_new_tokens=3)
    running.step()
    _step(trainer)
    assert not trainer.publish(engine, checkpoint="policy").switched
    running.cancel()
    assert engine.version.revision == 1 and engine.pending_version is None
    with pytest.raises(rt.ConfigError, match="cancelled"):
        running.step()
    with pytest.raises(rt.ConfigError, match="samples"):
        running.samples()


def test_the_weight_publication_fault_defaults_to_the_first_tensor_and_other_stages_take_no_index() -> None:
    trainer = _trainer()
    engine = rt.RolloutEngine(trainer.model)
    with inject_fault("weight_publication"), pytest.raises(rt.PublicationError) as failed:
        trainer.publish(engine, checkpoint="policy")
    assert failed.value.tensor == next(iter(dict(trainer.checkpoint("policy").named_parameters())))
    assert engine.version is None
    with pytest.raises(rt.ConfigError, match="index"):
        with inject_fault("validate", index=1):
            pass
