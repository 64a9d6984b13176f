"""The sweep's view: ratio against tokens per arm with its interval, and the cost fit with its residuals.

:func:`section` (``section(record, folder) -> Section``, see ``reports.context``)
reads one ``benchmark-sweep`` record (NOTE [Cost growth] in
``canaries/benchmark/sweep.py``): a plot of each arm's median ratio to
``plain`` against tokens per step (B x T) with its interval, a table of the
fitted fixed, per-token and per-token² costs with their largest residual,
and the fit's ratio at larger shapes, labelled a model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure as MplFigure

from .context import Figure, Section
from .generic import checks_table
from .plots import save_png

__all__ = ["section"]

MODEL_SHAPES = ((4, 1024), (4, 4096))  # the GPU presets' shapes, as batch x length


def _ratios(record: dict) -> pd.DataFrame:
    rows = [{"arm": c["arm"], "tokens": p["tokens"], "shape": p["label"], "ratio": c["ratio"],
             "ci_low": c["ci95"][0], "ci_high": c["ci95"][1], "verdict": c["verdict"]}
            for p in record["measurements"]["points"] for c in p["comparisons"]]
    return pd.DataFrame(rows)


def _plot(ratios: pd.DataFrame, path: Path) -> Path:
    figure = MplFigure(figsize=(6, 3.4), layout="constrained")
    axes = figure.add_subplot()
    for arm, rows in ratios.groupby("arm", sort=False):
        rows = rows.sort_values("tokens")
        low = np.nan_to_num(rows["ratio"] - rows["ci_low"])
        high = np.nan_to_num(rows["ci_high"] - rows["ratio"])
        axes.errorbar(rows["tokens"], rows["ratio"], yerr=[low, high], marker="o", capsize=3, label=arm)
    axes.axhline(1.0, color="#777", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("tokens per step (batch x sequence length)")
    axes.set_ylabel("step time / plain (95% CI)")
    axes.legend(fontsize=7)
    return save_png(figure, path)


def _predicted(fit: dict, plain: dict, terms: list[str], batch: int, length: int) -> float:
    """The fit's ratio at ``batch`` x ``length``; ``terms``: the record's names of fixed, B*T and B*T² costs."""
    row = np.array([1.0, batch * length, batch * float(length) ** 2])
    return float(row @ [fit[t] for t in terms] / (row @ [plain[t] for t in terms]))


def section(record: dict, folder: Path) -> Section:
    """The sweep section (module docstring); writes ``sweep-<digest>-ratios.png`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    ratios, fits = _ratios(record), record["measurements"]["fits"]
    plot = _plot(ratios, folder / f"sweep-{record['digest'][:12]}-ratios.png")
    table = pd.DataFrame([{"arm": arm, "fixed ms": f["fixed"] * 1e3, "per-token µs": f["per_token"] * 1e6,
                           "per-token² ns": f["per_token2"] * 1e9,
                           "largest residual ms": max(map(abs, f["residuals"]), default=float("nan")) * 1e3,
                           "shapes left out (loaded)": ", ".join(f.get("left_out", [])) or "-"} for arm, f in fits.items()])
    lines = [f"model, not a measurement: the fit of {record['config']['model']} predicts {arm} / plain "
             + ", ".join(f"{_predicted(f, fits['plain'], record['config']['terms'], b, t):.3f} at {b}×{t}" for b, t in MODEL_SHAPES)
             for arm, f in fits.items() if arm != "plain"]
    return Section(kind=record["kind"], title=f"Cost growth sweep ({record['config']['profile']})",
                   passed=record["passed"], verdict="passed" if record["passed"] else "failed",
                   key_figure=f"{len(record['measurements']['points'])} shapes, {len(fits) - 1} arms",
                   lines=lines, tables={"Ratio against plain per shape": ratios, "Cost fit": table,
                                        "Checks": checks_table(record)},
                   figures=[Figure(path=plot, caption="Ratio to plain against tokens per step, with intervals: "
                                   "falling = a fixed cost, flat = per token, rising = per token².", headline=True)])
