"""The synthetic pattern task and the sampler's recorded behaviour log-probs; the task end to end with the trainer."""

from __future__ import annotations

import math

import pytest
import torch

import reference_trainer as rt
from reference_trainer.errors import ConfigError
from reference_trainer.losses import group_advantages, reinforce_loss
from reference_trainer.model import DecoderLM, ModelConfig, token_logprobs
from reference_trainer.sampling import PatternTask, Sample, sample
from validation.trainers import trainer_with_policy


def _constant_policy(logits: torch.Tensor):
    """Every position gets the same ``(V,)`` logits, whatever the context."""
    return lambda ids: logits.expand(ids.shape[0], ids.shape[1], logits.shape[0])


def _bigram_policy(table: torch.Tensor):
    """Logits depend on the current token: ``table[ids]`` is ``(B, T, V)``."""
    return lambda ids: table[ids]


# --- PatternTask ----------------------------------------------------------------


def test_count_up_reward_on_hand_examples():
    task = PatternTask(vocab_size=10, prompt_len=3, completion_len=3, seed=0)
    prompt = torch.tensor([3, 7, 9])
    # Last token 9: count up mod 10 -> 0, 1, 2.
    assert task.targets(prompt).tolist() == [0, 1, 2]
    assert task.reward(prompt, torch.tensor([0, 1, 2])).item() == 1.0
    assert task.reward(prompt, torch.tensor([0, 1, 5])).item() == pytest.approx(2 / 3)
    assert task.reward(prompt, torch.tensor([9, 9, 9])).item() == 0.0
    batch = task.reward(torch.tensor([[3, 7, 9], [0, 0, 4]]), torch.tensor([[0, 1, 2], [5, 0, 7]]))
    # Second prompt ends in 4: target 5, 6, 7 -> positions 0 and 2 match.
    assert batch.dtype == torch.float32
    assert batch.tolist() == pytest.approx([1.0, 2 / 3])


def test_repeat_reward_on_hand_examples():
    task = PatternTask(vocab_size=10, prompt_len=2, completion_len=4, seed=0, pattern="repeat")
    prompt = torch.tensor([1, 6])
    assert task.targets(prompt).tolist() == [6, 6, 6, 6]
    assert task.reward(prompt, torch.tensor([6, 6, 6, 6])).item() == 1.0
    assert task.reward(prompt, torch.tensor([6, 0, 6, 1])).item() == 0.5
    assert task.reward(prompt, torch.tensor([7, 8, 9, 0])).item() == 0.0


def test_prompts_are_deterministic_per_index_and_seed():
    task = PatternTask(vocab_size=7, prompt_len=5, completion_len=2, seed=3)
    prompts = task.prompts(6)
    assert prompts.shape == (6, 5) and prompts.dtype == torch.int64
    assert int(prompts.min()) >= 0 and int(prompts.max()) < 7
    assert torch.equal(prompts, PatternTask(7, 5, 2, 3).prompts(6))
    assert torch.equal(prompts[2:], task.prompts(4, start=2))  # independent of batching
    assert not torch.equal(prompts, PatternTask(7, 5, 2, seed=4).prompts(6))
    assert len({tuple(row) for row in prompts.tolist()}) > 1


def test_reward_samples_scores_a_list_of_samples():
    task = PatternTask(vocab_size=10, prompt_len=2, completion_len=2, seed=0)
    samples = [
        Sample(torch.tensor([0, 4]), torch.tensor([5, 6]), torch.zeros(2)),
        Sample(torch.tensor([0, 9]), torch.tensor([0, 0]), torch.zeros(2)),
    ]
    assert task.reward_samples(samples).tolist() == [1.0, 0.5]


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("vocab_size", dict(vocab_size=1, prompt_len=2, completion_len=2)),
        ("prompt_len", dict(vocab_size=4, prompt_len=0, completion_len=2)),
        ("completion_len", dict(vocab_size=4, prompt_len=2, completion_len=True)),
        ("seed", dict(vocab_size=4, prompt_len=2, completion_len=2, seed=-1)),
        ("pattern", dict(vocab_size=4, prompt_len=2, completion_len=2, pattern="mirror")),
    ],
)
def test_task_rejects_bad_configuration(field, kwargs):
    with pytest.raises(ConfigError) as info:
        PatternTask(**kwargs)
    assert info.value.field == field


def test_reward_rejects_mismatched_shapes():
    task = PatternTask(vocab_size=10, prompt_len=2, completion_len=3)
    with pytest.raises(ConfigError) as info:
        task.reward(torch.tensor([1, 2]), torch.tensor([1, 2]))
    assert info.value.field == "completions"
    with pytest.raises(ConfigError) as info:
        task.reward(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]))
    assert info.value.field == "prompts"


# --- Sample helpers ---------------------------------------------------------------


