"""Where a commit publishes (NOTE [Gradient commit] Rule 5): ``.grad`` or one logical rank's buffer.

The trainer's own buffers (``RankGradients``: load, zero_grad, optim_step,
the busy check) are driven through logical ranks in
tests/dist/test_rank_gradients.py; here each sink is driven directly by a
``GradientTransaction`` on purpose-built staging.
"""

from __future__ import annotations

import torch

from reference_trainer.commit import GradientTransaction
from reference_trainer.sinks import BufferGradSink, LiveGradSink
from tests.support import make_trainer


def _commit_constants(sink, bound: int = 2):  # noqa: ANN001, ANN202
    """A trainer whose capture's gradients (constant 1, 2, ... per parameter) were committed into ``sink``."""
    trainer = make_trainer("full", dropout=0.0)
    capture = trainer.checkpoint("policy").capture()
    transaction = GradientTransaction(sink, trainer.checkpoint, [].append)
    grads = {name: torch.full_like(t, float(i + 1)) for i, (name, t) in enumerate(capture.tensors.items())}
    transaction.stage(capture, grads, bound)
    transaction.commit()
    return trainer, capture, grads


def test_a_buffer_sink_holds_the_gradients_and_origins_and_leaves_grad_alone() -> None:
    sink = BufferGradSink(logical_rank=0)
    trainer, capture, grads = _commit_constants(sink)
    checkpoint = trainer.checkpoint("policy")
    assert all(p.grad is None for p in checkpoint.parameters()) and not checkpoint.origins
    assert set(sink.grads) == {("policy", name) for name in grads}
    assert all(torch.equal(sink.grads[("policy", name)], grad) for name, grad in grads.items())
    assert sink.origins == {"policy": {(capture.version, 2)}}


def test_a_live_sink_writes_grad_and_the_checkpoints_origins() -> None:
    sink = LiveGradSink()
    trainer, capture, grads = _commit_constants(sink, bound=1)
    checkpoint = trainer.checkpoint("policy")
    assert all(torch.equal(checkpoint.parameter(name).grad, grad) for name, grad in grads.items())
    assert checkpoint.origins == {(capture.version, 1)}
    assert sink.current(checkpoint, next(iter(grads))) is checkpoint.parameter(next(iter(grads))).grad


def test_clearing_a_buffer_drops_only_the_named_checkpoint() -> None:
    sink = BufferGradSink(logical_rank=1)
    _commit_constants(sink)
    sink.grads[("reference", "w")], sink.origins["reference"] = torch.ones(1), set()  # a second checkpoint's entry
    sink.clear("policy")
    assert set(sink.grads) == {("reference", "w")} and set(sink.origins) == {"reference"}
    sink.clear()
    assert sink.grads == {} and sink.origins == {}
