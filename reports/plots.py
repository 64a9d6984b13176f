"""Plots of the series in evidence, saved as PNG with matplotlib's Agg canvas (no display, no pyplot state).

- :func:`plot_lifecycle`: bytes held at each lifecycle point, one bar per
  placement, one panel per pool (device, host): the memory canary's series.
- :func:`plot_ratios`: ratios with their 95% confidence intervals as error
  bars around a line at 1 (benchmarks: arm / baseline time).

Each takes a table from :mod:`reports.tables` and returns the written path.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["plot_lifecycle", "plot_ratios", "make_plots"]

_DPI = 100


def _save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)  # the Agg canvas: PNG without a display or a global backend
    figure.savefig(path, format="png", dpi=_DPI)
    return path


def plot_lifecycle(table: pd.DataFrame, path: Path, *, title: str = "") -> Path:
    """Grouped bars of ``bytes`` by ``point`` and ``placement``, a panel per ``pool`` (one record's rows)."""
    if table.empty:
        raise ValueError("plot_lifecycle: expected rows of (placement, point, pool, bytes), found none")
    pools = list(dict.fromkeys(table["pool"]))
    points = list(dict.fromkeys(table["point"]))
    placements = list(dict.fromkeys(table["placement"]))
    figure = Figure(figsize=(4.5 * len(pools), 3.6), layout="constrained")
    width = 0.8 / max(1, len(placements))
    for column, pool in enumerate(pools):
        axes = figure.add_subplot(1, len(pools), column + 1)
        rows = table[table["pool"] == pool]
        for index, placement in enumerate(placements):
            values = rows[rows["placement"] == placement].set_index("point")["bytes"]
            heights = [float(values.get(point, 0)) / 1024 for point in points]
            axes.bar([x + index * width for x in range(len(points))], heights, width, label=placement)
        axes.set_xticks([x + width * (len(placements) - 1) / 2 for x in range(len(points))])
        axes.set_xticklabels([p.replace("_", "\n") for p in points], fontsize=7)
        axes.set_ylabel("KiB held")
        axes.set_title(f"{pool} pool", fontsize=9)
        axes.legend(fontsize=7)
    if title:
        figure.suptitle(title, fontsize=9)
    return _save(figure, path)


def plot_ratios(table: pd.DataFrame, path: Path, *, title: str = "") -> Path:
    """Median ratios with CI error bars, one row per ``label``; a line at 1 marks "no change"."""
    if table.empty:
        raise ValueError("plot_ratios: expected rows of (label, median_ratio, ci_low, ci_high), found none")
    labels = [f"{r.record}: {r.label}" if table["record"].nunique() > 1 else r.label for r in table.itertuples()]
    figure = Figure(figsize=(6.5, 0.5 * len(table) + 1.4), layout="constrained")
    axes = figure.add_subplot(1, 1, 1)
    y = list(range(len(table)))
    medians = table["median_ratio"].to_numpy()
    errors = [medians - table["ci_low"].to_numpy(), table["ci_high"].to_numpy() - medians]
    axes.errorbar(medians, y, xerr=errors, fmt="o", capsize=4)
    axes.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    axes.set_yticks(y)
    axes.set_yticklabels(labels, fontsize=7)
    axes.set_xlabel("ratio to baseline (median, 95% CI)")
    if title:
        axes.set_title(title, fontsize=9)
    return _save(figure, path)


def make_plots(lifecycle: pd.DataFrame, ratios: pd.DataFrame, folder: Path) -> dict[str, list[Path]]:
    """Every plot the tables allow, under ``folder``; returns record name -> its plot paths."""
    plots: dict[str, list[Path]] = {}
    for record, rows in lifecycle.groupby("record", sort=False):
        path = folder / f"{_slug(record)}-lifecycle.png"
        plots.setdefault(record, []).append(plot_lifecycle(rows, path, title=f"{record}: bytes held"))
    for record, rows in ratios.groupby("record", sort=False):
        path = folder / f"{_slug(record)}-ratios.png"
        plots.setdefault(record, []).append(plot_ratios(rows, path, title=f"{record}: ratios"))
    return plots


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
