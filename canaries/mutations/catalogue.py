"""The catalogue of injected bugs the mutation suite runs (``canaries.mutations.canary``, NOTE [Mutation verdicts]).

Each :class:`Mutation` puts one realistic bug back into the real trainer for
the duration of a ``with mutation.apply():`` block, by patching a named seam
of the fixed code with ``unittest.mock.patch`` (a small wrapper or a one-line
replacement, never a hand copy of a large function), and names the canary
and the check meant to catch it. Bugs where two features meet (NOTE
[Intersection checks], NOTE [Admission intersections]), bugs an earlier suite
let through, and the planner's witnesses (each must fail the planner
certificate, NOTE [Planner certificate]) are reintroduced here one by one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from reference_trainer import admission as admission_module
from reference_trainer import checkpoints as checkpoints_module
from reference_trainer import commit as commit_module
from reference_trainer import corrections as corrections_module
from reference_trainer import importance as importance_module
from reference_trainer import planner as planner_module
from reference_trainer import residency as residency_module
from reference_trainer import sinks as sinks_module
from reference_trainer import staleness as staleness_module
from reference_trainer.admission import Admission
from reference_trainer.checkpoints import Checkpoint, WeightCapture
from reference_trainer.commit import GradientTransaction
from reference_trainer.corrections import KnownLogprobs
from reference_trainer.grad_norms import KnownNorm
from reference_trainer.records import RecordTable
from reference_trainer.planner import ForwardCost, Placement, SavedTerms, analytic_saved_bytes
from reference_trainer.ranks import LogicalRank
from reference_trainer.ranks.reduction import LogicalSums
from reference_trainer.ranks.tree import TreeFold
from reference_trainer.residency import SavedStateLedger
from reference_trainer.sinks import LiveGradSink, RankGradients
from reference_trainer.staleness import check_origins
from validation.errors import SetupError

from ..presets import Preset

__all__ = ["Mutation", "MUTATIONS", "active_mutations", "applied", "call_mutated", "mutation"]

_SCALE_BITS = "logical-rank scale: parameters equal for every W, .grad equal to the tree oracle on one process"
_ACTIVE: list[str] = []  # the mutations applied now in this process, outermost first


def active_mutations() -> tuple[str, ...]:
    """The names of the mutations active in this process: a check that spawns ranks applies them there too."""
    return tuple(_ACTIVE)


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


@dataclass(frozen=True)
class Mutation:
    """A known bug: what it breaks, which registered canary (and which of its checks) must catch it, how to inject it."""

    name: str
    description: str
    caught_by: str
    inject: Callable[[], contextlib.AbstractContextManager[Any]]
    check: str | None = None  # the check of ``caught_by`` meant to catch it (NOTE [Mutation verdicts] Rule 4)
    needs_dropout: bool = False

    @contextlib.contextmanager
    def apply(self) -> Iterator[None]:
        """The bug, active inside the block; :func:`active_mutations` names it meanwhile (for spawned ranks)."""
        _ACTIVE.append(self.name)
        try:
            with self.inject():
                yield
        finally:
            _ACTIVE.remove(self.name)

    def applies_to(self, config: Preset) -> bool:
        return not self.needs_dropout or config.model.dropout > 0


def _patched(target: Any, attribute: str, value: Any) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """An injector that replaces ``target.attribute`` by ``value`` inside its block."""
    return lambda: mock.patch.object(target, attribute, value)


# --- the original bugs ----------------------------------------------------------------------------


@contextlib.contextmanager
def _stale_weights() -> Iterator[None]:
    """No copy-on-write and no ledger: an old graph silently sees the live weights an optimizer step wrote."""
    with mock.patch.object(Checkpoint, "_copy_on_write", lambda self: None), \
            mock.patch.object(WeightCapture, "check_ledger", lambda self: None):
        yield


@contextlib.contextmanager
def _staleness_off_by_one() -> Iterator[None]:
    """Every module's ``check_age`` admits staleness ``bound + 1``."""
    original = staleness_module.check_age

    def lenient_check_age(checkpoint: Any, version: Any, bound: int) -> None:
        original(checkpoint, version, bound + 1)

    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if name.startswith("reference_trainer") and getattr(module, "check_age", None) is original:
                stack.enter_context(mock.patch.object(module, "check_age", lenient_check_age))
        yield


