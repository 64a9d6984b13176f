"""Retain, offload and replay give the same exact gradients (docs/semantics.md#placements-and-memory-admission)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference_trainer as rt
from tests.support import train_step
from validation.oracle import plain_gradients, relative_error, snapshot_weights
from validation.trainers import trainer_with_policy

PLACEMENTS = ("retain", "offload", "replay")


def _trainer(config: rt.ModelConfig, kind: str, seed: int) -> rt.Trainer:
    lora = rt.LoRAConfig(rank=2) if kind == "lora" else None
    trainer = trainer_with_policy(config, lora=lora, optimizer=rt.AdamWConfig(lr=5e-2), seed=seed, adapter_seed=seed)
    if lora is not None:
        torch.manual_seed(seed)  # the step's dropout masks: every placement starts from the same weights
        train_step(trainer, seed=seed + 1000)  # move B off zero
    return trainer


def _run(config, kind, seed, placement, sequences, staleness, autocast=None):
    """Gradient committed for one record under ``placement``, plus the oracle inputs."""
    trainer = _trainer(config, kind, seed)
    weights = snapshot_weights(trainer, "policy")
    torch.manual_seed(seed)
    state = torch.get_rng_state()
    options = rt.ForwardOptions(backward_state=placement, corrections=())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
        outs = trainer.forward([rt.ForwardInput(i, t) for i, t in sequences], options=options)
    assert {o.placement for o in outs} == {placement}
    for step in range(staleness):
        train_step(trainer, seed=seed + 2000 + step)
    trainer.backward(_loss([o.target_logprobs for o in outs]))
    grads = {n: p.grad for n, p in trainer.checkpoint("policy").named_parameters()}
    return grads, weights, state


def _loss(outs: list[torch.Tensor]) -> torch.Tensor:
    return sum(-(out * torch.linspace(-1.0, 1.0, out.numel())).sum() for out in outs)


@st.composite
def cases(draw):
    hidden = draw(st.sampled_from([16, 32]))
    config = rt.ModelConfig.tiny(
        hidden_size=hidden,
        num_hidden_layers=draw(st.integers(1, 2)),
        intermediate_size=2 * hidden,
        dropout=draw(st.sampled_from([0.0, 0.2])),
    )
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    lengths = draw(st.lists(st.integers(1, 10), min_size=1, max_size=3))
    sequences = []
    for length in lengths:
        tokens = torch.randint(0, config.vocab_size, (length + 1,), generator=g)
        sequences.append((tokens[:-1].clone(), tokens[1:].clone()))
    return config, draw(st.sampled_from(["lora", "full"])), draw(st.integers(0, 2)), sequences, draw(st.integers(0, 50))


@given(cases())
def test_fp32_placements_are_bitwise_equal_to_each_other_and_to_plain_autograd(case) -> None:
    config, kind, staleness, sequences, seed = case
    results = {p: _run(config, kind, seed, p, sequences, staleness) for p in PLACEMENTS}
    grads, weights, state = results["retain"]
    reference = plain_gradients(config, weights, sequences, _loss, state)
    for placement in PLACEMENTS:
        for name, expected in reference.items():
            assert torch.equal(results[placement][0][name], expected), f"{placement}: {name}"


@pytest.mark.parametrize("mode", ["bf16-model", "bf16-autocast"])
def test_bf16_placements_agree_and_sit_within_bf16_autograds_own_error(mode: str) -> None:
    config = rt.ModelConfig.tiny(dropout=0.1, dtype=torch.bfloat16 if mode == "bf16-model" else torch.float32)
    autocast = torch.bfloat16 if mode == "bf16-autocast" else None
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (13,), generator=g)
    sequences = [(tokens[:-1], tokens[1:]), (tokens[:5], tokens[1:6])]
    results = {p: _run(config, "full", 3, p, sequences, 1, autocast) for p in PLACEMENTS}
    grads, weights, state = results["retain"]
    plain = plain_gradients(config, weights, sequences, _loss, state, dtype=config.dtype, autocast_dtype=autocast)
    fp64 = plain_gradients(config, weights, sequences, _loss, state, dtype=torch.float64)
    for name in plain:
        for placement in ("offload", "replay"):  # each against retain's gradients
            assert torch.equal(results[placement][0][name], grads[name]), f"{placement}: {name}"
        # Tolerance derived from BF16 autograd's own error against FP64 (never below FP32 noise).
        own = relative_error(plain[name], fp64[name])
        assert relative_error(grads[name], fp64[name]) <= 2 * own + 1e-6, name
        assert own > 1e-4, "the BF16 baseline must really be BF16 (non-vacuous tolerance)"
