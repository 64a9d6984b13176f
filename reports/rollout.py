"""The rollout canary's view: the mismatch table per setting, a plot of the BF16 gaps, publication and lag figures.

:func:`section` (``section(record, folder) -> Section``, see ``reports.context``)
reads only the record (``canaries/rollout/canary.py`` writes it).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure as MplFigure

from .context import Figure, Section
from .generic import base_section
from .numbers import number
from .plots import save_png

__all__ = ["section", "mismatch_table", "plot_gaps"]

_FLOOR = 1e-9  # gaps of exactly 0 drawn at this height on the log axis


def mismatch_table(record: dict) -> pd.DataFrame:
    """One row per setting: dtype, cache, batch, padding, tokens, worst and median |gap|, share of ratios off band."""
    columns = ["dtype", "kv_cache", "batch", "padding", "tokens", "worst", "median", "share_outside_band"]
    return pd.DataFrame(record["measurements"]["mismatch"], columns=columns)


def plot_gaps(gaps: dict[str, list[float]], path: Path, *, tolerance: float) -> Path:
    """|engine - trainer| log-prob per token, one row of points per setting (its median marked), log scale, the FP32
    tolerance drawn across."""
    if not gaps:
        raise ValueError("plot_gaps: expected gaps per setting, found none")
    labels = list(gaps)
    figure = MplFigure(figsize=(8, 0.32 * len(labels) + 1.4), layout="constrained")
    axes = figure.add_subplot()
    for row, label in enumerate(labels):
        values = [max(g, _FLOOR) for g in gaps[label]]
        axes.scatter(
            values, [row] * len(values), s=8, alpha=0.5, color="tab:blue", label="tokens" if row == 0 else None
        )
        axes.scatter(
            [float(np.median(values))], [row], marker="|", s=200, color="black", label="median" if row == 0 else None
        )
    axes.set_yticks(range(len(labels)), labels)
    axes.axvline(tolerance, color="tab:red", linestyle="--", label=f"FP32 tolerance {tolerance:g}")
    axes.set_xscale("log")
    axes.set_xlabel("|engine - trainer| log-prob per token")
    axes.tick_params(axis="y", labelsize=7)
    axes.legend(fontsize=8)
    return save_png(figure, path)


def section(record: dict, folder: Path) -> Section:
    """The rollout record's section: the mismatch table and BF16 plot, then publication and lag lines."""
    m, config = record["measurements"], record["config"]
    table = mismatch_table(record)
    fp32 = table[table["dtype"] == "fp32"]
    figures = []
    if m["bf16_gaps"]:
        path = plot_gaps(
            m["bf16_gaps"], folder / f"rollout-bf16-{record['digest'][:12]}.png", tolerance=config["fp32_tolerance"]
        )
        figures.append(
            Figure(
                path=path,
                caption="BF16 engine against the FP32 trainer: per-token log-prob gaps per setting (shown, not gated)",
            )
        )
    faults, flight = m["publication"]["faults"], m["publication"]["inflight"]
    lines = [
        (
            f"publication: {faults['unchanged']} of {faults['tensors']} faulted publications left the engine "
            f"bitwise unchanged; {faults['nbytes']} bytes per publication in {number(faults['seconds'], '.2g')} s"
        ),
        (
            f"inflight versions {flight['versions']}: re-decoding at the recorded version within "
            f"{number(flight['worst_own_version_gap'], '.2g')}"
        ),
        f"behaviour lag: one step off-policy {m['lags']['one_step']}, staleness 0 {m['lags']['staleness_0']}",
    ]
    built = base_section(record, lines=lines, tables={"engine against trainer per setting": table}, figures=figures)
    return replace(
        built,
        key_figure=f"worst FP32 gap {number(float(fp32['worst'].max()), '.2g')} vs tolerance "
        f"{number(config['fp32_tolerance'], '.2g')}",
    )
