"""Memory admission for one trainer: the device limit, what the trainer holds, and the next forward's plan.

The stateful half of planning (the pure half is ``planner.py``, NOTE [Memory
admission]): it sums what checkpoints and pending records actually hold
(records measured by their saved-state ledgers), learns the model's saved
bytes and forward speed from forwards that ran, asks :func:`plan_placement`
for each record of a forward call and demotes pending retained records when
that makes it fit (Rule 6), once the whole call is admitted (Rule 4). A
version a loaded trainer keeps (NOTE [Weight captures] Rule 4) counts once, in
its checkpoint's held bytes: a forward at it, and its pending records, take no
weight snapshot of their own.

The device limit: an explicit ``memory_limit_bytes`` wins. Otherwise, on
CUDA, the trainer plans against the device's capacity, not its free memory
at one moment: the total memory less a safety margin of
``DEVICE_MARGIN_FRACTION`` of it (the allocator's rounding and
fragmentation, kernels' workspaces the estimate does not see), less what was
in use when the trainer was built (the frozen base model, other processes,
other tensors: not the trainer's to plan). Everything the trainer allocates
afterwards, checkpoints included, is counted by the plan (Rule 1). On CPU
the limit is ``None``: unbounded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import misses, seams
from .calibration import PlannerCalibration
from .checkpoints import Checkpoint, CheckpointVersion
from .errors import MemoryAdmissionError
from .model import ModelConfig
from .options import ResolvedOptions
from .planner import (
    ForwardCost,
    PendingUsage,
    Placement,
    PlacementDecision,
    PlanRequest,
    RecordUsage,
    SavedClass,
    analytic_saved_bytes,
    attention_saves_scores,
    estimate_forward_cost,
    fused_attention_enabled,
    plan_placement,
    saved_terms,
    shape_class,
)
from .records import ForwardRecord
from .timing import Stopwatch

__all__ = [
    "Admission",
    "Admitted",
    "DEVICE_MARGIN_FRACTION",
    "DeviceCapacity",
    "default_device_limit",
    "device_capacity",
    "merged_saved_scale",
]

DEVICE_MARGIN_FRACTION = 0.05
"""Share of the device's total memory the planner leaves unplanned (allocator rounding, fragmentation, kernel workspaces)."""


@dataclass(frozen=True)
class DeviceCapacity:
    """A device's total memory and what of it is free now, in bytes."""

    total: int
    free: int


def device_capacity(device: torch.device) -> DeviceCapacity | None:
    """The total and free memory of ``device`` on CUDA, ``None`` (unbounded) elsewhere.

    The one place the trainer reads the device's capacity; tests substitute it
    with ``reference_trainer.testing.substitute_device_capacity``.
    """
    override = seams.capacity_override()
    if override is not None:
        sizes = override(device)
        return None if sizes is None else DeviceCapacity(total=sizes[0], free=sizes[1])
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceCapacity(total=int(total), free=int(free))


def default_device_limit(device: torch.device) -> int | None:
    """The device limit when ``memory_limit_bytes`` is ``None``: total less the margin, less what others use now."""
    capacity = device_capacity(device)
    if capacity is None:
        return None
    in_use = capacity.total - capacity.free
    return max(0, int(capacity.total * (1.0 - DEVICE_MARGIN_FRACTION)) - in_use)


@dataclass(frozen=True)
class Admitted:
    """One record of a forward call, admitted: its decision, its cost, the class it learns the saved scale for, and
    the estimator's inputs."""

    decision: PlacementDecision
    cost: ForwardCost
    saved_class: SavedClass
    estimator: dict[str, Any]  # what ``estimate_forward_cost`` was given (NOTE [Planner misses])


def _kept(checkpoint: Checkpoint, version: CheckpointVersion) -> bool:
    """``version`` is an older one ``checkpoint`` keeps (NOTE [Weight captures] Rule 4): its weights are counted in
    ``held_nbytes``, so neither a forward at it nor its pending records take a snapshot of their own."""
    held = version.generation == checkpoint.generation and version.revision in checkpoint.kept
    return held and version != checkpoint.version


