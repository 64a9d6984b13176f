"""One page per run: every evidence record with its verdict, checks, key measurements, environment and source.

:func:`render_report` reads a folder of evidence (``reports.tables``), draws
the plots (``reports.plots``) and writes ``index.md`` and ``index.html``
beside them (default: ``<folder>/report/``). Links to records and plots are
relative, so the folder can be moved or uploaded as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from .plots import make_plots
from .tables import (
    LoadedRecord,
    checks_table,
    lifecycle_table,
    load_records,
    measurements_table,
    ratio_table,
    records_table,
)

__all__ = ["ReportPaths", "render_report", "MAX_MEASUREMENTS"]

MAX_MEASUREMENTS = 40  # per record on the page; the JSON has the rest
_VERDICT = {
    "passed": "PASSED",
    "failed": "FAILED",
    "caught": "CAUGHT (a deliberate bug made it fail, as it must)",
    "missed": "NOT CAUGHT (passed under a deliberate bug)",
    "invalid": "INVALID",
    "unverified": "UNVERIFIED",
}
_RESULT = {"passed": "pass", "failed": "**FAIL**", "skipped": "skipped"}


@dataclass(frozen=True)
class ReportPaths:
    """What :func:`render_report` wrote, and the run's overall verdict."""

    markdown: Path
    html: Path
    plots: list[Path] = field(default_factory=list)
    records: int = 0
    passed: bool = False


@dataclass
class _Section:
    record: LoadedRecord
    link: str
    checks: pd.DataFrame
    measurements: pd.DataFrame
    hidden_measurements: int
    plots: list[str]
    config: dict[str, Any]
    lifecycle: pd.DataFrame

    @property
    def verdict(self) -> str:
        return _VERDICT[self.record.status]


def _summary(records: list[LoadedRecord]) -> dict[str, int]:
    counts = {status: 0 for status in _VERDICT}
    for r in records:
        counts[r.status] += 1
    return counts


def _overall(counts: dict[str, int]) -> bool:
    """Passed: at least one record passed; none failed, missed a mutation or is invalid.

    Records of other schemas are listed, not judged; mutated runs that failed
    (caught) are what they should be.
    """
    return counts["passed"] > 0 and not (counts["failed"] or counts["missed"] or counts["invalid"])


def _config_summary(record: dict[str, Any]) -> dict[str, Any]:
    config = record.get("config") if isinstance(record.get("config"), dict) else {}
    keep = ("name", "preset", "profile", "device", "mutation", "sequences", "seq_len", "blocks", "presets")
    shown = {k: config[k] for k in keep if k in config and not isinstance(config[k], dict)}
    if isinstance(config.get("preset"), dict) and "name" in config["preset"]:
        shown["preset"] = config["preset"]["name"]
    return shown


def _lifecycle_grid(rows: pd.DataFrame) -> pd.DataFrame:
    """Placement x lifecycle point, each cell ``device B / host B``."""
    if rows.empty:
        return pd.DataFrame()
    cells = rows.pivot_table(index=["placement", "point"], columns="pool", values="bytes", aggfunc="first", sort=False)
    text = cells.apply(lambda r: " / ".join(f"{int(r[c])}" for c in cells.columns), axis=1).rename("bytes")
    grid = text.reset_index().pivot(index="placement", columns="point", values="bytes")
    grid = grid.reindex(index=list(dict.fromkeys(rows["placement"])), columns=list(dict.fromkeys(rows["point"])))
    return grid.reset_index()


def _sections(records: list[LoadedRecord], plots: dict[str, list[Path]], folder: Path) -> list[_Section]:
    checks, measurements, lifecycle = checks_table(records), measurements_table(records), lifecycle_table(records)
    sections = []
    for r in records:
        grid = _lifecycle_grid(lifecycle[lifecycle["record"] == r.name])
        mine = measurements[measurements["record"] == r.name]
        if not grid.empty:  # shown as its own table and plot
            mine = mine[~mine["key"].str.startswith("lifecycle_bytes.")]
        sections.append(
            _Section(
                record=r,
                link=Path(os.path.relpath(r.path, folder)).as_posix(),
                checks=checks[checks["record"] == r.name],
                measurements=mine.head(MAX_MEASUREMENTS),
                hidden_measurements=max(0, len(mine) - MAX_MEASUREMENTS),
                plots=[Path(os.path.relpath(p, folder)).as_posix() for p in plots.get(r.name, [])],
                config=_config_summary(r.record),
                lifecycle=grid,
            )
        )
    return sections


