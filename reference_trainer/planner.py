"""Where a forward keeps what its backward needs: a pure function of sizes and costs.

NOTE [Memory admission]
  1. The device budget covers everything the trainer allocated since it was built (the frozen base model is outside
     it) plus the transient peak of the work being run, so a forward admitted is one that cannot OOM later:
       checkpoints = per checkpoint: live parameters, FP32 masters and their gradient buffers, AdamW's moments
                     (counted before the first step allocates them), committed ``.grad`` (``Checkpoint.held_nbytes``);
       persistent  = per pending record: retained saved bytes, its weight snapshot (once per pending version), its
                     input snapshot;
       staging     = per involved checkpoint: one copy of its trainable bytes plus the out-of-place sum a commit
                     onto ``.grad`` builds (NOTE [Gradient commit] Rule 2);
       workspace   = the largest transient need of any pending or new record, plus its saved bytes if offloaded or
                     replayed (restored one record at a time).
     predicted peak = checkpoints + persistent + staging + workspace.
     Not counted: logical-rank gradient buffers, AdamW's host ``step`` scalars.
  2. Offloaded saved bytes count against the separate host budget instead.
  3. ``auto`` retains if that fits; otherwise it takes the cheaper of offload (bytes moved both ways) and replay (one
     more forward) that fits, within ``allow_offload`` and ``allow_replay``. A forced placement is honoured or refused.
  4. Nothing fits: ``MemoryAdmissionError(predicted_peak_bytes, limit_bytes, suggestion)`` before the forward
     allocates anything. A call of several records (NOTE [Forward records] Rule 1) is planned whole, each group
     counting those before it: one refusal refuses the call, and nothing ran, moved or was drawn.
  5. Sizes come from a conservative analytic estimate of the saved activations (``saved_bytes.py``: ``H·B·T²`` terms
     only where the attention backend saves scores, :func:`attention_saves_scores`; each LoRA target's ``x·Aᵀ``;
     FP32 masks under dropout; autocast's weight casts), scaled by measured forwards of the same :class:`SavedClass`
     (all that decides what a forward saves but its length). The scale is the most each measured forward allows at
     this length (``SavedTerms.worst_case``: its bytes fill the fastest-growing terms first), so a forward of another
     length is never under-priced. Times are measured where possible (defaults or a loaded calibration otherwise,
     NOTE [Planner calibration constants]).
  6. Reclamation (``auto`` only): when nothing fits, pending retained records are demoted, oldest first, as few as
     make the new forward fit; only then is it refused. A demoted record goes to host copies where its options allow
     offload and the host fits it, else to replay (graph dropped, the forward re-run from its RNG, mode and weight
     snapshot, NOTE [Saved-state lifetime] Rule 5); when that does not make room, every demotable record replays,
     leaving the host to the new forward. Both demotions free the same device bytes, so the second assignment fits
     whenever any does. Demotions are applied only once the whole call is admitted (Rule 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from .errors import MemoryAdmissionError
from .lora import LoRAConfig
from .model import ModelConfig
from .saved_bytes import SavedTerms, analytic_saved_bytes, autocast_weight_bytes, element_size, saved_terms

__all__ = [
    "Placement",
    "ForwardCost",
    "PendingUsage",
    "PlanRequest",
    "PlacementDecision",
    "RecordUsage",
    "SavedClass",
    "SavedTerms",
    "saved_terms",
    "autocast_weight_bytes",
    "plan_placement",
    "estimate_forward_cost",
    "analytic_saved_bytes",
    "attention_saves_scores",
    "fused_attention_enabled",
    "shape_class",
    "DEFAULT_SECONDS_PER_TOKEN",
]


DEFAULT_SECONDS_PER_TOKEN = 2e-5
"""Forward speed without a measurement or a calibration (Rule 5)."""


class Placement(str, Enum):
    """Where a record keeps its saved state; a string enum, equal to and printed as its value."""

    RETAIN = "retain"
    OFFLOAD = "offload"
    REPLAY = "replay"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class ForwardCost:
    """Bytes and seconds of one forward (and its backward) under each placement."""

    saved_bytes: int
    transient_bytes: int
    snapshot_bytes: int
    input_bytes: int
    staging_bytes: int
    forward_seconds: float
    transfer_seconds: float
    record_seconds: float = 0.0  # a per-record overhead of offload and replay (a calibration's, else none)

    def persistent(self, placement: Placement) -> int:
        kept = self.saved_bytes if placement is Placement.RETAIN else 0
        return kept + self.snapshot_bytes + self.input_bytes

    def workspace(self, placement: Placement) -> int:
        rebuilt = 0 if placement is Placement.RETAIN else self.saved_bytes
        return self.transient_bytes + rebuilt

    def host_bytes(self, placement: Placement) -> int:
        return self.saved_bytes if placement is Placement.OFFLOAD else 0

    def extra_seconds(self, placement: Placement) -> float:
        if placement is Placement.OFFLOAD:
            return 2 * self.transfer_seconds + self.record_seconds
        if placement is Placement.REPLAY:
            return self.forward_seconds + self.record_seconds
        return 0.0


@dataclass(frozen=True)
class PendingUsage:
    """What pending records already hold (Rule 1)."""

    device_persistent: int = 0
    host_bytes: int = 0
    max_workspace: int = 0
    checkpoint_bytes: int = 0  # what every checkpoint holds (Rule 1)


@dataclass(frozen=True)
class PlanRequest:
    cost: ForwardCost
    pending: PendingUsage
    requested: str  # "auto" | "retain" | "offload" | "replay"
    allow_offload: bool
    allow_replay: bool
    device_limit: int | None
    host_limit: int | None


@dataclass(frozen=True, kw_only=True)
class PlacementDecision:
    """Where a forward keeps what its backward needs, and why: the one plan result.

    ``placement`` is a :class:`Placement`, a string enum: it equals (and
    prints as) ``"retain"``, ``"offload"`` or ``"replay"``.

    ``predicted_bytes``: the device peak the plan admitted; ``saved_bytes``: the
    saved bytes it admitted for this record (on the device for retain, the host
    for offload, rebuilt at backward for replay), never fewer than it holds.
    ``predicted_seconds``: the extra seconds the plan priced each placement at
    (its value to seconds: retain 0, offload both transfers, replay one more
    forward; Rule 3), every placement whether it fit or not, so a caller can
    hold the prices against measured times (the planner canary).
    """

    placement: Placement
    predicted_bytes: int
    saved_bytes: int
    reason: str
    predicted_seconds: dict[str, float]


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

    def demoted(self, placement: Placement) -> RecordUsage:
        """The same retained record once its saved bytes left the device (Rule 6): copied to the host
        (``OFFLOAD``) or dropped to be rebuilt at backward (``REPLAY``); either way its backward rebuilds them."""
        moved = self.saved_bytes if placement is Placement.OFFLOAD else 0
        return RecordUsage(
            saved_bytes=self.saved_bytes,
            snapshot_bytes=self.snapshot_bytes,
            device_bytes=self.device_bytes - self.saved_bytes,
            host_bytes=self.host_bytes + moved,
            workspace_bytes=self.workspace_bytes + self.saved_bytes,
        )

    @classmethod
    def of(cls, cost: ForwardCost, placement: Placement, saved: int, host: int, snapshot: int) -> RecordUsage:
        """What a record of ``cost`` under ``placement`` holds with ``saved`` saved bytes (``host`` of them on the host)."""
        kept = saved if placement is Placement.RETAIN else 0
        return cls(
            saved_bytes=saved,
            snapshot_bytes=snapshot,
            device_bytes=kept + cost.input_bytes + snapshot,
            host_bytes=host if placement is Placement.OFFLOAD else 0,
            workspace_bytes=cost.transient_bytes + (0 if placement is Placement.RETAIN else saved),
        )


def _peak(request: PlanRequest, placement: Placement) -> int:
    cost, pending = request.cost, request.pending
    workspace = max(pending.max_workspace, cost.workspace(placement))
    persistent = pending.checkpoint_bytes + pending.device_persistent + cost.persistent(placement)
    return persistent + cost.staging_bytes + workspace


def _fits(request: PlanRequest, placement: Placement) -> tuple[bool, int, int]:
    peak = _peak(request, placement)
    host = request.pending.host_bytes + request.cost.host_bytes(placement)
    device_ok = request.device_limit is None or peak <= request.device_limit
    host_ok = request.host_limit is None or host <= request.host_limit
    return device_ok and host_ok, peak, host


def plan_placement(request: PlanRequest) -> PlacementDecision:
    """Choose a placement per NOTE [Memory admission], or raise ``MemoryAdmissionError``."""
    if request.requested != "auto":
        forced = Placement(request.requested)
        ok, peak, host = _fits(request, forced)
        if not ok:
            raise _refusal(request, peak, host, f"forced backward_state={forced.value!r} does not fit")
        return _decision(request, forced, peak, f"forced {forced.value}")
    ok, peak, host = _fits(request, Placement.RETAIN)
    if ok:
        return _decision(request, Placement.RETAIN, peak, "auto: retain fits the memory limit")
    candidates = [Placement.OFFLOAD] * request.allow_offload + [Placement.REPLAY] * request.allow_replay
    fitting = [(request.cost.extra_seconds(p), p) for p in candidates if _fits(request, p)[0]]
    if not fitting:
        allowed = ", ".join(p.value for p in [Placement.RETAIN, *candidates])
        raise _refusal(request, peak, host, f"no allowed placement ({allowed}) fits")
    seconds, choice = min(fitting, key=lambda item: item[0])
    _, peak, _ = _fits(request, choice)
    others = ", ".join(f"{p.value} {s * 1e3:.2f} ms" for s, p in fitting)
    return _decision(request, choice, peak, f"auto: retain does not fit; cheapest that fits ({others})")


def _decision(request: PlanRequest, placement: Placement, peak: int, reason: str) -> PlacementDecision:
    prices = {p.value: request.cost.extra_seconds(p) for p in Placement}
    return PlacementDecision(
        placement=placement,
        predicted_bytes=peak,
        saved_bytes=request.cost.saved_bytes,
        reason=reason,
        predicted_seconds=prices,
    )


def _refusal(request: PlanRequest, peak: int, host: int, what: str) -> MemoryAdmissionError:
    limit = request.device_limit if request.device_limit is not None else 0
    if request.device_limit is not None and peak > request.device_limit:
        suggestion = (
            f"{what}: backpropagate or drop pending outputs, use smaller batches, allow offload/replay, "
            f"or raise memory_limit_bytes to at least {peak}"
        )
        return MemoryAdmissionError(peak, request.device_limit, suggestion)
    suggestion = (
        f"{what}: offloaded bytes {host} exceed host_memory_limit_bytes; backpropagate pending outputs or allow replay"
    )
    return MemoryAdmissionError(host, request.host_limit if request.host_limit is not None else limit, suggestion)


# --- sizes and times (Rule 5) -----------------------------------------------------


def fused_attention_enabled(device_type: str) -> bool:
    """Whether scaled-dot-product attention may use a fused kernel (flash, memory-efficient, cuDNN) here."""
    backends = torch.backends.cuda
    if device_type == "cuda":
        return bool(
            backends.flash_sdp_enabled() or backends.mem_efficient_sdp_enabled() or backends.cudnn_sdp_enabled()
        )
    return bool(backends.flash_sdp_enabled())  # the CPU's fused kernel follows the flash switch


def attention_saves_scores(dtype: torch.dtype, device_type: str, dropout: float, fused_enabled: bool) -> bool:
    """Whether attention saves its ``(B, H, T, T)`` probabilities: only the math backend does.

    Math runs when no fused kernel is enabled, for FP64 on CUDA (fused kernels
    take FP16/BF16/FP32) and for dropout on the CPU (its fused kernel has none).
    """
    if not fused_enabled:
        return True
    if device_type == "cuda":
        return dtype == torch.float64
    return dropout > 0


def shape_class(batch: int, seq_len: int) -> tuple[int, int]:
    """Forwards whose saved bytes scale alike: the batch, and the sequence length's power-of-two bucket."""
    return batch, max(seq_len - 1, 0).bit_length()


