"""Memory-lifetime canary: what a forward holds, and that it is gone at the exact points it must be.

For each placement (retain, offload, replay), forced per forward, two
independent witnesses — the weakref tensor census (``validation.lifetime``)
and the storage census split into a device and a host pool
(``validation.memory``, NOTE [Memory census]) — are read at these points:

- ``after_forward``: the pending graph is visible (non-vacuity) and holds no
  more device bytes than the trainer accounts for; retain keeps
  its activations on the device; offload and replay keep none of them
  (activation storages are watched with storage weak references), offload's
  device bytes fall to replay's floor and its host copies hold what retain
  kept on the device (contract §6: offload copies, never aliases);
- ``after_backward``: nothing the forward made outlives its backward;
- ``after_drop``: nothing outlives an output dropped without backward;
- ``after_failed_commit``: after a backward that failed at publication the
  device pool (graph, saved state, gradient staging) is empty while the
  caller still holds the error, and everything is gone once it drops it (the
  error's traceback keeps the released record's small RNG state meanwhile:
  see the xfail in ``tests/canaries/test_memory.py``);
- ``before_next_logical_batch``: at the first pull of each logical batch, the
  previous batch's inputs, outputs and graphs are gone
  (``rt.logical_batches``, NOTE [Logical-batch lifetime]).

Then admission: a trainer under a small ``memory_limit_bytes`` (calibrated
from the trainer's own predictions so that two retained forwards fit, not
more) takes several pending forwards; every decision's predicted bytes, and
the census's sampled device peak, must stay within the limit, and the limit
must bind (some forward not retained).

On CUDA the same points also read the allocator: bytes back to the baseline
after backward (two witnesses: allocator and driver, each read twice),
offload's device bytes down to replay's floor, and ``max_memory_allocated``
within the admitted budget. Elsewhere those checks are reported as skipped.

Mutations (the canary's own negative controls, for ``canaries.mutations``):
``"offload_alias"`` makes the saved-state ledger's host "copy" a byte view
that aliases the original storage; the canary must then fail.

Entry point: :func:`run`; it prints a line per check and writes one
write-once evidence record (``validation.evidence``), whose path it returns.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import reference_trainer as rt
from canaries.presets import Preset, preset
from reference_trainer.residency import SavedStateLedger
from reference_trainer.testing import inject_fault
from validation.evidence import make_record, write_once
from validation.lifetime import TensorCensus
from validation.memory import (
    ActivationWitness,
    PoolBytes,
    StorageCensus,
    cuda_leak_verdict,
    cuda_reading,
    frozen_heap,
    WitnessVerdict,
    two_witnesses,
)

__all__ = ["run", "MUTATIONS", "PLACEMENTS", "POINTS", "KIND", "MemoryCanaryError"]

KIND = "memory-canary"
PLACEMENTS = ("retain", "offload", "replay")
POINTS = ("after_forward", "after_backward", "after_drop", "after_failed_commit", "before_next_logical_batch")
MUTATIONS = ("offload_alias",)

# Offload's pending device bytes may exceed replay's floor by this share of what retain keeps.
_FLOOR_SLACK = 0.05
# Offload's host copies must hold at least this share of what retain keeps on the device.
_HOST_SHARE = 0.95
_PENDING_FORWARDS = 5
# Allocator rounding (512 B blocks) and the driver's 2 MiB pages: below this is not a leak.
_CUDA_TOLERANCE = 2 * 1024 * 1024


class MemoryCanaryError(ValueError):
    """The canary was asked for something it does not know (a preset or a mutation)."""


def _aliasing_copy(self: SavedStateLedger, tensor: torch.Tensor) -> torch.Tensor:
    """Mutation ``offload_alias``: a byte view of the original storage instead of a host copy."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _mutated(mutation: str | None) -> contextlib.AbstractContextManager[Any]:
    if mutation is None:
        return contextlib.nullcontext()
    if mutation == "offload_alias":
        return mock.patch.object(SavedStateLedger, "_copy_storage", _aliasing_copy)
    raise MemoryCanaryError(f"unknown mutation {mutation!r}; expected None or one of {MUTATIONS}")


