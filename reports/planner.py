"""The planner canary's view: the certificate's figures, a regret-per-cell plot, a predicted-vs-measured bytes plot.

:func:`section` (``section(record, folder) -> Section``, see ``reports.context``)
reads only the record (NOTE [Planner certificate] in ``canaries/planner/certificate.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure as MplFigure

from validation.evidence import checks_of

from .context import Figure, Section
from .numbers import number
from .plots import save_png

__all__ = ["section", "cells_table", "bytes_table"]


def cells_table(certificate: dict) -> pd.DataFrame:
    """One row per planned cell: its status, the measured best, auto's regret with its interval, the refusal's verdict."""
    rows = []
    for cell in certificate["cells"]:
        low, high = cell["regret_interval"] or (np.nan, np.nan)
        rows.append(
            {
                "cell": cell["label"],
                "status": cell["status"],
                "best": cell["best"],
                "regret": cell["regret"],
                "regret_low": low,
                "regret_high": high,
                "gated_regret": cell["gated_regret"],
                "pairs_apart": cell["pairs_apart"],
                "pairs_ordered": cell["pairs_ordered"],
                "refusal_right": cell["refusal_right"],
                "error": cell["error"],
            }
        )
    return pd.DataFrame(rows)


def bytes_table(record: dict) -> pd.DataFrame:
    """One row per cell and placement: measured and predicted peak, held after a forward over admitted saved bytes."""
    rows = []
    for label, cell in record["measurements"]["cells"].items():
        for placement, memory in (cell["memory"] or {}).items():
            rows.append(
                {
                    "cell": label,
                    "placement": placement,
                    "measured_peak": memory["measured_peak"],
                    "predicted_peak": memory["predicted_peak"],
                    "saved_ratio": memory["saved_ratio"],
                }
            )
    return pd.DataFrame(rows)


def _regret_figure(cells: pd.DataFrame) -> MplFigure:
    measured = cells[cells["status"] == "measured"]
    figure = MplFigure(figsize=(7, 0.4 * max(3, len(measured)) + 1.2), layout="constrained")
    axes = figure.add_subplot()
    y = np.arange(len(measured))
    point = measured["regret"].to_numpy(dtype=float) * 100
    errors = np.vstack(
        [
            point - measured["regret_low"].to_numpy(dtype=float) * 100,
            measured["regret_high"].to_numpy(dtype=float) * 100 - point,
        ]
    )
    axes.errorbar(point, y, xerr=np.nan_to_num(np.abs(errors)), fmt="o", capsize=3)
    axes.axvline(0, color="grey", linewidth=0.8)
    axes.set_yticks(y, measured["cell"], fontsize=7)
    axes.set_xlabel("auto's regret, % (time ÷ measured best − 1, with interval)")
    return figure


def _bytes_figure(table: pd.DataFrame) -> MplFigure:
    figure = MplFigure(figsize=(5, 4.5), layout="constrained")
    axes = figure.add_subplot()
    for placement, rows in table.groupby("placement"):
        axes.scatter(rows["predicted_peak"] / 1024, rows["measured_peak"] / 1024, label=placement, s=18)
    top = float(max(table["predicted_peak"].max(), table["measured_peak"].max())) / 1024 if len(table) else 1.0
    axes.plot([0, top], [0, top], color="grey", linewidth=0.8, label="measured = predicted")
    axes.set_xlabel("predicted peak, KiB")
    axes.set_ylabel("measured peak (census), KiB")
    axes.legend(fontsize=7)
    return figure


def _headline(record: dict) -> tuple[str, str]:
    """The board's verdict and key figure: a passing run whose every measured cell was loaded is ``inconclusive`` (its
    timing checks were skipped, NOTE [Planner certificate] Rule 9), never a bare ``passed`` beside figures it could
    not measure; loaded cells left out of a judged run are counted in the key figure."""
    certificate = record["measurements"]["certificate"]
    loaded = certificate.get("loaded_cells", [])
    peak = f"worst peak ratio {number(certificate['worst_peak_ratio'], '.2f')}"
    if record["passed"] and loaded and len(loaded) == certificate["cells_measured"]:
        return "inconclusive", f"timing inconclusive: all {len(loaded)} measured cells loaded; {peak}"
    percent = lambda share: number(share, ".1%")  # noqa: E731
    key = (
        f"ordering {number(certificate['ordering'], '.2f')} on {certificate['pairs_apart']} pairs apart, median "
        f"regret {percent(certificate['median_regret'])}, worst {percent(certificate['worst_regret'])}, {peak}"
    )
    left_out = f"; {len(loaded)} loaded cell(s) left out of the timing" if loaded else ""
    return ("passed" if record["passed"] else "failed"), key + left_out


def section(record: dict, folder: Path) -> Section:
    """The planner canary's section; its two figures are written into ``folder``."""
    certificate = record["measurements"]["certificate"]
    cells, memory = cells_table(certificate), bytes_table(record)
    stem = Path(folder) / f"planner-{record['digest'][:10]}"
    figures = [
        Figure(
            path=save_png(_regret_figure(cells), stem.with_name(stem.name + "-regret.png")),
            caption="auto's regret per measured cell, with its interval",
            headline=True,
        ),
        Figure(
            path=save_png(_bytes_figure(memory), stem.with_name(stem.name + "-bytes.png")),
            caption="predicted against measured peak per cell and placement (above the line: an under-estimate)",
        ),
    ]
    verdict, key = _headline(record)
    lines = [
        (
            f"{certificate['cells_planned']} cells planned: {certificate['cells_measured']} measured, "
            f"{certificate['cells_refused']} refused ({len(certificate['wrong_refusals'])} wrongly), "
            f"{len(certificate['cells_failed'])} failed; over-estimate of the peak: median "
            f"{number(certificate['median_over_estimate'], '.2f')}, worst "
            f"{number(certificate['worst_over_estimate'], '.2f')}"
        )
    ]
    lines += [f"failed: {c.name}" + (f" ({c.detail})" if c.detail else "") for c in checks_of(record) if c.failed]
    return Section(
        kind=record["kind"],
        title="Planner canary: auto's choices and estimates against measured placements",
        passed=record["passed"],
        verdict=verdict,
        key_figure=key,
        lines=lines,
        tables={"cells": cells, "bytes per placement": memory},
        figures=figures,
        failed_rows={"cells": _failed_cells(record, cells)},
    )


def _failed_cells(record: dict, cells: pd.DataFrame) -> list[int]:
    """The rows of :func:`cells_table` that failed the record: a failed cell, and a wrong refusal when the
    certificate's refusal check failed (a refusal judged right is green, as a measured cell is)."""
    refusals_failed = any(c.failed and c.name.startswith("certificate: no wrong refusal") for c in checks_of(record))
    return [
        i
        for i, row in enumerate(cells.itertuples())
        if row.status == "failed" or (refusals_failed and row.status == "refused" and row.refusal_right is False)
    ]
