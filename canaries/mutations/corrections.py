"""Injected bugs in the importance correction of stale records (``canaries.mutations.catalogue``).

Each puts back a bug of which records are corrected, at which level, with
which cached log-probs (NOTE [Importance correction]).
"""

from __future__ import annotations

from typing import Any

import torch

from reference_trainer import corrections as corrections_module
from reference_trainer import importance as importance_module
from reference_trainer import staleness as staleness_module
from reference_trainer.corrections import KnownLogprobs

from .injection import Mutation, patched

__all__ = ["CORRECTION_MUTATIONS"]


def _fresh_as_stale(checkpoint: Any, version: Any) -> int:
    """The importance correction's staleness, at least 1: fresh records are treated as stale."""
    return max(1, staleness_module.staleness(checkpoint, version))


_REAL_UNITS = importance_module.unit_log_ratios


def _sequence_per_token(log_ratio: torch.Tensor, mask: torch.Tensor, active: torch.Tensor, level: str) -> Any:
    """The sequence level's weight applied per token: each token weighed by its own ratio, not its sequence's."""
    return _REAL_UNITS(log_ratio, mask, active, "token" if level == "sequence" else level)


def _process_scope(record: Any) -> tuple[None, str]:
    """The ``when_available`` scope ignores the record's owner: one cache for every logical rank."""
    return None, record.checkpoint.name


CORRECTION_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "correct_fresh_records",
        "the importance correction is applied to fresh records",
        "derivative",
        patched(corrections_module, "staleness", _fresh_as_stale),
        "scenario:corrections",
    ),
    Mutation(
        "sequence_weight_per_token",
        "importance level 'sequence' weighs each token by its own ratio instead of its sequence's product",
        "derivative",
        patched(importance_module, "unit_log_ratios", _sequence_per_token),
        "scenario:stale_grid",
    ),
    Mutation(
        "shared_correction_cache",
        "one when_available cache shared by every logical rank of a process",
        "derivative",
        patched(corrections_module, "_scope", _process_scope),
        "intersection: logical ranks give the same bits and corrections at W=1 and W=2 (default options)",
    ),
    Mutation(
        "when_available_across_dropout",
        "when_available pairs forwards that drew dropout masks",
        "derivative",
        patched(KnownLogprobs, "_maskless", lambda self, record: True),
        "intersection: when_available with dropout and unchanged weights reweights nothing",
    ),
)
