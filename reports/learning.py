"""The learning comparison's section of the report: curves with seed bands, paired differences, verdicts.

Reads only a ``learning`` evidence record (``canaries.learning.canary``); never
trains. Per workload it draws:

- :func:`curves_figure`: the metric against the optimizer step, one panel per
  arm group (staleness, placement, sensitivity, each with the baselines its
  arms are judged against): per arm one line (the mean over seeds) and one
  band (the range over seeds);
- :func:`differences_figure`: per compared pair, the per-seed paired
  differences (arm − baseline) as dots, their mean with the 90% confidence
  interval, and the equivalence margin as a shaded band, one panel for the
  final metric and one for the area under the curve;

and tabulates the verdicts (``section`` returns them as tables). Figures use
matplotlib's Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure as MplFigure

from reports.context import Figure, Section
from reports.numbers import interval, number
from reports.plots import LEGEND_POINTS, save_png
from validation.evidence import checks_of

__all__ = ["GROUPS", "curves_figure", "differences_figure", "verdict_table", "arms_table", "section"]

GROUPS = ("staleness", "placement", "levels", "rollout", "sensitivity")
_METRIC_TITLES = {"final": "final metric", "auc": "area under the curve (mean over steps)"}


def _panel_arms(arms: dict, group: str) -> list[str]:
    """The group's arms, preceded by the baselines they are judged against (once each)."""
    members = [name for name, arm in arms.items() if arm["group"] == group]
    baselines = [arms[m]["baseline"] for m in members if arms[m]["baseline"] and arms[m]["baseline"] not in members]
    return list(dict.fromkeys(baselines + members))