def test_sample_training_views_on_hand_example():
    s = Sample(torch.tensor([5, 6, 7]), torch.tensor([1, 2]), torch.tensor([-0.5, -1.5]), "v")
    assert s.tokens.tolist() == [5, 6, 7, 1, 2]
    assert s.input_tokens.tolist() == [5, 6, 7, 1]
    # target[t] = tokens[t + 1]; the first P - 1 = 2 targets are prompt tokens, masked.
    assert s.target_tokens.tolist() == [-1, -1, 1, 2]
    assert s.completion_mask.tolist() == [False, False, True, True]
    assert s.aligned_behaviour_logprobs.tolist() == [0.0, 0.0, -0.5, -1.5]
    assert s.prompt.tolist() == [5, 6, 7]  # views did not write into the prompt


# --- sampler ----------------------------------------------------------------------


def test_sampler_is_deterministic_under_a_seeded_generator():
    table = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 2
    prompts = PatternTask(vocab_size=8, prompt_len=3, completion_len=6, seed=1).prompts(8)

    def draw(seed: int) -> list[Sample]:
        generator = torch.Generator().manual_seed(seed)
        return sample(_bigram_policy(table), prompts, max_new_tokens=6, generator=generator)

    first, again, other = draw(123), draw(123), draw(124)
    assert len(first) == 8
    for a, b in zip(first, again):
        assert torch.equal(a.completion, b.completion)
        assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
        assert torch.equal(a.prompt, b.prompt) and a.completion.shape == (6,)
        assert a.behaviour_logprobs.dtype == torch.float32
    different = torch.stack([s.completion for s in first]) != torch.stack([s.completion for s in other])
    assert bool(different.any())  # the seed matters, so the check above is not vacuous


def test_sampler_records_the_given_version_object():
    marker = object()
    samples = sample(
        _constant_policy(torch.zeros(4)),
        torch.zeros(3, 2, dtype=torch.long),
        max_new_tokens=2,
        version=marker,
    )
    assert all(s.version is marker for s in samples)
    (unversioned,) = sample(_constant_policy(torch.zeros(4)), torch.tensor([1]), max_new_tokens=1)
    assert unversioned.version is None


def test_behaviour_logprobs_align_with_a_training_forward():
    """``token_logprobs(model(input_tokens), target_tokens)`` reproduces the recording."""
    model = DecoderLM(ModelConfig.tiny(initializer_range=0.5), seed=0).eval()
    task = PatternTask(vocab_size=64, prompt_len=4, completion_len=5, seed=2)
    samples = sample(
        lambda ids: model(ids),
        task.prompts(3),
        max_new_tokens=5,
        generator=torch.Generator().manual_seed(0),
    )
    p = task.prompt_len
    for s in samples:
        with torch.no_grad():
            trained = token_logprobs(model(s.input_tokens[None]), s.target_tokens[None])[0]
        assert trained[: p - 1].abs().max().item() == 0.0
        torch.testing.assert_close(trained[p - 1 :], s.behaviour_logprobs, rtol=0, atol=1e-5)
        torch.testing.assert_close(trained, s.aligned_behaviour_logprobs, rtol=0, atol=1e-5)
        # Non-vacuous: the policy is far from uniform, so an off-by-one layout would fail.
        assert (trained[p - 2 : -1] - s.behaviour_logprobs).abs().max().item() > 1e-2


def test_greedy_oracle_policy_earns_full_reward():
    task = PatternTask(vocab_size=6, prompt_len=3, completion_len=4, seed=5)
    # Next token = current token + 1 (mod 6): exactly the count-up pattern.
    table = torch.nn.functional.one_hot((torch.arange(6) + 1) % 6, 6).float() * 5.0
    samples = sample(_bigram_policy(table), task.prompts(10), max_new_tokens=4, top_k=1)
    assert task.reward_samples(samples).tolist() == [1.0] * 10


# Full distribution, probabilities by construction (the shift does not change them).
PROBS = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02], dtype=torch.float64)
LOGITS = (PROBS.log() + 1.7).float()


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature", "kept"),
    [
        (2, None, 1.0, {0, 1}),  # the two largest
        (None, 0.7, 1.0, {0, 1}),  # mass before token 1 is 0.5 < 0.7, before token 2 is 0.8
        # top-p on the top-3 renormalised (0.556, 0.333, 0.111): mass before token 2 is
        # 0.889 >= 0.85, so it goes (on the full distribution it would be 0.8 and stay).
        (3, 0.85, 1.0, {0, 1}),
        # renormalised top-4 (0.526, 0.316, 0.105, 0.053): before token 3 is 0.947 >= 0.9.
        (4, 0.9, 1.0, {0, 1, 2}),
        (2, None, 2.0, {0, 1}),  # temperature 2: probabilities ~ sqrt(p); same top 2
    ],
)
def test_truncated_sampling_records_full_distribution_logprobs(top_k, top_p, temperature, kept):
    tempered = PROBS ** (1 / temperature)
    full = tempered / tempered.sum()  # the full distribution at this temperature, by hand
    kept_mass = sum(full[i].item() for i in kept)
    assert kept_mass < 0.95  # truncation really removes mass

    samples = sample(
        _constant_policy(LOGITS),
        torch.zeros(100, 1, dtype=torch.long),
        max_new_tokens=2,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator().manual_seed(0),
    )
    tokens = torch.stack([s.completion for s in samples]).flatten()
    recorded = torch.stack([s.behaviour_logprobs for s in samples]).flatten()
    assert set(tokens.tolist()) == kept  # only kept tokens drawn, and every one of them

    # Independent reference: log_softmax of the full logits at the temperature.
    reference = torch.log_softmax(LOGITS.double() / temperature, dim=-1)[tokens]
    torch.testing.assert_close(recorded.double(), reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(recorded.double(), full[tokens].log(), rtol=0, atol=1e-6)
    # Not the renormalised probability: that is larger by a factor 1 / kept_mass >= 1 / 0.95.
    renormalised = full[tokens] / kept_mass
    assert (renormalised.log() - recorded.double()).min().item() > -math.log(0.95) - 1e-6
    assert (recorded.double().exp() - kept_mass).abs().min().item() > 0.02


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_new_tokens", dict(max_new_tokens=0)),
        ("temperature", dict(max_new_tokens=1, temperature=0.0)),
        ("temperature", dict(max_new_tokens=1, temperature=math.nan)),
        ("top_k", dict(max_new_tokens=1, top_k=0)),
        ("top_k", dict(max_new_tokens=1, top_k=1.5)),
        ("top_p", dict(max_new_tokens=1, top_p=0.0)),
        ("top_p", dict(max_new_tokens=1, top_p=1.5)),
    ],
)
def test_sampler_rejects_bad_settings(field, kwargs):
    with pytest.raises(ConfigError) as info:
        sample(_constant_policy(torch.zeros(4)), torch.zeros(1, 2, dtype=torch.long), **kwargs)
    assert info.value.field == field


