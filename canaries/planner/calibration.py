"""Calibration of the planner's cost model on paired, within-cell deltas.

NOTE [Planner calibration]
  1. An arm's extra seconds are linear in its features: bytes moved (both
     transfers of offload), tokens replayed, records offloaded or replayed
     (a per-record overhead): ``features · constants``, the constants
     (seconds per byte, per token, per record) non-negative.
  2. Within one cell every pair of timed forced arms gives one row: the
     difference of their features against the median of their per-block
     time differences (paired, so what the arms share, and the drift the
     alternating blocks cancel, is out). The constants are the non-negative
     least-squares fit of those rows (``scipy.optimize.nnls``).
  3. The gate is held out: fitted on one half of the cells (even positions),
     the fitted prices order the other half's pairs that are apart (NOTE
     [Planner certificate] Rule 2), at least ``HELD_OUT_GATE`` of them.
  4. Only cells that were not loaded (NOTE [Planner certificate] Rule 9) are
     fitted or judged; with no pair apart the gate has nothing to judge, and
     when loaded cells were left out it says so: ``inconclusive (loaded: ...)``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from .certificate import TIMING_CHECKS, CellResult, cell_verdict

__all__ = ["FEATURES", "HELD_OUT_GATE", "fit", "priced", "held_out", "held_out_check"]

FEATURES = ("seconds_per_byte", "seconds_per_token", "seconds_per_record")
HELD_OUT_GATE = 0.90


def _rows(cells: Sequence[CellResult]) -> tuple[np.ndarray, np.ndarray]:
    rows, deltas = [], []
    for cell in cells:
        for a, b in itertools.combinations(cell.admitted, 2):
            rows.append(np.subtract(cell.features[a], cell.features[b]))
            deltas.append(float(np.median(np.subtract(cell.seconds[a], cell.seconds[b]))))
    return np.asarray(rows, dtype=float).reshape(-1, len(FEATURES)), np.asarray(deltas, dtype=float)


def fit(cells: Sequence[CellResult]) -> dict[str, float]:
    """Rule 2: the non-negative constants that best explain the cells' paired deltas (zeros with no rows)."""
    rows, deltas = _rows(cells)
    if not len(rows):
        return dict.fromkeys(FEATURES, 0.0)
    scale = np.abs(rows).max(axis=0)
    scale[scale == 0] = 1.0  # bytes and records differ by orders of magnitude: fit on unit columns
    constants, _ = nnls(rows / scale, deltas)
    return dict(zip(FEATURES, (constants / scale).tolist()))


def priced(cell: CellResult, constants: dict[str, float]) -> CellResult:
    """``cell`` with its predicted prices replaced by the fitted model's (Rule 1)."""
    weights = np.asarray([constants[name] for name in FEATURES])
    return dataclasses.replace(cell, predicted={p: float(np.dot(f, weights)) for p, f in cell.features.items()})


def held_out(cells: Sequence[CellResult], confidence: float = 0.95) -> dict:
    """Rules 3-4: fit on the even cells not loaded, judge the ordering of the odd ones' pairs apart."""
    measured = [c for c in cells if c.error is None and c.auto is not None and len(c.admitted) > 1 and c.load is None]
    constants = fit(measured[0::2])
    verdicts = [cell_verdict(priced(c, constants), confidence) for c in measured[1::2]]
    apart = sum(v.pairs_apart for v in verdicts)
    ordered = sum(v.pairs_ordered for v in verdicts)
    return {
        "constants": constants,
        "fitted_cells": len(measured[0::2]),
        "held_out_cells": len(verdicts),
        "pairs_apart": apart,
        "ordering": ordered / apart if apart else float("nan"),
        "loaded_cells": [c.label for c in cells if c.load is not None],
    }


def held_out_check(calibrated: dict, loaded: str) -> tuple[str, bool | None, str]:
    """The gate of Rule 3 as a check ``(name, ok, detail)`` over :func:`held_out`'s figures; ``loaded``: the
    certificate's ``inconclusive (loaded: ...)`` detail, or "" (Rule 4)."""
    apart = calibrated["pairs_apart"]
    detail = (
        f"{calibrated['ordering']:.3f} of {apart} held-out pairs apart (gate >= {HELD_OUT_GATE}); "
        f"constants {calibrated['constants']}"
    )
    return (
        TIMING_CHECKS[-1],
        calibrated["ordering"] >= HELD_OUT_GATE if apart else None,
        loaded if loaded and not apart else f"{detail}; left out: {loaded}" if loaded else detail,
    )
