"""``rtv bench --sweep``: how the versioned step's cost grows with the shape, and a fit of it.

NOTE [Cost growth]
1. Grid: sequence length x batch on the preset's model (:data:`GRIDS`; CPU:
   64..1024 tokens per sequence, batch 1, 4, 8 in ``nightly``, a small grid
   otherwise). At each shape every arm is compared with ``plain`` through
   ``validation.abba.compare`` (its own blocks and looks, arms built fresh per
   shape), so each point has a ratio with its interval.
2. Fit: per arm (``plain`` included), the median step seconds at each shape
   (over the blocks the load probe kept; a shape with none is left out of
   the fit and named in ``left_out``) is fitted as
   ``fixed + per_token * B*T + per_token2 * B*T**2`` by non-negative least squares (``scipy.optimize.nnls``: a cost is never
   negative), with the residuals kept. A fixed per-step cost shows as a ratio
   falling with tokens, a per-token one as a flat ratio, a ``T**2`` one
   (attention scores saved) as a rising one.
3. The fit's ratio at other token counts (:func:`predicted_ratio`) is a
   model, not a measurement, and is labelled so wherever it is shown.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict

import numpy as np
from scipy.optimize import nnls

from validation.abba import LoadProbe, compare
from validation.evidence import Checks

from ..registry import Judged
from .arms import TimedWorkload
from .canary import WARMUP_BLOCKS, Builder, Group, build_arms

__all__ = ["KIND", "GRIDS", "TERMS", "fit", "predicted_ratio", "judge"]

KIND = "benchmark-sweep"
TERMS = ("fixed", "per_token", "per_token2")
# profile -> (sequence lengths, batches, arms, max blocks per shape, budget seconds for the whole sweep)
GRIDS = {
    "quick": ((32, 128), (1, 4), ("retain@s0",), 8, 30.0),
    "default": ((64, 256), (1, 4), ("retain@s0", "replay@s0"), 16, 90.0),
    "nightly": ((64, 128, 256, 512, 1024), (1, 4, 8),
                tuple(f"{p}@s{s}" for s in (0, 2) for p in ("retain", "offload", "replay")), 32, 1200.0),
}


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


def judge(preset: str, profile: str, *, model: str = "small", gate: float = 0.05, seed: int = 0,
          clock: Callable[[], float] = time.perf_counter, load_probe: LoadProbe | None = None,
          build: Builder = build_arms) -> Judged:
    """Run the grid of ``profile`` (Rule 1) on ``model`` and fit each arm (Rule 2); the caller records it.

    ``clock``, ``load_probe`` and ``build`` are as ``canary.judge``'s (tests fake them).
    """
    lengths, batches, arms, max_blocks, budget = GRIDS[profile]
    shapes = [(b, t) for t in lengths for b in batches]
    points = []
    for batch, length in shapes:
        workload = TimedWorkload(model=model, sequences=batch, seq_len=length)
        built = build(Group(workload, ("plain", *arms), False), seed)
        results = compare(built, baseline="plain", gate=gate, max_blocks=max_blocks, budget_s=budget / len(shapes),
                          warmup_blocks=WARMUP_BLOCKS, clock=clock, load_probe=load_probe)
        points.append({"workload": asdict(workload), "label": workload.label, "batch": batch, "seq_len": length,
                       "tokens": workload.tokens, "comparisons": [r.as_dict() for r in results]})
        built.clear()
    fits = {arm: _fit_arm(points, arm) for arm in ("plain", *arms)}
    checks = Checks()
    fitted = all(np.isfinite(f["fixed"]) for f in fits.values())
    checks.check("every arm's costs were fitted", fitted,
                 "; ".join(f"{a}: {len(f['left_out'])} shapes fully loaded" for a, f in fits.items()))
    return Judged(KIND, {"preset": preset, "profile": profile, "model": model, "gate": gate, "seed": seed,
                         "arms": list(arms), "terms": list(TERMS), "lengths": list(lengths), "batches": list(batches),
                         "note": "the fit's predictions are a model, not a measurement"},
                  checks, {"points": points, "fits": fits})
