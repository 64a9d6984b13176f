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
  kept on the device (offload copies, never aliases: NOTE [Saved-state lifetime] Rule 4);
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
must bind (some forward not retained); after every forward the pending
records hold no more than the limits (held <= admitted). Then the
intersections of ``canaries.memory.intersections`` (NOTE [Admission
intersections]): train mode after eval mode with dropout, LoRA rank 256,
a long forward after a shorter one of its class, the checkpoints' state.
Last, the logical-rank scale check (``canaries.memory.scale``): gradient
bytes the logical ranks hold and receive, and their bits, over ``L`` and
``W`` on gloo, full and LoRA; the quick profile (``rtv run`` on CPU) reports
it skipped, since its spawned ranks cost seconds, and runs it only when a
focused run names it (the mutation suite's logical-rank mutations).

On CUDA the same points also read the allocator: bytes back to the baseline
after backward (two witnesses: allocator and driver, each read twice),
offload's device bytes down to replay's floor, and ``max_memory_allocated``
within the admitted budget. Elsewhere those checks are reported as skipped.

The lifecycle points live in ``canaries.memory.lifecycle``; this module holds
admission and the entry point :func:`judge` (``canaries.registry``'s
interface; every profile runs the same checks, which take seconds; the
scale check's profile picks its layouts). The
registry writes its one write-once evidence record. Its
negative control, ``offload_alias``, lives with the other injected bugs in
``canaries.mutations.catalogue``; the mutation suite may ask for the
intersection checks alone (``run(checks=...)``, NOTE [Mutation verdicts] Rule 4).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

import reference_trainer as rt
from validation.evidence import Checks
from validation.memory import StorageCensus, cuda_reading, frozen_heap

from ..preset_budget import check_fits
from ..presets import PLACEMENTS, Preset
from ..registry import Judged
from ..request import CanaryRun
from .intersections import SCENARIOS, check_checkpoint_budget, check_scenario, held_within_limits
from .lifecycle import (
    POINTS,
    CensusWorkload,
    bytes_left,
    committed_grads,
    lifecycle,
    negative_logprob_sum,
    offload_checks,
)
from .scale import SCALE_CHECKS, scale_check

__all__ = ["KIND", "CUDA_CHECKS", "CHECKPOINT_STATE_CHECK", "INTERSECTION_CHECKS", "judge"]

KIND = "memory-canary"
_PENDING_FORWARDS = 5


def _calibrate(work: CensusWorkload, trainer: rt.Trainer, cuda: bool) -> tuple[int, int]:
    """A device limit where two retained forwards fit and a third does not; a host limit for two offloads.

    From the trainer's own prediction for one pending forward and what that
    record holds; on CUDA never above 80% of the free device memory.
    """
    warm = trainer.forward(work.inputs(500))
    trainer.backward(negative_logprob_sum(warm))
    del warm
    first = trainer.forward(work.inputs(501))
    predicted, usage = first[0].decision.predicted_bytes, first[0].usage
    del first
    limit = predicted + usage.device_bytes + usage.device_bytes // 2
    if cuda:
        limit = min(limit, int(0.8 * torch.cuda.mem_get_info(work.device)[0]))
    return limit, 2 * usage.saved_bytes + usage.saved_bytes // 5


def _admission(work: CensusWorkload, calibration: rt.Trainer, verdicts: Checks, cuda: bool) -> dict[str, Any]:
    """Several pending forwards under a small limit: predictions and the measured peak stay within it."""
    limit, host_limit = _calibrate(work, calibration, cuda)
    trainer = work.trainer(memory_limit_bytes=limit, host_memory_limit_bytes=host_limit)
    layers = work.model.model.layers
    census = StorageCensus(work.device)
    pending: list[list[rt.ForwardOutput]] = []

    def callers() -> list[torch.Tensor]:  # the caller's output leaves and committed grads are not the trainer's budget
        return [*(o.target_logprobs for outputs in pending for o in outputs), *committed_grads(trainer)]

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
    held: list[tuple[bool, str]] = []  # NOTE [Admission intersections] Rule 1, after every forward
    refused: str | None = None
    try:
        for k in range(_PENDING_FORWARDS):
            try:
                pending.append(trainer.forward(work.inputs(600 + k)))
            except rt.MemoryAdmissionError as error:
                refused = str(error)
                break
            decisions.append(pending[-1][0].decision)
            held.append(held_within_limits(trainer, limit, host_limit))
            census.measure(ignore=callers())
        while pending:
            trainer.backward(negative_logprob_sum(pending[0]))
            del pending[0]
            census.measure(ignore=callers())
    finally:
        for handle in handles:
            handle.remove()
    left = bytes_left(census, trainer, "admission: bytes after the last backward")
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
        "admission: held <= admitted after every forward",
        bool(held) and all(ok for ok, _ in held),
        "; ".join(f"forward {k}: {detail}" for k, (_, detail) in enumerate(held)) or "no forward admitted",
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


CHECKPOINT_STATE_CHECK = "admission: a forward beside a stepped checkpoint's state: held + state <= admitted"
INTERSECTION_CHECKS = (*(f"admission: {name}: held <= admitted" for name in SCENARIOS), CHECKPOINT_STATE_CHECK)


def _intersections(preset: Preset, verdicts: Checks, wanted: Collection[str] | None) -> dict[str, dict]:
    """NOTE [Admission intersections] Rules 2-3: each scenario (each of ``wanted``, when given) refused, or
    admitted within its limit."""
    values = {}
    for name, check in zip(SCENARIOS, INTERSECTION_CHECKS):
        if wanted is None or check in wanted:
            passed, detail, values[name] = check_scenario(preset, name)
            verdicts.check(check, passed, detail)
    if wanted is None or CHECKPOINT_STATE_CHECK in wanted:
        passed, detail, values["checkpoint state"] = check_checkpoint_budget(preset)
        verdicts.check(CHECKPOINT_STATE_CHECK, passed, detail)
    return values


def _lifecycle_and_admission(preset: Preset, verdicts: Checks, cuda: bool) -> dict[str, Any]:
    """The lifecycle points for every placement, offload's checks and the admission run (the module docstring)."""
    work = CensusWorkload(preset)
    lifecycle_trainer = work.trainer()
    calibration_trainer = work.trainer()
    # Warm up allocator, kernels and caches before any baseline is taken.
    warm = lifecycle_trainer.forward(work.inputs(0))
    lifecycle_trainer.backward(negative_logprob_sum(warm))
    del warm
    with frozen_heap():
        per = {p: lifecycle(work, lifecycle_trainer, p, verdicts, cuda) for p in PLACEMENTS}
        offload = offload_checks(per, verdicts, cuda)
        admission = _admission(work, calibration_trainer, verdicts, cuda)
    return {
        "lifecycle_bytes": {p: per[p].bytes_at for p in PLACEMENTS},
        "lifecycle_values": {p: per[p].values for p in PLACEMENTS},
        "offload": offload,
        "admission": admission,
    }


CUDA_CHECKS = (
    *(f"cuda: {p}: allocator back to baseline after backward" for p in PLACEMENTS),
    "cuda: offload: allocator bytes after forward fall to replay's floor",
    "cuda: admission: max_memory_allocated within the admitted budget",
)


def judge(run: CanaryRun) -> Judged:
    """The registry's entry point: the canary on ``run.preset`` (on CUDA its memory estimate checked first).

    ``run.checks`` (the mutation suite's focused runs, NOTE [Mutation verdicts]
    Rule 4): when every one is an intersection check (:data:`INTERSECTION_CHECKS`)
    or a logical-rank scale check (``scale.SCALE_CHECKS``) only those run;
    otherwise the whole canary runs. A failed check is not an
    exception: read ``passed`` in the record.
    """
    preset, profile, checks = run.preset, run.profile, run.checks
    if preset.device == "cuda":
        check_fits(preset, oracle=False, echo=run.echo)
    cuda = preset.cuda_checks
    verdicts = Checks(echo=run.echo)
    focused = set(INTERSECTION_CHECKS) | set(SCALE_CHECKS)
    whole = checks is None or not set(checks) <= focused
    run.echo(f"memory canary: preset {preset.name} on {preset.device}")
    measurements: dict[str, Any] = {}
    # The caller's RNG streams are left as they were.
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        torch.manual_seed(0)
        if whole:
            measurements.update(_lifecycle_and_admission(preset, verdicts, cuda))
        if whole or set(checks) & set(INTERSECTION_CHECKS):
            with frozen_heap():
                measurements["admission_intersections"] = _intersections(preset, verdicts, None if whole else checks)
        if (whole and profile != "quick") or (not whole and set(checks) & set(SCALE_CHECKS)):
            measurements["logical_rank_scale"] = scale_check(profile, verdicts)
        elif whole:  # spawned ranks cost seconds: the quick profile (rtv run on cpu) leaves them to the deeper ones
            for name in SCALE_CHECKS:
                verdicts.skip(
                    name,
                    f"profile {profile!r}: rtv canary memory --profile default runs it "
                    "(L up to 64, W up to 4, full and LoRA)",
                )
    if whole and not cuda:
        reason = (
            f"no CUDA device: preset {preset.name!r} swapped for the CPU"
            if preset.swapped
            else f"preset {preset.name!r} runs on {preset.device}"
        )
        for name in CUDA_CHECKS:
            verdicts.skip(name, reason)
    return Judged(
        KIND,
        {
            **preset.describe(),
            "profile": profile,
            "placements": list(PLACEMENTS),
            "points": list(POINTS),
            "checks": None if whole else list(checks),
        },
        verdicts,
        measurements,
    )