def _cell(value: Any) -> str:
    text = str(value)
    return text.replace("|", "\\|").replace("\n", "<br>")


def _md_table(frame: pd.DataFrame, columns: list[str], headers: list[str] | None = None) -> list[str]:
    lines = ["| " + " | ".join(headers or columns) + " |", "|" + "---|" * len(columns)]
    for row in frame[columns].itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return lines


def _render_markdown(title: str, records: list[LoadedRecord], sections: list[_Section], generated: str) -> str:
    """The page as Markdown (``sections`` from the same records)."""
    counts = _summary(records)
    overall = "PASSED" if _overall(counts) else "FAILED"
    lines = [f"# {title}", "", f"Generated {generated}. **{overall}**: {len(records)} records, "
             + ", ".join(f"{n} {status}" for status, n in counts.items() if n) + ".", ""]
    table = records_table(records)
    lines += _md_table(table, ["record", "kind", "status", "passed", "failed", "skipped"],
                       ["record", "kind", "verdict", "checks passed", "failed", "skipped"])
    for s in sections:
        r = s.record
        env = r.record.get("environment") if isinstance(r.record.get("environment"), dict) else {}
        source = r.record.get("source") if isinstance(r.record.get("source"), dict) else {}
        lines += ["", f"## {r.name}: {s.verdict}", "",
                  f"- kind: `{r.kind}`; file: [{s.link}]({s.link}); integrity: {r.integrity}",
                  f"- created: {r.record.get('created') or r.record.get('created_utc') or 'unknown'}"]
        if s.config:
            lines.append("- config: " + ", ".join(f"{k}={v}" for k, v in s.config.items()))
        if env:
            lines.append("- environment: " + ", ".join(
                f"{k} {env[k]}" for k in ("python", "torch", "platform", "cuda", "cpu_count") if env.get(k) is not None))
        if source:
            lines.append("- source: " + ", ".join(f"{k} `{v}`" for k, v in source.items()))
        if not s.checks.empty:
            shown = s.checks.assign(result=s.checks["result"].map(_RESULT))
            lines += ["", *_md_table(shown, ["check", "result", "detail"])]
        if not s.lifecycle.empty:
            columns = list(s.lifecycle.columns)
            lines += ["", "Bytes held (device / host) at each lifecycle point:", "", *_md_table(s.lifecycle, columns)]
        if not s.measurements.empty:
            lines += ["", "Key measurements:", "", *_md_table(s.measurements, ["key", "value"])]
            if s.hidden_measurements:
                lines.append(f"\n... {s.hidden_measurements} more in [{s.link}]({s.link})")
        for plot in s.plots:
            lines += ["", f"![{Path(plot).stem}]({plot})"]
    return "\n".join(lines) + "\n"


