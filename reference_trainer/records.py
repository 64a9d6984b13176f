"""The records that keep a forward's graph, and the table of a trainer's pending ones.

NOTE [Forward records]
  1. One ``trainer.forward`` call is one record per group of inputs with the
     same resolved options (usually one): its inputs run as one right-padded
     batch. The record owns a snapshot of the inputs, the weight capture, the
     RNG and autocast state of the forward, the resolved options and the
     graph root: the padded ``(B, T)`` FP32 target log-probs.
  2. The caller gets detached FP32 leaves (one per input); its loss never
     touches the model graph. Each leaf carries its record id.
  3. A backward consumes whole records: outputs its loss does not reach get a
     zero cotangent.
  4. A record is released (graph, capture and inputs dropped) after a
     successful backward without ``retain_graph``, after a failure past its
     model backward, or when the caller has dropped all of its outputs.
     :class:`RecordTable` holds the pending records and does all three.
  5. A table has an identity and a lineage: the identities of the trainers
     whose state ``Trainer.load`` resumed into this one, transitively (NOTE
     [Resume] Rule 2). Each output carries its table's identity, so a loss
     built from another trainer's output is a ``CheckpointReplacedError``
     when that trainer is in the lineage (its forwards ran on state this
     trainer replaced), and a ``ConfigError`` otherwise. Either way the
     refusal comes before anything runs: nothing changes.
"""

from __future__ import annotations

import itertools
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoints import Checkpoint, CheckpointVersion, WeightCapture
from .errors import CheckpointReplacedError, ConfigError, GradientCommitError, TrainerError
from .inputs import ForwardOutput, PaddedBatch
from .ledger import SavedStateLedger
from .options import ResolvedOptions
from .planner import Placement, PlacementDecision, RecordUsage
from .rng import ForwardState

__all__ = ["ForwardRecord", "OutputTag", "RecordTable", "tag_of"]

_record_ids = itertools.count()
_TAG = "_rt_output"  # the attribute that carries an output leaf's tag


@dataclass(frozen=True)
class OutputTag:
    """What a trainer output leaf carries (Rule 2): its record and row, the table that holds the record, and the
    identity of the trainer and the version that made it (Rule 5, even once that table is gone)."""

    record_id: int
    row: int
    table: weakref.ref[RecordTable]
    trainer: str
    version: CheckpointVersion


def tag_of(leaf: torch.Tensor) -> OutputTag:
    """The tag of a trainer output leaf (one :meth:`RecordTable.consumed_by` returned)."""
    tag: OutputTag = getattr(leaf, _TAG)
    return tag


@dataclass(eq=False, kw_only=True)
class ForwardRecord:
    """A forward's graph and everything needed to backpropagate it (NOTE [Forward records])."""

    checkpoint: Checkpoint
    capture: WeightCapture
    options: ResolvedOptions
    batch: PaddedBatch
    rng_state: ForwardState
    decision: PlacementDecision
    root: torch.Tensor | None = None
    forward_logprobs: torch.Tensor | None = None
    id: int = field(default_factory=lambda: next(_record_ids))
    live_outputs: int = 0
    released: bool = False
    ledger: SavedStateLedger | None = None  # retain/offload; None: replay
    usage: RecordUsage | None = None  # what the record holds (admission)
    owner: int | None = (
        None  # the logical rank whose code made it, which alone may backpropagate it (NOTE [Logical ranks] Rule 2)
    )
    estimator: dict[str, Any] | None = (
        None  # what its plan's estimate was computed from (a replay's miss, NOTE [Planner misses])
    )

    @property
    def version(self) -> CheckpointVersion:
        return self.capture.version

    def logprobs(self) -> torch.Tensor:
        """The forward's padded ``(B, T)`` log-probs, kept while the record is pending."""
        assert self.forward_logprobs is not None, f"forward record {self.id} was released"
        return self.forward_logprobs

    @property
    def placement(self) -> str:
        """Where the saved state is now: the planner's choice, or what a retained record was demoted to."""
        if self.ledger is not None:
            return self.ledger.placement.value
        return (self.decision.placement if self.released else Placement.REPLAY).value  # pending, no ledger: replays

    def demote(self, placement: Placement) -> None:
        """Move a retained record's saved state off the device (NOTE [Memory admission] Rule 6): to host copies
        (``OFFLOAD``), or dropped with its graph (``REPLAY``: the backward re-runs the forward from what every
        record keeps, NOTE [Saved-state lifetime] Rule 5)."""
        assert self.ledger is not None, "only a record with a ledger (retained) is demoted"
        if placement is Placement.OFFLOAD:
            self.ledger.demote()
            return
        self.root = None  # the graph owns the retained tensors: they go with it
        self.ledger.release()
        self.ledger = None

    def release(self) -> None:
        self.root = None
        if self.ledger is not None:
            self.ledger.release()
        self.ledger = None
        self.capture = None  # type: ignore[assignment]
        self.batch = None  # type: ignore[assignment]
        self.rng_state = None  # type: ignore[assignment]
        self.forward_logprobs = None
        self.released = True


