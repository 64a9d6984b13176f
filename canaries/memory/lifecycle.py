"""The memory canary's lifecycle points: what a forward holds, and that it is gone when it must be.

For one placement (forced per forward) :func:`lifecycle` reads two independent
witnesses (the weakref tensor census, ``validation.lifetime``; the storage
census split into a device and a host pool, ``validation.memory``) at each of
:data:`POINTS` (see ``canaries.memory.canary`` for what each point asserts);
:func:`offload_checks` then compares offload with retain and replay on the
same workload. :class:`validation.evidence.Checks` collects the checks as they are made;
:class:`CensusWorkload` is the model, inputs and trainers every census measures
against.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import reference_trainer as rt
from reference_trainer.testing import inject_fault
from validation.evidence import Checks
from validation.lifetime import TensorCensus
from validation.memory import (
    ActivationWitness,
    PoolBytes,
    StorageCensus,
    WitnessVerdict,
    cuda_leak_verdict,
    cuda_reading,
    two_witnesses,
)
from validation.trainers import trainer_with_policy

from ..presets import PLACEMENTS, Preset

__all__ = [
    "POINTS",
    "CensusWorkload",
    "LifecyclePoint",
    "committed_grads",
    "negative_logprob_sum",
    "bytes_left",
    "lifecycle",
    "offload_checks",
]

POINTS = ("after_forward", "after_backward", "after_drop", "after_failed_commit", "before_next_logical_batch")

# Offload's pending device bytes may exceed replay's floor by this share of what retain keeps.
_FLOOR_SLACK = 0.05
# Offload's host copies must hold at least this share of what retain keeps on the device.
_HOST_SHARE = 0.95
# Allocator rounding (512 B blocks) and the driver's 2 MiB pages: below this is not a leak.
_CUDA_TOLERANCE = 2 * 1024 * 1024


class CensusWorkload:
    """One model, inputs drawn from a seed, and trainers over the model (the baseline of every census)."""

    def __init__(self, preset: Preset) -> None:
        self.preset = preset
        self.device = torch.device(preset.device)
        with self.device:  # built in place: a GPU preset's weights never pass through host memory
            self.model = rt.DecoderLM(preset.model, seed=0)
        self.vocab = preset.model.vocab_size

    def trainer(self, **limits: int | None) -> rt.Trainer:
        return trainer_with_policy(self.model, lora=self.preset.lora, **limits)

    def inputs(self, seed: int) -> list[rt.ForwardInput]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab, (self.preset.sequences, self.preset.seq_len + 1), generator=g)
        return [rt.ForwardInput(row[:-1].clone(), row[1:].clone()) for row in tokens]


def _options(placement: str) -> rt.ForwardOptions:
    return rt.ForwardOptions(backward_state=placement, corrections=())


def committed_grads(trainer: rt.Trainer) -> list[torch.Tensor]:
    return [p.grad for p in trainer.checkpoint("policy").parameters() if p.grad is not None]


def negative_logprob_sum(outputs: list[rt.ForwardOutput]) -> torch.Tensor:
    return -sum(o.target_logprobs.sum() for o in outputs)


def bytes_left(
    census: StorageCensus, trainer: rt.Trainer, what: str, keep: Sequence[torch.Tensor] = ()
) -> WitnessVerdict:
    """Two readings of what the census still counts beyond the caller's tensors and committed grads.

    ``census.last`` is the second reading, split by pool.
    """
    return two_witnesses(what, lambda: census.measure(ignore=[*keep, *committed_grads(trainer)]).total, baseline=0)


def _names(entries: list[Any], limit: int = 4) -> str:
    shown = ", ".join(f"{e.name}{list(e.shape)}" if hasattr(e, "name") else f"{list(e.shape)}" for e in entries[:limit])
    return shown + (f", ... ({len(entries)} in all)" if len(entries) > limit else "")


@dataclass
class LifecyclePoint:
    """What one placement's lifecycle points measured: pool bytes per point, and other values."""

    bytes_at: dict[str, dict[str, int]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)


def _left_at(
    point: str,
    what: str,
    census: StorageCensus,
    trainer: rt.Trainer,
    tensors: TensorCensus,
    out: LifecyclePoint,
    keep: Sequence[torch.Tensor] = (),
) -> tuple[WitnessVerdict, list[Any]]:
    """What is left at a lifecycle point: the two-witness byte reading (recorded as ``point``) and the tensors alive."""
    left = bytes_left(census, trainer, what, keep)
    out.bytes_at[point] = census.last.as_dict()
    return left, tensors.alive(ignore=keep)


def _nothing_outlives(verdicts: Checks, name: str, left: WitnessVerdict, leftover: list[Any]) -> None:
    verdicts.check(
        name,
        not leftover and not left.leaked,
        f"{len(leftover)} tensors alive{': ' + _names(leftover) if leftover else ''}; {left.describe()}",
    )


