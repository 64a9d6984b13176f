"""Injected bugs in how gradients are committed and flushed into ``.grad`` (``canaries.mutations.catalogue``).

Each puts back a bug of the gradient transaction (rollback, finiteness), of
the logical-rank buffers' flush onto a live ``.grad``, or of the known norm
a step reuses (NOTE [Intersection checks], NOTE [Gradient intersections]).
"""

from __future__ import annotations

from unittest import mock

import torch

from reference_trainer import commit as commit_module
from reference_trainer import sinks as sinks_module
from reference_trainer.checkpoints import Checkpoint
from reference_trainer.commit import GradientTransaction
from reference_trainer.grad_norms import KnownNorm
from reference_trainer.sinks import LiveGradSink, RankGradients
from reference_trainer.staleness import check_origins

from .injection import Mutation, patched

__all__ = ["GRADIENT_MUTATIONS"]


_REAL_FLUSH = RankGradients.flush


def _flush_then_check(self: RankGradients, checkpoints: list[Checkpoint]) -> None:
    """The buffers are summed into ``.grad`` first, the committed origins checked after."""
    with mock.patch.object(sinks_module, "_first_error", lambda checkpoints: None):
        _REAL_FLUSH(self, checkpoints)
    for checkpoint in checkpoints:
        check_origins(checkpoint)


class _AssigningSink(LiveGradSink):
    """A live sink that sees no existing ``.grad``: the flush assigns the logical sum instead of adding it."""

    def current(self, checkpoint: Checkpoint, name: str) -> torch.Tensor | None:
        return None


GRADIENT_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "partial_commit",
        "a failure during publication keeps the gradients already published (no rollback)",
        "derivative",
        patched(GradientTransaction, "_rollback", lambda self, done: None),
        "scenario:faults",
    ),
    Mutation(
        "commit_non_finite",
        "the commit's validation skips the finiteness check (a first NaN backward commits)",
        "derivative",
        patched(commit_module, "first_non_finite", lambda staged, norms: None),
        "scenario:non_finite",
    ),
    Mutation(
        "flush_before_checks",
        "optim_step sums the logical-rank buffers into .grad before it checks the committed origins",
        "derivative",
        patched(RankGradients, "flush", _flush_then_check),
        "intersection: refused optim_step over a stale live .grad with logical-rank buffers pending changes nothing",
    ),
    Mutation(
        "known_norm_without_length",
        "KnownNorm.matches without its length check: a stale norm after .grad = None",
        "derivative",
        patched(KnownNorm, "_same_count", lambda self, grads: True),
        "intersection: a .grad dropped after its backward is left out of the step's norm",
    ),
    Mutation(
        "flush_assigns",
        "RankGradients.flush assigns the logical sum instead of adding it to .grad",
        "derivative",
        patched(sinks_module, "LiveGradSink", _AssigningSink),
        "intersection: logical-rank buffers flushed onto a live .grad add to it",
    ),
)
