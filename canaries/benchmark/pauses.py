"""Pause costs: what a save, a load, a forward demoted to offload and a weight publication cost training.

NOTE [Pause costs]
  1. Arms, each in alternating blocks against ``step`` (the versioned
     ``retain@s0`` step on the benchmark's first workload;
     ``validation.abba.compare``, NOTE [Alternating blocks]) so drift cancels
     and loaded blocks drop: ``save`` (``trainer.save`` into a scratch
     folder, each save removing the one before), ``load`` (``Trainer.load`` of
     it over the same base model), ``offload`` (the step with every forward's
     state offloaded: what the planner's demotion costs) and ``publish`` (the
     step, then ``trainer.publish`` of its version to a ``RolloutEngine`` in
     ``"drain"`` mode with nothing generating). A publication must be newer
     than what the engine serves (NOTE [Weight publication] Rule 3), so each
     follows its own step and its pause is ``publish``'s extra over ``step``.
  2. Reading: each arm's cost is its median ratio to the step with that
     ratio's interval (a save at 0.8 [0.7, 0.9] pauses training for 0.8 of a
     step), and its median seconds with their order-statistic interval
     (``validation.stats.median_ci``). The demotion's cost is ``offload``'s
     extra seconds over ``step``, the publication's ``publish``'s. ``bytes``
     is what one save writes, ``published_bytes`` what one publication sends
     (``PublicationReport.nbytes``). No verdict: a pause has no baseline to
     tie with.
  3. A run the load cut short reads ``inconclusive (loaded: ...)``, as every
     comparison does, and keeps whatever blocks it has.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import reference_trainer as rt
from validation import stats
from validation.abba import Comparison, LoadMeter, LoadProbe, compare

from .arms import TimedArm, TimedWorkload, base_model, device_clock, versioned_arm

__all__ = ["PAUSE_ARMS", "PAUSE_BLOCKS", "measure_pauses", "publishing", "saved_bytes"]

PAUSE_ARMS = ("save", "load", "offload", "publish")
PAUSE_BLOCKS = {"quick": (8, 10.0), "default": (16, 30.0), "nightly": (32, 120.0)}  # (max blocks, budget s)


def saved_bytes(folder: Path) -> int:
    """The bytes of the save in force under ``folder`` (the one ``LATEST`` names, NOTE [Durable saves] Rule 1)."""
    latest = (folder / "LATEST").read_text().split()[0]
    return sum(p.stat().st_size for p in (folder / latest).iterdir() if p.is_file())


def publishing(step: TimedArm, engine: rt.RolloutEngine) -> Callable[[], rt.PublicationReport]:
    """Rule 1's ``publish``: ``step``, then its trainer's ``"policy"`` at the version that step made, into ``engine``.

    Each call publishes a newer revision, so the engine's compare-and-set
    never refuses it (a ``VersionConflictError`` would mean something else
    published to ``engine``); with nothing generating on ``engine`` the
    drained publication switches at once.
    """
    trainer = step.trainer

    def run() -> rt.PublicationReport:
        step()
        return trainer.publish(engine, checkpoint="policy", mode="drain")

    return run


def _median(values: np.ndarray) -> float:
    return float(np.median(values)) if values.size else float("nan")


def _kept(result: Comparison) -> np.ndarray:
    """Which measured blocks the statistics use (not loaded, NOTE [Alternating blocks] Rule 4)."""
    keep = np.ones(len(result.ratios), dtype=bool)
    keep[list(result.loaded)] = False
    return keep


def _summary(result: Comparison) -> dict:
    """Rule 2: the arm's ratio to the step and its seconds, each with its interval."""
    keep = _kept(result)
    seconds, step = np.asarray(result.arm_seconds)[keep], np.asarray(result.baseline_seconds)[keep]
    low, high = stats.median_ci(seconds, result.confidence) if seconds.size else (np.nan, np.nan)
    extra_low, extra_high = stats.median_ci(seconds - step, result.confidence) if seconds.size else (np.nan, np.nan)
    return {
        "arm": result.arm,
        "blocks": result.blocks,
        "ratio": result.ratio,
        "ratio_ci": list(result.ci95),
        "seconds": _median(seconds),
        "seconds_ci": [float(low), float(high)],
        "extra_seconds": _median(seconds - step),
        "extra_seconds_ci": [float(extra_low), float(extra_high)],
        "confidence": result.confidence,
        "loaded": list(result.loaded),
        "reading": result.reading if result.load else "measured",
    }  # Rule 2: no verdict; Rule 3: a loaded run


def measure_pauses(
    workload: TimedWorkload,
    profile: str,
    *,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    load_probe: LoadProbe | None = None,
    meter: LoadMeter | None = None,
) -> dict:
    """Rule 1's arms on ``workload``, compared in blocks;
    ``{"workload", "step_seconds", "bytes", "published_bytes", "arms": [...]}``."""
    max_blocks, budget_s = PAUSE_BLOCKS[profile]
    model = base_model(workload, seed) if workload.lora else None
    step = versioned_arm(workload, "retain", 0, seed=seed, model=model)
    offload = versioned_arm(workload, "offload", 0, seed=seed, model=model)
    trainer = step.trainer
    publish = publishing(step, rt.RolloutEngine(trainer.model))
    with tempfile.TemporaryDirectory(prefix="rtv-pauses-") as scratch:
        folder = Path(scratch) / "save"
        arms = {
            "step": step,
            "save": lambda: trainer.save(folder),
            "load": lambda: rt.Trainer.load(folder, trainer.model),
            "offload": offload,
            "publish": publish,
        }
        sent = publish().nbytes  # the engine serves a version before the first block; one publication's bytes
        trainer.save(folder)  # load has a save to read from the first block on
        results = compare(
            arms,
            baseline="step",
            gate=0.05,
            max_blocks=max_blocks,
            budget_s=budget_s,
            clock=device_clock(workload.device, clock),
            load_probe=load_probe,
            meter=meter,
        )
        written = saved_bytes(folder)
    by_arm = {r.arm: _summary(r) for r in results}
    return {
        "workload": workload.label,
        "bytes": written,
        "published_bytes": sent,
        "max_blocks": max_blocks,
        "budget_s": budget_s,
        "step_seconds": _median(np.asarray(results[0].baseline_seconds)[_kept(results[0])]),
        "arms": [by_arm[name] for name in PAUSE_ARMS],
    }
