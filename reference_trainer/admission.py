"""Memory admission for one trainer: the device limit, what pending records hold, and the next forward's plan.

The stateful half of planning (the pure half is ``planner.py``, NOTE [Memory
admission]): it sums what pending records actually hold (measured by their
saved-state ledgers), learns the model's saved bytes and forward speed from
forwards that ran, asks :func:`plan_placement` for the next forward and
demotes pending retained records when that makes it fit (Rule 6).

The device limit: an explicit ``memory_limit_bytes`` wins. Otherwise, on
CUDA, the trainer plans against the device's capacity as it sees it when it
is built: :func:`device_capacity` (the free device memory), plus the bytes its
own records already hold (none, at construction), minus a safety margin of
``DEVICE_MARGIN_FRACTION`` of the capacity for the allocator's rounding and
fragmentation and for kernels' workspaces the estimate does not see. On CPU
the limit is ``None``: unbounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import testing
from .checkpoints import Checkpoint
from .graphs import ForwardRecord, PlacementDecision
from .errors import MemoryAdmissionError
from .model import ModelConfig
from .options import ResolvedOptions
from .timing import Stopwatch
from .planner import (
    ForwardCost,
    PendingUsage,
    Placement,
    PlanRequest,
    analytic_saved_bytes,
    attention_saves_scores,
    estimate_forward_cost,
    fused_attention_enabled,
    plan_placement,
    shape_class,
)

__all__ = ["Admission", "DEVICE_MARGIN_FRACTION", "RecordUsage", "default_device_limit", "device_capacity"]

# Without measurements: host copies at a few GB/s (CPU memcpy or PCIe).
_DEFAULT_TRANSFER_BYTES_PER_SECOND = 4e9

DEVICE_MARGIN_FRACTION = 0.05
"""Share of the device capacity the planner leaves unplanned (allocator rounding, fragmentation, kernel workspaces)."""


def device_capacity(device: torch.device) -> int | None:
    """Bytes the trainer may still allocate on ``device``: free CUDA memory, ``None`` (unbounded) elsewhere.

    The one place the trainer reads the device's capacity; tests substitute it
    with ``reference_trainer.testing.substitute_device_capacity``.
    """
    override = testing.capacity_override()
    if override is not None:
        return override(device)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def default_device_limit(device: torch.device, held_bytes: int = 0) -> int | None:
    """The device limit when ``memory_limit_bytes`` is ``None``: capacity + ``held_bytes`` - margin."""
    capacity = device_capacity(device)
    if capacity is None:
        return None
    return max(0, int((capacity + held_bytes) * (1.0 - DEVICE_MARGIN_FRACTION)))


@dataclass(frozen=True, kw_only=True)
class RecordUsage:
    """What one pending record holds: on the device, on the host, and needs at backward.

    ``device_bytes`` includes the weight snapshot of the record's version
    (``snapshot_bytes``); admission counts each pending version's snapshot once.
    """

    saved_bytes: int
    snapshot_bytes: int
    device_bytes: int
    host_bytes: int
    workspace_bytes: int

    def demoted(self) -> RecordUsage:
        """The same record once its retained saved bytes moved to host copies."""
        return RecordUsage(
            saved_bytes=self.saved_bytes,
            snapshot_bytes=self.snapshot_bytes,
            device_bytes=self.device_bytes - self.saved_bytes,
            host_bytes=self.host_bytes + self.saved_bytes,
            workspace_bytes=self.workspace_bytes + self.saved_bytes,
        )


class Admission:
    """Plans forwards against ``device_limit`` / ``host_limit`` (``None``: unbounded)."""

    def __init__(
        self, config: ModelConfig, device_limit: int | None, host_limit: int | None, device_type: str = "cpu"
    ) -> None:
        self.config = config
        self.device_limit = device_limit
        self.host_limit = host_limit
        self.device_type = device_type
        # Measured / analytic saved bytes, by shape class and whether attention saved its scores.
        self._saved_scales: dict[tuple[tuple[int, int], bool], float] = {}
        self._seconds_per_token: float | None = None
        self._timing: list[tuple[Stopwatch, int]] = []  # forwards whose device time is not known yet, with their tokens

    def plan(
        self,
        checkpoint: Checkpoint,
        lengths: list[int],
        options: ResolvedOptions,
        pending: Iterable[ForwardRecord],
        *,
        quantized: bool,
    ) -> tuple[PlacementDecision, ForwardCost]:
        """Plan the next forward and demote the pending records that must make room for it first."""
        decision, cost, demote = self.decide(checkpoint, lengths, options, pending, quantized=quantized)
        for record in demote:
            record.ledger.demote()
            record.usage = record.usage.demoted()
        return decision, cost

    def decide(
        self,
        checkpoint: Checkpoint,
        lengths: list[int],
        options: ResolvedOptions,
        pending: Iterable[ForwardRecord],
        *,
        quantized: bool,
    ) -> tuple[PlacementDecision, ForwardCost, list[ForwardRecord]]:
        """Plan the next forward; returns its decision, its cost and the records to demote first.

        When nothing fits an ``auto`` forward, pending retained records are
        demoted to host copies, oldest first, as few as make it fit (NOTE
        [Memory admission] Rule 6); a forced placement is honoured or refused.
        """
        pending = list(pending)
        shares_snapshot = any(r.version == checkpoint.version for r in pending)
        involved = {r.checkpoint.name: r.checkpoint for r in pending} | {checkpoint.name: checkpoint}
        # Weight snapshots are shared by every record of a version: counted once per pending version.
        snapshots = sum({r.version: r.checkpoint.trainable_nbytes() for r in pending}.values())
        cost = self._cost(
            len(lengths),
            max(lengths),
            snapshot_bytes=0 if shares_snapshot else checkpoint.trainable_nbytes(),
            staging_bytes=sum(c.trainable_nbytes() for c in involved.values()),
        )
        requested = options.backward_state
        if quantized and requested == "auto" and options.allow_replay:
            requested = "replay"  # quantized saved state can only be rebuilt (NOTE [Saved-state lifetime] 6)
        demotable = [
            r for r in pending if r.ledger is not None and r.ledger.placement is Placement.RETAIN
        ]
        reclaim = requested == "auto" and options.allow_offload
        refusal: MemoryAdmissionError | None = None
        for count in range(len(demotable) + 1 if reclaim else 1):
            demoted = {id(r) for r in demotable[:count]}
            usage = [r.usage.demoted() if id(r) in demoted else r.usage for r in pending if r.usage is not None]
            request = PlanRequest(
                cost=cost,
                pending=PendingUsage(
                    device_persistent=sum(u.device_bytes - u.snapshot_bytes for u in usage) + snapshots,
                    host_bytes=sum(u.host_bytes for u in usage),
                    max_workspace=max((u.workspace_bytes for u in usage), default=0),
                ),
                requested=requested,
                allow_offload=options.allow_offload and not quantized,
                allow_replay=options.allow_replay,
                device_limit=self.device_limit,
                host_limit=self.host_limit,
            )
            try:
                result = plan_placement(request)
            except MemoryAdmissionError as error:
                refusal = refusal or error
                continue
            reason = result.reason + (f"; demoted {count} pending retained record(s) to host" if count else "")
            decision = PlacementDecision(
                placement=result.placement.value, predicted_bytes=result.predicted_peak_bytes, reason=reason
            )
            return decision, cost, demotable[:count]
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

    def _scores_saved(self) -> bool:
        """Whether attention saves its probabilities now (the enabled backends may change between forwards)."""
        fused = fused_attention_enabled(self.device_type)
        return attention_saves_scores(self.config.dtype, self.device_type, self.config.dropout, fused)

    def _cost(self, batch: int, seq_len: int, *, snapshot_bytes: int, staging_bytes: int) -> ForwardCost:
        self._learn_speed()
        scores = self._scores_saved()
        return estimate_forward_cost(
            self.config,
            batch=batch,
            seq_len=seq_len,
            snapshot_bytes=snapshot_bytes,
            staging_bytes=staging_bytes,
            saved_scale=self._saved_scales.get((shape_class(batch, seq_len), scores)),
            measured_seconds_per_token=self._seconds_per_token,
            transfer_bytes_per_second=_DEFAULT_TRANSFER_BYTES_PER_SECOND,
            scores_saved=scores,
        )

    def observe(self, record: ForwardRecord, cost: ForwardCost, stopwatch: Stopwatch) -> RecordUsage:
        """Learn from a forward that ran (its speed once ``stopwatch`` knows it); returns what its record now holds."""
        batch, seq_len = record.batch.input_ids.shape
        self._timing.append((stopwatch, batch * seq_len))
        saved = cost.saved_bytes
        ledger = record.ledger
        if ledger is not None:  # measured: keep the largest measured/analytic ratio of its class (conservative)
            saved = ledger.device_bytes + ledger.copied_bytes
            scores = self._scores_saved()
            scale = saved / analytic_saved_bytes(self.config, batch, seq_len, scores_saved=scores)
            key = (shape_class(batch, seq_len), scores)
            self._saved_scales[key] = max(scale, self._saved_scales.get(key, 0.0))
        placement = Placement(record.decision.placement)
        kept = saved if placement is Placement.RETAIN else 0
        held_on_host = ledger.host_bytes if ledger is not None else saved  # pinned blocks, the arena: what is held
        return RecordUsage(
            saved_bytes=saved,
            snapshot_bytes=record.checkpoint.trainable_nbytes(),
            device_bytes=kept + cost.input_bytes + record.checkpoint.trainable_nbytes(),
            host_bytes=held_on_host if placement is Placement.OFFLOAD else 0,
            workspace_bytes=cost.transient_bytes + (0 if placement is Placement.RETAIN else saved),
        )
