"""The cost-growth sweep: how the versioned step's cost grows with the shape, and a fit of it.

NOTE [Cost growth]
1. Grid (:func:`plan`): sequence length x batch on the preset's model
   (:data:`CPU_GRIDS` on ``cpu``, :data:`GPU_LENGTHS` on a GPU preset; one
   without CUDA runs ``tiny`` CPU shapes and says so, ``swapped``). At each
   shape every arm is compared with ``plain`` by ``validation.abba.compare``,
   so each point is a ratio with its interval; first, every arm's first loss
   must equal plain's: like with like, the sweep's one check that reads no
   clock.
2. Fit: per arm, the median step seconds per shape (load-flagged blocks left
   out; a shape with none is named in ``left_out``, and too few shapes for the
   terms skips the check as ``inconclusive (loaded: ...)``, NOTE [Machine
   load] Rule 4) is fitted as ``fixed + per_token * B*T + per_token2 *
   B*T**2`` by ``scipy.optimize.nnls``, as a cost is never negative. The terms
   say where a versioned step's cost comes from (a falling, flat or rising
   ratio); a grid of one batch and three lengths fits exactly, so its zero
   residuals are no sign of a good fit.
3. The fit's ratio at other shapes (:data:`MODEL_SHAPES`) is a model, not a
   measurement, and is labelled so wherever shown: on a CPU record it
   extrapolates ``small``'s CPU costs and says nothing of another device.
4. Budget: a shape's share of ``budget_s`` is proportional to its block bound
   (:func:`block_bound`), and ``compare`` stops a shape whose share is spent.
   On ``cpu`` the planned blocks fit the budget under that bound
   (:func:`seconds_bound`, tested), so the budget binds only on a machine
   slower than the bound. ``rtv bench`` gives the sweep what its profile's
   budget leaves after the benchmark, less :data:`OUTSIDE_S`
   (:func:`budget_left`), never more than the plan's: on a machine loaded
   about 4x the benchmark alone took 250 s of the 300.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from scipy.optimize import nnls

from validation.abba import LoadMeter, LoadProbe, compare
from validation.errors import SetupError
from validation.evidence import Checks
from validation.load import inconclusive

from ..registry import Judged
from .arms import TimedWorkload, device_clock
from .canary import WARMUP_BLOCKS, Builder, Group, agree, build_arms, first_losses

__all__ = [
    "KIND",
    "CPU_GRIDS",
    "GPU_LENGTHS",
    "MODEL_SHAPES",
    "STEP_BOUND",
    "ARM_FACTOR",
    "TERMS",
    "SweepPlan",
    "RUN_BUDGETS_S",
    "OUTSIDE_S",
    "MIN_BUDGET_S",
    "plan",
    "block_bound",
    "seconds_bound",
    "budget_left",
    "fit",
    "predicted_ratio",
    "measure",
]

KIND = "benchmark-sweep"
TERMS = ("fixed", "per_token", "per_token2")
_EVERY = tuple(f"{p}@s{s}" for s in (0, 2) for p in ("retain", "offload", "replay"))
_ARMS = {"quick": ("retain@s0",), "default": ("retain@s0", "replay@s0"), "nightly": _EVERY}
# profile -> (sequence lengths, batches, max blocks per shape, budget seconds for the whole sweep), on `small`
CPU_GRIDS = {
    "quick": ((32, 128), (1, 4), 8, 30.0),
    "default": ((32, 128), (1, 4), 8, 64.0),
    "nightly": ((64, 128, 256, 512, 1024), (1, 4, 8), 16, 3600.0),
}
GPU_LENGTHS = (1024, 2048, 4096)  # at batch 4, like the seed's figures
_GPU_BLOCKS = {"quick": (8, 120.0), "default": (16, 600.0), "nightly": (32, 1800.0)}  # max blocks, budget seconds
MODEL_SHAPES = ((4, 1024), (4, 4096))  # the GPU presets' qwen3_8b shapes, batch x length
_MODEL_LENGTHS = tuple(2**k for k in range(4, 13))  # 16 .. 4096, at batch 4: the fit's curve in the report
# A plain step of `small` (float32, one thread) on the 2-core development machine, an upper bound in seconds:
# fixed, per token (B*T), per B*T**2. Measured busy (other jobs on the cores), plain at 1x64 0.05, 4x64 0.13-0.17,
# 4x256 0.36-0.39, 8x512 1.8-2.7; the bound is above every one of those.
STEP_BOUND = (0.05, 4.5e-4, 4e-7)
RUN_BUDGETS_S = {"default": 300.0}  # rtv bench, the sweep included (docs/harness.md#time-budgets); nightly has none
OUTSIDE_S = 30.0  # rtv bench outside its benchmark and sweep: imports before, records and the report after
MIN_BUDGET_S = 1.0  # a sweep with nothing left still runs each shape's warm-up and one block (compare's minimum)
ARM_FACTOR = 2.0  # a versioned step <= 2 plain ones: replay's floor 1 + F/(F+B) < 2; retain and offload measured below


@dataclass(frozen=True)
class SweepPlan:
    """The shapes (``workloads``, length-major), the arms compared with plain, blocks and budget; see the NOTE."""

    workloads: tuple[TimedWorkload, ...]
    arms: tuple[str, ...]
    max_blocks: int
    budget_s: float
    swapped: bool  # a GPU preset on a machine without CUDA: tiny CPU shapes instead


def _grid(lengths, batches, **workload) -> tuple[TimedWorkload, ...]:
    return tuple(TimedWorkload(sequences=b, seq_len=t, **workload) for t in lengths for b in batches)


def plan(preset: str, profile: str, *, cuda: bool | None = None) -> SweepPlan:
    """Rule 1's grid of ``preset`` x ``profile``; ``cuda``: whether the machine has CUDA (``None``: this one's)."""
    if profile not in _ARMS:
        raise SetupError(f"unknown profile {profile!r}", fix=f"use one of {', '.join(_ARMS)}")
    arms = _ARMS[profile]
    if preset == "cpu":
        lengths, batches, max_blocks, budget = CPU_GRIDS[profile]
        return SweepPlan(_grid(lengths, batches, model="small"), arms, max_blocks, budget, False)
    if preset not in ("gpu", "gpu-8b"):
        raise SetupError(f"unknown preset {preset!r}", fix="use one of cpu, gpu, gpu-8b")
    if not (torch.cuda.is_available() if cuda is None else cuda):
        lengths, batches, max_blocks, budget = CPU_GRIDS["quick"]
        return SweepPlan(_grid(lengths, batches, model="tiny", lora=True), arms, max_blocks, budget, True)
    model = "small" if preset == "gpu" else "qwen3_8b"
    max_blocks, budget = _GPU_BLOCKS[profile]
    workloads = _grid(GPU_LENGTHS, (4,), model=model, lora=True, dtype="bfloat16", device="cuda")
    return SweepPlan(workloads, arms, max_blocks, budget, False)


def block_bound(workload: TimedWorkload, arms: tuple[str, ...]) -> float:
    """Rule 4: seconds of one block at ``workload`` (plain and ``arms`` twice each) under :data:`STEP_BOUND`."""
    b, t = workload.sequences, workload.seq_len
    step = float(np.dot(STEP_BOUND, (1.0, b * t, b * float(t) ** 2)))
    return 2 * step * (1 + ARM_FACTOR * len(arms))


def seconds_bound(sweep: SweepPlan) -> float:
    """Rule 4: every planned block of ``sweep`` (warm-up included) at :func:`block_bound`."""
    return (WARMUP_BLOCKS + sweep.max_blocks) * sum(block_bound(w, sweep.arms) for w in sweep.workloads)


def budget_left(preset: str, profile: str, spent_s: float) -> float:
    """Rule 4: the sweep's budget once ``rtv bench``'s benchmark took ``spent_s``; the plan's at most.

    Only ``cpu`` profiles with a run budget (``default``) are cut; a GPU
    preset or ``nightly`` gets the plan's. With nothing left,
    :data:`MIN_BUDGET_S` (each shape then runs its warm-up and one block).
    """
    planned = plan(preset, profile).budget_s
    if preset != "cpu" or profile not in RUN_BUDGETS_S:
        return planned
    return min(planned, max(MIN_BUDGET_S, RUN_BUDGETS_S[profile] - spent_s - OUTSIDE_S))


def _design(batches: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.column_stack([np.ones(len(batches)), batches * lengths, batches * lengths.astype(float) ** 2])


def fit(batches, lengths, seconds) -> dict:
    """Rule 2 for one arm: ``{"fixed", "per_token", "per_token2", "residuals"}`` (seconds; residuals per shape)."""
    batches, lengths, seconds = (np.asarray(v, dtype=float) for v in (batches, lengths, seconds))
    design = _design(batches, lengths)
    scale = design.max(axis=0)  # columns of similar size, so nnls is well conditioned
    coefficients, _ = nnls(design / scale, seconds)
    coefficients = coefficients / scale
    return {**dict(zip(TERMS, coefficients.tolist())), "residuals": (seconds - design @ coefficients).tolist()}


def predicted_ratio(arm: dict, plain: dict, batch: int, length: int) -> float:
    """Rule 3: the fitted arm's step time over the fitted plain's at ``batch`` x ``length`` (a model)."""
    row = _design(np.array([batch], float), np.array([length], float))[0]
    return float(row @ [arm[t] for t in TERMS] / (row @ [plain[t] for t in TERMS]))


def _model(fits: dict[str, dict]) -> dict:
    """Rule 3: each arm's fitted ratio along batch 4 x :data:`_MODEL_LENGTHS` and at :data:`MODEL_SHAPES`."""
    arms = [a for a in fits if a != "plain"]
    return {
        "note": "model, not a measurement",
        "batch": 4,
        "lengths": list(_MODEL_LENGTHS),
        "ratios": {a: [predicted_ratio(fits[a], fits["plain"], 4, t) for t in _MODEL_LENGTHS] for a in arms},
        "shapes": [
            {"batch": b, "seq_len": t, "ratios": {a: predicted_ratio(fits[a], fits["plain"], b, t) for a in arms}}
            for b, t in MODEL_SHAPES
        ],
    }


