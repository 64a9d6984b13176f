"""The sweep's view: ratio against tokens per arm with its interval, and the cost fit with its residuals.

:func:`section` (``section(record, folder) -> Section``, see ``reports.context``)
reads one ``benchmark-sweep`` record (NOTE [Cost growth] in
``canaries/benchmark/sweep.py``): a plot of each arm's median ratio to
``plain`` against tokens per step (B x T) with its interval, and the fit's
ratio along batch 4 dashed beside it (labelled a model, the tokens beyond
the largest measured shape shaded as extrapolated); a table of the
fitted fixed, per-token and per-token² costs, one of the fit's residual at
every shape, and the fit's ratio at the GPU presets' shapes, labelled a
model, not a measurement. The record carries the model's figures; nothing
is refitted here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure as MplFigure

from .context import Figure, Section
from .generic import checks_table
from .numbers import number
from .plots import save_png

__all__ = ["section"]

MODEL_NOTE = "model, not a measurement"


def _ratios(record: dict) -> pd.DataFrame:
    rows = [
        {
            "arm": c["arm"],
            "tokens": p["tokens"],
            "shape": p["label"],
            "ratio": c["ratio"],
            "ci_low": c["ci95"][0],
            "ci_high": c["ci95"][1],
            "verdict": c.get("reading", c["verdict"]),
        }
        for p in record["measurements"]["points"]
        for c in p["comparisons"]
    ]
    return pd.DataFrame(rows)


def _plot(ratios: pd.DataFrame, model: dict | None, path: Path) -> Path:
    figure = MplFigure(figsize=(6, 3.4), layout="constrained")
    axes = figure.add_subplot()
    measured = ratios[np.isfinite(ratios["ratio"].astype(float))]  # a fully loaded shape has no ratio
    if measured.empty:
        axes.text(0.5, 0.5, "no shape measured: every block loaded", ha="center", transform=axes.transAxes)
        axes.set_xlim(ratios["tokens"].min() / 2, ratios["tokens"].max() * 2)
    for arm, group in measured.groupby("arm", sort=False):
        rows = group.sort_values("tokens")
        low = np.nan_to_num(rows["ratio"] - rows["ci_low"])
        high = np.nan_to_num(rows["ci_high"] - rows["ratio"])
        line = axes.errorbar(rows["tokens"], rows["ratio"], yerr=[low, high], marker="o", capsize=3, label=arm)
        if model is not None:
            tokens = [model["batch"] * t for t in model["lengths"]]
            axes.plot(tokens, model["ratios"][arm], linestyle="--", linewidth=0.9, color=line.lines[0].get_color())
    if model is not None:
        axes.plot([], [], linestyle="--", color="#555", label=f"fit at batch {model['batch']} ({MODEL_NOTE})")
        measured = ratios["tokens"].max()
        axes.axvspan(
            measured,
            model["batch"] * model["lengths"][-1],
            color="#999",
            alpha=0.15,
            linewidth=0,
            label="beyond the measured shapes: extrapolated",
        )
    axes.axhline(1.0, color="#777", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("tokens per step (batch x sequence length)")
    axes.set_ylabel("step time / plain (95% CI)")
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=7)
    return save_png(figure, path)


def _fit_table(fits: dict[str, dict]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "arm": arm,
                "fixed ms": f["fixed"] * 1e3,
                "per-token µs": f["per_token"] * 1e6,
                "per-token² ns": f["per_token2"] * 1e9,
                "largest residual ms": max(map(abs, f["residuals"]), default=float("nan")) * 1e3,
                "shapes left out (loaded)": ", ".join(f.get("left_out", [])) or "-",
            }
            for arm, f in fits.items()
        ]
    )


def _residuals(record: dict) -> pd.DataFrame:
    """Per fitted shape (the points not left out, in order) and arm: measured minus fitted step time, in ms."""
    rows: dict[str, dict] = {}
    for arm, f in record["measurements"]["fits"].items():
        shapes = [
            p["label"]
            for p in record["measurements"]["points"]
            if f"{p['batch']}x{p['seq_len']}" not in f.get("left_out", [])
        ]
        for shape, residual in zip(shapes, f["residuals"]):
            rows.setdefault(shape, {"shape": shape})[f"{arm} ms"] = residual * 1e3
    return pd.DataFrame(list(rows.values()))


def _model_lines(record: dict) -> list[str]:
    model = record["measurements"].get("model")
    if model is None:
        return ["no model: some arm's costs could not be fitted (see the checks)"]
    config = record["config"]
    largest = max(p["tokens"] for p in record["measurements"]["points"])
    source = f"{config['model']} on {config.get('device', 'cpu')} (measured up to {largest} tokens per step)"
    return [
        f"{MODEL_NOTE}: the fit of {source} predicts {arm} / plain "
        + ", ".join(f"{number(s['ratios'][arm], '.3f')} at {s['batch']}×{s['seq_len']}" for s in model["shapes"])
        + " (the GPU presets' qwen3_8b shapes)"
        for arm in config["arms"]
    ]


def section(record: dict, folder: Path) -> Section:
    """The sweep section (module docstring); writes ``sweep-<digest>-ratios.png`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    ratios, fits = _ratios(record), record["measurements"]["fits"]
    plot = _plot(ratios, record["measurements"].get("model"), folder / f"sweep-{record['digest'][:12]}-ratios.png")
    return Section(
        kind=record["kind"],
        title=f"Cost growth sweep ({record['config']['profile']})",
        passed=record["passed"],
        verdict="passed" if record["passed"] else "failed",
        key_figure=f"{len(record['measurements']['points'])} shapes, {len(fits) - 1} arms",
        lines=_model_lines(record),
        tables={
            "Ratio against plain per shape": ratios,
            "Cost fit": _fit_table(fits),
            "Residuals of the fit (measured - fitted step time)": _residuals(record),
            "Checks": checks_table(record),
        },
        figures=[
            Figure(
                path=plot,
                caption="Ratio to plain against tokens per step, with intervals; dashed: "
                f"the fit's ratio ({MODEL_NOTE}). Falling = a fixed cost, flat = per token, "
                "rising = per token².",
                headline=True,
            )
        ],
    )
