"""The one builder of a trainer with one ``policy`` checkpoint (``validation.trainers``): its contract.

The oracle for the weights is PyTorch's and the trainer's own construction,
done here by hand: ``DecoderLM(config, seed=s)`` and
``add_checkpoint(..., seed=s + 1)``.
"""

from __future__ import annotations

import pytest
import torch

import reference_trainer as rt
from validation.trainers import POLICY, trainer_with_policy

LORA = rt.LoRAConfig(rank=2)


def _state(trainer: rt.Trainer) -> dict[str, torch.Tensor]:
    """The base's weights and the policy's trainable ones, by name."""
    base = {f"base.{n}": t for n, t in trainer.model.state_dict().items()}
    return base | {f"policy.{n}": p.detach() for n, p in trainer.checkpoint(POLICY).named_parameters()}


def _bitwise_equal(a: rt.Trainer, b: rt.Trainer) -> bool:
    sa, sb = _state(a), _state(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


def _by_hand(seed: int, lora: rt.LoRAConfig | None, adapter_seed: int) -> rt.Trainer:
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(), seed=seed))
    trainer.add_checkpoint("policy", lora=lora, full=lora is None, seed=adapter_seed)
    return trainer


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_the_same_seed_gives_bitwise_the_same_trainer_whatever_the_global_rng(lora: rt.LoRAConfig | None) -> None:
    torch.manual_seed(1)
    first = trainer_with_policy(lora=lora, seed=3)
    torch.manual_seed(2)  # the builder never reads the global RNG
    assert _bitwise_equal(first, trainer_with_policy(lora=lora, seed=3))
    assert not _bitwise_equal(first, trainer_with_policy(lora=lora, seed=4))


def test_the_model_is_drawn_from_seed_and_the_adapter_from_seed_plus_one_unless_given() -> None:
    assert _bitwise_equal(trainer_with_policy(lora=LORA, seed=5), _by_hand(5, LORA, 6))
    assert _bitwise_equal(trainer_with_policy(lora=LORA, seed=5, adapter_seed=9), _by_hand(5, LORA, 9))
    built = rt.DecoderLM(rt.ModelConfig.tiny(), seed=7)  # a built model: seed only derives the adapter's
    assert _bitwise_equal(trainer_with_policy(built, lora=LORA, seed=2), _by_hand(7, LORA, 3))


def test_one_checkpoint_named_policy_of_the_kind_asked() -> None:
    lora, full = trainer_with_policy(lora=LORA), trainer_with_policy()
    assert POLICY == "policy" and list(lora.checkpoints) == list(full.checkpoints) == ["policy"]
    assert {n.split(".")[-2] for n, _ in lora.checkpoint(POLICY).named_parameters()} == {"lora_A", "lora_B"}
    assert [n for n, _ in full.checkpoint(POLICY).named_parameters()] == [n for n, _ in full.model.named_parameters()]


def test_the_model_config_optimizer_and_trainer_options_reach_the_trainer() -> None:
    config = rt.ModelConfig.tiny(dtype=torch.float64, dropout=0.1)
    adamw = rt.AdamWConfig(lr=0.25)
    options = rt.ForwardOptions(max_gradient_staleness=3)
    trainer = trainer_with_policy(
        config, optimizer=adamw, options=options, memory_limit_bytes=1 << 30, host_memory_limit_bytes=1 << 20
    )
    assert trainer.model.config == config and trainer.checkpoint(POLICY).optimizer_config == adamw
    assert (trainer.options, trainer.memory_limit_bytes, trainer.host_memory_limit_bytes) == (options, 1 << 30, 1 << 20)
    assert trainer_with_policy().checkpoint(POLICY).optimizer_config == rt.AdamWConfig()


def test_a_model_config_is_built_in_place_on_the_device_given() -> None:
    assert trainer_with_policy(device="meta").model.lm_head.weight.device.type == "meta"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model": rt.DecoderLM(rt.ModelConfig.tiny(), seed=0), "device": "cpu"}, "device"),
        ({"model": "tiny"}, "model"),
        ({"lora": 4}, "lora"),
    ],
    ids=["device-with-built-model", "model-str", "lora-int"],
)
def test_bad_arguments_are_the_trainers_config_error(kwargs: dict, field: str) -> None:
    with pytest.raises(rt.ConfigError) as info:
        trainer_with_policy(**kwargs)
    assert info.value.field == field
