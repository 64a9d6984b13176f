"""The planner's misses, reported as they happen: saved bytes above their estimate, a refusal, a failed allocation.

NOTE [Planner misses]
  1. A miss is reported to every observer in force (:func:`observe_planner_misses`,
     innermost and outer alike; none: nothing is built). Three kinds:
     ``"saved_bytes_exceeded"`` (a forward's measured saved bytes, from its
     saved-state ledger, above the saved bytes its plan admitted),
     ``"refused"`` (admission raised ``MemoryAdmissionError``; the refused
     forward's estimate, the error's text) and ``"allocation_failed"`` (an
     admitted forward, or a replay at backward, raised
     ``torch.OutOfMemoryError``: that forward's estimate, the error's text;
     the error is then raised on, as a forward's own error, wrapped in
     ``GradientCommitError`` by a backward, :func:`allocation_failures_reported`).
     A failed forward call leaves the trainer as it was (its records
     released, the RNG set back); a pending retained record the call's
     admission demoted stays demoted (NOTE [Memory admission] Rule 6: where
     it lives changed, not what its backward computes).
  2. A miss carries the estimator's inputs as plain numbers (the model's and
     LoRA's fields, the batch, the length, the learned scale and speed, the
     bandwidth, the snapshot and staging bytes): :func:`replay_estimate`
     recomputes the estimate from them alone, on a CPU, with no model.
  3. Observers see the miss and may write it down (the harness writes a
     write-once, verified evidence record, ``validation.misses``); an
     observer that raises is the caller's error, raised from the forward
     after the trainer's state is as the call leaves it (a refusal still
     refuses).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from . import seams
from .lora import LoRAConfig
from .model import ModelConfig
from .planner import estimate_forward_cost

__all__ = ["PlannerMiss", "allocation_failures_reported", "observe_planner_misses", "replay_estimate", "plain_inputs"]


@dataclass(frozen=True)
class PlannerMiss:
    """One miss (NOTE [Planner misses]): its kind, the estimator's plain inputs, the estimate, what was found."""

    kind: str  # "saved_bytes_exceeded" | "refused" | "allocation_failed"
    inputs: dict[str, Any]
    estimate: int  # the saved bytes the plan estimated
    measured: int | None  # the saved bytes measured ("saved_bytes_exceeded")
    raised: str | None  # the error's text ("refused", "allocation_failed")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plain_inputs(config: ModelConfig, estimator: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``estimate_forward_cost`` (and its ``config``) as plain JSON numbers (Rule 2)."""
    model = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    model["dtype"] = str(config.dtype).removeprefix("torch.")
    lora, autocast = estimator.get("lora"), estimator.get("autocast")
    return {
        **estimator,
        "config": model,
        "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
        "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)},
    }


def replay_estimate(inputs: Mapping[str, Any]) -> int:
    """The saved bytes ``estimate_forward_cost`` gives for a miss's plain ``inputs`` (Rule 2)."""
    model = dict(inputs["config"])
    config = ModelConfig(**{**model, "dtype": getattr(torch, model["dtype"])})
    lora = inputs["lora"]
    rest = {k: v for k, v in inputs.items() if k not in ("config", "lora", "autocast")}
    autocast = inputs.get("autocast")
    rest["autocast"] = None if autocast is None else getattr(torch, autocast)
    lora_config = (
        None if lora is None else LoRAConfig(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]))
    )
    return estimate_forward_cost(config, lora=lora_config, **rest).saved_bytes


@contextmanager
def observe_planner_misses(observer: Callable[[PlannerMiss], None]) -> Iterator[Callable[[PlannerMiss], None]]:
    """Within the block, every planner miss of every trainer is passed to ``observer`` (Rule 1)."""
    with seams.planner_miss_observers.pushed(observer):
        yield observer


@contextmanager
def allocation_failures_reported(
    config: ModelConfig, estimator: Mapping[str, Any] | None, estimate: int
) -> Iterator[None]:
    """A ``torch.OutOfMemoryError`` raised in the block is reported as an ``"allocation_failed"`` miss of the forward
    estimated from ``estimator`` (``None``: unplanned, nothing to report), then raised on (Rule 1)."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        if estimator is not None:
            report("allocation_failed", config, estimator, estimate, raised=str(error))
        raise


def report(
    kind: str,
    config: ModelConfig,
    estimator: Mapping[str, Any],
    estimate: int,
    *,
    measured: int | None = None,
    raised: str | None = None,
) -> None:
    """Tell every observer in force of a miss; builds nothing when none is (Rule 1)."""
    observers = list(seams.planner_miss_observers)
    if not observers:
        return
    miss = PlannerMiss(kind, plain_inputs(config, estimator), estimate, measured, raised)
    for observer in observers:
        observer(miss)