class _Verdicts:
    """Checks as they are made: pass/fail, a detail line with the values, or skipped with a reason."""

    def __init__(self) -> None:
        self.checks: dict[str, bool] = {}
        self.details: dict[str, str] = {}
        self.skipped: dict[str, str] = {}

    def check(self, name: str, passed: bool, detail: str) -> bool:
        self.checks[name] = bool(passed)
        self.details[name] = detail
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}", flush=True)
        return bool(passed)

    def skip(self, name: str, reason: str) -> None:
        self.skipped[name] = reason
        print(f"SKIP  {name}: {reason}", flush=True)


class _Workload:
    """One model, inputs drawn from a seed, and trainers over the model (the baseline of every census)."""

    def __init__(self, spec: Preset) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        with self.device:  # built in place: a GPU preset's weights never pass through host memory
            self.model = rt.DecoderLM(spec.model, seed=0)
        self.vocab = spec.model.vocab_size

    def trainer(self, **limits: int | None) -> rt.Trainer:
        trainer = rt.Trainer(self.model, **limits)
        if self.spec.lora is not None:
            trainer.add_checkpoint("policy", lora=self.spec.lora, seed=1)
        else:
            trainer.add_checkpoint("policy", full=True)
        return trainer

    def inputs(self, seed: int) -> list[rt.ForwardInput]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab, (self.spec.sequences, self.spec.seq_len + 1), generator=g)
        return [rt.ForwardInput(row[:-1].clone(), row[1:].clone()) for row in tokens]


def _options(placement: str) -> rt.ForwardOptions:
    return rt.ForwardOptions(backward_state=placement, corrections=())


def _grads(trainer: rt.Trainer) -> list[torch.Tensor]:
    return [p.grad for p in trainer.checkpoint("policy").parameters() if p.grad is not None]


def _loss(outputs: list[rt.ForwardOutput]) -> torch.Tensor:
    return -sum(o.target_logprobs.sum() for o in outputs)


def _bytes_left(
    census: StorageCensus, trainer: rt.Trainer, what: str, keep: Sequence[torch.Tensor] = ()
) -> WitnessVerdict:
    """Two readings of what the census still counts beyond the caller's tensors and committed grads.

    ``census.last`` is the second reading, split by pool.
    """
    return two_witnesses(what, lambda: census.measure(ignore=[*keep, *_grads(trainer)]).total, baseline=0)


def _names(entries: list[Any], limit: int = 4) -> str:
    shown = ", ".join(f"{e.name}{list(e.shape)}" if hasattr(e, "name") else f"{list(e.shape)}" for e in entries[:limit])
    return shown + (f", ... ({len(entries)} in all)" if len(entries) > limit else "")


@dataclass
class _Point:
    """What one placement's lifecycle points measured: pool bytes per point, and other values."""

    bytes_at: dict[str, dict[str, int]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)


