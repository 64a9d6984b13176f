"""The commit's finiteness check (one fused norm, then an exact per-tensor check): refuses NaN, keeps huge finite values."""

from __future__ import annotations

import pytest
import torch

import reference_trainer as rt


def _trainer_and_output() -> tuple[rt.Trainer, rt.ForwardOutput]:
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(), seed=0))
    trainer.add_checkpoint("policy", full=True)
    tokens = torch.randint(0, trainer.model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    return trainer, trainer.forward(rt.ForwardInput(tokens[:-1], tokens[1:]))


def test_a_first_backward_with_a_nan_loss_commits_nothing() -> None:
    trainer, out = _trainer_and_output()
    with pytest.raises(rt.GradientCommitError, match="expected a finite gradient"):
        trainer.backward(out.target_logprobs.sum() * float("nan"))
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())


def test_finite_gradients_whose_squares_overflow_still_commit() -> None:
    trainer, out = _trainer_and_output()
    trainer.backward(out.target_logprobs.sum() * 1e25)
    grads = [p.grad for p in trainer.checkpoint("policy").parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    assert max(float(g.abs().max()) for g in grads) > 1e20  # the fused norm overflowed: the exact path decided