@pytest.mark.parametrize(
    "prompts",
    [
        torch.zeros(2, 3),  # float ids
        torch.zeros(2, 0, dtype=torch.long),  # empty prompts
        [torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long)],  # ragged
        [],
    ],
)
def test_sampler_rejects_bad_prompts(prompts):
    with pytest.raises(ConfigError) as info:
        sample(_constant_policy(torch.zeros(4)), prompts, max_new_tokens=1)
    assert info.value.field == "prompts"


def test_sampler_rejects_logits_of_the_wrong_shape():
    with pytest.raises(ConfigError) as info:
        sample(lambda ids: torch.zeros(ids.shape[0], 4), torch.zeros(1, 2, dtype=torch.long), max_new_tokens=1)
    assert info.value.field == "logits_fn"


def test_a_generator_off_the_models_device_is_refused_with_the_device_to_use() -> None:
    """On CUDA a CPU generator cannot draw from CUDA probabilities: say so before drawing (meta stands in for CUDA)."""
    logits_fn = lambda ids: torch.zeros(*ids.shape, 5, device="meta")  # noqa: E731
    with pytest.raises(ConfigError, match="generator") as info:
        sample(logits_fn, torch.zeros(2, 3, dtype=torch.long), max_new_tokens=1, generator=torch.Generator())
    assert "device='meta'" in str(info.value)


# --- the synthetic RL task end to end: sample from the trainer's policy, train on the reward


def test_policy_logits_match_the_trainers_own_log_probs_and_carry_the_version() -> None:
    trainer = trainer_with_policy(lora=rt.LoRAConfig(rank=4))
    logits_fn, version = trainer.policy()
    assert version == trainer.checkpoint("policy").version
    task = PatternTask(vocab_size=64, prompt_len=4, completion_len=3, seed=0)
    samples = sample(
        logits_fn, task.prompts(2), max_new_tokens=3, generator=torch.Generator().manual_seed(0), version=version
    )
    out = trainer.forward([rt.ForwardInput(s.input_tokens, s.target_tokens) for s in samples])
    for s, o in zip(samples, out):
        recorded = s.aligned_behaviour_logprobs
        assert torch.allclose(o.target_logprobs.detach(), recorded, atol=1e-5)
        assert s.version == o.version


def test_reinforce_on_the_pattern_task_raises_the_reward() -> None:
    torch.manual_seed(0)
    trainer = trainer_with_policy(rt.ModelConfig.tiny(vocab_size=8), optimizer=rt.AdamWConfig(lr=3e-2))
    task = PatternTask(vocab_size=8, prompt_len=2, completion_len=2, seed=0, pattern="repeat")
    generator = torch.Generator().manual_seed(0)
    rewards = []
    for _ in range(25):
        logits_fn, version = trainer.policy()
        prompts = task.prompts(4).repeat_interleave(4, dim=0)  # the same 4 prompts, 4 samples each
        samples = sample(logits_fn, prompts, max_new_tokens=2, generator=generator, version=version)
        reward = task.reward_samples(samples)
        rewards.append(float(reward.mean()))
        advantages = group_advantages(reward, group_size=4)
        outs = trainer.forward([rt.ForwardInput(s.input_tokens, s.target_tokens) for s in samples])
        logprobs = [o.target_logprobs for o in outs]
        masks = [s.target_tokens >= 0 for s in samples]
        loss = sum(reinforce_loss(lp, adv, m, reduction="sum") for lp, adv, m in zip(logprobs, advantages, masks))
        trainer.backward(loss / len(samples))
        trainer.optim_step()
        trainer.zero_grad()
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards
