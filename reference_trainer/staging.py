"""One record's part of a transactional backward: its cotangent corrected, its model backward, its gradients staged.

``Trainer.backward`` finds the records a loss consumes, checks them, then
calls :func:`stage_record` on each in submission order inside one
``GradientTransaction`` (NOTE [Gradient commit] in ``commit.py``). For one
record it takes the record's share of the loss's cotangent, drops stale
behaviour tokens (NOTE [Behaviour tokens] in ``behaviour.py``), reweights a
stale record that asks for it (NOTE [Importance correction] in
``corrections.py``), runs the model backward at the record's capture
(``residency.record_backward``) and stages the gradients in the transaction,
which commits them all or none; the ``"model_backward"`` fault seam fires
between the start and the model backward. An error propagates to
``Trainer.backward``, which aborts the transaction.
"""

from __future__ import annotations

import torch

from . import seams
from .behaviour import behaviour_cotangent
from .commit import GradientTransaction
from .corrections import KnownLogprobs, correct_record
from .cotangents import record_cotangent
from .model import DecoderLM
from .outcomes import RecordReport
from .records import ForwardRecord
from .residency import record_backward
from .staleness import staleness

__all__ = ["stage_record"]


def stage_record(
    model: DecoderLM,
    known_logprobs: KnownLogprobs,
    record: ForwardRecord,
    leaves: list[tuple[torch.Tensor, torch.Tensor | None]],
    transaction: GradientTransaction,
    retain_graph: bool,
) -> RecordReport:
    """Correct the record's cotangent, run its model backward and stage the gradients."""
    cotangent, behaviour, stale = behaviour_cotangent(
        record, record_cotangent(record, leaves)
    )  # NOTE [Behaviour tokens]
    cotangent, stats = correct_record(model, record, cotangent, known_logprobs, stale)
    transaction.start(record)
    seams.maybe_fail("model_backward")
    grads = record_backward(model, record, cotangent, retain_graph)
    transaction.stage(record.capture, grads, record.options.max_gradient_staleness)
    return RecordReport(
        record_id=record.id,
        version=record.version,
        staleness=staleness(record.checkpoint, record.version),
        placement=record.placement,
        correction=stats,
        behaviour=behaviour,
    )