def _median_seconds(point: dict, arm: str) -> float:
    """``arm``'s median step seconds at ``point`` over the blocks the load probe kept; NaN when it kept none."""
    first = point["comparisons"][0]
    kept = [i for i in range(len(first["ratios"])) if i not in set(first["loaded"])]
    if arm == "plain":
        values = first["baseline_seconds"]
    else:
        values = next(c for c in point["comparisons"] if c["arm"] == arm)["arm_seconds"]
    return float(np.median([values[i] for i in kept])) if kept else float("nan")


def _fit_arm(points: list[dict], arm: str) -> dict:
    """Rule 2 for ``arm`` over the points with a measured median (a fully loaded shape is left out, and named)."""
    rows = [(p["batch"], p["seq_len"], _median_seconds(p, arm)) for p in points]
    used = [r for r in rows if np.isfinite(r[2])]
    left_out = [f"{b}x{t}" for b, t, s in rows if not np.isfinite(s)]
    if len(used) < len(TERMS):
        return {**dict.fromkeys(TERMS, float("nan")), "residuals": [], "left_out": left_out}
    return {**fit(*zip(*used)), "left_out": left_out}


def _checks(points: list[dict], fits: dict[str, dict]) -> Checks:
    """Like with like at every shape (no clock); the fit, skipped as loaded when loaded shapes left too few (Rule 2)."""
    checks = Checks()
    unlike = [p["label"] for p in points if not p["arms_agree"]]
    checks.check(
        "at every shape, every arm's first loss equals plain's",
        not unlike,
        f"first losses differ at {', '.join(unlike)}" if unlike else "first losses agree",
    )
    name = "every arm's costs were fitted"
    left_out = sorted({shape for f in fits.values() for shape in f["left_out"]})
    if all(np.isfinite(f["fixed"]) for f in fits.values()):
        checks.check(
            name,
            True,
            f"{len(points) - len(left_out)} of {len(points)} shapes fitted"
            + (f"; fully loaded, left out: {', '.join(left_out)}" if left_out else ""),
        )
    else:
        loads = [p["comparisons"][0]["load"] for p in points if f"{p['batch']}x{p['seq_len']}" in left_out]
        checks.skip(
            name,
            inconclusive(
                f"{len(left_out)} of {len(points)} shapes fully loaded ({'; '.join(loads)}), "
                f"fewer than the {len(TERMS)} terms need"
            ),
        )
    return checks


