"""The benchmark history page: one trend plot per (machine, workload, arm) series, its change points and verdict.

``render_history(found, title, out_file)`` takes the series that
``validation.history.series`` found in the store (NOTE [Benchmark history]; the
caller reads the store, so reports keep to evidence and plain data), plots each
series' per-commit median step time with its interval and a dashed line
before the first commit after each change, and writes a Markdown page and its
HTML sibling (PNGs beside them). ``rtv history`` fronts it.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from .classes import result_class
from .numbers import number
from .plots import save_png
from .render import slug

__all__ = ["HistoryPaths", "render_history", "change_line"]


@dataclass(frozen=True)
class HistoryPaths:
    """What :func:`render_history` wrote, and every series it judged."""

    markdown: Path
    html: Path
    plots: list[Path] = field(default_factory=list)
    series: list = field(default_factory=list)  # validation.history.Series


def change_line(change) -> str:  # a validation.history.Change
    """e.g. ``c08: +5.1% step time (Mann-Whitney p=0.0012) → regression``."""
    return (
        f"{change.commit[:12]}: {number(change.change * 100, '+.1f')}% step time "
        f"(Mann-Whitney p={number(change.p_value, '.2g')}) → {change.verdict}"
    )


def _plot(series, path: Path) -> Path:  # a validation.history.Series
    figure = Figure(figsize=(7, 3.2), layout="constrained")
    axes = figure.add_subplot()
    x = range(len(series.commits))
    ms = [s * 1e3 for s in series.seconds]
    low = [
        max(0.0, m - lo * 1e3) if lo == lo else 0.0 for m, lo in zip(ms, series.ci_low)
    ]  # NaN: no interval (old rows)
    high = [max(0.0, hi * 1e3 - m) if hi == hi else 0.0 for m, hi in zip(ms, series.ci_high)]
    axes.errorbar(x, ms, yerr=[low, high], marker="o", capsize=3)
    for change in series.changes:
        axes.axvline(change.index - 0.5, linestyle="--", color="#a11" if change.verdict == "regression" else "#777")
    axes.set_xticks(list(x), [c[:8] for c in series.commits], rotation=60, fontsize=7)
    axes.set_ylabel("median step ms (95% CI)")
    axes.set_title(f"{series.arm} · {series.workload} · machine {series.machine_id} → {series.verdict}", fontsize=9)
    return save_png(figure, path)


def render_history(found: list, title: str, out_file: Path) -> HistoryPaths:
    """Render ``found`` (``validation.history.Series``) under ``title`` into ``out_file`` (.md) and its .html."""
    folder = out_file.parent
    plots = [
        _plot(s, folder / "plots" / f"history-{slug(s.machine_id + '-' + s.workload + '-' + s.arm)}.png") for s in found
    ]
    rows = [
        (s, p.relative_to(folder).as_posix(), "; ".join(map(change_line, s.changes)) or "-")
        for s, p in zip(found, plots)
    ]
    lines = [
        f"# {title}",
        "",
        "| machine | workload | arm | commits | verdict | changes (first commit after) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {s.machine_id} | {s.workload} | {s.arm} | {len(s.commits)} | {s.verdict} | {changes} |"
        for s, _, changes in rows
    ]
    lines += ["", *(f"![{s.arm} {s.workload} {s.machine_id}]({link})" for s, link, _ in rows), ""]
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text("\n".join(lines))
    body = "".join(
        f"<tr><td>{s.machine_id}</td><td>{html.escape(s.workload)}</td><td>{html.escape(s.arm)}</td>"
        f"<td>{len(s.commits)}</td><td class='{result_class(s.verdict)}'>{s.verdict}</td><td>{html.escape(changes)}</td></tr>"
        for s, _, changes in rows
    )
    images = "".join(f"<figure><img src='{link}' alt='{html.escape(s.arm)}'></figure>" for s, link, _ in rows)
    page = out_file.with_suffix(".html")
    page.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1><table id='history'><tr><th>machine</th><th>workload</th><th>arm</th>"
        f"<th>commits</th><th>verdict</th><th>changes</th></tr>{body}</table>{images}</body></html>\n"
    )
    return HistoryPaths(markdown=out_file, html=page, plots=plots, series=found)
