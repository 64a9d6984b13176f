"""What one benchmark run measures: its groups of arms per workload, its block and time budgets (:func:`plan`).

The plan of ``canaries.benchmark.canary`` for a preset name and a profile:
the gated comparisons (``retain@s0`` and ``replay@s0`` against ``plain``) in
groups of their own, first (:func:`split_gated`), the other arms after,
reported only; a GPU preset on a machine without CUDA runs tiny CPU shapes,
ungated, and says so (``Plan.swapped``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from validation.errors import SetupError

from ..presets import PLACEMENT_REQUESTS
from . import profiling
from .arms import TimedWorkload, arm_name

__all__ = ["GATED", "Group", "Plan", "plan", "split_gated"]

GATED = ("retain@s0", "replay@s0")


@dataclass(frozen=True)
class Group:
    """One workload and the arms compared on it (``plain`` first); ``gated``: whether its gates are enforced.

    ``part``: which arms of the workload a split group holds (``"gated"`` or
    ``"other arms"``, see :func:`split_gated`); empty for a group of them all.
    """

    workload: TimedWorkload
    arms: tuple[str, ...]
    gated: bool
    part: str = ""

    @property
    def label(self) -> str:
        return f"{self.workload.label} · {self.part}" if self.part else self.workload.label


def split_gated(workload: TimedWorkload, arms: tuple[str, ...]) -> tuple[Group, ...]:
    """The gated comparisons in blocks of their own, first; the other arms after, reported only.

    Arms in one process share its allocator and caches: measured here on
    ``small`` 4x64, running the six other arms in the same blocks moved
    ``retain@s0 / plain`` from about 1.03 to about 1.06, an artifact no single
    training job has. So a gate is decided on arms built fresh, with only the
    arms it needs (``plain``, ``retain@s0``, ``replay@s0``), before any other
    arm has run.
    """
    gated = ("plain", *(a for a in arms if a in GATED))
    others = ("plain", *(a for a in arms if a != "plain" and a not in GATED))
    groups = [Group(workload, gated, True, "gated")]
    if len(others) > 1:
        groups.append(Group(workload, others, False, "other arms"))
    return tuple(groups)


@dataclass(frozen=True)
class Plan:
    groups: tuple[Group, ...]
    max_blocks: int
    budget_s: float
    swapped: bool  # a GPU preset on a machine without CUDA: CPU shapes instead
    profiled_blocks: int = profiling.PROFILED_BLOCKS  # NOTE [Profiled blocks]; 0: no profile, no traces


def _arms(placements: tuple[str, ...], stalenesses: tuple[int, ...]) -> tuple[str, ...]:
    return ("plain", *(arm_name(p, s) for s in stalenesses for p in placements))


def plan(preset: str, profile: str) -> Plan:
    """What ``preset`` x ``profile`` runs (sized so ``rtv bench`` stays within docs/harness.md#time-budgets here)."""
    quick, nightly = profile == "quick", profile == "nightly"
    every = _arms(PLACEMENT_REQUESTS, (0, 2))
    if preset == "cpu":
        small = TimedWorkload(model="small", sequences=4, seq_len=64)
        if quick:
            return Plan((Group(small, _arms(("retain", "replay"), (0,)), True),), 32, 35.0, False)
        if not nightly:
            return Plan(split_gated(small, every), 64, 200.0, False)
        others = tuple(
            Group(TimedWorkload(model=m, sequences=4, seq_len=64, lora=lora), every, False)
            for m, lora in (("small", True), ("tiny", False), ("tiny", True))
        )
        return Plan(split_gated(small, every) + others, 64, 1200.0, False)
    if preset not in ("gpu", "gpu-8b"):
        raise SetupError(f"unknown preset {preset!r}", fix="use one of cpu, gpu, gpu-8b")
    if not torch.cuda.is_available():  # the GPU code path on CPU shapes, said in the evidence
        tiny = TimedWorkload(model="tiny", sequences=4, seq_len=64, lora=True)
        arms = _arms(("retain", "replay"), (0,)) if quick else every
        # Not gated: the fixed per-step cost dominates a tiny step; the gates are for the real shapes.
        return Plan((Group(tiny, arms, False),), 16 if quick else 32, 40.0 if quick else 120.0, True)
    cuda = dict(lora=True, dtype="bfloat16", device="cuda")
    arms = _arms(("retain", "replay"), (0,)) if quick else (every if nightly else _arms(PLACEMENT_REQUESTS, (0,)))
    if preset == "gpu":
        return Plan(
            split_gated(TimedWorkload(model="small", sequences=4, seq_len=1024, **cuda), arms), 64, 300.0, False
        )
    groups = split_gated(TimedWorkload(model="qwen3_8b", sequences=4, seq_len=1024, **cuda), arms) + (
        Group(TimedWorkload(model="qwen3_8b", sequences=4, seq_len=4096, **cuda), arms, False),
    )
    return Plan(groups, 32 if quick else 64, 300.0 if quick else 900.0, False)
