"""The trainer: checkpoints, versioned forwards, transactional backwards, optimizer steps.

Read top to bottom: checkpoints (named in ``checkpoint_catalogue.py``, NOTE [Weight
captures] in ``checkpoints.py``), ``forward`` (NOTE [Forward records] in
``records.py``, NOTE [Memory admission] in ``planner.py``, NOTE [Saved-state
lifetime] in ``residency.py``), ``backward`` (NOTE [Staleness] in
``staleness.py``, each record staged by ``staging.py``, NOTE [Gradient
commit] in ``commit.py``), ``optim_step``. Each step is a short function
over helpers that live with their concept; none of them calls back into
this module.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from . import misses
from .admission import Admission, Admitted, default_device_limit
from .calibration import PlannerCalibration, resolve_calibration
from .checkpoint_catalogue import CheckpointCatalogue
from .checkpoints import BASE, AdamWConfig, Checkpoint, CheckpointStep, CheckpointVersion, check_step_arguments
from .commit import Coordinator, GradientTransaction
from .corrections import KnownLogprobs
from .cotangents import cotangents_by_record, output_cotangents
from .errors import CheckpointBusyError, ConfigError, GradientCommitError, TrainerError, int_at_least
from .inputs import ForwardInput, ForwardOutput, PaddedBatch, check_token_range, flatten_inputs
from .lora import LoRAConfig, freeze
from .model import DecoderLM
from .options import ForwardOptions, ResolvedOptions, resolve_options
from .outcomes import BackwardReport, RecordReport, StepReport
from .records import ForwardRecord, RecordTable
from .residency import check_recordable, check_restorable, has_quantized_module, record_forward, weight_storages
from .resume import load_trainer, write_save
from .rng import capture_forward_state, draws_undone_on_failure
from .rollout import PublicationReport, RolloutEngine, publication_of
from .running import base_logprobs, model_logits
from .sinks import GradientSink, LiveGradSink, RankGradients
from .staging import stage_record
from .staleness import check_age
from .timing import start_stopwatch

__all__ = ["Trainer", "StepReport", "CheckpointStep", "BackwardReport", "RecordReport"]


class Trainer:
    """Versioned forward/backward over one frozen base model and named checkpoints.

    ``options``: trainer-level :class:`ForwardOptions`. ``memory_limit_bytes`` bounds the device pool the
    planner admits forwards into: ``None`` means the device's capacity on CUDA (total memory less a safety
    margin, less what was in use at construction: ``admission.default_device_limit``) and unbounded on CPU;
    it covers the checkpoints' own state too; an explicit value always wins. ``host_memory_limit_bytes``
    bounds the host pool for offloaded state (``None``: unbounded). ``planner_calibration``: the planner's
    constants, a :class:`PlannerCalibration` or a JSON file's path (NOTE [Planner calibration constants]).
    """

    def __init__(
        self,
        model: DecoderLM,
        *,
        options: ForwardOptions | None = None,
        memory_limit_bytes: int | None = None,
        host_memory_limit_bytes: int | None = None,
        planner_calibration: PlannerCalibration | str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(model, DecoderLM):
            raise ConfigError("model", type(model).__name__, "a reference_trainer.DecoderLM")
        if options is not None and not isinstance(options, ForwardOptions):
            raise ConfigError("options", options, "None or a ForwardOptions")
        for name, value in (
            ("memory_limit_bytes", memory_limit_bytes),
            ("host_memory_limit_bytes", host_memory_limit_bytes),
        ):
            if value is not None and not int_at_least(value, 0):
                raise ConfigError(name, value, "None or an int >= 0")
        calibration = resolve_calibration(planner_calibration)  # before anything changes: a bad file refuses
        self.model = freeze(model)
        self.options = options
        self.device = model.lm_head.weight.device
        self.memory_limit_bytes = (
            memory_limit_bytes if memory_limit_bytes is not None else default_device_limit(self.device)
        )
        self.host_memory_limit_bytes = host_memory_limit_bytes
        self._base_storages = weight_storages(model.parameters())  # the frozen base never moves
        self._catalogue = CheckpointCatalogue(self.model)
        self.known_logprobs = KnownLogprobs(model.config.dropout)
        """Current log-probs for ``"when_available"`` corrections (NOTE [Importance correction] Rule 7; saves keep them)."""
        self.records = RecordTable(on_release=lambda record: self.known_logprobs.released(record, self.records))
        """The pending forward records (for inspection and tests)."""
        self.rank_gradients = RankGradients()
        """Gradients logical ranks committed that ``optim_step`` has not summed yet (NOTE [Logical ranks])."""
        self._live_grads = LiveGradSink()
        self._admission = Admission(
            model.config, self.memory_limit_bytes, host_memory_limit_bytes, self.device.type, calibration
        )

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
        return self._catalogue.add(name, lora=lora, full=full, optimizer=optimizer, seed=seed)

    def checkpoint(self, name: str) -> Checkpoint:
        return self._catalogue.get(name)

    @property
    def checkpoints(self) -> Mapping[str, Checkpoint]:
        return self._catalogue.by_name()

    @property
    def next_generation(self) -> int:
        """The generation the next added or loaded checkpoint takes (kept by saves, NOTE [Resume])."""
        return self._catalogue.next_generation

    @next_generation.setter
    def next_generation(self, generation: int) -> None:
        self._catalogue.next_generation = generation

    def live_records(self, checkpoint: str | None = None) -> int:
        """Records (graphs) still pending backward, for one checkpoint or all."""
        return self.records.count(checkpoint)

    def load_checkpoint(self, name: str, state_dict: Mapping[str, Any], *, discard_graphs: bool = False) -> None:
        """Load parameters, optimizer state and revision; the checkpoint gets a new generation.

        Refused with ``CheckpointBusyError`` while it has live graphs or pending
        gradients (committed ``.grad``, or logical-rank buffers not yet summed
        by ``optim_step``), unless ``discard_graphs=True``: pending gradients
        are then dropped and older graphs raise ``CheckpointReplacedError`` at
        backward.
        """
        self.rank_gradients.check_caller("load_checkpoint")
        checkpoint = self.checkpoint(name)
        checkpoint.check_state_dict(state_dict)
        live = self.records.count(name)
        buffered = self.rank_gradients.pending(name)
        pending = sum(1 for p in checkpoint.parameters() if p.grad is not None) + buffered
        if (live or pending) and not discard_graphs:
            raise CheckpointBusyError(name, live, pending)
        if buffered:
            self.rank_gradients.clear([name], call="load_checkpoint")
        checkpoint.load(state_dict, self._catalogue.new_generation())
        self.known_logprobs.forget(name)

    # --- saves (NOTE [Resume] in resume.py, NOTE [Durable saves] in saves.py) -------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write this trainer's state (not its pending forwards) to the folder ``path``; collective in a process group."""
        write_save(self, path)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        model: DecoderLM,
        *,
        memory_limit_bytes: int | None = None,
        host_memory_limit_bytes: int | None = None,
        planner_calibration: PlannerCalibration | str | os.PathLike[str] | None = None,
    ) -> Trainer:
        """A trainer over ``model`` (the saved base) as saved under ``path``; the process RNG becomes the saved one. The
        limits and calibration are the machine's, given again. Every file is verified first; a refused load changes nothing."""
        return load_trainer(cls, path, model, memory_limit_bytes, host_memory_limit_bytes, planner_calibration)

    def policy(self, checkpoint: Any = None) -> tuple[Callable[[torch.Tensor], torch.Tensor], CheckpointVersion | None]:
        """A no-grad ``logits_fn(input_ids (B, T)) -> logits (B, T, V)`` at the current weights, and their version.

        For sampling (``reference_trainer.sampling.sample``): record the version
        with each sample. The function runs the model in eval mode (no dropout)
        on the live weights of ``checkpoint`` (``BASE``: the frozen base) as they
        are when it is called; the version returned is the one at this call.
        """
        selected = None if checkpoint is BASE else self._catalogue.select(checkpoint)

        def logits_fn(input_ids: torch.Tensor) -> torch.Tensor:
            training = self.model.training
            self.model.eval()
            try:
                with torch.no_grad():
                    tensors = None if selected is None else dict(selected.named_parameters())
                    return model_logits(self.model, selected, tensors, input_ids)
            finally:
                self.model.train(training)

        return logits_fn, None if selected is None else selected.version

    def publish(
        self,
        engine: RolloutEngine,
        *,
        checkpoint: str | None = None,
        mode: str = "drain",
        expected: CheckpointVersion | None = None,
    ) -> PublicationReport:
        """Send ``checkpoint``'s live weights at its version to a ``RolloutEngine``: all or nothing, compare-and-set on
        ``expected``, ``mode`` ``"drain"`` or ``"inflight"`` (NOTE [Weight publication] in ``rollout/publication.py``)."""
        if not isinstance(engine, RolloutEngine):
            raise ConfigError("engine", type(engine).__name__, "a reference_trainer.RolloutEngine")
        return engine.apply(publication_of(self._catalogue.select(checkpoint)), mode=mode, expected=expected)

    # --- forward ------------------------------------------------------------------

    def forward(self, inputs: Any, *, checkpoint: Any = None, options: ForwardOptions | None = None) -> Any:
        """Run ``inputs`` (a ``ForwardInput`` or nested lists) and return outputs of the same shape.

        ``checkpoint=BASE`` runs the frozen base in eval mode (no dropout, no
        RNG drawn, no record): reference log-probs, also under
        ``torch.inference_mode()``. A ``CheckpointVersion`` runs that version:
        the current one, or one a loaded trainer kept for a forward pending at
        the save, made again (NOTE [Weight captures] Rule 4). Any other forward
        records the graph its backward needs whatever the caller's grad mode
        and is refused under ``inference_mode`` (``check_recordable``).
        """
        if options is not None and not isinstance(options, ForwardOptions):
            raise ConfigError("options", options, "None or a ForwardOptions")
        flat, rebuild = flatten_inputs(inputs)
        check_token_range(flat, self.model.config.vocab_size)
        if checkpoint is BASE:
            return rebuild(base_logprobs(self.model, flat, self.device))
        check_recordable()
        at = checkpoint if isinstance(checkpoint, CheckpointVersion) else None
        selected = self._catalogue.select(checkpoint if at is None else at.name)
        version = selected.capture_at(at).version if at is not None else selected.version  # an unheld one refused
        groups: dict[ResolvedOptions, list[int]] = {}
        for index, item in enumerate(flat):
            groups.setdefault(resolve_options(item.options, options, self.options), []).append(index)
        quantized = has_quantized_module(self.model)
        admitted = self._admission.plan_call(  # the whole call, before any group runs (NOTE [Memory admission] Rule 4)
            selected,
            version,
            [([int(flat[i].input_tokens.numel()) for i in indices], resolved) for resolved, indices in groups.items()],
            self.records,
            self._catalogue.values(),
            quantized=quantized,
            training=self.model.training,
        )
        outputs: list[ForwardOutput | None] = [None] * len(flat)
        try:
            with draws_undone_on_failure(self.device):  # one call is all or nothing, its dropout draws too
                for (resolved, indices), plan in zip(groups.items(), admitted):
                    items = [flat[i] for i in indices]
                    for index, output in zip(
                        indices, self._submit(selected, version, items, resolved, plan, quantized)
                    ):
                        outputs[index] = output
        except BaseException:
            self.records.release_outputs(outputs)
            raise
        return rebuild(outputs)

    def _submit(
        self,
        checkpoint: Checkpoint,
        version: CheckpointVersion,
        items: list[ForwardInput],
        options: ResolvedOptions,
        plan: Admitted,
        quantized: bool,
    ) -> list[ForwardOutput]:
        """One admitted record at ``version``: the forward, then its tagged outputs."""
        batch = PaddedBatch.build(items, self.device)  # copies: the caller may overwrite its tensors
        state = capture_forward_state(self.model, self.device)
        capture = checkpoint.capture_at(version)
        stopwatch = start_stopwatch(self.device)
        with misses.allocation_failures_reported(
            self.model.config, plan.estimator, plan.cost.saved_bytes
        ):  # NOTE [Planner misses]
            root, ledger = record_forward(
                self.model,
                checkpoint,
                capture,
                batch,
                plan.decision.placement,
                frozen_storages=self._base_storages,
                quantized=quantized,
                host_reserve_bytes=plan.cost.saved_bytes,
            )
        record = ForwardRecord(
            checkpoint=checkpoint,
            capture=capture,
            options=options,
            batch=batch,
            rng_state=state,
            decision=plan.decision,
            root=root if ledger is not None else None,
            forward_logprobs=root.detach(),
            ledger=ledger,
            owner=self.rank_gradients.running(),
            estimator=plan.estimator,
        )
        record.usage = self._admission.observe(record, plan, stopwatch.stop())
        self.known_logprobs.remember(record, self.records)
        return self.records.add(record)

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
        if not isinstance(retain_graph, bool):
            raise ConfigError("retain_graph", retain_graph, "a bool")
        transaction = GradientTransaction(sink or self._live_grads, self.checkpoint, self.records.release, coordinator)
        try:
            records, reports = self._stage(loss, retain_graph, transaction, sink)
            transaction.commit()
        except BaseException as exc:
            # Staged tensors must not outlive the failure through the traceback's frames.
            traceback.clear_frames(exc.__traceback__)
            transaction.abort(exc)
            if isinstance(exc, TrainerError) or not isinstance(exc, Exception):
                raise
            raise GradientCommitError(f"backward failed and committed nothing: {exc}") from exc
        if not retain_graph:
            for record in records:
                self.records.release(record)
        return BackwardReport(records=reports)

    def _stage(
        self, loss: torch.Tensor, retain_graph: bool, transaction: GradientTransaction, sink: GradientSink | None
    ) -> tuple[list[ForwardRecord], list[RecordReport]]:
        """Where the records may commit, cotangents of the consumed outputs, then each record's checks
        and model backward into staging."""
        leaves, records = self.records.consumed_by(loss)
        self.rank_gradients.check_route([r.owner for r in records], sink)
        cotangents = output_cotangents(loss, leaves, retain_graph)
        self._admit_backward(records)
        by_record = cotangents_by_record(leaves, cotangents)
        return records, [
            stage_record(self.model, self.known_logprobs, r, by_record[r.id], transaction, retain_graph)
            for r in records
        ]

    def _admit_backward(self, records: list[ForwardRecord]) -> None:
        """Ages first, then restorability: a refused record is released, nothing has run (NOTE [Staleness])."""
        for check in (lambda r: check_age(r.checkpoint, r.version, r.options.max_gradient_staleness), check_restorable):
            for record in records:
                try:
                    check(record)
                except TrainerError:
                    self.records.release(record)
                    raise

    # --- optimizer ----------------------------------------------------------------

    def optim_step(
        self,
        *,
        lr: float | None = None,
        max_grad_norm: float | None = None,
        checkpoints: Iterable[str] | None = None,
    ) -> StepReport:
        """Step every selected checkpoint that holds gradients, once per call (NOTE [Staleness] Rule 4 first).

        Every origin, committed or buffered, of every selected checkpoint is
        checked first; then logical ranks' buffered gradients are summed into
        ``.grad`` in the fixed order of NOTE [Logical ranks] Rule 4 (Rule 5); then each
        checkpoint steps. A refused step changes nothing.
        """
        check_step_arguments(lr, max_grad_norm)
        selected = self._catalogue.selected(checkpoints)
        self.rank_gradients.flush(selected)
        return StepReport(checkpoints={c.name: c.step(lr, max_grad_norm) for c in selected})

    def zero_grad(self, *, checkpoints: Iterable[str] | None = None) -> None:
        """Drop committed gradients (``.grad = None``), logical-rank buffers and their recorded origins."""
        selected = self._catalogue.selected(checkpoints)
        self.rank_gradients.clear([c.name for c in selected])
        for checkpoint in selected:
            checkpoint.clear_gradients()
