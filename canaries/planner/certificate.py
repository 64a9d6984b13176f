"""The planner's certificate: its choices and estimates held against measured placements.

NOTE [Planner certificate]
  1. A cell is one workload under one pair of limits. Every placement the
     limits admit is timed as a forced arm beside ``auto`` in the same
     alternating blocks (NOTE [Alternating blocks]); load-flagged blocks are
     left out and replaced within the grid's budget, and a cell with more
     than ``MAX_LOADED`` flagged is *loaded*: its load is recorded and none
     of its timings judged (Rule 9). Every placement also runs once on an
     unlimited trainer under the memory census, for its measured peak and
     host bytes.
  2. Pairs are compared only when apart (their per-block ratio's median
     interval, ``validation.stats.median_ci``, excludes 1). Ordering accuracy
     is the share of such forced pairs whose predicted prices
     (``PlacementDecision.predicted_seconds``) order them as measured; a
     predicted tie is a wrong order.
  3. ``auto``'s regret: the median of its per-block ratio to the fastest
     forced arm, less 1; gated as 0 when its interval reaches 0 (not
     measurably slower), the point estimate still recorded.
  4. A refusal is right when no placement's measured peak and host bytes fit
     the limits, wrong otherwise.
  5. Memory: what each record holds after its forward / the saved bytes its
     plan admitted is never above 1, since an under-estimate becomes an OOM
     on a GPU (the peak's slack would hide it); measured / predicted peak is
     recorded per placement and cell, its over-estimate as median and
     worst. An admitted placement over the limits (peak or host) fails too.
  6. Completeness: every planned cell has a verdict; a cell whose run raised
     is recorded with its error and fails the certificate.
  7. Prices follow the work, with no clock: offload does retain's work plus
     the transfers, replay plus a forward, so each is priced strictly above
     retain in every measured cell. Unlike Rule 2 this needs no pair apart,
     so a price that drops a cost fails on a loaded machine too.
  8. A placement kept out whose measured peak and host bytes fit was kept out
     by an over-estimate, invisible to Rules 2-5: its predicted / measured
     peak must stay within ``Gates.kept_out_over_estimate`` (2; the CPU grid
     keeps retain out at 1.4-1.8, a broken estimate at 59x). Bytes, no clock.
  9. Timing never fails a correct trainer: Rules 2 and 3 (and the held-out
     calibration) judge only cells that were not loaded; with none left a
     timing check is ``inconclusive (loaded: <measured load>)``, a skip.
     Rules 1 and 4-8 read no clock and hold on any machine.

The statistics take plain per-block seconds, so tests drive them with a fake
clock through ``validation.abba.run_block``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from reports.numbers import number
from validation import stats
from validation.load import inconclusive

__all__ = [
    "Gates",
    "ArmMemory",
    "CellResult",
    "CellVerdict",
    "pair_interval",
    "cell_verdict",
    "certify",
    "loaded_detail",
    "AUTO",
    "TIMING_CHECKS",
]

AUTO = "auto"
# Rule 9: the checks that read a clock (the calibration's held-out gate too); every other check reads bytes or prices
TIMING_CHECKS = (
    "certificate: pairwise ordering on pairs apart",
    "certificate: median regret",
    "certificate: worst regret",
    "calibration: held-out cells ordered by constants fitted on the others",
)


@dataclass(frozen=True)
class Gates:
    """The certificate's gates: the bounds Rules 2-5 and 8 judge against (NOTE [Planner certificate])."""

    ordering: float = 0.95
    median_regret: float = 0.02
    worst_regret: float = 0.10
    wrong_refusals: float = 0.0
    peak_ratio: float = 1.0
    kept_out_over_estimate: float = 2.0  # Rule 8: predicted / measured peak of a placement kept out that fits
    confidence: float = 0.95


@dataclass(frozen=True)
class ArmMemory:
    """One placement run once on an unlimited trainer (Rule 1): measured and predicted bytes."""

    measured_peak: int
    predicted_peak: int
    measured_host: int
    saved_estimate: int  # the largest saved bytes the plan admitted for one of its records (offload: host bytes)
    saved_ratio: float  # the largest (bytes a record holds after its forward) / (saved bytes its plan admitted)


