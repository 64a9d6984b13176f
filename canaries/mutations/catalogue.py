"""The catalogue of injected bugs the mutation suite runs (``canaries.mutations.canary``, NOTE [Mutation verdicts]).

Each :class:`Mutation` (``canaries.mutations.injection``) puts one realistic
bug back into the real trainer for the duration of a ``with
mutation.apply():`` block, by patching a named seam of the fixed code with
``unittest.mock.patch`` (a small wrapper or a one-line replacement, never a
hand copy of a large function), and names the canary and the check meant to
catch it. The bugs are written beside the part of the trainer they break:
checkpoints and staleness (``versions``), the gradient commit and flush
(``gradients``), the logical ranks (``ranks``), the importance correction
(``corrections``), saved state, admission and the planner (``memory``).
:data:`MUTATIONS` lists them all, in the order the suite runs them: the
original bugs, then bugs where two features meet (NOTE [Intersection
checks], NOTE [Admission intersections]) and bugs an earlier suite let
through, then the planner's witnesses (each must fail the planner
certificate, NOTE [Planner certificate]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from validation.errors import SetupError

from .corrections import CORRECTION_MUTATIONS
from .gradients import GRADIENT_MUTATIONS
from .injection import Mutation, active_mutations
from .memory import MEMORY_MUTATIONS
from .ranks import RANK_MUTATIONS
from .versions import VERSION_MUTATIONS

__all__ = ["Mutation", "MUTATIONS", "PARTS", "active_mutations", "applied", "call_mutated", "mutation"]

PARTS: dict[str, tuple[Mutation, ...]] = {  # the part of the trainer -> the bugs put back into it
    "versions": VERSION_MUTATIONS,
    "gradients": GRADIENT_MUTATIONS,
    "ranks": RANK_MUTATIONS,
    "corrections": CORRECTION_MUTATIONS,
    "memory": MEMORY_MUTATIONS,
}
_ORDER = (  # the order the suite runs them (and its record lists them)
    # the original bugs
    "stale_weights",
    "replay_without_rng",
    "partial_commit",
    "commit_non_finite",
    "staleness_off_by_one",
    "correct_fresh_records",
    "sequence_weight_per_token",
    "offload_alias",
    "per_rank_normalisation",
    # where two features meet, one bug at a time, and bugs an earlier suite let through
    "shared_correction_cache",
    "flush_before_checks",
    "fp32_masters_for_fp64",
    "saved_scale_ignores_training",
    "lora_term_uncounted",
    "groups_admitted_one_by_one",
    "optimizer_state_unchecked",
    "known_norm_without_length",
    "flush_assigns",
    "busy_counts_every_checkpoint",
    "scale_without_worst_case",
    "when_available_across_dropout",
    "fold_in_arrival_order",
    "no_cross_process_reduction",
    "budget_ignores_checkpoints",
    # the planner's witnesses
    "attention_term_dropped",
    "host_budget_ignored",
    "offload_priced_at_zero",
    "scale_across_shape_classes",
)
_BY_NAME = {m.name: m for part in PARTS.values() for m in part}
MUTATIONS: dict[str, Mutation] = {name: _BY_NAME[name] for name in _ORDER}


def mutation(name: str) -> Mutation:
    """The mutation ``name``; :class:`SetupError` naming the known ones otherwise."""
    try:
        return MUTATIONS[name]
    except KeyError:
        raise SetupError(f"unknown mutation {name!r}", fix=f"use one of {', '.join(MUTATIONS)}") from None


@contextlib.contextmanager
def applied(names: tuple[str, ...]) -> Iterator[None]:
    """The named mutations active inside the block: a spawned rank's, as :func:`active_mutations` named them."""
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mutation(name).apply())
        yield


def call_mutated(names: tuple[str, ...], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with the named mutations active: what a check sends to the ranks it spawns."""
    with applied(names):
        return fn(*args)