@dataclass
class _Held:
    """A pending record, or an earlier record of the call being planned, as the plan sees it."""

    version: CheckpointVersion
    checkpoint: Checkpoint
    usage: RecordUsage
    record: ForwardRecord | None  # None: planned in this call, not run yet (never demoted)
    demote: Placement | None = None  # planned: demote to this once the whole call is admitted

    @property
    def demotable(self) -> bool:
        record = self.record
        return (
            self.demote is None
            and record is not None
            and record.ledger is not None
            and record.ledger.placement is Placement.RETAIN
            and bool(self.targets)
        )

    @property
    def targets(self) -> list[Placement]:
        """Where this record may be demoted to (Rule 6): what its own options allow."""
        if self.record is None:  # planned in this call: nothing to demote yet
            return []
        options = self.record.options
        return [Placement.OFFLOAD] * options.allow_offload + [Placement.REPLAY] * options.allow_replay


class Admission:
    """Plans forwards against ``device_limit`` / ``host_limit`` (``None``: unbounded)."""

    def __init__(
        self,
        config: ModelConfig,
        device_limit: int | None,
        host_limit: int | None,
        device_type: str = "cpu",
        calibration: PlannerCalibration | None = None,
    ) -> None:
        self.config = config
        self.calibration = calibration if calibration is not None else PlannerCalibration.defaults()
        self.device_limit = device_limit
        self.host_limit = host_limit
        self.device_type = device_type
        # The largest measured saved bytes of each class, by length (Rule 5): no estimate below any forward that ran.
        self._seen: dict[SavedClass, dict[int, int]] = {}
        self._seconds_per_token: float | None = None
        self._timing: list[tuple[Stopwatch, int]] = []  # forwards whose device time is not known yet, with their tokens

    def plan_call(
        self,
        checkpoint: Checkpoint,
        version: CheckpointVersion,
        groups: list[tuple[list[int], ResolvedOptions]],
        pending: Iterable[ForwardRecord],
        checkpoints: Iterable[Checkpoint],
        *,
        quantized: bool,
        training: bool,
    ) -> list[Admitted]:
        """Admit every record of one forward call at ``version`` of ``checkpoint`` (its current one, or one it keeps)
        (``groups``: each record's sequence lengths and options), or none.

        Each group is planned counting the ones before it as pending (Rule 4);
        the demotions they need are made only once every group is admitted,
        so a refusal leaves every pending record as it was.
        """
        held = [_Held(r.version, r.checkpoint, r.usage, r) for r in pending if r.usage is not None]
        holdings = sum(c.held_nbytes() for c in checkpoints)
        admitted = []
        for lengths, options in groups:
            plan, demote = self._decide(checkpoint, version, lengths, options, held, holdings, quantized, training)
            for entry, target in demote:
                entry.usage, entry.demote = entry.usage.demoted(target), target
            snapshot = 0 if _kept(checkpoint, version) else checkpoint.trainable_nbytes()
            saved = plan.cost.saved_bytes
            usage = RecordUsage.of(plan.cost, plan.decision.placement, saved, saved, snapshot)
            held.append(_Held(version, checkpoint, usage, None))
            admitted.append(plan)
        for entry in held:
            if entry.demote is not None and entry.record is not None:  # only a pending record is demotable
                entry.record.demote(entry.demote)
                entry.record.usage = entry.usage
        return admitted

    def _decide(
        self,
        checkpoint: Checkpoint,
        version: CheckpointVersion,
        lengths: list[int],
        options: ResolvedOptions,
        held: list[_Held],
        holdings: int,
        quantized: bool,
        training: bool,
    ) -> tuple[Admitted, list[tuple[_Held, Placement]]]:
        """Plan one record; returns it admitted and the held records to demote first, with where to.

        When nothing fits an ``auto`` forward, pending retained records are
        demoted, oldest first, as few as make it fit (NOTE [Memory admission]
        Rule 6: to host copies where the host fits, else to replay); a forced
        placement is honoured or refused.
        """
        # A kept version's weights count in its checkpoint's holdings already (NOTE [Weight captures] Rule 4).
        shares_snapshot = _kept(checkpoint, version) or any(h.version == version for h in held)
        involved = {h.checkpoint.name: h.checkpoint for h in held} | {checkpoint.name: checkpoint}
        # Weight snapshots are shared by every record of a version: counted once per pending version.
        snapshots = sum(
            {h.version: h.checkpoint.trainable_nbytes() for h in held if not _kept(h.checkpoint, h.version)}.values()
        )
        saved_class = self._saved_class(checkpoint, len(lengths), max(lengths), training)
        estimator = self._estimator(
            saved_class,
            len(lengths),
            max(lengths),
            snapshot_bytes=0 if shares_snapshot else checkpoint.trainable_nbytes(),
            staging_bytes=sum(_staging_nbytes(c) for c in involved.values()),
        )
        cost = estimate_forward_cost(self.config, **estimator)
        requested = options.backward_state
        if quantized and requested == "auto" and options.allow_replay:
            requested = "replay"  # quantized saved state can only be rebuilt (NOTE [Saved-state lifetime] 6)
        demotable = [h for h in held if h.demotable] if requested == "auto" else []
        refusal: MemoryAdmissionError | None = None
        for targets in _demotions(demotable, held, self.host_limit):
            usage = [h.usage.demoted(targets[id(h)]) if id(h) in targets else h.usage for h in held]
            request = PlanRequest(
                cost=cost,
                pending=PendingUsage(
                    device_persistent=sum(u.device_bytes - u.snapshot_bytes for u in usage) + snapshots,
                    host_bytes=sum(u.host_bytes for u in usage),
                    max_workspace=max((u.workspace_bytes for u in usage), default=0),
                    checkpoint_bytes=holdings,
                ),
                requested=requested,
                allow_offload=options.allow_offload and not quantized,
                allow_replay=options.allow_replay,
                device_limit=self.device_limit,
                host_limit=self.host_limit,
            )
            try:
                decision = plan_placement(request)
            except MemoryAdmissionError as error:
                refusal = refusal or error
                continue
            demote = [(h, targets[id(h)]) for h in demotable if id(h) in targets]
            if demote:
                where = ", ".join(
                    f"{sum(t is p for _, t in demote)} to {p.value}" for p in dict.fromkeys(t for _, t in demote)
                )
                decision = replace(
                    decision, reason=f"{decision.reason}; demoted {len(demote)} pending retained record(s) ({where})"
                )
            return Admitted(decision, cost, saved_class, estimator), demote
        misses.report("refused", self.config, estimator, cost.saved_bytes, raised=str(refusal))
        assert refusal is not None, "_demotions yields at least the assignment that demotes nothing"
        raise refusal

    def _learn_speed(self) -> None:
        """Fold in the forwards whose device time is now known (on CUDA, once the device passed them)."""
        waiting = []
        for stopwatch, tokens in self._timing:
            seconds = stopwatch.seconds()
            if seconds is None:
                waiting.append((stopwatch, tokens))
                continue
            per_token = seconds / tokens
            previous = self._seconds_per_token
            self._seconds_per_token = per_token if previous is None else 0.5 * (previous + per_token)
        self._timing = waiting

    def _saved_class(self, checkpoint: Checkpoint, batch: int, seq_len: int, training: bool) -> SavedClass:
        """What decides the saved bytes of this forward now (the enabled attention backends may change between calls)."""
        dropout = self.config.dropout if training else 0.0
        fused = fused_attention_enabled(self.device_type)
        autocast = torch.is_autocast_enabled(self.device_type)
        return SavedClass(
            shape=shape_class(batch, seq_len),
            scores_saved=attention_saves_scores(self.config.dtype, self.device_type, dropout, fused),
            dropout_active=dropout > 0,
            autocast=torch.get_autocast_dtype(self.device_type) if autocast else None,
            lora=checkpoint.lora_config,
        )

    def _estimator(
        self, saved_class: SavedClass, batch: int, seq_len: int, *, snapshot_bytes: int, staging_bytes: int
    ) -> dict[str, Any]:
        """The keyword arguments of ``estimate_forward_cost`` for this forward (a miss records them, NOTE [Planner misses])."""
        self._learn_speed()
        return dict(
            batch=batch,
            seq_len=seq_len,
            snapshot_bytes=snapshot_bytes,
            staging_bytes=staging_bytes,
            saved_scale=self._saved_scale(saved_class, batch, seq_len),
            measured_seconds_per_token=self._seconds_per_token or self.calibration.seconds_per_token,
            transfer_bytes_per_second=self.calibration.transfer_bytes_per_second,
            record_seconds=self.calibration.seconds_per_record,
            scores_saved=saved_class.scores_saved,
            lora=saved_class.lora,
            dropout_active=saved_class.dropout_active,
            autocast=saved_class.autocast,
        )

    def _saved_scale(self, saved_class: SavedClass, batch: int, seq_len: int) -> float | None:
        """Rule 5: the largest ratio to the analytic count, at ``seq_len``, of the most each forward of the class
        that ran allows a ``seq_len`` forward to save (``SavedTerms.worst_case``); ``None``: none ran."""
        kind: dict[str, Any] = dict(
            scores_saved=saved_class.scores_saved,
            lora=saved_class.lora,
            dropout_active=saved_class.dropout_active,
            autocast=saved_class.autocast,
        )
        terms, analytic = (
            saved_terms(self.config, batch, **kind),
            analytic_saved_bytes(self.config, batch, seq_len, **kind),
        )
        scale = None
        for length, measured in self._seen.get(saved_class, {}).items():
            scale = merged_saved_scale(scale, terms.worst_case(length, measured, seq_len) / analytic)
        return scale

    def observe(self, record: ForwardRecord, admitted: Admitted, stopwatch: Stopwatch) -> RecordUsage:
        """Learn from a forward that ran (its speed once ``stopwatch`` knows it); returns what its record now holds."""
        batch, seq_len = record.batch.input_ids.shape
        self._timing.append((stopwatch, batch * seq_len))
        saved, ledger, key = admitted.cost.saved_bytes, record.ledger, admitted.saved_class
        if ledger is not None:  # measured: keep the largest of its class and length (conservative)
            saved = ledger.device_bytes + ledger.copied_bytes
            seen = self._seen.setdefault(key, {})
            seen[seq_len] = max(seen.get(seq_len, 0), saved)
            if saved > admitted.cost.saved_bytes:
                misses.report(
                    "saved_bytes_exceeded", self.config, admitted.estimator, admitted.cost.saved_bytes, measured=saved
                )
        held_on_host = ledger.host_bytes if ledger is not None else saved  # pinned blocks, the arena: what is held
        return RecordUsage.of(
            admitted.cost, record.decision.placement, saved, held_on_host, record.checkpoint.trainable_nbytes()
        )


