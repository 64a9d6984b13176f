"""The rollout engine's KV-cached decoding against the trainer's own forward at the same weights."""

from __future__ import annotations

import pytest
import torch

import reference_trainer as rt
from reference_trainer.model import token_logprobs
from reference_trainer.rollout.engine import FP32_LOGPROB_TOLERANCE
from validation.trainers import trainer_with_policy

PROMPT_LENGTHS = (3, 6, 4, 5, 2, 6, 3, 5)
NEW_TOKENS = 5


def _trainer(dtype: torch.dtype = torch.float32) -> rt.Trainer:
    """A LoRA policy whose factors are random, so the adapter changes the base's log-probs."""
    model = rt.DecoderLM(rt.ModelConfig.tiny(dtype=dtype), seed=0)
    trainer = trainer_with_policy(model, lora=rt.LoRAConfig(rank=4))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, param in trainer.checkpoint("policy").named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    return trainer


def _prompts(batch: int, *, ragged: bool = True) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(batch)
    lengths = PROMPT_LENGTHS[:batch] if ragged else (4,) * batch
    return [torch.randint(64, (n,), generator=generator) for n in lengths]


def _published(trainer: rt.Trainer, **engine_options: object) -> rt.RolloutEngine:
    engine = rt.RolloutEngine(trainer.model, **engine_options)
    trainer.publish(engine, checkpoint="policy")
    return engine


def _unpadded_logprobs(trainer: rt.Trainer, sample) -> torch.Tensor:
    """The oracle: the model's plain forward of the one sequence, no cache, no padding, FP64 softmax."""
    logits_fn, _ = trainer.policy("policy")
    logits = logits_fn(sample.input_tokens[None])[0].double()
    return token_logprobs(logits, sample.target_tokens)[sample.prompt.shape[0] - 1 :]


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_fp32_behaviour_logprobs_equal_a_full_recompute_at_every_batch_and_padding(batch: int, kv_cache: bool) -> None:
    trainer = _trainer()
    engine = _published(trainer, kv_cache=kv_cache)
    samples = engine.generate(_prompts(batch), max_new_tokens=NEW_TOKENS, generator=torch.Generator().manual_seed(0))
    # Two references: each sequence alone, and the trainer's right-padded batch of them all.
    outputs = trainer.forward(
        [rt.ForwardInput(input_tokens=s.input_tokens, target_tokens=s.target_tokens) for s in samples],
        checkpoint="policy",
    )
    for s, output, prompt in zip(samples, outputs, _prompts(batch)):
        assert torch.equal(s.prompt, prompt) and s.completion.shape == (NEW_TOKENS,)
        alone = _unpadded_logprobs(trainer, s)
        batched = output.target_logprobs.detach()[s.prompt.shape[0] - 1 :]
        assert (s.behaviour_logprobs.double() - alone).abs().max() <= FP32_LOGPROB_TOLERANCE
        assert (s.behaviour_logprobs - batched).abs().max() <= FP32_LOGPROB_TOLERANCE


def test_the_cache_runs_each_column_once_and_without_it_every_column_every_token() -> None:
    trainer = _trainer()
    prompts = _prompts(4, ragged=False)  # (4, 4)
    cached, uncached = _published(trainer), _published(trainer, kv_cache=False)
    cached.generate(prompts, max_new_tokens=NEW_TOKENS)
    uncached.generate(prompts, max_new_tokens=NEW_TOKENS)
    assert cached.columns_run == 4 * (4 + NEW_TOKENS - 1)  # prefill, then one column per new token
    assert uncached.columns_run == 4 * sum(4 + i for i in range(NEW_TOKENS))


