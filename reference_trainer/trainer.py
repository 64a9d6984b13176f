"""The trainer: checkpoints, versioned forwards, transactional backwards, optimizer steps.

Reading order: ``forward`` (NOTE [Forward records] in ``graphs.py``), ``backward``
(NOTE [Staleness], NOTE [Importance correction], NOTE [Gradient commit]),
``optim_step``. Weight versions follow NOTE [Weight captures] in
``checkpoints.py``.
"""

from __future__ import annotations

import itertools
import math
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import testing
from .checkpoints import BASE, AdamWConfig, Checkpoint, CheckpointVersion
from .commit import Coordinator, GradientSink, GradientTransaction, LiveGradSink
from .corrections import CorrectionStats, correct_cotangent
from .admission import Admission
from .errors import CheckpointBusyError, ConfigError, GradientCommitError, TrainerError, UnsupportedSavedStateError
from .graphs import (
    ForwardInput,
    ForwardOutput,
    ForwardRecord,
    PaddedBatch,
    flatten_inputs,
    output_cotangents,
    run_model,
)
from .lora import LoRAConfig, freeze
from .model import DecoderLM
from .options import ForwardOptions, ResolvedOptions, resolve_options
from .planner import Placement
from .residency import SavedStateLedger, is_quantized_module, weight_storages
from .rng import capture_forward_state, restored_forward_state
from .staleness import check_age, staleness

__all__ = ["Trainer", "StepReport", "CheckpointStep", "BackwardReport", "RecordReport"]


@dataclass(frozen=True)
class CheckpointStep:
    """What ``optim_step`` did to one checkpoint."""

    stepped: bool
    reason: str | None
    grad_norm: float | None
    clipped: bool
    revision: int


@dataclass(frozen=True)
class StepReport:
    """Per-checkpoint outcome of ``optim_step``; index by checkpoint name."""

    checkpoints: dict[str, CheckpointStep]

    def __getitem__(self, name: str) -> CheckpointStep:
        return self.checkpoints[name]


@dataclass(frozen=True)
class RecordReport:
    record_id: int
    version: CheckpointVersion
    staleness: int
    placement: str
    correction: CorrectionStats | None


@dataclass(frozen=True)
class BackwardReport:
    """Which records a backward consumed, their ages and any correction applied."""

    records: list[RecordReport] = field(default_factory=list)

    @property
    def corrected(self) -> list[RecordReport]:
        return [r for r in self.records if r.correction is not None]


