"""Injected bugs in the trainer's memory: saved state, admission and the planner (``canaries.mutations.catalogue``).

Each puts back a bug of where a forward's saved state lives (replay, offload)
or of how admission and the planner price it (NOTE [Admission intersections]);
the planner's witnesses must each fail NOTE [Planner certificate].
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from reference_trainer import admission as admission_module
from reference_trainer import planner as planner_module
from reference_trainer import residency as residency_module
from reference_trainer.admission import Admission
from reference_trainer.checkpoints import Checkpoint
from reference_trainer.planner import ForwardCost, Placement, SavedTerms, analytic_saved_bytes
from reference_trainer.residency import SavedStateLedger

from .injection import Mutation, patched

__all__ = ["MEMORY_MUTATIONS"]


def _aliasing_copy(self: SavedStateLedger, tensor: torch.Tensor) -> torch.Tensor:
    """A byte view of the original storage instead of a host copy."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


_REAL_SAVED_CLASS = Admission._saved_class


def _saved_class_of_config(self: Admission, checkpoint: Checkpoint, batch: int, seq_len: int, training: bool) -> Any:
    """The saved-bytes class follows ``config.dropout`` only, as if the model were always training."""
    return _REAL_SAVED_CLASS(self, checkpoint, batch, seq_len, True)


def _proportional(self: SavedTerms, seen_len: int, seen_bytes: int, seq_len: int) -> float:
    """The seen forward's bytes scaled as the analytic count scales, as if every term grew alike."""
    return seen_bytes * self.at(seq_len) / self.at(seen_len)


def _estimate_with(**fixed: Any) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """An injector: the analytic saved-bytes estimate with ``fixed`` options whatever the caller passes, in the
    planner and in admission's measured/analytic scale alike (LoRA's term left out: ``lora=None``; no attention
    term: ``scores_saved=False``)."""

    def estimate(config: Any, batch: int, seq_len: int, **options: Any) -> int:
        return analytic_saved_bytes(config, batch, seq_len, **{**options, **fixed})

    @contextlib.contextmanager
    def inject() -> Iterator[None]:
        with (
            mock.patch.object(planner_module, "analytic_saved_bytes", estimate),
            mock.patch.object(admission_module, "analytic_saved_bytes", estimate),
        ):
            yield

    return inject


_REAL_EXTRA_SECONDS = ForwardCost.extra_seconds


def _offload_free(self: ForwardCost, placement: Placement) -> float:
    """Offload priced at zero seconds (no transfer either way)."""
    return 0.0 if placement is Placement.OFFLOAD else _REAL_EXTRA_SECONDS(self, placement)


_REAL_DECIDE = Admission._decide


def _decide_and_demote(self: Admission, *args: Any) -> Any:
    """Each group's demotions are made as soon as it is planned, before the call is admitted whole."""
    plan, demote = _REAL_DECIDE(self, *args)
    for entry, target in demote:
        entry.record.demote(target)
        entry.record.usage = entry.usage.demoted(target)
    return plan, demote


MEMORY_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "replay_without_rng",
        "replay re-runs the forward without restoring its RNG state (other dropout masks)",
        "derivative",
        patched(residency_module, "restored_forward_state", lambda state, model: contextlib.nullcontext()),
        "scenario:stale_exact",
        needs_dropout=True,
    ),
    Mutation(
        "offload_alias",
        "offload keeps an alias of the saved storage instead of a host copy",
        "memory",
        patched(SavedStateLedger, "_copy_storage", _aliasing_copy),
        "offload: host copies hold what retain keeps on the device",
    ),
    Mutation(
        "saved_scale_ignores_training",
        "the saved-bytes class ignores train/eval mode (dropout active follows the config only)",
        "memory",
        patched(Admission, "_saved_class", _saved_class_of_config),
        "admission: train-mode forward after an eval-mode one (dropout on): held <= admitted",
    ),
    Mutation(
        "lora_term_uncounted",
        "the analytic saved-bytes estimate leaves out LoRA's x·Aᵀ",
        "memory",
        _estimate_with(lora=None),
        "admission: first forward of LoRA rank 256: held <= admitted",
    ),
    Mutation(
        "groups_admitted_one_by_one",
        "a multi-group forward makes each group's demotions before the whole call is admitted",
        "derivative",
        patched(Admission, "_decide", _decide_and_demote),
        "intersection: refused forward whose second option group is refused by admission changes nothing",
    ),
    Mutation(
        "scale_without_worst_case",
        "admission prices a forward at a measured forward's ratio to the "
        "analytic count whatever its length (a longer one of the bucket saves a larger share of dropout's "
        "T² terms)",
        "memory",
        patched(SavedTerms, "worst_case", _proportional),
        "admission: long forward after a shorter one of its shape class (dropout on): held <= admitted",
    ),
    Mutation(
        "budget_ignores_checkpoints",
        "the plan leaves out what the checkpoints hold (AdamW state, masters, .grad)",
        "memory",
        patched(Checkpoint, "held_nbytes", lambda self: 0),
        "admission: a forward beside a stepped checkpoint's state: held + state <= admitted",
    ),
    Mutation(
        "attention_term_dropped",
        "the analytic saved-bytes estimate leaves out attention's H·B·T² probabilities (and dropout's masks of them)",
        "planner",
        _estimate_with(scores_saved=False),
        "certificate: held after a forward / admitted saved bytes <= 1",
    ),
    Mutation(
        "host_budget_ignored",
        "the plan counts no host bytes for a new offload (the host budget never binds it)",
        "planner",
        patched(ForwardCost, "host_bytes", lambda self, placement: 0),
        "certificate: admitted placements within the limits (measured)",
    ),
    Mutation(
        "offload_priced_at_zero",
        "offload is priced at no seconds (no transfers)",
        "planner",
        patched(ForwardCost, "extra_seconds", _offload_free),
        "certificate: offload and replay priced above retain",
    ),
    Mutation(
        "scale_across_shape_classes",
        "a measured saved-bytes scale is applied to forwards of every shape "
        "class (one class for every batch and length)",
        "planner",
        patched(admission_module, "shape_class", lambda batch, seq_len: (0, 0)),
        "certificate: no wrong refusal",
    ),  # a larger batch's bytes price a smaller one: refused where it fits
)
