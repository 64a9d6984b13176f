"""The synthetic RL task end to end: sample from the trainer's policy, train on the reward."""

from __future__ import annotations

import torch

import reference_trainer as rt
from reference_trainer.losses import group_advantages, reinforce_loss
from reference_trainer.sampling import PatternTask, sample


def test_policy_logits_match_the_trainers_own_log_probs_and_carry_the_version() -> None:
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(), seed=0))
    trainer.add_checkpoint("policy", lora=rt.LoRAConfig(rank=4), seed=1)
    logits_fn, version = trainer.policy()
    assert version == trainer.checkpoint("policy").version
    task = PatternTask(vocab_size=64, prompt_len=4, completion_len=3, seed=0)
    samples = sample(logits_fn, task.prompts(2), max_new_tokens=3, generator=torch.Generator().manual_seed(0), version=version)
    out = trainer.forward([rt.ForwardInput(s.input_tokens, s.target_tokens) for s in samples])
    for s, o in zip(samples, out):
        recorded = s.aligned_behaviour_logprobs
        assert torch.allclose(o.target_logprobs.detach(), recorded, atol=1e-5)
        assert s.version == o.version


def test_reinforce_on_the_pattern_task_raises_the_reward() -> None:
    torch.manual_seed(0)
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(vocab_size=8), seed=0))
    trainer.add_checkpoint("policy", full=True, optimizer=rt.AdamWConfig(lr=3e-2))
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