@dataclass
class CellResult:
    """What one cell measured. ``seconds``: per-block seconds of each timed arm (forced placements and ``auto``);
    ``predicted``: each placement's predicted extra seconds; ``memory``: each placement's bytes (Rule 1);
    ``admitted``: the forced placements the limits admit; ``auto``: auto's placements (None: refused);
    ``error``: why the cell failed (Rule 6); ``features``: each placement's bytes moved, tokens replayed and
    records, for calibration (NOTE [Planner calibration])."""

    label: str
    device_limit: int | None
    host_limit: int | None
    seconds: dict[str, list[float]] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)
    memory: dict[str, ArmMemory] = field(default_factory=dict)
    admitted: list[str] = field(default_factory=list)
    auto: list[str] | None = None
    error: str | None = None
    features: dict[str, list[float]] = field(default_factory=dict)  # NOTE [Planner calibration] Rule 1
    loaded_blocks: int = 0  # blocks left out as loaded (NOTE [Alternating blocks] Rule 4)
    load: str | None = None  # the measured load when the cell is loaded (Rule 1): its timings are not judged


@dataclass(frozen=True, kw_only=True)
class CellVerdict:
    """One cell's verdict (Rules 2-6); a refused or failed cell keeps the defaults of what it could not measure."""

    label: str
    status: str  # "measured" | "refused" | "failed"
    best: str | None = None
    regret: float | None = None  # point estimate (Rule 3)
    regret_interval: tuple[float, float] | None = None
    gated_regret: float | None = None
    pairs_apart: int = 0
    pairs_ordered: int = 0
    wrong_pairs: tuple[str, ...] = ()
    refusal_right: bool | None = None
    peak_ratios: dict[str, float] = field(default_factory=dict)
    saved_ratios: dict[str, float] = field(default_factory=dict)
    over_limit: tuple[str, ...] = ()
    unpriced: tuple[str, ...] = ()  # placements priced at or below retain (Rule 7)
    kept_out: dict[str, float] = field(default_factory=dict)  # Rule 8: each one's predicted / measured peak
    load: str | None = None  # Rule 9: the cell was loaded, its timings not judged
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def pair_interval(a: Sequence[float], b: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """Median of the per-block ratio ``a / b`` and its interval (NaN bounds when too few blocks, Rule 2)."""
    ratios = np.asarray(a, dtype=float) / np.asarray(b, dtype=float)
    low, high = stats.median_ci(ratios, confidence)
    return float(np.median(ratios)), float(low), float(high)


def _apart(low: float, high: float) -> bool:
    return bool(np.isfinite([low, high]).all()) and (low > 1 or high < 1)


def _fits(memory: ArmMemory, device_limit: int | None, host_limit: int | None) -> bool:
    return (device_limit is None or memory.measured_peak <= device_limit) and (
        host_limit is None or memory.measured_host <= host_limit
    )


def _ordering(cell: CellResult, confidence: float) -> tuple[int, int, list[str]]:
    """Rule 2 over the cell's forced arms: (pairs apart, pairs ordered as measured, the wrong ones)."""
    apart = ordered = 0
    wrong = []
    for a, b in itertools.combinations(cell.admitted, 2):
        _, low, high = pair_interval(cell.seconds[a], cell.seconds[b], confidence)
        if not _apart(low, high):
            continue
        apart += 1
        measured = 1 if low > 1 else -1  # a slower than b
        predicted = np.sign(cell.predicted[a] - cell.predicted[b])
        if predicted == measured:
            ordered += 1
        else:
            wrong.append(
                f"{a} vs {b}: measured ratio [{low:.3f}, {high:.3f}], predicted "
                f"{cell.predicted[a] * 1e3:.3f} vs {cell.predicted[b] * 1e3:.3f} ms"
            )
    return apart, ordered, wrong


def _kept_out(cell: CellResult) -> dict[str, float]:
    """Rule 8: predicted / measured peak of each placement the limits kept out whose measured bytes fit them."""
    return {
        p: m.predicted_peak / m.measured_peak
        for p, m in cell.memory.items()
        if p not in cell.admitted and m.measured_peak > 0 and _fits(m, cell.device_limit, cell.host_limit)
    }


def _unpriced(cell: CellResult) -> tuple[str, ...]:
    """Rule 7: the placements priced at or below retain."""
    retain = cell.predicted.get("retain", 0.0)
    return tuple(
        f"{p} {s * 1e3:.3f} ms <= retain {retain * 1e3:.3f} ms"
        for p, s in cell.predicted.items()
        if p != "retain" and s <= retain
    )


def cell_verdict(cell: CellResult, confidence: float = 0.95) -> CellVerdict:
    """The verdict of one cell (Rules 2-9); a loaded cell's timings are left unjudged (Rule 9)."""
    peak_ratios = {p: m.measured_peak / m.predicted_peak for p, m in cell.memory.items() if m.predicted_peak > 0}
    over = tuple(
        p for p in cell.admitted if p in cell.memory and not _fits(cell.memory[p], cell.device_limit, cell.host_limit)
    )
    saved_ratios = {p: m.saved_ratio for p, m in cell.memory.items()}
    common = dict(
        peak_ratios=peak_ratios, saved_ratios=saved_ratios, over_limit=over, label=cell.label, kept_out=_kept_out(cell)
    )
    if cell.error is not None:
        return CellVerdict(status="failed", error=cell.error, **common)
    if cell.auto is None:
        right = not any(_fits(m, cell.device_limit, cell.host_limit) for m in cell.memory.values())
        return CellVerdict(status="refused", refusal_right=right, **common)
    if cell.load is not None:
        return CellVerdict(status="measured", load=cell.load, unpriced=_unpriced(cell), **common)
    apart, ordered, wrong = _ordering(cell, confidence)
    best = min(cell.admitted, key=lambda p: float(np.median(cell.seconds[p])))
    ratio, low, high = pair_interval(cell.seconds[AUTO], cell.seconds[best], confidence)
    gated = max(0.0, ratio - 1) if _apart(low, high) and low > 1 else 0.0
    return CellVerdict(
        status="measured",
        best=best,
        regret=ratio - 1,
        regret_interval=(low - 1, high - 1),
        gated_regret=gated,
        pairs_apart=apart,
        pairs_ordered=ordered,
        wrong_pairs=tuple(wrong),
        unpriced=_unpriced(cell),
        **common,
    )


def loaded_detail(cells: Sequence[CellResult | CellVerdict]) -> str:
    """Rule 9: ``inconclusive (loaded: ...)`` naming each loaded cell and its measured load; "" when none was."""
    loaded = [f"{c.label}: {c.load}" for c in cells if c.load is not None]
    return inconclusive(f"{len(loaded)} cells, " + "; ".join(loaded)) if loaded else ""


def _timing(ok: bool, measured: Sequence[CellVerdict], timed: Sequence[CellVerdict]) -> bool | None:
    """Rule 9: a timing check's verdict on the cells not loaded; None (inconclusive) when every measured cell was
    loaded; False when nothing was measured at all."""
    if not timed:
        return None if measured else False
    return bool(ok)


def certify(
    planned: Sequence[str], cells: Mapping[str, CellResult], gates: Gates = Gates()
) -> tuple[dict, list[tuple[str, bool | None, str]]]:
    """The certificate over every ``planned`` cell label: its figures and its checks ``(name, ok, detail)``.

    A planned cell missing from ``cells`` counts as failed (Rule 6). ``ok`` is None for a check with
    nothing to judge (no pair measurably apart): skipped, and said so."""
    verdicts = [
        cell_verdict(cells[label], gates.confidence)
        if label in cells
        else CellVerdict(label=label, status="failed", error="no result")
        for label in planned
    ]
    failed = [v.label for v in verdicts if v.status == "failed"]
    measured = [v for v in verdicts if v.status == "measured"]
    refused = [v for v in verdicts if v.status == "refused"]
    timed = [v for v in measured if v.load is None]  # Rule 9: a loaded cell's timings are not judged
    apart = sum(v.pairs_apart for v in timed)
    ordering = sum(v.pairs_ordered for v in timed) / apart if apart else float("nan")
    regrets = np.asarray([v.gated_regret for v in timed], dtype=float)
    median = float(np.median(regrets)) if regrets.size else float("nan")
    p95 = float(np.percentile(regrets, 95)) if regrets.size else float("nan")
    worst = float(regrets.max()) if regrets.size else float("nan")
    wrong = [v.label for v in refused if not v.refusal_right]
    ratios = np.asarray([r for v in verdicts for r in v.peak_ratios.values()], dtype=float)
    over_estimate = 1 / ratios - 1 if ratios.size else np.asarray([np.nan])
    over_limit = [f"{v.label}: {', '.join(v.over_limit)}" for v in verdicts if v.over_limit]
    unpriced = [f"{v.label}: {', '.join(v.unpriced)}" for v in measured if v.unpriced]
    kept_out = {f"{v.label}/{p}": r for v in verdicts for p, r in v.kept_out.items()}
    over_kept_out = [f"{name}: {r:.2f}" for name, r in kept_out.items() if r > gates.kept_out_over_estimate]
    loaded = loaded_detail(measured)
    left_out = f"; left out: {loaded}" if loaded else ""
    figures = {
        "cells_planned": len(planned),
        "cells_measured": len(measured),
        "cells_refused": len(refused),
        "cells_failed": failed,
        "pairs_apart": apart,
        "ordering": ordering,
        "median_regret": median,
        "p95_regret": p95,
        "worst_regret": worst,
        "wrong_refusals": wrong,
        "wrong_refusal_share": len(wrong) / len(refused) if refused else 0.0,
        "worst_peak_ratio": float(ratios.max()) if ratios.size else float("nan"),
        "median_over_estimate": float(np.median(over_estimate)),
        "worst_over_estimate": float(over_estimate.max()),
        "worst_kept_out_over_estimate": max(kept_out.values(), default=float("nan")),
        "loaded_cells": [v.label for v in measured if v.load is not None],
        "cells": [v.as_dict() for v in verdicts],
    }
    wrong_pairs = "; ".join(f"{v.label}: {w}" for v in timed for w in v.wrong_pairs)
    under = [f"{v.label}/{p}: {r:.3f}" for v in verdicts for p, r in v.peak_ratios.items() if r > gates.peak_ratio]
    saved = [r for v in verdicts for r in v.saved_ratios.values()]
    under_saved = [
        f"{v.label}/{p}: {r:.3f}" for v in verdicts for p, r in v.saved_ratios.items() if r > gates.peak_ratio
    ]
    figures["worst_saved_ratio"] = max(saved, default=float("nan"))
    checks = [
        (
            "certificate: every planned cell has a verdict, none failed",
            not failed,
            f"{len(planned)} planned; failed: {failed or 'none'}; "
            + "; ".join(f"{v.label}: {v.error}" for v in verdicts if v.error),
        ),
        (
            "certificate: pairwise ordering on pairs apart",
            None if not apart else ordering >= gates.ordering,
            loaded
            if loaded and not apart
            else f"{number(ordering, '.3f')} of {apart} pairs apart (gate >= {gates.ordering}); wrong: {wrong_pairs or 'none'}{left_out}",
        ),
        (
            "certificate: median regret",
            _timing(median <= gates.median_regret, measured, timed),
            loaded
            if loaded and not timed
            else f"median {number(median, '.4f')}, p95 {number(p95, '.4f')} (gate <= {gates.median_regret}){left_out}",
        ),
        (
            "certificate: worst regret",
            _timing(worst <= gates.worst_regret, measured, timed),
            loaded
            if loaded and not timed
            else f"worst {number(worst, '.4f')} (gate <= {gates.worst_regret}); "
            + ", ".join(f"{v.label} {v.gated_regret:.3f}" for v in timed)
            + left_out,
        ),
        (
            "certificate: no wrong refusal",
            len(wrong) / max(1, len(refused)) <= gates.wrong_refusals,
            f"{len(refused)} refused, wrong: {wrong or 'none'}",
        ),
        (
            "certificate: measured peak / predicted peak <= 1",
            ratios.size > 0 and not under,
            f"worst {number(figures['worst_peak_ratio'], '.3f')} over {ratios.size} runs; under-estimates: {under or 'none'}",
        ),
        (
            "certificate: held after a forward / admitted saved bytes <= 1",
            bool(saved) and not under_saved,
            f"worst {number(figures['worst_saved_ratio'], '.3f')} over {len(saved)} runs; under-estimates: {under_saved or 'none'}",
        ),
        (
            "certificate: admitted placements within the limits (measured)",
            not over_limit,
            "; ".join(over_limit) or "every admitted placement's measured bytes within its limits",
        ),
        (
            "certificate: offload and replay priced above retain",
            bool(measured) and not unpriced,
            "; ".join(unpriced) or f"in all {len(measured)} measured cells",
        ),
        (
            "certificate: placements kept out where they fit: predicted / measured peak within the bound",
            None if not kept_out else not over_kept_out,
            f"worst {number(figures['worst_kept_out_over_estimate'], '.2f')} over {len(kept_out)} kept out (gate <= "
            f"{gates.kept_out_over_estimate}); over: {over_kept_out or 'none'}"
            if kept_out
            else "no placement was kept out where its measured bytes fit",
        ),
    ]
    return figures, checks