def _after_forward_and_backward(
    work: _Workload, trainer: rt.Trainer, p: str, verdicts: _Verdicts, cuda: bool, out: _Point
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
    pending = census.measure(ignore=[*keep, *_grads(trainer)])
    out.bytes_at["after_forward"] = pending.as_dict()
    out.values["accounted_device_bytes_after_forward"] = accounted
    alive = activations.alive()
    seen = len({s.ref.cdata for s in activations.seen})
    alive_bytes = sum(s.nbytes for s in alive)
    out.values.update(activations_seen=seen, activations_alive_after_forward=len(alive),
                      activation_bytes_alive_after_forward=alive_bytes)
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
    left = _bytes_left(census, trainer, f"{p}: bytes after backward", keep)
    out.bytes_at["after_backward"] = census.last.as_dict()
    leftover = tensors.alive(ignore=keep)
    verdicts.check(
        f"{p}: nothing outlives backward",
        not leftover and not left.leaked,
        f"{len(leftover)} tensors alive{': ' + _names(leftover) if leftover else ''}; {left.describe()}",
    )
    del keep
    if cuda:
        leaked, values = cuda_leak_verdict(f"{p}: after backward", work.device, before_cuda, tolerance=_CUDA_TOLERANCE)
        out.values["cuda_after_backward"] = values
        verdicts.check(
            f"cuda: {p}: allocator back to baseline after backward",
            not leaked,
            f"allocator {values['allocator']}, driver {values['driver']}",
        )


def _after_drop(work: _Workload, trainer: rt.Trainer, p: str, verdicts: _Verdicts, out: _Point) -> None:
    """Outputs dropped without a backward take their record with them (NOTE [Forward records] Rule 4)."""
    census = StorageCensus(work.device)
    with TensorCensus() as tensors:
        outputs = trainer.forward(work.inputs(200), options=_options(p))
    pending = census.measure(ignore=_grads(trainer))
    del outputs
    left = _bytes_left(census, trainer, f"{p}: bytes after dropping the outputs")
    out.bytes_at["after_drop"] = census.last.as_dict()
    leftover = tensors.alive()
    verdicts.check(
        f"{p}: nothing outlives a dropped output",
        pending.total > 0 and not leftover and not left.leaked and trainer.live_records() == 0,
        f"pending {pending.total} B; {len(leftover)} tensors alive; {left.describe()}; "
        f"{trainer.live_records()} records pending",
    )


def _after_failed_commit(work: _Workload, trainer: rt.Trainer, p: str, verdicts: _Verdicts, out: _Point) -> None:
    """A backward that fails at publication frees graph, saved state and staging (contract §4)."""
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
    held = census.measure(ignore=[*keep, loss, *_grads(trainer)])  # the error's frames still hold the loss
    out.values["held_with_error_after_failed_commit"] = held.as_dict()
    verdicts.check(
        f"{p}: a failed commit frees graph, saved state and staging while the caller holds the error",
        error is not None and held.device == 0 and trainer.live_records() == 0,
        f"fault {'raised ' + type(error).__name__ if error is not None else 'did NOT fire'}; device pool "
        f"{held.device} B, host pool {held.host} B while the error is held; {trainer.live_records()} records pending",
    )
    del error, loss
    left = _bytes_left(census, trainer, f"{p}: bytes after a failed commit", keep)
    out.bytes_at["after_failed_commit"] = census.last.as_dict()
    leftover = tensors.alive(ignore=keep)
    verdicts.check(
        f"{p}: nothing outlives a failed commit once the error is dropped",
        not leftover and not left.leaked,
        f"{len(leftover)} tensors alive{': ' + _names(leftover) if leftover else ''}; {left.describe()}",
    )


def _before_next_logical_batch(
    work: _Workload, trainer: rt.Trainer, p: str, verdicts: _Verdicts, out: _Point
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
                readings.append(_bytes_left(census, trainer, f"{p}: bytes at pull {i}"))
                worst = PoolBytes(max(worst.device, census.last.device), max(worst.host, census.last.host))
            yield work.inputs(400 + i)[0]

    for batch in rt.logical_batches(source(), size=per_batch):
        batch.outputs = trainer.forward(list(batch.micro_batches), options=_options(p))
        batch.loss = _loss(batch.outputs[: per_batch // 2])  # the other half stays pending until release
        trainer.backward(batch.loss)
        del batch  # Rule 3: the loop variable would keep the batch shell
    out.bytes_at["before_next_logical_batch"] = worst.as_dict()
    verdicts.check(
        f"{p}: previous logical batch freed before the next pull",
        len(readings) == batches - 1 and not any(r.leaked for r in readings),
        "; ".join(r.describe() for r in readings) or "no pull was measured",
    )


def _lifecycle(work: _Workload, trainer: rt.Trainer, p: str, verdicts: _Verdicts, cuda: bool) -> _Point:
    """The lifecycle points (:data:`POINTS`) for one placement."""
    out = _Point()
    _after_forward_and_backward(work, trainer, p, verdicts, cuda, out)
    _after_drop(work, trainer, p, verdicts, out)
    _after_failed_commit(work, trainer, p, verdicts, out)
    _before_next_logical_batch(work, trainer, p, verdicts, out)
    return out


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    return -sum(t.sum() for t in tensors)


def _offload_checks(per: dict[str, _Point], verdicts: _Verdicts, cuda: bool) -> dict[str, int]:
    """Offload against the other two placements on the same workload (contract §6)."""
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


def _calibrate(work: _Workload, trainer: rt.Trainer, cuda: bool) -> tuple[int, int]:
    """A device limit where two retained forwards fit and a third does not; a host limit for two offloads.

    From the trainer's own prediction for one pending forward and what that
    record holds; on CUDA never above 80% of the free device memory.
    """
    warm = trainer.forward(work.inputs(500))
    trainer.backward(_loss(warm))
    del warm
    first = trainer.forward(work.inputs(501))
    predicted, usage = first[0].decision.predicted_bytes, first[0].usage
    del first
    limit = predicted + usage.device_bytes + usage.device_bytes // 2
    if cuda:
        limit = min(limit, int(0.8 * torch.cuda.mem_get_info(work.device)[0]))
    return limit, 2 * usage.saved_bytes + usage.saved_bytes // 5


def _admission(
    work: _Workload, calibration: rt.Trainer, verdicts: _Verdicts, cuda: bool
) -> dict[str, Any]:
    """Several pending forwards under a small limit: predictions and the measured peak stay within it."""
    limit, host_limit = _calibrate(work, calibration, cuda)
    trainer = work.trainer(memory_limit_bytes=limit, host_memory_limit_bytes=host_limit)
    layers = work.model.model.layers
    census = StorageCensus(work.device)
    pending: list[list[rt.ForwardOutput]] = []

    def callers() -> list[torch.Tensor]:  # the caller's output leaves and committed grads are not the trainer's budget
        return [*(o.target_logprobs for outputs in pending for o in outputs), *_grads(trainer)]

    sample = census.sample_hook(ignore=callers)

    def in_backward(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        if output.requires_grad:  # fires when the backward reaches the first layer: most staging exists
            output.register_hook(sample)

    # Sampled peaks: the end of each forward (and replay), and deep in each backward.
    handles = [layers[-1].register_forward_hook(sample), layers[0].register_forward_hook(in_backward)]
    if cuda:
        baseline = cuda_reading(work.device).allocated
        torch.cuda.reset_peak_memory_stats(work.device)
    decisions: list[rt.PlacementDecision] = []
    refused: str | None = None
    try:
        for k in range(_PENDING_FORWARDS):
            try:
                pending.append(trainer.forward(work.inputs(600 + k)))
            except rt.MemoryAdmissionError as error:
                refused = str(error)
                break
            decisions.append(pending[-1][0].decision)
            census.measure(ignore=callers())
        while pending:
            trainer.backward(_loss(pending[0]))
            del pending[0]
            census.measure(ignore=callers())
    finally:
        for handle in handles:
            handle.remove()
    left = _bytes_left(census, trainer, "admission: bytes after the last backward")
    placements = [d.placement for d in decisions]
    predicted = [d.predicted_bytes for d in decisions]
    values: dict[str, Any] = {
        "limit_bytes": limit,
        "host_limit_bytes": host_limit,
        "placements": placements,
        "predicted_bytes": predicted,
        "census_peak_device": census.peak.device,
        "census_peak_host": census.peak.host,
        "refused": refused,
    }
    verdicts.check(
        "admission: every pending forward admitted, and the limit binds",
        refused is None and len(decisions) == _PENDING_FORWARDS and set(placements) - {"retain"} != set(),
        f"placements {placements} under {limit} B" + (f"; refused: {refused}" if refused else ""),
    )
    verdicts.check(
        "admission: every predicted peak within the limit",
        bool(predicted) and max(predicted) <= limit,
        f"predicted {predicted} B; limit {limit} B",
    )
    verdicts.check(
        "admission: census device peak within the limit",
        0 < census.peak.device <= limit,
        f"sampled peak {census.peak.device} B (device pool); limit {limit} B",
    )
    verdicts.check(
        "admission: census host peak within the host limit",
        census.peak.host <= host_limit,
        f"sampled peak {census.peak.host} B (host pool); host limit {host_limit} B",
    )
    verdicts.check("admission: nothing left after the last backward", not left.leaked, left.describe())
    if cuda:
        peak = torch.cuda.max_memory_allocated(work.device) - baseline
        values["cuda_peak_allocated"] = peak
        verdicts.check(
            "cuda: admission: max_memory_allocated within the admitted budget",
            peak <= limit,
            f"max_memory_allocated {peak} B above the baseline {baseline} B; limit {limit} B",
        )
    return values


CUDA_CHECKS = (
    *(f"cuda: {p}: allocator back to baseline after backward" for p in PLACEMENTS),
    "cuda: offload: allocator bytes after forward fall to replay's floor",
    "cuda: admission: max_memory_allocated within the admitted budget",
)


def run(preset_name: str = "cpu", *, out_dir: Path, mutation: str | None = None) -> Path:
    """Run the canary on ``preset(preset_name).on_this_machine()``; returns the evidence path.

    ``mutation``: ``None`` or one of :data:`MUTATIONS` (the canary must then
    fail). Raises :class:`MemoryCanaryError` for an unknown mutation and
    ``ValueError`` for an unknown preset; a failed check is not an exception:
    read ``passed`` in the record.
    """
    mutated = _mutated(mutation)  # validate before any work
    spec = preset(preset_name).on_this_machine()
    cuda = spec.cuda_checks
    verdicts = _Verdicts()
    print(f"memory canary: preset {spec.name} on {spec.device}" + (f", mutation {mutation}" if mutation else ""), flush=True)
    # The caller's RNG streams are left as they were.
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        torch.manual_seed(0)
        work = _Workload(spec)
        lifecycle_trainer = work.trainer()
        calibration_trainer = work.trainer()
        # Warm up allocator, kernels and caches before any baseline is taken.
        warm = lifecycle_trainer.forward(work.inputs(0))
        lifecycle_trainer.backward(_loss(warm))
        del warm
        with mutated, frozen_heap():
            per = {p: _lifecycle(work, lifecycle_trainer, p, verdicts, cuda) for p in PLACEMENTS}
            offload = _offload_checks(per, verdicts, cuda)
            admission = _admission(work, calibration_trainer, verdicts, cuda)
    if not cuda:
        reason = (
            f"no CUDA device: preset {spec.name!r} swapped for the CPU" if spec.swapped
            else f"preset {spec.name!r} runs on {spec.device}"
        )
        for name in CUDA_CHECKS:
            verdicts.skip(name, reason)
    measurements = {
        "lifecycle_bytes": {p: per[p].bytes_at for p in PLACEMENTS},
        "lifecycle_values": {p: per[p].values for p in PLACEMENTS},
        "offload": offload,
        "admission": admission,
        "details": verdicts.details,
        "skipped_checks": verdicts.skipped,
        "mutation": mutation,
    }
    record = make_record(
        KIND,
        config={**spec.describe(), "mutation": mutation, "placements": list(PLACEMENTS), "points": list(POINTS)},
        checks=verdicts.checks,
        measurements=measurements,
    )
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    suffix = f"-{mutation}" if mutation else ""
    path = write_once(Path(out_dir) / f"memory-{spec.name}{suffix}-{stamp}-{os.getpid()}.json", record)
    failed = [name for name, ok in verdicts.checks.items() if not ok]
    verdict = "PASSED" if not failed else f"FAILED ({len(failed)} of {len(verdicts.checks)} checks)"
    print(f"memory canary: {verdict}; {len(verdicts.skipped)} skipped")
    print(f"wrote {path}", flush=True)
    return path