def _demotions(demotable: list[_Held], held: list[_Held], host_limit: int | None) -> Iterator[dict[int, Placement]]:
    """Rule 6's candidate demotions, fewest first: none, then for each count of the oldest demotable records
    the host-first assignment (offload while the host fits, else replay) and the replay-first one (the host
    left to the new forward), each once; by ``id`` of the held record."""
    yield {}
    host = sum(h.usage.host_bytes for h in held)
    for count in range(1, len(demotable) + 1):
        chosen = demotable[:count]
        host_first: dict[int, Placement] = {}
        room = host
        for entry in chosen:
            fits = host_limit is None or room + entry.usage.saved_bytes <= host_limit
            target = Placement.OFFLOAD if fits and Placement.OFFLOAD in entry.targets else entry.targets[-1]
            room += entry.usage.saved_bytes if target is Placement.OFFLOAD else 0
            host_first[id(entry)] = target
        yield host_first
        replay_first = {id(e): e.targets[-1] for e in chosen}  # targets end with replay where it is allowed
        if replay_first != host_first:
            yield replay_first


def merged_saved_scale(known: float | None, measured: float) -> float:
    """A class's saved-bytes scale after one more measured forward: the largest seen (NOTE [Memory admission]
    Rule 5), so the estimate is never below a forward of the class that ran (``known`` None: the first)."""
    return measured if known is None else max(known, measured)


def _staging_nbytes(checkpoint: Checkpoint) -> int:
    """Gradients a backward stages for ``checkpoint``, plus the out-of-place sums onto committed ``.grad`` (Rule 1)."""
    sums = sum(p.grad.numel() * p.grad.element_size() for p in checkpoint.parameters() if p.grad is not None)
    return checkpoint.trainable_nbytes() + sums