class RecordTable:
    """The pending records of one trainer, by id; outputs find their record through the tag they carry.

    ``on_release(record)`` runs after a pending record is released (the
    ``when_available`` cache drops what only that record could use then).
    ``identity`` and ``lineage``: Rule 5 (``resume`` sets the lineage).
    """

    def __init__(self, on_release: Callable[[ForwardRecord], None]) -> None:
        self._records: dict[int, ForwardRecord] = {}
        self._on_release = on_release
        self.identity = uuid.uuid4().hex
        self.lineage: frozenset[str] = frozenset()
        self._generation: Callable[[str], int | None] = lambda name: None

    def resume(self, lineage: frozenset[str], generation: Callable[[str], int | None]) -> None:
        """Make this the table of a trainer that resumed the state of the trainers in ``lineage`` (Rule 5).

        ``generation(name)``: the current generation of this trainer's checkpoint
        ``name``, or ``None`` without one (then a resumed trainer's output is a
        ``ConfigError`` like any other trainer's: no checkpoint of this trainer
        replaced the one it used).
        """
        self.lineage = frozenset(lineage)
        self._generation = generation

    def __iter__(self) -> Iterator[ForwardRecord]:
        return iter(list(self._records.values()))

    def get(self, record_id: int) -> ForwardRecord | None:
        return self._records.get(record_id)

    def count(self, checkpoint: str | None = None) -> int:
        """Pending records, of one checkpoint or of all."""
        return sum(1 for r in self._records.values() if checkpoint in (None, r.checkpoint.name))

    def add(self, record: ForwardRecord) -> list[ForwardOutput]:
        """Make ``record`` pending and return its outputs: tagged leaves, one per input (Rule 2)."""
        outputs = []
        for row, length in enumerate(record.batch.lengths):
            leaf = record.logprobs()[row, :length].clone().requires_grad_(True)
            setattr(leaf, _TAG, OutputTag(record.id, row, weakref.ref(self), self.identity, record.version))
            weakref.finalize(leaf, _output_dropped, weakref.ref(self), record.id)
            outputs.append(
                ForwardOutput(
                    target_logprobs=leaf,
                    version=record.version,
                    placement=record.decision.placement.value,
                    decision=record.decision,
                    record_id=record.id,
                    usage=record.usage,
                )
            )
        record.live_outputs = len(outputs)
        self._records[record.id] = record
        return outputs

    def release(self, record: ForwardRecord) -> None:
        """Drop ``record``'s graph and state (Rule 4); idempotent."""
        record.release()
        if self._records.pop(record.id, None) is not None:
            self._on_release(record)

    def release_outputs(self, outputs: Sequence[ForwardOutput | None]) -> None:
        """Release the records behind ``outputs`` (a forward call that failed part-way)."""
        for output in outputs:
            record = None if output is None or output.record_id is None else self._records.get(output.record_id)
            if record is not None:
                self.release(record)

    def consumed_by(self, loss: torch.Tensor) -> tuple[list[torch.Tensor], list[ForwardRecord]]:
        """The tagged outputs ``loss`` reaches, and their records in submission order (Rule 3)."""
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ConfigError("loss", type(loss).__name__, "a tensor that depends on trainer outputs")
        if loss.numel() != 1:
            raise ConfigError(
                "loss",
                f"a tensor of shape {tuple(loss.shape)}",
                "a one-element tensor",
                "reduce it first, e.g. loss.sum()",
            )
        leaves = [leaf for leaf in _graph_leaves(loss) if hasattr(leaf, _TAG)]
        records: dict[int, ForwardRecord] = {}
        for leaf in leaves:
            tag = tag_of(leaf)
            if tag.table() is not self:
                raise self._foreign(tag)
            record = self._records.get(tag.record_id)
            if record is None:
                raise GradientCommitError(
                    f"output of forward record {tag.record_id} was already backpropagated or "
                    "released; expected a pending output. Pass retain_graph=True to backpropagate "
                    "twice, or forward again"
                )
            records[record.id] = record
        if not records:
            raise ConfigError("loss", "a loss that reaches no trainer output", "a loss built from forward outputs")
        return leaves, [records[i] for i in sorted(records)]

    def _foreign(self, tag: OutputTag) -> TrainerError:
        """The error for another trainer's output (Rule 5): replaced when this trainer resumed its state."""
        version = tag.version
        current = self._generation(version.name) if tag.trainer in self.lineage else None
        if current is not None:
            return CheckpointReplacedError(version.name, version.generation, current, by="Trainer.load")
        return ConfigError(
            "loss",
            f"a loss built from another trainer's output (forward record {tag.record_id})",
            "a loss built from this trainer's forward outputs only",
            "backpropagate each trainer's outputs through that trainer's backward",
        )

    def output_dropped(self, record_id: int) -> None:
        record = self._records.get(record_id)
        if record is None:
            return
        record.live_outputs -= 1
        if record.live_outputs <= 0:
            self.release(record)


def _output_dropped(table_ref: weakref.ref[RecordTable], record_id: int) -> None:
    table = table_ref()
    if table is not None:
        table.output_dropped(record_id)


def _graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """Leaf tensors reachable from ``loss`` (in discovery order, without duplicates)."""
    if loss.grad_fn is None:
        return [loss]
    leaves: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack: list[torch.autograd.graph.Node | None] = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.setdefault(id(variable), variable)
        stack.extend(fn for fn, _ in node.next_functions)
    return list(leaves.values())