def curves_figure(name: str, workload: dict) -> MplFigure:
    """Mean curve and seed band (min to max) per arm, one panel per arm group present."""
    arms = workload["arms"]
    groups = [g for g in GROUPS if any(a["group"] == g for a in arms.values())]
    columns = min(2, len(groups))  # two panels a row: a row of four was scaled to a third on the page (5 px legends)
    rows = -(-len(groups) // columns)
    figure = MplFigure(figsize=(5.2 * columns, 4.0 * rows), layout="constrained")
    ylabel = f"{workload['metric']} ({workload['unit']})"
    for column, group in enumerate(groups):
        axes = figure.add_subplot(rows, columns, column + 1)
        for index, arm in enumerate(_panel_arms(arms, group)):
            steps = np.asarray(arms[arm]["steps"])
            curves = np.asarray(arms[arm]["curves"])  # (seeds, points)
            color = f"C{index % 10}"
            style = "--" if arms[arm]["sensitivity"] else "-"
            axes.plot(steps, curves.mean(0), style, color=color, label=arm, linewidth=1.4)
            band = axes.fill_between(steps, curves.min(0), curves.max(0), color=color, alpha=0.18, linewidth=0)
            band.set_gid(arm)
        axes.axhline(workload["success"], color="grey", linestyle=":", linewidth=1, label="success threshold")
        axes.set_xlabel("optimizer step")
        axes.set_ylabel(ylabel)
        axes.set_title(f"{name}: {group} arms (line: mean, band: range over {curves.shape[0]} seeds)", fontsize=9)
        axes.legend(fontsize=LEGEND_POINTS)
    return figure


def differences_figure(name: str, workload: dict) -> MplFigure:
    """Per-seed paired differences, mean with 90% CI and the ±margin band, per compared pair and metric."""
    verdicts = pd.DataFrame(workload["verdicts"])
    pairs = list(dict.fromkeys(zip(verdicts["arm"], verdicts["baseline"])))
    figure = MplFigure(figsize=(11.0, 0.45 * len(pairs) + 1.8), layout="constrained")
    for column, metric in enumerate(("final", "auc")):
        axes = figure.add_subplot(1, 2, column + 1)
        rows = verdicts[verdicts["metric"] == metric].set_index(["arm", "baseline"])
        for y, pair in enumerate(pairs):
            row = rows.loc[pair]
            label = y == 0
            axes.fill_betweenx(
                [y - 0.38, y + 0.38],
                -row["margin"],
                row["margin"],
                color="tab:green",
                alpha=0.15,
                linewidth=0,
                label="equivalence margin (±)" if label else None,
            )
            differences = np.asarray(row["differences"])
            axes.plot(
                differences,
                np.full(differences.shape, y + 0.15),
                "o",
                color="tab:blue",
                markersize=3,
                label="seed" if label else None,
            )
            axes.errorbar(
                [row["mean_difference"]],
                [y - 0.1],
                xerr=[[row["mean_difference"] - row["ci_low"]], [row["ci_high"] - row["mean_difference"]]],
                fmt="D",
                color="black",
                markersize=4,
                capsize=3,
                label="mean, 90% CI" if label else None,
            )
            axes.annotate(
                row["verdict"],
                (1.0, y),
                xycoords=("axes fraction", "data"),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
        axes.axvline(0.0, color="grey", linewidth=1)
        axes.set_yticks(range(len(pairs)))
        axes.set_yticklabels([f"{arm} − {baseline}" for arm, baseline in pairs], fontsize=7)
        axes.set_ylim(len(pairs) - 0.5, -0.5)
        axes.set_xlabel(f"paired difference, arm − baseline ({workload['unit']})")
        axes.set_title(f"{name}: {_METRIC_TITLES[metric]}", fontsize=8)
        axes.legend(fontsize=LEGEND_POINTS, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    return figure


def verdict_table(workload: dict) -> pd.DataFrame:
    """One row per (arm, baseline, metric): the verdict and the numbers behind it."""
    rows = [
        {
            "arm": v["arm"],
            "baseline": v["baseline"],
            "metric": v["metric"],
            "verdict": v["verdict"],
            "mean difference": number(v["mean_difference"], "+.4g"),
            "90% CI": interval(v["ci_low"], v["ci_high"], "+.4g"),
            "margin": f"{number(v['margin'])} (floor {number(v['margin_floor'])}, "
            f"baseline SD {number(v['baseline_sd'])})",
            "p (TOST)": number(v["p_tost"], ".3g"),
            "seeds": v["n"],
        }
        for v in workload["verdicts"]
    ]
    return pd.DataFrame(rows)


def _ratios(distribution: dict | None) -> str:
    """A ratio distribution of the evidence (``canaries.learning.summary.ratio_distribution``) in one cell."""
    if not distribution:
        return "-"
    return " / ".join(
        number(distribution[k] if k != "0.5" else distribution["quantiles"]["0.5"], ".3g")
        for k in ("min", "0.5", "max")
    )


def arms_table(workload: dict) -> pd.DataFrame:
    """One row per arm: criterion met, final metric, staleness seen, fraction corrected, importance ratios."""
    rows = []
    for name, arm in workload["arms"].items():
        finals = np.asarray(arm["final"])
        rows.append(
            {
                "arm": name,
                "what": arm["summary"],
                "meets criterion": f"{sum(arm['meets'])}/{len(arm['meets'])} seeds",
                "final (mean ± SD)": f"{number(finals.mean())} ± {number(finals.std(ddof=1) if finals.size > 1 else 0.0, '.2g')}",
                "records by staleness": ", ".join(f"{k}: {n}" for k, n in arm["staleness_counts"].items()),
                "fraction corrected": number(float(np.mean(arm["fraction_corrected"])), ".3g"),
                "raw ratio (min / median / max)": _ratios(arm.get("raw_ratio")),
                "clipped ratio (min / median / max)": _ratios(arm.get("clipped_ratio")),
            }
        )
    return pd.DataFrame(rows)


def _headline(workloads: dict) -> tuple[str, list[str], list[str]]:
    """The key figure (strict vs staleness 2 corrected, final metric), one line per workload, the key verdicts."""
    key, lines, verdicts = [], [], []
    for name, workload in workloads.items():
        reason = workload["precondition"]["reason"]
        if reason:
            lines.append(f"{name}: {reason}")
            continue
        for v in workload["verdicts"]:
            if v["arm"] == "stale2_corrected" and v["baseline"] == "strict" and v["metric"] == "final":
                verdicts.append(v["verdict"])
                key.append(
                    f"{name} {v['verdict']} ({number(v['mean_difference'], '+.3g')} {workload['unit']}, "
                    f"90% CI {interval(v['ci_low'], v['ci_high'], '+.3g')} vs margin ±{number(v['margin'], '.3g')})"
                )
        exact = ", ".join(
            f"{p['arm']} = {p['with']}: {'bitwise equal' if p['equal'] else 'DIFFERENT'}" for p in workload["exact"]
        )
        caught = ", ".join(f"{s['arm']}: {'caught' if s['caught'] else 'NOT CAUGHT'}" for s in workload["sensitivity"])
        lines.append(f"{name} ({workload['criterion']}): {exact}; sensitivity {caught}")
    return ("stale2_corrected vs strict: " + "; ".join(key) if key else "no comparison ran"), lines, verdicts


def _failed_verdicts(name: str, workload: dict, failed: set[str]) -> list[int]:
    """The rows of :func:`verdict_table` whose gated check (``--gate``, named as ``canaries.learning.summary`` names
    it) failed the record."""
    gated = lambda v: f"{name}: {v['arm']} equivalent to {v['baseline']} ({v['metric']}, gated)"  # noqa: E731
    return [i for i, v in enumerate(workload["verdicts"]) if gated(v) in failed]


def _in_order(workload: dict, order: list[str]) -> dict:
    if "arms" not in workload:
        return workload
    arms = workload["arms"]
    return {**workload, "arms": {name: arms[name] for name in order if name in arms}}


def section(record: dict, folder: Path) -> Section:
    """The learning record's section; its figures are written into ``folder``."""
    order = [arm["name"] for arm in record["config"]["arms"]]  # the canary's order (JSON keys come sorted)
    workloads = {name: _in_order(workload, order) for name, workload in record["measurements"]["workloads"].items()}
    stem = f"learning-{record['digest'][:10]}"
    figures, tables, failed_rows = [], {}, {}
    failed = {c.name for c in checks_of(record) if c.failed}
    for name, workload in workloads.items():
        if workload["precondition"]["reason"]:
            continue
        curves = save_png(curves_figure(name, workload), Path(folder) / f"{stem}-{name}-curves.png")
        figures.append(
            Figure(path=curves, caption=f"{name}: {workload['metric']} per arm (mean and seed range)", headline=True)
        )
        differences = save_png(differences_figure(name, workload), Path(folder) / f"{stem}-{name}-differences.png")
        figures.append(Figure(path=differences, caption=f"{name}: paired differences per seed against the margin"))
        tables[f"{name}: verdicts (paired TOST, α = 0.05)"] = verdict_table(workload)
        failed_rows[f"{name}: verdicts (paired TOST, α = 0.05)"] = _failed_verdicts(name, workload, failed)
        tables[f"{name}: arms"] = arms_table(workload)
    key_figure, lines, verdicts = _headline(workloads)
    shown = not record["config"].get("gate", False) and bool(verdicts)  # equivalence verdicts enforced only by --gate
    lines += [f"failed: {c.name}" + (f" ({c.detail})" if c.detail else "") for c in checks_of(record) if c.failed]
    lines += list(record["config"].get("notes", []))
    return Section(
        kind=record["kind"],
        title="Learning comparison: matched-schedule arms across seeds",
        passed=record["passed"],
        verdict=", ".join(dict.fromkeys(verdicts)) if shown else "passed" if record["passed"] else "failed",
        key_figure=key_figure,
        lines=lines,
        tables=tables,
        figures=figures,
        shown=shown,
        failed_rows=failed_rows,
    )