def test_a_seeded_generator_makes_the_samples_deterministic_and_greedy_follows_the_argmax() -> None:
    trainer = _trainer()
    engine = _published(trainer)
    first, second = (
        engine.generate(_prompts(4), max_new_tokens=NEW_TOKENS, generator=torch.Generator().manual_seed(7))
        for _ in range(2)
    )
    assert all(torch.equal(a.completion, b.completion) for a, b in zip(first, second))
    logits_fn, _ = trainer.policy("policy")
    for s in engine.generate(_prompts(4), max_new_tokens=NEW_TOKENS, top_k=1):
        logits = logits_fn(s.tokens[None])[0, s.prompt.shape[0] - 1 : -1]  # (C, V)
        assert torch.equal(s.completion, logits.argmax(-1))


def test_behaviour_logprobs_are_at_the_temperature_over_the_full_vocabulary() -> None:
    trainer = _trainer()
    engine = _published(trainer)
    logits_fn, _ = trainer.policy("policy")
    for s in engine.generate(_prompts(4), max_new_tokens=NEW_TOKENS, temperature=0.7, top_k=5, top_p=0.8):
        logits = logits_fn(s.tokens[None])[0, s.prompt.shape[0] - 1 : -1].double()
        expected = torch.log_softmax(logits / 0.7, -1).gather(-1, s.completion[:, None]).squeeze(-1)
        assert (s.behaviour_logprobs.double() - expected).abs().max() <= FP32_LOGPROB_TOLERANCE
        scored = engine.score(s.prompt, s.completion, temperature=0.7)
        assert (scored - s.behaviour_logprobs).abs().max() <= FP32_LOGPROB_TOLERANCE


def test_samples_carry_the_version_and_revision_of_every_token_and_align_with_the_trainer() -> None:
    trainer = _trainer()
    engine = _published(trainer)
    (s,) = engine.generate(_prompts(1), max_new_tokens=NEW_TOKENS)
    assert s.version == trainer.checkpoint("policy").version
    assert s.behaviour_revisions.tolist() == [0] * NEW_TOKENS
    aligned = s.aligned_behaviour_revisions
    assert aligned.shape == s.input_tokens.shape
    assert aligned.tolist() == [-1] * (s.prompt.shape[0] - 1) + [0] * NEW_TOKENS


def test_a_bf16_engine_differs_from_the_trainer_but_stays_close() -> None:
    trainer = _trainer()
    engine = _published(trainer, dtype=torch.bfloat16)
    samples = engine.generate(_prompts(4), max_new_tokens=NEW_TOKENS, generator=torch.Generator().manual_seed(0))
    gaps = torch.cat([(s.behaviour_logprobs.double() - _unpadded_logprobs(trainer, s)).abs() for s in samples])
    assert all(s.behaviour_logprobs.dtype == torch.float32 for s in samples)
    assert gaps.max() > FP32_LOGPROB_TOLERANCE  # rounding shows
    assert gaps.max() < 0.1


def test_bad_engine_arguments_and_an_unpublished_engine_are_refused() -> None:
    trainer = _trainer()
    with pytest.raises(rt.ConfigError, match="dtype"):
        rt.RolloutEngine(trainer.model, dtype=torch.int64)
    with pytest.raises(rt.ConfigError, match="model"):
        rt.RolloutEngine(object())
    engine = rt.RolloutEngine(trainer.model)
    with pytest.raises(rt.EngineBusyError, match="publication first"):
        engine.start(_prompts(1), max_new_tokens=1)
    trainer.publish(engine, checkpoint="policy")
    with pytest.raises(rt.ConfigError, match="prompts"):
        engine.start([torch.zeros(2, 2, dtype=torch.long)], max_new_tokens=1)
    with pytest.raises(rt.ConfigError, match="max_new_tokens"):
        engine.start(_prompts(1), max_new_tokens=0)
    with pytest.raises(rt.ConfigError, match="temperature"):
        engine.start(_prompts(1), max_new_tokens=1, temperature=0.0)
    with pytest.raises(rt.ConfigError, match="completion"):
        engine.score(torch.tensor([1, 2]), torch.tensor([], dtype=torch.long))
    with pytest.raises(rt.ConfigError, match="prompt"):
        engine.score(torch.tensor([[1, 2]]), torch.tensor([3]))
    generation = engine.start(_prompts(1), max_new_tokens=1)
    with pytest.raises(rt.ConfigError, match="samples"):
        generation.samples()
    generation.step()
    with pytest.raises(rt.ConfigError, match="step"):
        generation.step()
    with pytest.raises(rt.ConfigError, match="engine"):
        trainer.publish(object(), checkpoint="policy")