_HTML = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(
    """<!doctype html>
<html><head><meta charset="utf-8"><title>{{ title }}</title>
<style>
body { font-family: sans-serif; margin: 2em; max-width: 72em; }
table { border-collapse: collapse; margin: 0.5em 0; } td, th { border: 1px solid #ccc; padding: 2px 6px; font-size: 90%; }
.passed, .pass, .caught { color: #161; } .failed, .fail, .invalid, .missed { color: #a11; font-weight: bold; }
.skipped, .unverified { color: #777; }
</style></head><body>
<h1>{{ title }}</h1>
<p>Generated {{ generated }}. <span class="{{ 'passed' if overall == 'PASSED' else 'failed' }}">{{ overall }}</span>:
{{ records|length }} records{% for status, n in counts.items() if n %}, {{ n }} {{ status }}{% endfor %}.</p>
<table><tr><th>record</th><th>kind</th><th>verdict</th><th>checks passed</th><th>failed</th><th>skipped</th></tr>
{% for row in summary %}<tr><td><a href="#{{ row.record }}">{{ row.record }}</a></td><td>{{ row.kind }}</td>
<td class="{{ row.status }}">{{ row.status }}</td><td>{{ row.passed }}</td><td>{{ row.failed }}</td><td>{{ row.skipped }}</td></tr>
{% endfor %}</table>
{% for s in sections %}
<h2 id="{{ s.record.name }}">{{ s.record.name }}: <span class="{{ s.record.status }}">{{ s.verdict }}</span></h2>
<ul><li>kind <code>{{ s.record.kind }}</code>; file <a href="{{ s.link }}">{{ s.link }}</a>; integrity: {{ s.record.integrity }}</li>
{% if s.config %}<li>config: {% for k, v in s.config.items() %}{{ k }}={{ v }}{% if not loop.last %}, {% endif %}{% endfor %}</li>{% endif %}
{% set env = s.record.record.get('environment') or {} %}{% if env %}<li>environment: python {{ env.get('python') }}, torch {{ env.get('torch') }}, {{ env.get('platform') }}{% if env.get('cuda') %}, {{ env.get('cuda') }}{% endif %}</li>{% endif %}
{% set src = s.record.record.get('source') or {} %}{% if src %}<li>source: {% for k, v in src.items() %}{{ k }} <code>{{ v }}</code>{% if not loop.last %}, {% endif %}{% endfor %}</li>{% endif %}
</ul>
{% if s.checks|length %}<table><tr><th>check</th><th>result</th><th>detail</th></tr>
{% for c in s.checks.itertuples() %}<tr><td>{{ c.check }}</td><td class="{{ c.result }}">{{ c.result }}</td><td>{{ c.detail }}</td></tr>
{% endfor %}</table>{% endif %}
{% if s.lifecycle|length %}<p>Bytes held (device / host) at each lifecycle point:</p><table><tr>{% for c in s.lifecycle.columns %}<th>{{ c }}</th>{% endfor %}</tr>
{% for row in s.lifecycle.itertuples(index=False) %}<tr>{% for v in row %}<td>{{ v }}</td>{% endfor %}</tr>
{% endfor %}</table>{% endif %}
{% if s.measurements|length %}<table><tr><th>measurement</th><th>value</th></tr>
{% for m in s.measurements.itertuples() %}<tr><td>{{ m.key }}</td><td>{{ m.value }}</td></tr>
{% endfor %}</table>{% if s.hidden_measurements %}<p>... {{ s.hidden_measurements }} more in <a href="{{ s.link }}">the record</a></p>{% endif %}{% endif %}
{% for plot in s.plots %}<p><img src="{{ plot }}" alt="{{ plot }}"></p>{% endfor %}
{% endfor %}
</body></html>
"""
)


def _render_html(title: str, records: list[LoadedRecord], sections: list[_Section], generated: str) -> str:
    """The page as HTML (the same content as the Markdown page)."""
    counts = _summary(records)
    overall = "PASSED" if _overall(counts) else "FAILED"
    summary = list(records_table(records).itertuples())
    return _HTML.render(title=title, generated=generated, overall=overall, counts=counts, records=records,
                        summary=summary, sections=sections)


def render_report(in_dir: Path, out_file: Path | None = None, *, title: str | None = None) -> ReportPaths:
    """Render every record under ``in_dir`` into ``out_file`` (Markdown) and its ``.html`` sibling.

    ``out_file`` defaults to ``<in_dir>/report/index.md``; plots go to a
    ``plots/`` folder beside it. ``passed``: at least one record passed and
    none failed, missed its deliberate bug or is invalid.
    """
    in_dir = Path(in_dir)
    out_file = Path(out_file) if out_file is not None else in_dir / "report" / "index.md"
    if out_file.suffix.lower() != ".md":
        raise ValueError(f"report output {out_file}: expected a Markdown file name ending in .md")
    records = load_records(in_dir)
    folder = out_file.parent
    plots = make_plots(lifecycle_table(records), ratio_table(records), folder / "plots")
    sections = _sections(records, plots, folder)
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    title = title or f"rtv report: {in_dir}"
    folder.mkdir(parents=True, exist_ok=True)
    out_file.write_text(_render_markdown(title, records, sections, generated))
    html = out_file.with_suffix(".html")
    html.write_text(_render_html(title, records, sections, generated))
    counts = _summary(records)
    return ReportPaths(
        markdown=out_file,
        html=html,
        plots=[p for paths in plots.values() for p in paths],
        records=len(records),
        passed=_overall(counts),
    )
