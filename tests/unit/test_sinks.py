"""Where a commit publishes (NOTE [Gradient commit] Rule 5): ``.grad`` or one logical rank's door into the fold.

The trainer's own buffers (``RankGradients``: load, zero_grad, optim_step,
the busy check) are driven through logical ranks in
tests/dist/test_rank_gradients.py; here each sink is driven directly by a
``GradientTransaction`` on purpose-built staging.
"""

from __future__ import annotations

import pytest
import torch

from reference_trainer.commit import GradientTransaction
from reference_trainer.sinks import BufferGradSink, LiveGradSink
from tests.support import make_trainer


def _commit_constants(sink, bound: int = 2):
    """A trainer whose capture's gradients (constant 1, 2, ... per parameter) were committed into ``sink``."""
    trainer = make_trainer("full", dropout=0.0)
    capture = trainer.checkpoint("policy").capture()
    transaction = GradientTransaction(sink, trainer.checkpoint, [].append)
    grads = {name: torch.full_like(t, float(i + 1)) for i, (name, t) in enumerate(capture.tensors.items())}
    transaction.stage(capture, grads, bound)
    transaction.commit()
    return trainer, capture, grads


class RecordingFold:
    """A ``GradientFold`` that records what a buffer sink hands it."""

    def __init__(self) -> None:
        self.added: list[tuple[int, tuple[str, str], torch.Tensor]] = []
        self.discarded = 0

    def add(self, logical_rank: int, key: tuple[str, str], value: torch.Tensor) -> None:
        self.added.append((logical_rank, key, value))

    def discard(self) -> None:
        self.discarded += 1

    def pending(self, checkpoint: str | None = None) -> int:
        return len(self.added)

    def clear(self, checkpoint: str) -> None:
        self.added.clear()


def test_a_buffer_sink_hands_each_gradient_to_the_fold_keeps_origins_and_leaves_grad_alone() -> None:
    fold = RecordingFold()
    sink = BufferGradSink(logical_rank=3, fold=fold)
    trainer, capture, grads = _commit_constants(sink)
    checkpoint = trainer.checkpoint("policy")
    assert all(p.grad is None for p in checkpoint.parameters()) and not checkpoint.origins
    assert [(rank, key) for rank, key, _ in fold.added] == [(3, ("policy", name)) for name in grads]
    assert all(torch.equal(value, grads[key[1]]) for _, key, value in fold.added)
    assert sink.origins == {"policy": {(capture.version, 2)}} and fold.discarded == 0
    assert sink.current(checkpoint, next(iter(grads))) is None  # each round's leaf starts empty


def test_a_buffer_sink_takes_ownership_and_a_rollback_discards_the_round() -> None:
    """The transaction keeps no reference to a folded gradient while it waits for its peers (Rule 5)."""
    fold = RecordingFold()
    sink = BufferGradSink(logical_rank=0, fold=fold)

    class Refusing:
        def agree(self, error: BaseException | None) -> None:
            held = [s for s in transaction._staged.values() if s.value is not None or s.new is not None]
            assert not held, "the transaction still holds a gradient the fold owns"
            raise RuntimeError("a peer failed")

    trainer = make_trainer("full", dropout=0.0)
    capture = trainer.checkpoint("policy").capture()
    transaction = GradientTransaction(sink, trainer.checkpoint, [].append, Refusing())
    transaction.stage(capture, {name: torch.ones_like(t) for name, t in capture.tensors.items()}, 2)
    with pytest.raises(RuntimeError, match="a peer failed"):
        transaction.commit()
    assert fold.discarded == len(capture.tensors) and sink.origins == {}


def test_a_live_sink_writes_grad_and_the_checkpoints_origins() -> None:
    sink = LiveGradSink()
    trainer, capture, grads = _commit_constants(sink, bound=1)
    checkpoint = trainer.checkpoint("policy")
    assert all(torch.equal(checkpoint.parameter(name).grad, grad) for name, grad in grads.items())
    assert checkpoint.origins == {(capture.version, 1)}
    assert sink.current(checkpoint, next(iter(grads))) is checkpoint.parameter(next(iter(grads))).grad


def test_clearing_a_buffer_drops_only_the_named_checkpoints_origins() -> None:
    sink = BufferGradSink(logical_rank=1, fold=RecordingFold())
    _commit_constants(sink)
    sink.origins["reference"] = set()  # a second checkpoint's entry
    sink.clear("policy")
    assert set(sink.origins) == {"reference"}
    sink.clear()
    assert sink.origins == {}