def _fresh_as_stale(checkpoint: Any, version: Any) -> int:
    """The importance correction's staleness, at least 1: fresh records are treated as stale."""
    return max(1, staleness_module.staleness(checkpoint, version))


def _local_count(self: LogicalRank, mask: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """``global_token_count`` returning the logical rank's own count: per-rank instead of global normalisation."""
    masks = [mask] if isinstance(mask, torch.Tensor) else list(mask)
    return sum(int(torch.count_nonzero(m)) for m in masks)


def _aliasing_copy(self: SavedStateLedger, tensor: torch.Tensor) -> torch.Tensor:
    """A byte view of the original storage instead of a host copy."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


# --- where two features meet (NOTE [Intersection checks], NOTE [Admission intersections]) --------------


_REAL_UNITS = importance_module.unit_log_ratios


def _sequence_per_token(log_ratio: torch.Tensor, mask: torch.Tensor, active: torch.Tensor, level: str) -> Any:
    """The sequence level's weight applied per token: each token weighed by its own ratio, not its sequence's."""
    return _REAL_UNITS(log_ratio, mask, active, "token" if level == "sequence" else level)


def _process_scope(record: Any) -> tuple[None, str]:
    """The ``when_available`` scope ignores the record's owner: one cache for every logical rank."""
    return None, record.checkpoint.name


_REAL_FLUSH = RankGradients.flush


def _flush_then_check(self: RankGradients, checkpoints: list[Checkpoint]) -> None:
    """The buffers are summed into ``.grad`` first, the committed origins checked after."""
    with mock.patch.object(sinks_module, "_first_error", lambda checkpoints: None):
        _REAL_FLUSH(self, checkpoints)
    for checkpoint in checkpoints:
        check_origins(checkpoint)


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
        with mock.patch.object(planner_module, "analytic_saved_bytes", estimate), \
                mock.patch.object(admission_module, "analytic_saved_bytes", estimate):
            yield

    return inject


# --- the planner's witnesses (each must fail NOTE [Planner certificate]) -----------------------------------

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


# --- bugs an earlier suite let through (each now has the check that catches it) ------------------------


class _AssigningSink(LiveGradSink):
    """A live sink that sees no existing ``.grad``: the flush assigns the logical sum instead of adding it."""

    def current(self, checkpoint: Checkpoint, name: str) -> torch.Tensor | None:
        return None


_REAL_COUNT = RecordTable.count


def _count_every_checkpoint(self: RecordTable, checkpoint: str | None = None) -> int:
    """The busy check's record count over every checkpoint, whichever one is asked for."""
    return _REAL_COUNT(self, None)



def _arrival_push(self: TreeFold, node: tuple[int, int], value: torch.Tensor) -> None:
    """``TreeFold.push`` folding left to right as contributions arrive: ``((g0 + g1) + g2) + ...`` per process."""
    if not self.entries:
        self.entries.append((node, value))
        return
    (lo, _), total = self.entries[0]
    self.entries[0] = ((lo, node[1]), total + value)


def _local_pieces(self: LogicalSums, bucket: list, local: dict, nodes: list, specs: dict, label: str) -> dict:
    """``LogicalSums._exchange`` without the exchange: each shard's owner finishes the tree from its own partial sums."""
    world, rank = self.comm.world_size, self.comm.rank
    return {key: [(node, torch.tensor_split(v.reshape(-1), world)[rank]) for node, v in local.get(key, [])] for key in bucket}

MUTATIONS: dict[str, Mutation] = {
    m.name: m
    for m in (
        Mutation("stale_weights", "backward differentiates the live weights, not the forward's (no copy-on-write, "
                 "no ledger)", "derivative", _stale_weights, "scenario:stale_exact"),
        Mutation("replay_without_rng", "replay re-runs the forward without restoring its RNG state (other dropout "
                 "masks)", "derivative", _patched(residency_module, "restored_forward_state",
                                                  lambda state, model: contextlib.nullcontext()),
                 "scenario:stale_exact", needs_dropout=True),
        Mutation("partial_commit", "a failure during publication keeps the gradients already published (no "
                 "rollback)", "derivative", _patched(GradientTransaction, "_rollback", lambda self, done: None),
                 "scenario:faults"),
        Mutation("commit_non_finite", "the commit's validation skips the finiteness check (a first NaN backward "
                 "commits)", "derivative", _patched(commit_module, "first_non_finite", lambda staged, norms: None),
                 "scenario:non_finite"),
        Mutation("staleness_off_by_one", "the staleness check admits bound + 1", "derivative", _staleness_off_by_one,
                 "scenario:bounds"),
        Mutation("correct_fresh_records", "the importance correction is applied to fresh records", "derivative",
                 _patched(corrections_module, "staleness", _fresh_as_stale), "scenario:corrections"),
        Mutation("sequence_weight_per_token", "importance level 'sequence' weighs each token by its own ratio "
                 "instead of its sequence's product", "derivative",
                 _patched(importance_module, "unit_log_ratios", _sequence_per_token), "scenario:stale_grid"),
        Mutation("offload_alias", "offload keeps an alias of the saved storage instead of a host copy", "memory",
                 _patched(SavedStateLedger, "_copy_storage", _aliasing_copy),
                 "offload: host copies hold what retain keeps on the device"),
        Mutation("per_rank_normalisation", "each logical rank normalises its loss by its own token count",
                 "derivative", _patched(LogicalRank, "global_token_count", _local_count),
                 "logical_global_normalisation"),
        # where two features meet, one bug at a time
        Mutation("shared_correction_cache", "one when_available cache shared by every logical rank of a "
                 "process", "derivative", _patched(corrections_module, "_scope", _process_scope),
                 "intersection: logical ranks give the same bits and corrections at W=1 and W=2 (default options)"),
        Mutation("flush_before_checks", "optim_step sums the logical-rank buffers into .grad before it "
                 "checks the committed origins", "derivative", _patched(RankGradients, "flush", _flush_then_check),
                 "intersection: refused optim_step over a stale live .grad with logical-rank buffers pending "
                 "changes nothing"),
        Mutation("fp32_masters_for_fp64", "FP32 masters for every dtype other than FP32, FP64 included",
                 "derivative", _patched(checkpoints_module, "needs_master", lambda dtype: dtype != torch.float32),
                 "intersection: FP64 stale scenario matches the FP64 oracle at FP64 tolerance"),
        Mutation("saved_scale_ignores_training", "the saved-bytes class ignores train/eval mode (dropout "
                 "active follows the config only)", "memory", _patched(Admission, "_saved_class", _saved_class_of_config),
                 "admission: train-mode forward after an eval-mode one (dropout on): held <= admitted"),
        Mutation("lora_term_uncounted", "the analytic saved-bytes estimate leaves out LoRA's x·Aᵀ",
                 "memory", _estimate_with(lora=None), "admission: first forward of LoRA rank 256: held <= admitted"),
        Mutation("groups_admitted_one_by_one", "a multi-group forward makes each group's demotions before "
                 "the whole call is admitted", "derivative", _patched(Admission, "_decide", _decide_and_demote),
                 "intersection: refused forward whose second option group is refused by admission changes nothing"),
        Mutation("optimizer_state_unchecked", "load_checkpoint accepts an AdamW state that cannot step",
                 "derivative", _patched(checkpoints_module, "check_adamw_state", lambda *args: None),
                 "intersection: refused load_checkpoint of an AdamW state without exp_avg (discard_graphs=True) "
                 "changes nothing"),
        Mutation("known_norm_without_length", "KnownNorm.matches without its length check: a stale norm after "
                 ".grad = None", "derivative", _patched(KnownNorm, "_same_count", lambda self, grads: True),
                 "intersection: a .grad dropped after its backward is left out of the step's norm"),
        Mutation("flush_assigns", "RankGradients.flush assigns the logical sum instead of adding it to .grad",
                 "derivative", _patched(sinks_module, "LiveGradSink", _AssigningSink),
                 "intersection: logical-rank buffers flushed onto a live .grad add to it"),
        Mutation("busy_counts_every_checkpoint", "the busy check counts every checkpoint's records", "derivative",
                 _patched(RecordTable, "count", _count_every_checkpoint),
                 "intersection: load_checkpoint of one checkpoint while another has a pending record succeeds"),
        Mutation("scale_without_worst_case", "admission prices a forward at a measured forward's ratio to the "
                 "analytic count whatever its length (a longer one of the bucket saves a larger share of dropout's "
                 "T² terms)", "memory", _patched(SavedTerms, "worst_case", _proportional),
                 "admission: long forward after a shorter one of its shape class (dropout on): held <= admitted"),
        Mutation("when_available_across_dropout", "when_available pairs forwards that drew dropout masks",
                 "derivative", _patched(KnownLogprobs, "_maskless", lambda self, record: True),
                 "intersection: when_available with dropout and unchanged weights reweights nothing"),
        Mutation("fold_in_arrival_order", "logical ranks' gradients are folded left to right as they arrive, not in "
                 "the fixed tree", "memory", _patched(TreeFold, "push", _arrival_push), _SCALE_BITS),
        Mutation("no_cross_process_reduction", "each process finishes the logical-rank sum from its own partial sums "
                 "only", "memory", _patched(LogicalSums, "_exchange", _local_pieces), _SCALE_BITS),
        Mutation("budget_ignores_checkpoints", "the plan leaves out what the checkpoints hold (AdamW "
                 "state, masters, .grad)", "memory", _patched(Checkpoint, "held_nbytes", lambda self: 0),
                 "admission: a forward beside a stepped checkpoint's state: held + state <= admitted"),
        # the planner's witnesses
        Mutation("attention_term_dropped", "the analytic saved-bytes estimate leaves out attention's H·B·T² "
                 "probabilities (and dropout's masks of them)", "planner", _estimate_with(scores_saved=False),
                 "certificate: held after a forward / admitted saved bytes <= 1"),
        Mutation("host_budget_ignored", "the plan counts no host bytes for a new offload (the host budget never "
                 "binds it)", "planner", _patched(ForwardCost, "host_bytes", lambda self, placement: 0),
                 "certificate: admitted placements within the limits (measured)"),
        Mutation("offload_priced_at_zero", "offload is priced at no seconds (no transfers)", "planner",
                 _patched(ForwardCost, "extra_seconds", _offload_free), "certificate: offload and replay priced above retain"),
        Mutation("scale_across_shape_classes", "a measured saved-bytes scale is applied to forwards of every shape "
                 "class (one class for every batch and length)", "planner",
                 _patched(admission_module, "shape_class", lambda batch, seq_len: (0, 0)),
                 "certificate: no wrong refusal"),  # a larger batch's bytes price a smaller one: refused where it fits
    )
}


def mutation(name: str) -> Mutation:
    """The mutation ``name``; :class:`SetupError` naming the known ones otherwise."""
    try:
        return MUTATIONS[name]
    except KeyError:
        raise SetupError(f"unknown mutation {name!r}", fix=f"use one of {', '.join(MUTATIONS)}") from None
