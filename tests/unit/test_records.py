"""Versioned backward through forward records (NOTE [Forward records]): a stale gradient is the exact gradient at the forward's weights; the ledger; FP64 (docs/semantics.md#staleness)."""

from __future__ import annotations

import pytest
import torch

import reference_trainer as rt
from tests.support import (
    NO_CORRECTION,
    advantages,
    make_trainer,
    sequence,
    train_step,
)
from validation.oracle import plain_gradients, relative_error, snapshot_weights
from validation.trainers import trainer_with_policy


def _move_lora_b_off_zero(trainer: rt.Trainer) -> None:
    train_step(trainer, seed=100)
    b = [p for n, p in trainer.checkpoint("policy").named_parameters() if "lora_B" in n]
    assert all(bool(p.abs().sum() > 0) for p in b)


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_stale_gradient_is_exact_gradient_of_forward_weights(kind: str, k: int) -> None:
    trainer = make_trainer(kind, dropout=0.1)
    if kind == "lora":
        _move_lora_b_off_zero(trainer)
    config = trainer.model.config
    ids, tgt = sequence(1)
    original_ids, original_tgt = ids.clone(), tgt.clone()
    adv = advantages(1)
    weights = snapshot_weights(trainer, "policy")

    torch.manual_seed(1234)
    rng_state = torch.get_rng_state()
    out = trainer.forward(rt.ForwardInput(ids, tgt), options=NO_CORRECTION)
    ids.fill_(0)  # the caller overwrites its inputs...
    tgt.fill_(3)
    torch.manual_seed(999)  # ...and reseeds the global RNG
    for step in range(k):
        train_step(trainer, seed=200 + step)
    assert trainer.checkpoint("policy").revision == out.version.revision + k

    report = trainer.backward(-(out.target_logprobs * adv).sum())
    assert report.records[0].staleness == k
    committed = {n: p.grad for n, p in trainer.checkpoint("policy").named_parameters()}

    def loss(outs: list[torch.Tensor]) -> torch.Tensor:
        return -(outs[0] * adv).sum()

    seqs = [(original_ids, original_tgt)]
    ref32 = plain_gradients(config, weights, seqs, loss, rng_state)
    ref64 = plain_gradients(config, weights, seqs, loss, rng_state, dtype=torch.float64)
    for name, grad in committed.items():
        assert grad is not None, name
        assert torch.equal(grad, ref32[name]), f"{name}: not bitwise equal to plain FP32 autograd"
        assert float(ref64[name].abs().max()) > 0, f"{name}: vacuous (zero) reference"
        baseline_error = relative_error(ref32[name], ref64[name])
        assert relative_error(grad, ref64[name]) <= 2 * baseline_error + 1e-12

    if k > 0:  # non-vacuous: the live weights moved, and their gradient is different
        live = snapshot_weights(trainer, "policy")
        moved = max(float((live.trainable[n] - weights.trainable[n]).abs().max()) for n in committed)
        assert moved > 1e-3
        at_live = plain_gradients(config, live, seqs, loss, rng_state)
        worst = max(relative_error(at_live[n], ref32[n]) for n in committed)
        assert worst > 1e-3, "the gradient at the live weights should differ far beyond FP32 noise"


def test_ledger_refuses_weights_written_behind_the_trainers_back() -> None:
    trainer = make_trainer("full", dropout=0.0)
    ids, tgt = sequence(6)
    out = trainer.forward(rt.ForwardInput(ids, tgt), options=NO_CORRECTION)
    with torch.no_grad():
        next(iter(trainer.checkpoint("policy").parameters())).add_(1.0)
    with pytest.raises(rt.GradientCommitError, match="modified in place outside the trainer"):
        trainer.backward(-out.target_logprobs.sum())
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())


@pytest.mark.parametrize("placement", ["retain", "offload", "replay"])
def test_an_fp64_model_returns_fp64_logprobs_and_gradients(placement: str) -> None:
    config = rt.ModelConfig.tiny(dtype=torch.float64, dropout=0.0)
    trainer = trainer_with_policy(config)
    ids, tgt = sequence(3)
    out = trainer.forward(
        rt.ForwardInput(ids, tgt), options=rt.ForwardOptions(backward_state=placement, corrections=())
    )
    base = trainer.forward(rt.ForwardInput(ids, tgt), checkpoint=rt.BASE)
    assert out.target_logprobs.dtype == base.target_logprobs.dtype == torch.float64
    # Independent: the frozen model's own FP64 forward (the checkpoint still equals the base).
    with torch.no_grad():
        expected = rt.token_logprobs(trainer.model(ids.unsqueeze(0)), tgt.unsqueeze(0))[0]
    assert expected.dtype == torch.float64 and torch.allclose(
        out.target_logprobs.detach(), expected, rtol=0, atol=1e-12
    )
    trainer.backward(out.target_logprobs.sum())
    assert all(p.grad.dtype == torch.float64 for p in trainer.checkpoint("policy").parameters())
