"""GradientTransaction's own checks (NOTE [Gradient commit] Rule 2), driven directly.

Through the trainer most of these are also caught earlier (ages are checked
before any model backward runs) or cannot arise (a backward's gradients have
the capture's shapes); the transaction still validates everything it
publishes, so each check is exercised here on purpose-built staging.
"""

from __future__ import annotations

import pytest
import torch

import reference_trainer as rt
from reference_trainer.commit import GradientTransaction
from reference_trainer.sinks import LiveGradSink
from reference_trainer.staleness import check_age
from tests.support import make_trainer, train_step


def _transaction(trainer: rt.Trainer, lookup=None) -> GradientTransaction:  # noqa: ANN001
    released: list = []
    return GradientTransaction(LiveGradSink(), lookup or trainer.checkpoint, released.append)


def _grads(capture, transform=lambda g: g) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {n: transform(torch.ones_like(t)) for n, t in capture.tensors.items()}


def _assert_nothing_published(trainer: rt.Trainer) -> None:
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())


def test_validate_refuses_an_origin_that_grew_too_old_after_staging() -> None:
    trainer = make_trainer("full", dropout=0.0)
    capture = trainer.checkpoint("policy").capture()
    transaction = _transaction(trainer)
    transaction.stage(capture, _grads(capture), 0)
    train_step(trainer, seed=5)  # revision 0 -> 1: the staged origin is now stale beyond bound 0
    with pytest.raises(rt.StaleGradientError):
        transaction.commit()
    _assert_nothing_published(trainer)


def test_validate_refuses_a_replaced_checkpoint_object() -> None:
    trainer = make_trainer("full", dropout=0.0)
    other = make_trainer("full", dropout=0.0)
    capture = trainer.checkpoint("policy").capture()
    lookup = {"policy": trainer.checkpoint("policy")}
    transaction = _transaction(trainer, lookup.__getitem__)
    transaction.stage(capture, _grads(capture), 2)
    lookup["policy"] = other.checkpoint("policy")  # the name now resolves to another checkpoint
    with pytest.raises(rt.GradientCommitError, match="gradient target was replaced"):
        transaction.commit()
    _assert_nothing_published(trainer)


@pytest.mark.parametrize(
    ("what", "transform"),
    [
        ("shape", lambda g: g.reshape(-1)[:-1] if g.numel() > 1 else g.reshape(2, -1)),
        ("dtype", lambda g: g.double()),
        ("device", lambda g: g.to("meta")),
    ],
)
def test_validate_refuses_a_gradient_of_the_wrong_shape_dtype_or_device(what: str, transform) -> None:  # noqa: ANN001
    trainer = make_trainer("full", dropout=0.0)
    capture = trainer.checkpoint("policy").capture()
    transaction = _transaction(trainer)
    transaction.stage(capture, _grads(capture, transform), 2)
    with pytest.raises(rt.GradientCommitError, match=f"gradient {what} expected"):
        transaction.commit()
    _assert_nothing_published(trainer)


def test_validate_refuses_a_non_finite_first_gradient() -> None:
    trainer = make_trainer("full", dropout=0.0)
    capture = trainer.checkpoint("policy").capture()
    transaction = _transaction(trainer)
    transaction.stage(capture, _grads(capture, lambda g: g * float("nan")), 2)
    with pytest.raises(rt.GradientCommitError, match="expected a finite gradient"):
        transaction.commit()
    _assert_nothing_published(trainer)


def test_a_version_newer_than_the_checkpoint_is_refused() -> None:
    """Rule 2's lower bound (staleness >= 0): unreachable through the trainer, where revisions only grow."""
    trainer = make_trainer("full", dropout=0.0)
    checkpoint = trainer.checkpoint("policy")
    ahead = rt.CheckpointVersion("policy", checkpoint.generation, checkpoint.revision + 1)
    with pytest.raises(rt.StaleGradientError) as info:
        check_age(checkpoint, ahead, 2)
    assert info.value.staleness == -1
    check_age(checkpoint, checkpoint.version, 0)  # the same version is fresh