def _token_key(batch: PaddedBatch, row: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    length = batch.lengths[row]
    return tuple(batch.input_ids[row, :length].tolist()), tuple(batch.targets[row, :length].tolist())


class Trainer:
    """Versioned forward/backward over one frozen base model and named checkpoints.

    ``options``: trainer-level :class:`ForwardOptions`. ``memory_limit_bytes``
    (device pool) and ``host_memory_limit_bytes`` (host pool for offloaded
    state) bound what the planner admits; ``None`` means unbounded.
    """

    def __init__(
        self,
        model: DecoderLM,
        *,
        options: ForwardOptions | None = None,
        memory_limit_bytes: int | None = None,
        host_memory_limit_bytes: int | None = None,
    ) -> None:
        if options is not None and not isinstance(options, ForwardOptions):
            raise ConfigError("options", options, "None or a ForwardOptions")
        for name, value in (("memory_limit_bytes", memory_limit_bytes), ("host_memory_limit_bytes", host_memory_limit_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(name, value, "None or an int >= 0")
        self.model = freeze(model)
        self._base_storages = weight_storages(model.parameters())  # the frozen base never moves
        self.options = options
        self.memory_limit_bytes = memory_limit_bytes
        self.host_memory_limit_bytes = host_memory_limit_bytes
        self.device = model.lm_head.weight.device
        self._checkpoints: dict[str, Checkpoint] = {}
        self._generations = itertools.count()
        self._records: dict[int, ForwardRecord] = {}
        self._sink: GradientSink = LiveGradSink()
        self._admission = Admission(model.config, memory_limit_bytes, host_memory_limit_bytes)
        # Called first by optim_step / zero_grad (logical ranks flush or clear their buffers).
        self.before_step_hooks: list[Callable[[Trainer, list[str]], None]] = []
        self.zero_grad_hooks: list[Callable[[Trainer, list[str]], None]] = []
        # Current-revision log-probs by checkpoint and token content, kept only while an
        # older record of the checkpoint is alive (NOTE [Importance correction], when_available).
        self._known_logprobs: dict[str, dict[bytes, tuple[CheckpointVersion, torch.Tensor]]] = {}

    # --- checkpoints --------------------------------------------------------------

    def add_checkpoint(
        self,
        name: str,
        *,
        lora: LoRAConfig | None = None,
        full: bool = False,
        optimizer: AdamWConfig | None = None,
        seed: int | None = None,
    ) -> Checkpoint:
        """Create a trainable checkpoint: a LoRA adapter (``lora=``) or a full copy (``full=True``)."""
        if not isinstance(name, str) or not name:
            raise ConfigError("name", name, "a non-empty str")
        if name in self._checkpoints:
            raise ConfigError("name", name, f"a name not already used (existing: {sorted(self._checkpoints)})")
        if (lora is None) == (not full):
            raise ConfigError("lora/full", (lora, full), "exactly one of lora=LoRAConfig(...) or full=True")
        if lora is not None and not isinstance(lora, LoRAConfig):
            raise ConfigError("lora", lora, "a LoRAConfig")
        optimizer = optimizer if optimizer is not None else AdamWConfig()
        if not isinstance(optimizer, AdamWConfig):
            raise ConfigError("optimizer", optimizer, "an AdamWConfig")
        checkpoint = Checkpoint(
            name, self.model, lora=lora, full=full, optimizer=optimizer, generation=next(self._generations), seed=seed
        )
        self._checkpoints[name] = checkpoint
        return checkpoint

    def checkpoint(self, name: str) -> Checkpoint:
        try:
            return self._checkpoints[name]
        except KeyError:
            raise ConfigError("checkpoint", name, f"one of {sorted(self._checkpoints)}") from None

    @property
    def checkpoints(self) -> Mapping[str, Checkpoint]:
        return dict(self._checkpoints)

    def live_records(self, checkpoint: str | None = None) -> int:
        """Records (graphs) still pending backward, for one checkpoint or all."""
        return sum(1 for r in self._records.values() if checkpoint in (None, r.checkpoint.name))

    def load_checkpoint(self, name: str, state_dict: Mapping[str, Any], *, discard_graphs: bool = False) -> None:
        """Load parameters, optimizer state and revision; the checkpoint gets a new generation.

        Refused with ``CheckpointBusyError`` while it has live graphs or pending
        gradients, unless ``discard_graphs=True``: pending gradients are then
        dropped and older graphs raise ``CheckpointReplacedError`` at backward.
        """
        checkpoint = self.checkpoint(name)
        checkpoint.check_state_dict(state_dict)
        live = self.live_records(name)
        pending = sum(1 for p in checkpoint.parameters() if p.grad is not None)
        if (live or pending) and not discard_graphs:
            raise CheckpointBusyError(name, live, pending)
        checkpoint.load(state_dict, next(self._generations))
        self._known_logprobs.pop(name, None)

    def _select_checkpoint(self, checkpoint: str | None) -> Checkpoint:
        if checkpoint is not None:
            return self.checkpoint(checkpoint)
        if len(self._checkpoints) != 1:
            raise ConfigError(
                "checkpoint",
                None,
                f"a checkpoint name (the trainer has {sorted(self._checkpoints) or 'none'}); "
                "add one with add_checkpoint or pass checkpoint=...",
            )
        return next(iter(self._checkpoints.values()))

    def policy(self, checkpoint: Any = None) -> tuple[Callable[[torch.Tensor], torch.Tensor], CheckpointVersion | None]:
        """A no-grad ``logits_fn(input_ids (B, T)) -> logits (B, T, V)`` at the current weights, and their version.

        For sampling (``reference_trainer.sampling.sample``): record the version
        with each sample. The function runs the model in eval mode (no dropout)
        on the live weights of ``checkpoint`` (``BASE``: the frozen base) as they
        are when it is called; the version returned is the one at this call.
        """
        selected = None if checkpoint is BASE else self._select_checkpoint(checkpoint)

        def logits_fn(input_ids: torch.Tensor) -> torch.Tensor:
            training = self.model.training
            self.model.eval()
            try:
                with torch.no_grad():
                    if selected is None:
                        return self.model(input_ids)
                    if selected.is_full:
                        return torch.func.functional_call(self.model, dict(selected.named_parameters()), (input_ids,))
                    with selected.adapter.attached(self.model):
                        return self.model(input_ids)
            finally:
                self.model.train(training)

        return logits_fn, None if selected is None else selected.version

    # --- forward ------------------------------------------------------------------

    def forward(self, inputs: Any, *, checkpoint: Any = None, options: ForwardOptions | None = None) -> Any:
        """Run ``inputs`` (a ``ForwardInput`` or nested lists) and return outputs of the same shape."""
        if options is not None and not isinstance(options, ForwardOptions):
            raise ConfigError("options", options, "None or a ForwardOptions")
        flat, rebuild = flatten_inputs(inputs)
        self._check_token_range(flat)
        if checkpoint is BASE:
            return rebuild(self._forward_base(flat))
        selected = self._select_checkpoint(checkpoint)
        groups: dict[ResolvedOptions, list[int]] = {}
        for index, item in enumerate(flat):
            groups.setdefault(resolve_options(item.options, options, self.options), []).append(index)
        outputs: list[ForwardOutput | None] = [None] * len(flat)
        try:
            for resolved, indices in groups.items():
                for index, output in zip(indices, self._submit(selected, [flat[i] for i in indices], resolved)):
                    outputs[index] = output
        except BaseException:
            # One call is all or nothing: release the groups that already ran.
            for output in outputs:
                if output is not None and output.record_id in self._records:
                    self._release(self._records[output.record_id])
            raise
        return rebuild(outputs)

    def _check_token_range(self, flat: list[ForwardInput]) -> None:
        vocab = self.model.config.vocab_size
        for item in flat:
            tokens, targets = item.input_tokens, item.targets()
            if int(tokens.min()) < 0 or int(tokens.max()) >= vocab or int(targets.max()) >= vocab:
                raise ConfigError(
                    "input_tokens/target_tokens",
                    (int(tokens.min()), int(tokens.max()), int(targets.max())),
                    f"input ids in [0, {vocab}) and target ids < {vocab} (negative targets mask)",
                )

    def _forward_base(self, flat: list[ForwardInput]) -> list[ForwardOutput]:
        """Reference log-probs of the frozen base: no grad, no dropout, no RNG drawn."""
        batch = PaddedBatch.build(flat, self.device)
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                logprobs = run_model(self.model, None, None, batch)
        finally:
            self.model.train(training)
        return [
            ForwardOutput(logprobs[row, :length].clone(), None, "none")
            for row, length in enumerate(batch.lengths)
        ]

    def _submit(self, checkpoint: Checkpoint, items: list[ForwardInput], options: ResolvedOptions) -> list[ForwardOutput]:
        quantized = any(is_quantized_module(m) for m in self.model.modules())
        lengths = [int(i.input_tokens.numel()) for i in items]
        # Admission first: a refusal happens before anything is allocated.
        decision, cost, demote = self._admission.decide(
            checkpoint, lengths, options, self._records.values(), quantized=quantized
        )
        for pending in demote:
            pending.residency.demote()
            pending.usage = pending.usage.demoted()
        batch = PaddedBatch.build(items, self.device)  # copies: the caller may overwrite its tensors
        state = capture_forward_state(self.device)
        capture = checkpoint.capture()
        placement = Placement(decision.placement)
        ledger = None
        started = time.perf_counter()
        if placement is Placement.REPLAY:
            with torch.no_grad():
                root = run_model(self.model, checkpoint, capture, batch)
        else:
            weights = self._base_storages | weight_storages(capture.tensors.values())
            ledger = SavedStateLedger(placement, weights, pin_memory=self.device.type == "cuda")
            if quantized:
                ledger.note_unsupported("a module marked with mark_quantized_saved_state")
            with torch.enable_grad(), ledger.hooks():
                root = run_model(self.model, checkpoint, capture, batch)
            ledger.end_forward()
        seconds = time.perf_counter() - started
        record = ForwardRecord(
            checkpoint,
            capture,
            options,
            batch,
            state,
            decision,
            root=root if ledger is not None else None,
            forward_logprobs=root.detach(),
            residency=ledger,
        )
        record.usage = self._admission.observe(record, cost, seconds)
        self._remember_logprobs(record)
        outputs = []
        for row, length in enumerate(batch.lengths):
            leaf = root[row, :length].detach().clone().requires_grad_(True)
            leaf._rt_record_id, leaf._rt_row = record.id, row
            weakref.finalize(leaf, _output_dropped, weakref.ref(self), record.id)
            outputs.append(ForwardOutput(leaf, capture.version, decision.placement, decision, record.id, record.usage))
        record.live_outputs = len(outputs)
        self._records[record.id] = record
        return outputs

    def _remember_logprobs(self, record: ForwardRecord) -> None:
        name = record.checkpoint.name
        older_alive = any(
            r.checkpoint.name == name and r.version != record.version for r in self._records.values()
        )
        if not older_alive:
            return
        known = self._known_logprobs.setdefault(name, {})
        for row in range(len(record.batch.lengths)):
            length = record.batch.lengths[row]
            known[_token_key(record.batch, row)] = (record.version, record.forward_logprobs[row, :length])

    def _release(self, record: ForwardRecord) -> None:
        record.release()
        self._records.pop(record.id, None)
        name = record.checkpoint.name
        if name in self._known_logprobs and not any(r.checkpoint.name == name for r in self._records.values()):
            del self._known_logprobs[name]

    # --- backward -----------------------------------------------------------------

    def backward(
        self,
        loss: torch.Tensor,
        *,
        retain_graph: bool = False,
        sink: GradientSink | None = None,
        coordinator: Coordinator | None = None,
    ) -> BackwardReport:
        """Backpropagate ``loss`` through the forwards it uses, committing all gradients or none.

        Advanced (used by logical ranks): ``sink`` redirects where gradients
        commit; ``coordinator.agree(error)`` is called exactly once, with this
        rank's error or ``None`` after local publication, and raises if any
        peer failed, so every rank commits or none does.
        """
        transaction = GradientTransaction(sink or self._sink, self.checkpoint)
        started: list[ForwardRecord] = []
        agreed = False

        def confirm() -> None:
            nonlocal agreed
            agreed = True
            if coordinator is not None:
                coordinator.agree(None)

        try:
            records, reports = self._stage_records(loss, retain_graph, transaction, started)
            transaction.validate()
            transaction.publish(confirm=confirm)
        except BaseException as exc:
            transaction.discard()
            for record in started:
                self._release(record)
            # Staged tensors must not outlive the failure through the traceback's frames.
            traceback.clear_frames(exc.__traceback__)
            if coordinator is not None and not agreed:
                coordinator.agree(exc)
            if isinstance(exc, TrainerError) or not isinstance(exc, Exception):
                raise
            raise GradientCommitError(f"backward failed and committed nothing: {exc}") from exc
        if not retain_graph:
            for record in records:
                self._release(record)
        return BackwardReport(reports)

    def _stage_records(
        self,
        loss: torch.Tensor,
        retain_graph: bool,
        transaction: GradientTransaction,
        started: list[ForwardRecord],
    ) -> tuple[list[ForwardRecord], list[RecordReport]]:
        """Collect cotangents, check ages, run each record's model backward into staging.

        Records whose model backward has started are appended to ``started``
        (released on failure); the others stay retryable.
        """
        leaves, records = self._consumed_records(loss)
        cotangents = output_cotangents(loss, leaves, retain_graph)
        for record in records:
            try:
                check_age(record.checkpoint, record.version, record.options.max_gradient_staleness)
            except GradientCommitError:
                self._release(record)
                raise
        for record in records:
            if record.residency is not None and record.residency.unsupported is not None:
                error = UnsupportedSavedStateError(
                    f"forward record {record.id} ({record.decision.placement}) saved state the trainer "
                    f"cannot keep or restore exactly: {record.residency.unsupported}; expected "
                    "unquantized saved tensors. Use backward_state='replay' (exact re-run) or run "
                    "these layers unquantized; the record was released and nothing was committed"
                )
                self._release(record)
                raise error
        per_record: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {r.id: [] for r in records}
        for leaf, cotangent in zip(leaves, cotangents):
            per_record[leaf._rt_record_id].append((leaf, cotangent))
        reports = []
        for record in records:
            cotangent, stats = self._correct(record, self._record_cotangent(record, per_record[record.id]))
            started.append(record)
            testing.maybe_fail("model_backward")
            grads = self._model_backward(record, cotangent, retain_graph)
            transaction.stage(record.capture, grads, record.options.max_gradient_staleness)
            age = staleness(record.checkpoint, record.version)
            reports.append(RecordReport(record.id, record.version, age, record.decision.placement, stats))
        return records, reports

    def _consumed_records(self, loss: torch.Tensor) -> tuple[list[torch.Tensor], list[ForwardRecord]]:
        """The trainer outputs ``loss`` reaches, and their records in submission order."""
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ConfigError("loss", type(loss).__name__, "a tensor that depends on trainer outputs")
        leaves = [leaf for leaf in _graph_leaves(loss) if hasattr(leaf, "_rt_record_id")]
        records: dict[int, ForwardRecord] = {}
        for leaf in leaves:
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

    @staticmethod
    def _record_cotangent(record: ForwardRecord, pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        cotangent = torch.zeros_like(record.forward_logprobs)
        for leaf, grad in pairs:
            if grad is not None:
                cotangent[leaf._rt_row, : grad.numel()] = grad
        # Masked targets carry no gradient; zeroing their cotangent keeps them out of corrections.
        cotangent.masked_fill_(record.batch.targets < 0, 0.0)
        return cotangent

    def _correct(self, record: ForwardRecord, cotangent: torch.Tensor) -> tuple[torch.Tensor, CorrectionStats | None]:
        """Apply the record's importance correction if it is stale (NOTE [Importance correction])."""
        correction = record.options.correction
        age = staleness(record.checkpoint, record.version)
        if correction is None or age == 0:
            return cotangent, None
        if correction.policy == "always":
            current = self._current_logprobs(record)
            rows = list(range(len(record.batch.lengths)))
        else:
            known = self._known_logprobs.get(record.checkpoint.name, {})
            current = torch.full_like(record.forward_logprobs, math.nan)
            rows = []
            for row in range(len(record.batch.lengths)):
                entry = known.get(_token_key(record.batch, row))
                if entry is not None and entry[0] == record.checkpoint.version:
                    current[row, : record.batch.lengths[row]] = entry[1]
                    rows.append(row)
            if not rows:
                return cotangent, None
        corrected = cotangent.clone()
        sub, stats = correct_cotangent(
            cotangent[rows], current[rows], record.forward_logprobs[rows], correction, age
        )
        corrected[rows] = sub
        return corrected, stats

    def _current_logprobs(self, record: ForwardRecord) -> torch.Tensor:
        """One no-grad forward of the record's inputs at the current weights, RNG restored."""
        checkpoint = record.checkpoint
        with torch.no_grad(), restored_forward_state(record.rng_state):
            return run_model(self.model, checkpoint, checkpoint.capture(), record.batch)

    def _model_backward(self, record: ForwardRecord, cotangent: torch.Tensor, retain_graph: bool) -> dict[str, torch.Tensor]:
        capture = record.capture
        capture.check_ledger()
        # A replay record keeps nothing between backwards, even with retain_graph: it replays again.
        root = record.root if record.root is not None else self._replay(record)
        names = list(capture.tensors)
        grads = torch.autograd.grad(
            root, [capture.tensors[n] for n in names], cotangent, retain_graph=retain_graph, allow_unused=True
        )
        if record.residency is not None:
            record.residency.end_backward()
        return {n: g for n, g in zip(names, grads) if g is not None}

    def _replay(self, record: ForwardRecord) -> torch.Tensor:
        """Re-run a replay record's forward on its own weight snapshot, RNG and autocast restored."""
        with torch.enable_grad(), restored_forward_state(record.rng_state):
            root = run_model(self.model, record.checkpoint, record.capture, record.batch)
        if not torch.equal(root.detach(), record.forward_logprobs):
            worst = float((root.detach() - record.forward_logprobs).abs().max())
            raise GradientCommitError(
                f"replay of forward record {record.id} did not reproduce the outputs the caller saw "
                f"(max abs difference {worst:.3e}); expected bitwise-equal log-probs. The model or its "
                "inputs changed outside the trainer, or a kernel is not deterministic: use retain or offload"
            )
        return root

    # --- optimizer ----------------------------------------------------------------

    def optim_step(
        self,
        *,
        lr: float | None = None,
        max_grad_norm: float | None = None,
        checkpoints: Iterable[str] | None = None,
    ) -> StepReport:
        """Step every selected checkpoint that holds gradients (NOTE [Staleness] Rule 4 first)."""
        for label, value, allowed in (("lr", lr, "None or a finite number >= 0"), ("max_grad_norm", max_grad_norm, "None or a finite number > 0")):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
                or (label == "max_grad_norm" and value == 0)
            ):
                raise ConfigError(label, value, allowed)
        selected = [self.checkpoint(n) for n in _names(checkpoints, self._checkpoints)]
        for hook in self.before_step_hooks:
            hook(self, [c.name for c in selected])
        for checkpoint in selected:
            for version, bound in sorted(checkpoint.origins, key=lambda o: o[0].revision):
                check_age(checkpoint, version, bound)
        results = {c.name: self._step_one(c, lr, max_grad_norm) for c in selected}
        return StepReport(results)

    @staticmethod
    def _step_one(checkpoint: Checkpoint, lr: float | None, max_grad_norm: float | None) -> CheckpointStep:
        if not checkpoint.has_gradients():
            return CheckpointStep(False, "no gradients", None, False, checkpoint.revision)
        params = checkpoint.stepped_tensors()  # FP32: the live parameters; else FP32 masters
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if not bool(torch.isfinite(norm)):
            checkpoint.clear_gradients()
            return CheckpointStep(False, f"non-finite gradient norm ({float(norm)}); gradients cleared", float(norm), False, checkpoint.revision)
        clipped = False
        if max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
            checkpoint.copy_back_clipped_gradients()
            clipped = bool(norm > max_grad_norm)
        checkpoint.apply_step(lr)
        return CheckpointStep(True, None, float(norm), clipped, checkpoint.revision)

    def zero_grad(self, *, checkpoints: Iterable[str] | None = None) -> None:
        """Drop committed gradients (``.grad = None``) and their recorded origins."""
        names = _names(checkpoints, self._checkpoints)
        selected = [self.checkpoint(name) for name in names]
        for hook in self.zero_grad_hooks:
            hook(self, names)
        for checkpoint in selected:
            checkpoint.clear_gradients()


def _names(checkpoints: Iterable[str] | str | None, every: Iterable[str]) -> list[str]:
    """Checkpoint names from a ``checkpoints=`` argument (a single name is one name)."""
    if checkpoints is None:
        return list(every)
    return [checkpoints] if isinstance(checkpoints, str) else list(checkpoints)


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


def _output_dropped(trainer_ref: weakref.ref[Trainer], record_id: int) -> None:
    trainer = trainer_ref()
    if trainer is None:
        return
    record = trainer._records.get(record_id)
    if record is None:
        return
    record.live_outputs -= 1
    if record.live_outputs <= 0:
        trainer._release(record)
