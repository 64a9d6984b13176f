"""Cotangent routing: from the caller's loss to each output leaf, and from the leaves to each record's root (NOTE [Forward records] Rules 2-3 in ``records.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import seams
from .errors import GradientCommitError
from .records import ForwardRecord, tag_of

__all__ = ["cotangents_by_record", "output_cotangents", "record_cotangent"]


def output_cotangents(
    loss: torch.Tensor, outputs: list[torch.Tensor], retain_graph: bool
) -> tuple[torch.Tensor | None, ...]:
    """The caller's autograd: ``d loss / d output`` for each output leaf (``None`` if unused).

    A failure here happens before any model backward, so it leaves every
    record retryable (stage ``"user_autograd"`` of NOTE [Gradient commit]).
    """
    try:
        seams.maybe_fail("user_autograd")
        return torch.autograd.grad(loss, outputs, retain_graph=retain_graph, allow_unused=True)
    except Exception as exc:
        raise GradientCommitError(
            f"the loss's own autograd failed ({exc}); nothing was committed and the outputs "
            "can be backpropagated again",
            record_retryable=True,
        ) from exc


def cotangents_by_record(
    leaves: list[torch.Tensor], cotangents: Sequence[torch.Tensor | None]
) -> dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """``(output leaf, its cotangent)`` pairs grouped by the record id each leaf is tagged with (Rule 2)."""
    grouped: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for leaf, cotangent in zip(leaves, cotangents):
        grouped.setdefault(tag_of(leaf).record_id, []).append((leaf, cotangent))
    return grouped


def record_cotangent(record: ForwardRecord, leaves: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """The padded ``(B, T)`` cotangent of a record's root from ``(output leaf, its cotangent)`` pairs (Rule 3)."""
    cotangent = torch.zeros_like(record.logprobs())
    for leaf, grad in leaves:
        if grad is not None:
            cotangent[tag_of(leaf).row, : grad.numel()] = grad
    # Masked targets carry no gradient; zeroing their cotangent keeps them out of corrections.
    cotangent.masked_fill_(record.batch.targets < 0, 0.0)
    return cotangent