def _after_forward_and_backward(
    work: CensusWorkload, trainer: rt.Trainer, p: str, verdicts: Checks, cuda: bool, out: LifecyclePoint
) -> None:
    """The pending graph is visible; activations are kept (retain) or gone (offload, replay); then nothing is left."""
    before_cuda = cuda_reading(work.device) if cuda else None
    census = StorageCensus(work.device)
    with ActivationWitness(work.model) as activations, TensorCensus() as tensors:
        outputs = trainer.forward(work.inputs(100), options=_options(p))
    keep = [o.target_logprobs for o in outputs]
    accounted = outputs[0].usage.device_bytes
    del outputs
    census.mark_device(activations.refs)
    pending = census.measure(ignore=[*keep, *committed_grads(trainer)])
    out.bytes_at["after_forward"] = pending.as_dict()
    out.values["accounted_device_bytes_after_forward"] = accounted
    alive = activations.alive()
    seen = len({s.ref.cdata for s in activations.seen})
    alive_bytes = sum(s.nbytes for s in alive)
    out.values.update(
        activations_seen=seen,
        activations_alive_after_forward=len(alive),
        activation_bytes_alive_after_forward=alive_bytes,
    )
    if cuda:
        out.values["cuda_allocated_after_forward"] = cuda_reading(work.device).allocated - before_cuda.allocated
    pending_tensors = tensors.alive(ignore=keep)
    verdicts.check(
        f"{p}: census sees the pending graph after forward",
        bool(pending_tensors) and pending.total > 0,
        f"{len(pending_tensors)} tensors alive, device {pending.device} B, host {pending.host} B "
        "(a census that sees nothing proves nothing)",
    )
    verdicts.check(
        f"{p}: census device bytes within the trainer's own accounting",
        pending.device <= accounted,
        f"census {pending.device} B in the device pool; ForwardOutput.usage.device_bytes {accounted} B",
    )
    if p == "retain":
        verdicts.check(
            "retain: saved activations stay on the device until backward",
            bool(alive) and pending.device > 0,
            f"{len(alive)} activation storages alive ({alive_bytes} B), device pool {pending.device} B",
        )
    else:
        verdicts.check(
            f"{p}: no activation outlives the forward",
            not alive,
            f"{len(alive)} of {seen} activation storages still allocated ({alive_bytes} B)"
            + (f": {_names(alive)}" if alive else ""),
        )

    trainer.backward(_sum(keep))
    left, leftover = _left_at("after_backward", f"{p}: bytes after backward", census, trainer, tensors, out, keep)
    _nothing_outlives(verdicts, f"{p}: nothing outlives backward", left, leftover)
    del keep
    if cuda:
        leaked, values = cuda_leak_verdict(f"{p}: after backward", work.device, before_cuda, tolerance=_CUDA_TOLERANCE)
        out.values["cuda_after_backward"] = values
        verdicts.check(
            f"cuda: {p}: allocator back to baseline after backward",
            not leaked,
            f"allocator {values['allocator']}, driver {values['driver']}",
        )


def _after_drop(work: CensusWorkload, trainer: rt.Trainer, p: str, verdicts: Checks, out: LifecyclePoint) -> None:
    """Outputs dropped without a backward take their record with them (NOTE [Forward records] Rule 4)."""
    census = StorageCensus(work.device)
    with TensorCensus() as tensors:
        outputs = trainer.forward(work.inputs(200), options=_options(p))
    pending = census.measure(ignore=committed_grads(trainer))
    del outputs
    left, leftover = _left_at("after_drop", f"{p}: bytes after dropping the outputs", census, trainer, tensors, out)
    verdicts.check(
        f"{p}: nothing outlives a dropped output",
        pending.total > 0 and not leftover and not left.leaked and trainer.live_records() == 0,
        f"pending {pending.total} B; {len(leftover)} tensors alive; {left.describe()}; "
        f"{trainer.live_records()} records pending",
    )


def _after_failed_commit(
    work: CensusWorkload, trainer: rt.Trainer, p: str, verdicts: Checks, out: LifecyclePoint
) -> None:
    """A backward that fails at publication frees graph, saved state and staging (docs/semantics.md#transactions)."""
    census = StorageCensus(work.device)
    with TensorCensus() as tensors:
        outputs = trainer.forward(work.inputs(300), options=_options(p))
    keep = [o.target_logprobs for o in outputs]
    del outputs
    loss = _sum(keep)
    error: BaseException | None = None
    with inject_fault("publish"):
        try:
            trainer.backward(loss)
        except rt.GradientCommitError as caught:
            error = caught  # held on purpose: the device state must go even while the caller keeps the error
    held = census.measure(ignore=[*keep, loss, *committed_grads(trainer)])  # the error's frames still hold the loss
    out.values["held_with_error_after_failed_commit"] = held.as_dict()
    verdicts.check(
        f"{p}: a failed commit frees graph, saved state and staging while the caller holds the error",
        error is not None and held.device == 0 and trainer.live_records() == 0,
        f"fault {'raised ' + type(error).__name__ if error is not None else 'did NOT fire'}; device pool "
        f"{held.device} B, host pool {held.host} B while the error is held; {trainer.live_records()} records pending",
    )
    del error, loss
    left, leftover = _left_at(
        "after_failed_commit", f"{p}: bytes after a failed commit", census, trainer, tensors, out, keep
    )
    _nothing_outlives(verdicts, f"{p}: nothing outlives a failed commit once the error is dropped", left, leftover)


