"""The report context: what a page shows, built from evidence, rendered by the Markdown and HTML templates.

Each evidence kind that has its own view provides a section builder::

    def section(record: dict, folder: Path) -> Section

in a module of this package (registered in ``reports.kinds``). It reads only
the record (never re-runs anything), writes its figures into ``folder`` and
returns a :class:`Section`: the data the templates render. Kinds without a
builder get the generic view (checks and declared measurements,
``reports.generic``).

:class:`ReportContext` is the whole page: one :class:`RecordView` per
evidence file (its section, or why it is invalid) and the run's verdict.
``reports.render`` builds it from a folder of evidence and renders it with
the two templates in ``reports/templates`` (``report.md.j2``,
``report.html.j2``); both see the same context, so they show the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

__all__ = ["Figure", "Section", "RecordView", "ReportContext"]


@dataclass(frozen=True, kw_only=True)
class Figure:
    """A plot file written by a section builder, with the caption shown under it."""

    path: Path
    caption: str


@dataclass(frozen=True, kw_only=True)
class Section:
    """One evidence record's view on the page.

    ``verdict``: the one-word outcome shown on the verdict board
    (``passed``, ``failed``, ``tie``, ``equivalent``, ...); ``key_figure``:
    the one line beside it (e.g. ``worst gradient error 3e-7 (threshold 1e-5)``);
    ``lines``: short sentences shown first in the section (one per
    comparison, say); ``tables``: titled pandas tables; ``figures``: plots.
    """

    kind: str
    title: str
    passed: bool
    verdict: str
    key_figure: str
    lines: list[str] = field(default_factory=list)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: list[Figure] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class RecordView:
    """One evidence file on the page: where it is (relative link), its status and integrity, its section.

    ``section`` is None for an invalid file (``integrity`` says why);
    ``figures`` are the section's plots as links relative to the page.
    """

    name: str
    link: str
    status: str  # passed | failed | invalid
    integrity: str
    created: str
    environment: dict
    source: dict
    section: Section | None
    figures: list[Figure] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class ReportContext:
    """The page: title, when it was made, the records, and the verdict.

    ``passed``: at least one record, every record verified, every record passed.
    """

    title: str
    generated: str
    records: list[RecordView]

    @property
    def counts(self) -> dict[str, int]:
        counts = {"passed": 0, "failed": 0, "invalid": 0}
        for view in self.records:
            counts[view.status] += 1
        return counts

    @property
    def passed(self) -> bool:
        return bool(self.records) and self.counts["passed"] == len(self.records)
