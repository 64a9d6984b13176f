"""Forward inputs, outputs and the records that keep a forward's graph.

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
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call

from .checkpoints import Checkpoint, CheckpointVersion, WeightCapture
from . import testing
from .errors import ConfigError, GradientCommitError
from .host_reads import read_on_host, trusted_padding
from .lora import attach_lora
from .model import DecoderLM, token_logprobs
from .options import ForwardOptions, ResolvedOptions

__all__ = [
    "ForwardInput",
    "ForwardOutput",
    "ForwardRecord",
    "PaddedBatch",
    "PlacementDecision",
    "RecordTable",
    "base_logprobs",
    "check_token_range",
    "cotangents_by_record",
    "flatten_inputs",
    "output_cotangents",
    "record_cotangent",
    "model_logits",
    "run_model",
]

_record_ids = itertools.count()


@dataclass(frozen=True)
class ForwardInput:
    """One sequence: 1-D ``input_tokens`` and same-length ``target_tokens``.

    ``target_logprobs[t] = log p(target_tokens[t] | input_tokens[:t+1])``; a
    negative target masks position ``t`` (log-prob 0, no gradient). With
    ``target_tokens=None`` the targets are the inputs shifted left by one, the
    last position masked. ``options`` override the call's and trainer's.
    """

    input_tokens: torch.Tensor
    target_tokens: torch.Tensor | None = None
    options: ForwardOptions | None = None

    def __post_init__(self) -> None:
        tokens = self.input_tokens
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.numel() == 0:
            raise ConfigError("input_tokens", _describe(tokens), "a non-empty 1-D integer tensor")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ConfigError("input_tokens", tokens.dtype, "an integer dtype")
        targets = self.target_tokens
        if targets is not None and (
            not isinstance(targets, torch.Tensor)
            or tuple(targets.shape) != tuple(tokens.shape)
            or targets.dtype.is_floating_point
            or targets.dtype == torch.bool
        ):
            raise ConfigError(
                "target_tokens", _describe(targets), f"None or an integer tensor of shape {tuple(tokens.shape)}"
            )
        if self.options is not None and not isinstance(self.options, ForwardOptions):
            raise ConfigError("options", self.options, "None or a ForwardOptions")

    def targets(self) -> torch.Tensor:
        if self.target_tokens is not None:
            return self.target_tokens
        shifted = torch.full_like(self.input_tokens, -1)
        shifted[:-1] = self.input_tokens[1:]
        return shifted


def _describe(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    return value


@dataclass(frozen=True, kw_only=True)
class PlacementDecision:
    """Where a forward keeps what its backward needs, and why.

    ``predicted_bytes``: the device peak the plan admitted; ``saved_bytes``: the
    saved bytes it admitted for this record (on the device for retain, the host
    for offload, rebuilt at backward for replay), never fewer than it holds.
    """

    placement: str
    predicted_bytes: int
    saved_bytes: int
    reason: str


@dataclass(kw_only=True)
class ForwardOutput:
    """What a forward returns for one input.

    ``target_logprobs``: FP32 leaf with ``requires_grad=True`` (plain tensor for
    ``checkpoint=BASE``). ``version``: the weights used (``None`` for BASE).
    ``placement`` and ``decision``: the planner's choice for the record;
    ``usage``: the bytes the record holds (device, host) and needs at backward.
    """

    target_logprobs: torch.Tensor
    version: CheckpointVersion | None
    placement: str
    decision: PlacementDecision | None = None
    record_id: int | None = None
    usage: Any = None


@dataclass
class PaddedBatch:
    """Right-padded ``(B, T)`` ids, real-token mask and targets (pads target -1)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    targets: torch.Tensor
    lengths: list[int]

    @classmethod
    def build(cls, inputs: Sequence[ForwardInput], device: torch.device) -> PaddedBatch:
        lengths = [int(i.input_tokens.numel()) for i in inputs]
        width = max(lengths)
        ids = torch.zeros(len(inputs), width, dtype=torch.long, device=device)
        targets = torch.full((len(inputs), width), -1, dtype=torch.long, device=device)
        for row, item in enumerate(inputs):
            ids[row, : lengths[row]] = item.input_tokens
            targets[row, : lengths[row]] = item.targets()
        mask = None
        if min(lengths) < width:
            mask = torch.arange(width, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
        return cls(ids, mask, targets, lengths)


@dataclass(eq=False, kw_only=True)
class ForwardRecord:
    """A forward's graph and everything needed to backpropagate it (NOTE [Forward records])."""

    checkpoint: Checkpoint
    capture: WeightCapture
    options: ResolvedOptions
    batch: PaddedBatch
    rng_state: dict[str, Any]
    decision: PlacementDecision
    root: torch.Tensor | None = None
    forward_logprobs: torch.Tensor | None = None
    id: int = field(default_factory=lambda: next(_record_ids))
    live_outputs: int = 0
    released: bool = False
    ledger: Any = None  # residency.SavedStateLedger (retain/offload) or None (replay)
    usage: Any = None  # admission.RecordUsage: what the record holds
    owner: int | None = None  # the logical rank whose code made it, which alone may backpropagate it (NOTE [Logical ranks] Rule 2)

    @property
    def version(self) -> CheckpointVersion:
        return self.capture.version

    @property
    def placement(self) -> str:
        """Where the saved state is now: the planner's choice, or ``"offload"`` once a retained record was demoted."""
        return self.ledger.placement.value if self.ledger is not None else self.decision.placement

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


def model_logits(
    model: DecoderLM,
    checkpoint: Checkpoint | None,
    tensors: Mapping[str, torch.Tensor] | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B, T, V)`` logits of ``model`` with ``checkpoint``'s weights taken from ``tensors`` (the frozen base if None).

    The one place that runs the model for a checkpoint: a full checkpoint's
    ``tensors`` replace the model's parameters (``functional_call``); a LoRA
    checkpoint's are its adapter factors, attached for the call. ``tensors``
    may be live parameters or a capture's snapshot of them.
    """
    args, kwargs = (input_ids,), {"attention_mask": attention_mask}
    if checkpoint is None:
        return model(*args, **kwargs)
    if checkpoint.is_full:
        return functional_call(model, dict(tensors), args, kwargs)
    with attach_lora(model, checkpoint.lora_config, tensors):
        return model(*args, **kwargs)


def run_model(model: DecoderLM, checkpoint: Checkpoint | None, capture: WeightCapture | None, batch: PaddedBatch) -> torch.Tensor:
    """Padded ``(B, T)`` FP32 target log-probs of ``batch`` under ``capture``'s weights (base if None)."""
    tensors = None if capture is None else capture.tensors
    with trusted_padding():  # PaddedBatch.build made the mask right-padded: no host read per call
        logits = model_logits(model, checkpoint, tensors, batch.input_ids, batch.attention_mask)
    return token_logprobs(logits, batch.targets)


def output_cotangents(
    loss: torch.Tensor, outputs: list[torch.Tensor], retain_graph: bool
) -> tuple[torch.Tensor | None, ...]:
    """The caller's autograd: ``d loss / d output`` for each output leaf (``None`` if unused).

    A failure here happens before any model backward, so it leaves every
    record retryable (stage ``"user_autograd"`` of NOTE [Gradient commit]).
    """
    try:
        testing.maybe_fail("user_autograd")
        return torch.autograd.grad(loss, outputs, retain_graph=retain_graph, allow_unused=True)
    except Exception as exc:
        raise GradientCommitError(
            f"the loss's own autograd failed ({exc}); nothing was committed and the outputs "
            "can be backpropagated again",
            record_retryable=True,
        ) from exc


def flatten_inputs(inputs: object) -> tuple[list[ForwardInput], Callable[[list[Any]], Any]]:
    """Flatten a (nested) list of ``ForwardInput`` and return a function that rebuilds the shape."""
    flat, rebuild = _flatten(inputs)
    if not flat:
        raise ConfigError("inputs", inputs, "at least one ForwardInput")
    return flat, rebuild


def _flatten(inputs: object) -> tuple[list[ForwardInput], Callable[[list[Any]], Any]]:
    if isinstance(inputs, ForwardInput):
        return [inputs], lambda flat: flat[0]
    if not isinstance(inputs, (list, tuple)):
        raise ConfigError("inputs", type(inputs).__name__, "a ForwardInput or a (nested) list of them")
    flat: list[ForwardInput] = []
    parts = []
    for item in inputs:
        sub, rebuild = _flatten(item)
        parts.append((len(flat), len(sub), rebuild))
        flat.extend(sub)

    def rebuild_all(values: list[Any]) -> list[Any]:
        return [rebuild(values[start : start + count]) for start, count, rebuild in parts]

    return flat, rebuild_all


def check_token_range(flat: list[ForwardInput], vocab: int) -> None:
    """Raise ``ConfigError`` unless every input id is in ``[0, vocab)`` and every target id below ``vocab``.

    Inputs on the CPU are checked there; those on a device in one host read
    per device for the whole call (NOTE [Host syncs] in ``host_reads.py``).
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for item in flat:
        tokens, targets = item.input_tokens, item.targets()
        extremes = torch.stack((tokens.min(), tokens.max(), targets.max())).long()
        by_device.setdefault(tokens.device, []).append(extremes)
    for device, parts in by_device.items():
        stacked = torch.stack(parts)  # (inputs, 3)
        rows = stacked.tolist() if device.type == "cpu" else read_on_host(stacked, "token range")
        for low, high, target_high in rows:
            if low < 0 or high >= vocab or target_high >= vocab:
                raise ConfigError(
                    "input_tokens/target_tokens",
                    (low, high, target_high),
                    f"input ids in [0, {vocab}) and target ids < {vocab} (negative targets mask)",
                )


def base_logprobs(model: DecoderLM, flat: list[ForwardInput], device: torch.device) -> list[ForwardOutput]:
    """Reference log-probs of the frozen base: no grad, eval mode (no dropout, no RNG drawn), no record."""
    batch = PaddedBatch.build(flat, device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logprobs = run_model(model, None, None, batch)
    finally:
        model.train(training)
    return [
        ForwardOutput(target_logprobs=logprobs[row, :length].clone(), version=None, placement="none")
        for row, length in enumerate(batch.lengths)
    ]


def cotangents_by_record(
    leaves: list[torch.Tensor], cotangents: Sequence[torch.Tensor | None]
) -> dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """``(output leaf, its cotangent)`` pairs grouped by the record id each leaf is tagged with (Rule 2)."""
    grouped: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for leaf, cotangent in zip(leaves, cotangents):
        grouped.setdefault(leaf._rt_record_id, []).append((leaf, cotangent))
    return grouped


def record_cotangent(record: ForwardRecord, leaves: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """The padded ``(B, T)`` cotangent of a record's root from ``(output leaf, its cotangent)`` pairs (Rule 3)."""
    cotangent = torch.zeros_like(record.forward_logprobs)
    for leaf, grad in leaves:
        if grad is not None:
            cotangent[leaf._rt_row, : grad.numel()] = grad
    # Masked targets carry no gradient; zeroing their cotangent keeps them out of corrections.
    cotangent.masked_fill_(record.batch.targets < 0, 0.0)
    return cotangent


class RecordTable:
    """The pending records of one trainer, by id; outputs find their record through the tag they carry.

    ``on_release(record)`` runs after a pending record is released (the
    ``when_available`` cache drops what only that record could use then).
    """

    def __init__(self, on_release: Callable[[ForwardRecord], None]) -> None:
        self._records: dict[int, ForwardRecord] = {}
        self._on_release = on_release

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
            leaf = record.forward_logprobs[row, :length].clone().requires_grad_(True)
            leaf._rt_record_id, leaf._rt_row, leaf._rt_table = record.id, row, weakref.ref(self)
            weakref.finalize(leaf, _output_dropped, weakref.ref(self), record.id)
            outputs.append(
                ForwardOutput(
                    target_logprobs=leaf,
                    version=record.version,
                    placement=record.decision.placement,
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
            record = None if output is None else self._records.get(output.record_id)
            if record is not None:
                self.release(record)

    def consumed_by(self, loss: torch.Tensor) -> tuple[list[torch.Tensor], list[ForwardRecord]]:
        """The tagged outputs ``loss`` reaches, and their records in submission order (Rule 3)."""
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ConfigError("loss", type(loss).__name__, "a tensor that depends on trainer outputs")
        if loss.numel() != 1:
            raise ConfigError("loss", f"a tensor of shape {tuple(loss.shape)}", "a one-element tensor", "reduce it first, e.g. loss.sum()")
        leaves = [leaf for leaf in _graph_leaves(loss) if hasattr(leaf, "_rt_record_id")]
        records: dict[int, ForwardRecord] = {}
        for leaf in leaves:
            if leaf._rt_table() is not self:
                raise ConfigError(
                    "loss",
                    f"a loss built from another trainer's output (forward record {leaf._rt_record_id})",
                    "a loss built from this trainer's forward outputs only",
                    "backpropagate each trainer's outputs through that trainer's backward",
                )
            record = self._records.get(leaf._rt_record_id)
            if record is None:
                raise GradientCommitError(
                    f"output of forward record {leaf._rt_record_id} was already backpropagated or "
                    "released; expected a pending output. Pass retain_graph=True to backpropagate "
                    "twice, or forward again"
                )
            records[record.id] = record
        if not records:
            raise ConfigError("loss", "a loss that reaches no trainer output", "a loss built from forward outputs")
        return leaves, [records[i] for i in sorted(records)]

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
    stack = [loss.grad_fn]
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
