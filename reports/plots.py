"""Plots of the series in evidence, saved as PNG with matplotlib's Agg canvas (no display, no pyplot state).

- :func:`plot_lifecycle`: bytes held at each lifecycle point, one bar per
  placement, one panel per pool (device, host): the memory canary's series.

Each takes a pandas table (built by a section builder) and returns the written path.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["LEGEND_POINTS", "plot_lifecycle", "save_png"]

_DPI = 100
# Legends are set at 8 pt on figures at most ~11 in wide: the page shows a PNG at most 76em (1216 px) wide, so
# their text reaches the reader at >= 10 px; a wider figure is scaled down, its text with it.
LEGEND_POINTS = 8


def save_png(figure: Figure, path: Path) -> Path:
    """Write ``figure`` to ``path`` (folders made) as a PNG through the Agg canvas; returns ``path``."""
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
    return save_png(figure, path)