def _moved(trainer: rt.Trainer) -> rt.CheckpointVersion:
    """One optimizer step of the policy: a newer version to publish."""
    output = trainer.forward(rt.ForwardInput(input_tokens=torch.arange(12) % 64), checkpoint="policy")
    trainer.backward(-output.target_logprobs.sum())
    trainer.optim_step()
    trainer.zero_grad()
    return trainer.checkpoint("policy").version


@pytest.mark.parametrize("bad", [[5, 64], [-1, 3]], ids=["past-the-vocabulary", "negative"])
def test_a_prompt_token_outside_the_vocabulary_is_refused_and_leaves_nothing_running(bad: list[int]) -> None:
    trainer = _trainer()
    engine = _published(trainer)
    with pytest.raises(rt.ConfigError, match=r"expected token ids in \[0, 64\), found .*; map the prompt"):
        engine.generate([torch.tensor([2, 3, 4]), torch.tensor(bad)], max_new_tokens=2)
    version = _moved(trainer)
    assert trainer.publish(engine, checkpoint="policy").switched  # a drain: nothing holds it back
    assert engine.version == version and len(engine.generate(_prompts(2), max_new_tokens=1)) == 2


def test_a_generate_interrupted_mid_way_is_cancelled_and_the_drained_publication_waiting_on_it_proceeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = _trainer()
    engine = _published(trainer)
    real_draw, calls, published = rt.rollout.engine.draw, [], []

    def draw_then_interrupt(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        if len(calls) == 2:  # mid-generate: a drained publication waits on this generation, then a Ctrl-C
            published.append(trainer.publish(engine, checkpoint="policy"))
            raise KeyboardInterrupt
        return real_draw(*args)

    _moved(trainer)
    monkeypatch.setattr(rt.rollout.engine, "draw", draw_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(_prompts(2), max_new_tokens=NEW_TOKENS)
    assert not published[0].switched  # it was pending while the generation ran ...
    assert engine.version == published[0].version and engine.pending_version is None  # ... and switched on cancel
    monkeypatch.setattr(rt.rollout.engine, "draw", real_draw)
    assert len(engine.generate(_prompts(2), max_new_tokens=2)) == 2


@pytest.mark.parametrize("failing_step", [0, 2], ids=["prefill", "decode"])
def test_a_step_whose_draw_raises_rolls_the_cache_back_and_the_generation_continues_exactly(
    failing_step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = _trainer()
    engine = _published(trainer)
    expected = engine.generate(_prompts(4), max_new_tokens=NEW_TOKENS, generator=torch.Generator().manual_seed(3))
    generation = engine.start(_prompts(4), max_new_tokens=NEW_TOKENS, generator=torch.Generator().manual_seed(3))
    for _ in range(failing_step):
        generation.step()
    real_draw = rt.rollout.engine.draw

    def failing(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(rt.rollout.engine, "draw", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        generation.step()
    monkeypatch.setattr(rt.rollout.engine, "draw", real_draw)
    assert len(generation.versions) == failing_step
    while not generation.done:
        generation.step()
    for got, want in zip(generation.samples(), expected):
        assert torch.equal(got.completion, want.completion)
        assert torch.equal(got.behaviour_logprobs, want.behaviour_logprobs)


def test_samples_carry_the_generation_of_every_token() -> None:
    trainer = _trainer()
    engine = _published(trainer)
    (s,) = engine.generate(_prompts(1), max_new_tokens=NEW_TOKENS)
    generation = trainer.checkpoint("policy").version.generation
    assert s.behaviour_generations.tolist() == [generation] * NEW_TOKENS
    assert s.aligned_behaviour_generations.tolist() == [-1] * (s.prompt.shape[0] - 1) + [generation] * NEW_TOKENS