def measure(
    preset: str,
    profile: str,
    *,
    gate: float = 0.05,
    seed: int = 0,
    budget_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    load_probe: LoadProbe | None = None,
    meter: LoadMeter | None = None,
    build: Builder = build_arms,
) -> Judged:
    """Run :func:`plan`'s grid (Rule 1) and fit each arm (Rule 2); the caller records it (kind ``benchmark-sweep``).

    ``budget_s``: seconds for the whole sweep instead of the plan's (``rtv
    bench`` passes :func:`budget_left`). ``clock``, ``load_probe``,
    ``meter`` and ``build`` are as ``canary.measure``'s (tests fake them). Raises
    :class:`SetupError` for an unknown preset or profile.
    """
    sweep = plan(preset, profile)
    if budget_s is not None:
        sweep = dataclasses.replace(sweep, budget_s=budget_s)
    bounds = [block_bound(w, sweep.arms) for w in sweep.workloads]
    started, points = time.perf_counter(), []
    for workload, bound in zip(sweep.workloads, bounds):
        built = build(Group(workload, ("plain", *sweep.arms), False), seed)
        losses = first_losses(built)
        results = compare(
            built,
            baseline="plain",
            gate=gate,
            max_blocks=sweep.max_blocks,
            budget_s=sweep.budget_s * bound / sum(bounds),
            warmup_blocks=WARMUP_BLOCKS,
            clock=device_clock(workload.device, clock),
            load_probe=load_probe,
            meter=meter,
        )
        points.append(
            {
                "workload": asdict(workload),
                "label": workload.label,
                "batch": workload.sequences,
                "seq_len": workload.seq_len,
                "tokens": workload.tokens,
                "first_losses": losses,
                "arms_agree": agree(losses, workload.dtype),
                "comparisons": [r.as_dict() for r in results],
            }
        )
        built.clear()
    fits = {arm: _fit_arm(points, arm) for arm in ("plain", *sweep.arms)}
    checks = _checks(points, fits)
    fitted = all(np.isfinite(f["fixed"]) for f in fits.values())
    first = sweep.workloads[0]
    return Judged(
        KIND,
        {
            "preset": preset,
            "profile": profile,
            "model": first.model,
            "device": first.device,
            "gate": gate,
            "seed": seed,
            "arms": list(sweep.arms),
            "terms": list(TERMS),
            "lengths": sorted({w.seq_len for w in sweep.workloads}),
            "batches": sorted({w.sequences for w in sweep.workloads}),
            "max_blocks": sweep.max_blocks,
            "budget_s": sweep.budget_s,
            "seconds_bound": seconds_bound(sweep) if preset == "cpu" else None,
            "swapped_for_cpu": sweep.swapped,
            "note": "the fit's predictions are a model, not a measurement",
        },
        checks,
        {
            "points": points,
            "fits": fits,
            "model": _model(fits) if fitted else None,
            "seconds": time.perf_counter() - started,
        },
    )
