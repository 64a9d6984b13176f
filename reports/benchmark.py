"""The benchmark's view: a section built from one ``benchmark`` evidence record, and a page of its own.

:func:`section` (``section(record, folder) -> Section``, see ``reports.context``)
reads only the record: it writes the plots (ratio with its interval per arm
and workload against the gate band; per-block seconds, to show drift; memory
per arm) and a CSV of every raw sample into ``folder``, and returns the
tables and one line per comparison, e.g.::

    tok/s −12.1% [−14.0..−10.3] (retain@s0 vs plain, 8 ABBA blocks, small 4×64 full, drift ρ=0.08) → regression vs ±5% gate

(tokens/s change = 1 / ratio − 1, so its interval is the ratio's, inverted).
``rtv bench`` renders it through the one report (``reports.render_report``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure as MplFigure

from .context import Figure, Section
from .generic import checks_table
from .numbers import MISSING, interval, number
from .plots import save_png

__all__ = ["section", "comparison_line", "difference_text", "samples_table", "plot_ratios", "enforced"]

MIB = 2**20


def _pct(value: float) -> str:
    return number(value * 100, "+.1f").replace("-", "−")


def comparison_line(comparison: dict, workload: str, gate: float) -> str:
    """One sentence per comparison (module docstring); ``comparison`` is a ``Comparison.as_dict()``."""
    low, high = comparison["ci95"]
    change = (
        f"{_pct(1 / comparison['ratio'] - 1)}%"
        if comparison["ratio"] and np.isfinite(comparison["ratio"])
        else "not measured"
    )
    interval = (
        f"[{_pct(1 / high - 1)}..{_pct(1 / low - 1)}]"
        if np.isfinite([low, high]).all() and low and high
        else "[no interval]"
    )
    rho = comparison["drift"]["rho"]
    drift = f"drift ρ={number(rho, '.2f')}{' (significant)' if comparison['drift']['significant'] else ''}"
    loaded = f", {len(comparison['loaded'])} loaded blocks dropped" if comparison.get("loaded") else ""
    shape = re.sub(r"(\d)x(\d)", "\\1×\\2", workload)
    verdict = comparison.get("reading", comparison["verdict"])  # a record older than the reading has none
    return (
        f"tok/s {change} {interval} ({comparison['arm']} vs {comparison['baseline']}, "
        f"{comparison['blocks']} ABBA blocks, {shape}, {drift}{loaded}) "
        f"→ {verdict} vs ±{gate * 100:g}% gate"
    )


def enforced(comparison: dict) -> bool:
    """Whether a comparison of a gated group is enforced (``canaries.benchmark.canary``): retain@s0 vs plain, and
    replay@s0 vs its floor; every other is reported only."""
    against_plain = comparison["baseline"] == "plain"
    return (comparison["arm"], against_plain) in {("retain@s0", True), ("replay@s0", False)}


def _comparisons(record: dict) -> pd.DataFrame:
    rows = []
    for group in record["measurements"]["groups"]:
        extra = [group["replay_floor"]] if group["replay_floor"] else []
        for c in group["comparisons"] + extra:
            rows.append(
                {
                    "workload": group["label"],
                    "arm": c["arm"],
                    "baseline": c["baseline"],
                    "blocks": c["blocks"],
                    "ratio": c["ratio"],
                    "ci_low": c["ci95"][0],
                    "ci_high": c["ci95"][1],
                    "drift_rho": c["drift"]["rho"],
                    "loaded": len(c.get("loaded", ())),
                    "verdict": c["verdict"],
                    "enforced": group["gated"] and enforced(c),
                }
            )
    return pd.DataFrame(rows)


def _arms(record: dict) -> pd.DataFrame:
    rows = []
    for group in record["measurements"]["groups"]:
        for name in ["plain", *(c["arm"] for c in group["comparisons"])]:  # run order (JSON keys are sorted)
            m = group["arms"][name]
            rows.append(
                {
                    "workload": group["label"],
                    "arm": name,
                    "step_ms": m["step_seconds"] * 1e3,
                    "tokens_per_s": m["tokens_per_second"],
                    "forward_ms": m["forward_seconds"] * 1e3,
                    "rest_ms": m["rest_seconds"] * 1e3,
                    "held_device_MiB": m["held_device_bytes"] / MIB,
                    "held_host_MiB": m["held_host_bytes"] / MIB,
                    "peak_MiB": m["peak_bytes"] / MIB,
                }
            )
    return pd.DataFrame(rows)


def samples_table(record: dict) -> pd.DataFrame:
    """Every raw per-block sample: workload, block, arm, seconds, ratio to plain, whether the block was loaded."""
    rows = []
    for group in record["measurements"]["groups"]:
        for c in group["comparisons"]:
            loaded = set(c["loaded"])
            for block, (arm_s, base_s) in enumerate(zip(c["arm_seconds"], c["baseline_seconds"])):
                rows.append(
                    {
                        "workload": group["label"],
                        "block": block,
                        "arm": c["arm"],
                        "seconds": arm_s,
                        "ratio": arm_s / base_s,
                        "loaded": block in loaded,
                    }
                )
        first = group["comparisons"][0]
        rows += [
            {
                "workload": group["label"],
                "block": block,
                "arm": "plain",
                "seconds": s,
                "ratio": 1.0,
                "loaded": block in set(first["loaded"]),
            }
            for block, s in enumerate(first["baseline_seconds"])
        ]
    return pd.DataFrame(rows)


def plot_ratios(table: pd.DataFrame, gate: float, path: Path) -> Path:
    """Each row's median ratio with its interval against the tie band ``±gate`` (columns of :func:`_comparisons`)."""
    figure = MplFigure(figsize=(7, 0.4 * len(table) + 1.5), layout="constrained")
    axes = figure.add_subplot()
    labels = [f"{r.workload}: {r.arm} / {r.baseline}" for r in table.itertuples()]
    y = np.arange(len(table))
    low = (table["ratio"] - table["ci_low"]).fillna(0).clip(lower=0)
    high = (table["ci_high"] - table["ratio"]).fillna(0).clip(lower=0)
    axes.axvspan(1 - gate, 1 + gate, color="tab:green", alpha=0.15, label=f"tie band ±{gate:.0%}")
    axes.axvline(1.0, color="grey", lw=0.8)
    axes.errorbar(table["ratio"], y, xerr=[low, high], fmt="o", capsize=3)
    axes.set_yticks(y, labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("median ratio of step times, with its interval")
    axes.legend(fontsize=7)
    return save_png(figure, path)


def _plot_blocks(samples: pd.DataFrame, path: Path) -> Path:
    workloads = list(dict.fromkeys(samples["workload"]))
    figure = MplFigure(figsize=(7, 3 * len(workloads)), layout="constrained")
    for index, workload in enumerate(workloads):
        axes = figure.add_subplot(len(workloads), 1, index + 1)
        rows = samples[samples["workload"] == workload]
        for arm, series in rows.groupby("arm", sort=False):
            axes.plot(series["block"], series["seconds"] * 1e3, marker=".", lw=0.8, label=arm)
            flagged = series[series["loaded"]]
            axes.plot(flagged["block"], flagged["seconds"] * 1e3, "x", color="red")
        axes.set_title(f"{workload}: per-block step time (red x: loaded, dropped)", fontsize=9)
        axes.set_xlabel("block")
        axes.set_ylabel("ms")
        axes.legend(fontsize=6, ncol=3)
    return save_png(figure, path)


def _plot_memory(arms: pd.DataFrame, path: Path) -> Path:
    figure = MplFigure(figsize=(7, 0.35 * len(arms) + 1.5), layout="constrained")
    axes = figure.add_subplot()
    labels = [f"{r.workload}: {r.arm}" for r in arms.itertuples()]
    y = np.arange(len(arms))
    axes.barh(y - 0.27, arms["held_device_MiB"], 0.27, label="held, device pool (trainer's accounting)")
    axes.barh(y, arms["held_host_MiB"], 0.27, label="held, host pool (trainer's accounting)")
    axes.barh(y + 0.27, arms["peak_MiB"], 0.27, label="allocation peak of one step")
    axes.set_yticks(y, labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("MiB")
    axes.legend(fontsize=7)
    return save_png(figure, path)


def difference_text(difference: dict) -> str:
    """A profiled difference (``profiling.differences``) in words: never a negative cost.

    ``cost``: ``+2.72 ms [+2.38..+3.05]``; ``saving``: ``1.71 ms faster
    [1.58..1.84]``; ``within noise``: ``within noise [−3.37..+1.84 ms]``.
    """
    mean, (low, high) = difference["mean_seconds"] * 1e3, (x * 1e3 for x in difference["ci"])
    if not np.isfinite([mean, low, high]).all():
        return MISSING
    if difference["reading"] == "cost":
        return f"+{mean:.2f} ms [+{low:.2f}..+{high:.2f}]"
    if difference["reading"] == "saving":
        return f"{-mean:.2f} ms faster [{-high:.2f}..{-low:.2f}]"
    return f"within noise [{low:+.2f}..{high:+.2f} ms]".replace("-", "−")


def _traced(group: dict) -> bool:
    """Whether the group has a profile from traces (a record of an older rtv has a hand-timed one, or none)."""
    return bool(group.get("profile")) and "extra" in group["profile"]


def _profile_table(groups: list[dict]) -> pd.DataFrame:
    """Where retain@s0's extra time goes, per workload profiled from traces (``canaries.benchmark.profiling``)."""
    rows = [
        {
            "workload": g["label"],
            "component": c["name"],
            "retain@s0 − plain per step": difference_text(c),
            "reading": c["reading"],
            "% of plain step": f"{100 * c['mean_seconds'] / g['profile']['plain_step_seconds']:.1f}"
            if c["reading"] == "cost"
            else "",
            "what it buys": c["buys"],
        }
        for g in groups
        if _traced(g)
        for c in g["profile"]["components"]
    ]
    return pd.DataFrame(
        rows,
        columns=["workload", "component", "retain@s0 − plain per step", "reading", "% of plain step", "what it buys"],
    )


def _profile_line(group: dict) -> str:
    if not _traced(group):  # its hand-timed split has no intervals, and its remainder could read as a negative cost
        return (
            f"{group['label']}: this record's profile was hand-timed by an older rtv, without intervals; "
            "it is not shown (rerun rtv bench for the table from traces)."
        )
    profile = group["profile"]
    medians = "; ".join(
        f"{arm}: block {a['median_block']}, {a['median_seconds'] * 1e3:.1f} ms" for arm, a in profile["arms"].items()
    )
    return (
        f"{group['label']}: over {profile['blocks']} profiled blocks ({profile['note']}), retain@s0's step "
        f"against plain's: {difference_text(profile['extra'])}; the table "
        f"'Where retain@s0's extra time goes' splits it from the traces, each component's interval at "
        f"{profile['confidence']:.0%}. Kept traces: the median block of each arm ({medians}). optim_step "
        f"reuses the commit's gradient norm, so the step makes one norm pass where it made two: "
        f"{profile['saved_by_reuse_seconds'] * 1e3:.1f} ms per step saved (README, "
        "'Where the versioned step's time goes')."
    )


PAUSE_LABELS = {
    "save": "trainer.save",
    "load": "Trainer.load",
    "offload": "a forward demoted to offload",
    "publish": "trainer.publish (after its step)",
}


def _pauses_table(pauses: dict | None) -> pd.DataFrame:
    """NOTE [Pause costs] Rule 2: per pause, its seconds and its ratio to the step, each with its interval."""
    columns = [
        "pause",
        "seconds",
        "seconds CI",
        "× step",
        "× step CI",
        "extra s over the step",
        "extra s CI",
        "bytes written",
        "bytes sent",
        "blocks",
        "reading",
    ]
    rows = [
        {
            "pause": PAUSE_LABELS.get(a["arm"], a["arm"]),
            "seconds": number(a["seconds"], ".4g"),
            "seconds CI": interval(*a["seconds_ci"], ".4g"),
            "× step": number(a["ratio"], ".3f"),
            "× step CI": interval(*a["ratio_ci"], ".3f"),
            "extra s over the step": number(a["extra_seconds"], ".4g"),
            "extra s CI": interval(*a["extra_seconds_ci"], ".4g"),
            "bytes written": pauses["bytes"] if a["arm"] == "save" else MISSING,
            "bytes sent": pauses["published_bytes"] if a["arm"] == "publish" else MISSING,
            "blocks": a["blocks"],
            "reading": a["reading"],
        }
        for a in (pauses or {}).get("arms", [])
    ]
    return pd.DataFrame(rows, columns=columns)


def _extra(arm: dict) -> str:
    """An arm's extra seconds over the step with its interval, e.g. ``+0.05 s [0.04..0.06]``."""
    return f"+{number(arm['extra_seconds'], '.4g')} s {interval(*arm['extra_seconds_ci'], '.4g', between='..')}"


def pause_line(pauses: dict) -> str:
    """One sentence for the pause costs (NOTE [Pause costs] Rule 2); a record made before the ``publish`` arm
    reads without it."""
    by_arm = {a["arm"]: a for a in pauses["arms"]}
    save, load, offload = by_arm["save"], by_arm["load"], by_arm["offload"]
    publish = by_arm.get("publish")
    published = (
        f"; a weight publication {_extra(publish)}, sending {pauses['published_bytes'] / MIB:.2f} MiB"
        if publish
        else ""
    )
    return (
        f"Pauses on {pauses['workload']} (step {number(pauses['step_seconds'], '.4g')} s): a save "
        f"{number(save['ratio'], '.2f')} {interval(*save['ratio_ci'], '.2f', between='..')} of a step, "
        f"writing {pauses['bytes'] / MIB:.2f} MiB; a load {number(load['ratio'], '.2f')} "
        f"{interval(*load['ratio_ci'], '.2f', between='..')}; a forward demoted to offload "
        f"{_extra(offload)} a step{published} ({save['blocks']} ABBA blocks; {save['reading']})."
    )


def _headline(record: dict, comparisons: pd.DataFrame) -> tuple[str, str]:
    gated = comparisons[comparisons["enforced"] & (comparisons["arm"] == "retain@s0")]
    if gated.empty:
        return ("passed" if record["passed"] else "failed"), f"{len(comparisons)} comparisons, none enforced"
    row = gated.iloc[0]
    target = record["config"]["target"] or record["config"]["target_reported"]
    gate = record["config"]["gate"]
    return row["verdict"], (
        f"retain@s0 / plain {number(row['ratio'], '.3f')} "
        f"{interval(row['ci_low'], row['ci_high'], '.3f', between='..')} "
        f"vs gate band [{1 - gate:g}, {1 + gate:g}] on {row['workload']} (target median ≤ {target})"
    )


def section(record: dict, folder: Path) -> Section:
    """The benchmark section of a report (module docstring); writes three PNGs and a CSV of samples into ``folder``,
    named after the record's digest (``benchmark-<digest>-ratios.png``, ...)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config, gate = record["config"], record["config"]["gate"]
    comparisons, arms, samples = _comparisons(record), _arms(record), samples_table(record)
    stem = f"benchmark-{record['digest'][:12]}"  # several benchmark records share one plots folder
    samples.to_csv(folder / f"{stem}-samples.csv", index=False)
    figures = [
        Figure(
            path=plot_ratios(comparisons, gate, folder / f"{stem}-ratios.png"),
            caption=f"Median step-time ratio per arm and workload with its interval; green: the ±{gate:.0%} tie band.",
            headline=True,
        ),
        Figure(
            path=_plot_blocks(samples, folder / f"{stem}-blocks.png"),
            caption="Per-block step time of every arm: a trend would show drift; red crosses are loaded blocks.",
        ),
        Figure(
            path=_plot_memory(arms, folder / f"{stem}-memory.png"),
            caption="Bytes each arm holds between forward and backward, and one step's allocation peak.",
        ),
    ]
    lines = [comparison_line(c, g["label"], gate) for g in record["measurements"]["groups"] for c in g["comparisons"]]
    lines += [
        comparison_line(g["replay_floor"], g["label"], gate)
        for g in record["measurements"]["groups"]
        if g["replay_floor"]
    ]
    lines += [_profile_line(g) for g in record["measurements"]["groups"] if g.get("profile")]
    lines += [pause_line(record["measurements"]["pauses"])] if record["measurements"].get("pauses") else []
    links = [
        (
            (
                f"{g['label']}: torch.profiler trace of {arm}'s median profiled block (Chrome trace JSON: Perfetto, "
                "chrome://tracing)"
            ),
            Path(os.path.relpath(path, folder.parent)).as_posix(),
        )  # folder: the page's plots folder
        for g in record["measurements"]["groups"]
        for arm, path in g.get("traces", {}).items()
    ]
    lines.append(
        f"Workloads: {', '.join(config['workloads'])}; {config['threads']} thread(s); "
        f"{'GPU preset run on CPU with its shapes swapped for CPU ones; ' if config['swapped_for_cpu'] else ''}"
        f"{config['note']}."
    )
    verdict, key_figure = _headline(record, comparisons)
    enforced = comparisons["enforced"] if len(comparisons) else pd.Series(dtype=bool)
    failed = [i for i, row in enumerate(comparisons.itertuples()) if row.enforced and row.verdict == "regression"]
    return Section(
        kind=record["kind"],
        title=f"Benchmark ({config['preset']}, {config['profile']})",
        passed=record["passed"],
        verdict=verdict,
        key_figure=key_figure,
        lines=lines,
        tables={
            "Comparisons": comparisons,
            "Arms": arms,
            "Where retain@s0's extra time goes": _profile_table(record["measurements"]["groups"]),
            "Pause costs": _pauses_table(record["measurements"].get("pauses")),
            "Checks": checks_table(record),
        },
        figures=figures,
        links=links,
        failed_rows={"Comparisons": failed},
        shown=not enforced.any(),  # a verdict is shown only when no comparison is enforced (a gated group is)
    )