@dataclass(frozen=True)
class SavedClass:
    """Forwards whose measured/analytic saved-bytes ratio is shared (Rule 5): all that decides what is saved."""

    shape: tuple[int, int]  # shape_class
    scores_saved: bool  # attention saves its probabilities (math backend)
    dropout_active: bool  # train mode and p > 0: residual dropout masks are saved
    autocast: torch.dtype | None  # the ambient autocast dtype, None when off
    lora: LoRAConfig | None  # None: a full checkpoint


def estimate_forward_cost(
    config: ModelConfig,
    *,
    batch: int,
    seq_len: int,
    snapshot_bytes: int,
    staging_bytes: int,
    saved_scale: float | None,
    measured_seconds_per_token: float | None,
    transfer_bytes_per_second: float,
    scores_saved: bool = True,
    lora: LoRAConfig | None = None,
    dropout_active: bool = False,
    autocast: torch.dtype | None = None,
    record_seconds: float = 0.0,
) -> ForwardCost:
    """The cost of one ``(batch, seq_len)`` forward of ``config``.

    ``saved_scale`` (measured / analytic saved bytes, from forwards that ran)
    replaces the analytic estimate's slack once known, with a 5% margin.
    """
    tokens = batch * seq_len
    elem = element_size(config)
    saved = analytic_saved_bytes(
        config, batch, seq_len, scores_saved=scores_saved, lora=lora, dropout_active=dropout_active, autocast=autocast
    )
    if saved_scale is not None:
        saved = int(saved * saved_scale * 1.05) + 4096
    c, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    square = config.num_attention_heads * batch * seq_len * seq_len if scores_saved else 0
    transient = tokens * v * 4 * 4 + tokens * (3 * i + 4 * c) * elem * 2 + square * elem * 4
    seconds_per_token = (
        measured_seconds_per_token if measured_seconds_per_token is not None else DEFAULT_SECONDS_PER_TOKEN
    )
    return ForwardCost(
        saved_bytes=saved,
        transient_bytes=int(transient),
        snapshot_bytes=snapshot_bytes,
        input_bytes=tokens * 16,
        staging_bytes=staging_bytes,
        forward_seconds=seconds_per_token * tokens,
        transfer_seconds=saved / transfer_bytes_per_second,
        record_seconds=record_seconds,
    )
