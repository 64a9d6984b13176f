"""One page per run: the report context built from a folder of evidence, rendered as Markdown and HTML.

:func:`build_context` loads every record (``reports.records``), asks each
kind's builder (``reports.kinds``) for its section, writes the figures
beside the page and makes every link relative, so the folder can be moved
or uploaded as it is. :func:`render_report` renders the context with the two
jinja2 templates in ``reports/templates``: the Markdown links its plots, the
HTML embeds them as data URIs (one self-contained file).

The page reads top down: records that failed or do not verify,
each with its failed checks and why; the verdict board (one row per record,
id ``verdict-board``); the headline plots; then each record's section
(``section-<name>``, its tables ``<section id>-table-<n>``).
"""

from __future__ import annotations

import base64
import importlib
import os
import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import jinja2

from validation.errors import SetupError

from .classes import classed_rows, result_class
from .context import RecordView, ReportContext, Section
from .generic import checks_table
from .kinds import kind
from .numbers import number
from .records import LoadedRecord, find_records, load_records

__all__ = ["ReportPaths", "build_context", "render_report"]

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
    undefined=jinja2.StrictUndefined,
    autoescape=jinja2.select_autoescape(["html.j2"]),
    keep_trailing_newline=True,
)
_TEMPLATES.filters["cell"] = lambda value: str(value).replace("|", "\\|").replace("\n", "<br>")  # one backslash


def slug(text: str) -> str:
    """``text`` as an HTML id fragment: lower case letters, digits and dashes."""
    return re.sub(r"[^A-Za-z0-9]+", "-", str(text)).strip("-").lower()


_TEMPLATES.filters["slug"] = slug
_TEMPLATES.filters["value"] = lambda value: number(value) if isinstance(value, float) else value  # never "nan"
_TEMPLATES.filters["css"] = result_class  # the page's fixed class vocabulary (reports.classes)
_TEMPLATES.filters["classed_rows"] = classed_rows


def _data_uri(path: Path) -> str:
    """A PNG as a data URI (the HTML page carries its plots)."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


@dataclass(frozen=True)
class ReportPaths:
    """What :func:`render_report` wrote, and the run's overall verdict."""

    markdown: Path
    html: Path
    plots: list[Path] = field(default_factory=list)
    records: int = 0
    passed: bool = False
    skipped: list[Path] = field(default_factory=list)


def _section(loaded: LoadedRecord, folder: Path) -> Section:
    declared = kind(loaded.kind)
    module = importlib.import_module(declared.builder if declared and declared.builder else "reports.generic")
    return module.section(loaded.record, folder)


def _failed_checks(loaded: LoadedRecord) -> list[tuple[str, str]]:
    if loaded.status == "invalid":
        return [("integrity", loaded.integrity)]
    failed = checks_table(loaded.record).query("result == 'FAIL'")
    return [(row.check, row.detail or "the record gives no detail") for row in failed.itertuples()]


def _view(loaded: LoadedRecord, folder: Path) -> RecordView:
    relative = lambda path: Path(os.path.relpath(path, folder)).as_posix()  # noqa: E731
    section = None if loaded.status == "invalid" else _section(loaded, folder / "plots")
    figures = [] if section is None else [replace(f, path=Path(relative(f.path))) for f in section.figures]
    return RecordView(
        name=loaded.name,
        anchor="section-" + slug(loaded.name),
        link=relative(loaded.path),
        status=loaded.status,
        integrity=loaded.integrity,
        created=loaded.record.get("created", "unknown"),
        environment=loaded.record.get("environment", {}),
        source=loaded.record.get("source", {}),
        section=section,
        figures=figures,
        failed_checks=_failed_checks(loaded),
        injected=[str(fault) for fault in loaded.record.get("config", {}).get("injected", [])],
        forced=loaded.record.get("config", {}).get("inject_failure") is True,
    )


def build_context(in_dir: Path, folder: Path, *, title: str) -> ReportContext:
    """The page for every record under ``in_dir``, its figures written under ``folder / "plots"``."""
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    records = [_view(r, folder) for r in load_records(in_dir)]  # SetupError when in_dir is no folder
    skipped = [Path(os.path.relpath(path, folder)).as_posix() for path in find_records(in_dir).skipped]
    return ReportContext(title=title, generated=generated, records=records, skipped=skipped)


def render_report(in_dir: Path, out_file: Path | None = None, *, title: str | None = None) -> ReportPaths:
    """Render every record under ``in_dir`` into ``out_file`` (Markdown) and its ``.html`` sibling.

    ``out_file`` defaults to ``<in_dir>/report/index.md``; plots go to a
    ``plots/`` folder beside it. Raises :class:`SetupError` for a name that
    does not end in ``.md`` or an ``in_dir`` that is not a folder.
    """
    in_dir = Path(in_dir)
    out_file = Path(out_file) if out_file is not None else in_dir / "report" / "index.md"
    if out_file.suffix.lower() != ".md":
        raise SetupError(f"report output {out_file} is not a Markdown file name", fix="pass --out FILE ending in .md")
    folder = out_file.parent
    context = build_context(in_dir, folder, title=title or f"rtv report: {in_dir}")
    folder.mkdir(parents=True, exist_ok=True)
    out_file.write_text(_TEMPLATES.get_template("report.md.j2").render(page=context))
    html = out_file.with_suffix(".html")
    embedded = {str(f.path): _data_uri(folder / f.path) for view in context.records for f in view.figures}
    html.write_text(_TEMPLATES.get_template("report.html.j2").render(page=context, embedded=embedded))
    plots = [folder / f.path for view in context.records for f in view.figures]
    return ReportPaths(
        markdown=out_file,
        html=html,
        plots=plots,
        records=len(context.records),
        passed=context.passed,
        skipped=[Path(os.path.normpath(folder / path)) for path in context.skipped],
    )