def _before_next_logical_batch(
    work: CensusWorkload, trainer: rt.Trainer, p: str, verdicts: Checks, out: LifecyclePoint
) -> None:
    """At the first pull of each logical batch the previous one is gone (NOTE [Logical-batch lifetime])."""
    per_batch, batches = 2, 3
    census = StorageCensus(work.device)
    readings: list[WitnessVerdict] = []
    worst = PoolBytes()

    def source() -> Iterator[rt.ForwardInput]:  # the source is the witness: it reads before each pull
        nonlocal worst
        for i in range(per_batch * batches):
            if i and i % per_batch == 0:
                readings.append(bytes_left(census, trainer, f"{p}: bytes at pull {i}"))
                worst = PoolBytes(max(worst.device, census.last.device), max(worst.host, census.last.host))
            yield work.inputs(400 + i)[0]

    for batch in rt.logical_batches(source(), size=per_batch):
        batch.outputs = trainer.forward(list(batch.micro_batches), options=_options(p))
        batch.loss = negative_logprob_sum(batch.outputs[: per_batch // 2])  # the other half stays pending until release
        trainer.backward(batch.loss)
        del batch  # Rule 3: the loop variable would keep the batch shell
    out.bytes_at["before_next_logical_batch"] = worst.as_dict()
    verdicts.check(
        f"{p}: previous logical batch freed before the next pull",
        len(readings) == batches - 1 and not any(r.leaked for r in readings),
        "; ".join(r.describe() for r in readings) or "no pull was measured",
    )


def lifecycle(work: CensusWorkload, trainer: rt.Trainer, p: str, verdicts: Checks, cuda: bool) -> LifecyclePoint:
    """The lifecycle points (:data:`POINTS`) for one placement."""
    out = LifecyclePoint()
    _after_forward_and_backward(work, trainer, p, verdicts, cuda, out)
    _after_drop(work, trainer, p, verdicts, out)
    _after_failed_commit(work, trainer, p, verdicts, out)
    _before_next_logical_batch(work, trainer, p, verdicts, out)
    return out


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    return -sum(t.sum() for t in tensors)


def offload_checks(per: dict[str, LifecyclePoint], verdicts: Checks, cuda: bool) -> dict[str, int]:
    """Offload against the other two placements on the same workload (NOTE [Saved-state lifetime])."""
    after = {p: per[p].bytes_at["after_forward"] for p in PLACEMENTS}
    kept = after["retain"]["device"] - after["replay"]["device"]  # what retain keeps on the device
    floor = after["replay"]["device"] + int(_FLOOR_SLACK * kept)
    copied = after["offload"]["host"] - after["replay"]["host"]
    verdicts.check(
        "offload: device bytes after forward fall to replay's floor",
        kept > 0 and after["offload"]["device"] <= floor,
        f"offload {after['offload']['device']} B on the device; replay {after['replay']['device']} B, "
        f"retain {after['retain']['device']} B; allowed up to {floor} B",
    )
    verdicts.check(
        "offload: host copies hold what retain keeps on the device",
        kept > 0 and copied >= _HOST_SHARE * kept,
        f"offload host pool {after['offload']['host']} B (replay {after['replay']['host']} B): copies {copied} B; "
        f"retain keeps {kept} B on the device; need at least {int(_HOST_SHARE * kept)} B",
    )
    name = "cuda: offload: allocator bytes after forward fall to replay's floor"
    if cuda:
        allocated = {p: per[p].values["cuda_allocated_after_forward"] for p in PLACEMENTS}
        kept_cuda = allocated["retain"] - allocated["replay"]
        floor_cuda = allocated["replay"] + int(_FLOOR_SLACK * kept_cuda)
        verdicts.check(
            name,
            kept_cuda > 0 and allocated["offload"] <= floor_cuda,
            f"memory_allocated growth after forward: retain {allocated['retain']} B, offload "
            f"{allocated['offload']} B, replay {allocated['replay']} B; allowed up to {floor_cuda} B",
        )
    return {"retain_keeps": kept, "offload_copies": copied, "offload_floor": floor}
