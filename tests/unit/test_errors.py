"""Every bad argument is a typed error saying what was expected and what was found, and changes nothing.

See docs/semantics.md#refusals-change-nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import reference_trainer as rt
from tests.support import NO_CORRECTION, advantages, assert_grads_unchanged, grad_snapshot, make_trainer, sequence


def _output(trainer: rt.Trainer, seed: int = 0) -> rt.ForwardOutput:
    ids, tgt = sequence(seed)
    return trainer.forward(rt.ForwardInput(ids, tgt), options=NO_CORRECTION)


def _loss(out: rt.ForwardOutput, seed: int = 0) -> torch.Tensor:
    return -(out.target_logprobs * advantages(seed)).sum()


def _other_trainers_loss(trainer: rt.Trainer) -> None:
    other = make_trainer("full", dropout=0.0)
    trainer.backward(_loss(_output(other)))


# (name, the call, the field the error names, what the message must say it found)
CASES: list[tuple[str, Callable[[rt.Trainer], Any], str, str]] = [
    (
        "forward-checkpoint-list",
        lambda t: t.forward(rt.ForwardInput(*sequence(0)), checkpoint=["policy"]),
        "checkpoint",
        "found ['policy']",
    ),
    ("optim_step-checkpoints-int", lambda t: t.optim_step(checkpoints=5), "checkpoints", "found 5"),
    (
        "optim_step-checkpoints-unhashable",
        lambda t: t.optim_step(checkpoints=[["policy"]]),
        "checkpoint",
        "found ['policy']",
    ),
    ("zero_grad-checkpoints-int", lambda t: t.zero_grad(checkpoints=5), "checkpoints", "found 5"),
    ("adamw-betas-none", lambda t: rt.AdamWConfig(betas=None), "AdamWConfig.betas", "found None"),
    ("adamw-lr-str", lambda t: rt.AdamWConfig(lr="fast"), "AdamWConfig.lr", "found 'fast'"),
    ("trainer-none", lambda t: rt.Trainer(None), "model", "found 'NoneType'"),
    (
        "add_checkpoint-optimizer-dict",
        lambda t: t.add_checkpoint("other", full=True, optimizer={"lr": 1}),
        "optimizer",
        "found {'lr': 1}",
    ),
    ("add_checkpoint-full-str", lambda t: t.add_checkpoint("other", full="yes"), "full", "found 'yes'"),
    ("backward-not-a-tensor", lambda t: t.backward(1.0), "loss", "found 'float'"),
    ("backward-non-scalar", lambda t: t.backward(_output(t).target_logprobs * 2.0), "loss", "a tensor of shape (9,)"),
    ("backward-retain-str", lambda t: t.backward(_loss(_output(t)), retain_graph="yes"), "retain_graph", "found 'yes'"),
    ("backward-other-trainer", _other_trainers_loss, "loss", "another trainer's output"),
]


def _state(trainer: rt.Trainer) -> tuple:
    checkpoint = trainer.checkpoint("policy")
    params = {n: p.detach().clone() for n, p in checkpoint.named_parameters()}
    return params, checkpoint.version, sorted(trainer.checkpoints), grad_snapshot(trainer)


@pytest.mark.parametrize(("call", "field", "found"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_argument_is_a_config_error_with_expected_and_found_and_changes_nothing(
    call: Callable, field: str, found: str
) -> None:
    trainer = make_trainer("full", dropout=0.0)
    trainer.backward(_loss(_output(trainer, 1), 1))  # committed gradients a refusal must not touch
    params, version, names, grads = _state(trainer)
    with pytest.raises(rt.ConfigError) as info:
        call(trainer)
    assert info.value.field == field
    message = str(info.value)
    assert "expected" in message and found in message and "already backpropagated" not in message, message
    for n, p in trainer.checkpoint("policy").named_parameters():
        assert torch.equal(p, params[n]), n
    assert trainer.checkpoint("policy").version == version and sorted(trainer.checkpoints) == names
    assert_grads_unchanged(trainer, grads)


def test_a_loss_refused_for_its_shape_or_retain_graph_leaves_its_outputs_usable() -> None:
    trainer = make_trainer("full", dropout=0.0)
    out = _output(trainer)
    for bad in (
        lambda: trainer.backward(out.target_logprobs * 1.0),
        lambda: trainer.backward(_loss(out), retain_graph=1),
    ):
        with pytest.raises(rt.ConfigError):
            bad()
    assert trainer.live_records() == 1
    trainer.backward(_loss(out))
    assert trainer.checkpoint("policy").has_gradients()


# --- grad modes (docs/semantics.md#versioned-backward: a forward records the graph its backward needs) ----


def test_a_forward_under_inference_mode_is_refused_with_the_fix_and_records_nothing() -> None:
    trainer = make_trainer("full", dropout=0.1)
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    with torch.inference_mode(), pytest.raises(rt.ConfigError) as info:
        _output(trainer)
    message = str(info.value)
    assert info.value.field == "forward" and "inference_mode" in message and "checkpoint=rt.BASE" in message, message
    assert trainer.live_records() == 0
    assert torch.equal(torch.get_rng_state(), rng), "a refused forward drew from the RNG"
    with torch.inference_mode():  # reference log-probs: the documented way
        reference = trainer.forward(rt.ForwardInput(*sequence(0)), checkpoint=rt.BASE)
    assert reference.target_logprobs.shape == (9,)


def test_a_forward_under_no_grad_records_its_graph_as_usual() -> None:
    """``no_grad`` governs the caller's own autograd; the trainer's forward always records (documented)."""
    trainer = make_trainer("full", dropout=0.0)
    with torch.no_grad():
        out = _output(trainer)
    assert out.target_logprobs.requires_grad and trainer.live_records() == 1
    plain = _output(trainer)
    assert torch.equal(out.target_logprobs, plain.target_logprobs)
    trainer.backward(_loss(out) + _loss(plain))
    assert trainer.checkpoint("policy").has_gradients() and trainer.live_records() == 0
