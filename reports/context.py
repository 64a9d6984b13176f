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

from .classes import result_class
from .kinds import kind

__all__ = ["Figure", "Section", "RecordView", "ReportContext", "forced_failure"]

FORCED_FAILURE = "failure:"  # how ``rtv run --inject-failure`` names its fault (``canaries.suite``)


def forced_failure(fault: str) -> bool:
    """Whether an injected fault forces a check to fail (``--inject-failure``) rather than mutating the trainer
    (``--inject-mutation``: ``mutation NAME``): it changes no record but the one it fails."""
    return str(fault).startswith(FORCED_FAILURE)


@dataclass(frozen=True, kw_only=True)
class Figure:
    """A plot file written by a section builder, with the caption shown under it.

    ``headline``: shown again near the top of the page, under the verdict
    board (learning curves, throughput ratios, the memory lifecycle).
    """

    path: Path
    caption: str
    headline: bool = False


@dataclass(frozen=True, kw_only=True)
class Section:
    """One evidence record's view on the page.

    ``verdict``: the one-word outcome shown on the verdict board
    (``passed``, ``failed``, ``tie``, ``equivalent``, ...); ``key_figure``:
    the one line beside it (e.g. ``worst gradient error 3e-7 (threshold 1e-5)``);
    ``lines``: short sentences shown first in the section (one per
    comparison, say); ``tables``: titled pandas tables; ``figures``: plots;
    ``links``: ``(text, href)`` of files to open (traces), hrefs relative to the page.
    ``shown``: ``verdict`` is a comparison's outcome the record shows without
    enforcing it (the board reads ``shown: worse``, never ``passed`` beside it).
    ``failed_rows``: per table name, the positions of the rows that failed the
    record (an enforced comparison's ``regression``): their result cell is
    red whatever its word (``reports.classes``); a shown-only verdict stays amber.
    ``canary``: the board's name for the record when the record itself names
    it (a canary that raised, ``reports.raised``); empty: the kind's label.
    """

    kind: str
    title: str
    passed: bool
    verdict: str
    key_figure: str
    lines: list[str] = field(default_factory=list)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: list[Figure] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)
    shown: bool = False
    failed_rows: dict[str, list[int]] = field(default_factory=dict)
    canary: str = ""


@dataclass(frozen=True, kw_only=True)
class RecordView:
    """One evidence file on the page: where it is (relative link), its status and integrity, its section.

    ``section`` is None for an invalid file (``integrity`` says why);
    ``figures`` are the section's plots as links relative to the page;
    ``anchor`` the stable HTML id of its section (``section-<name>``);
    ``failed_checks`` each failed check with the reason the record gives;
    ``injected``: the faults put in on purpose while the record was made
    (its ``config["injected"]``, ``validation.evidence.injected``);
    ``forced``: the record is the one a forced failure was made on (its
    ``config["inject_failure"]``, the smoke check's).
    """

    name: str
    anchor: str
    link: str
    status: str  # passed | failed | invalid
    integrity: str
    created: str
    environment: dict
    source: dict
    section: Section | None
    figures: list[Figure] = field(default_factory=list)
    failed_checks: list[tuple[str, str]] = field(default_factory=list)
    injected: list[str] = field(default_factory=list)
    forced: bool = False

    @property
    def verdict(self) -> str:
        return self.section.verdict if self.section else "invalid"

    @property
    def canary(self) -> str:
        """The board's name for the record: the section's, else the command line's canary name of its kind
        (``reports.kinds``), else its kind."""
        if self.section and self.section.canary:
            return self.section.canary
        name = self.section.kind if self.section else "?"
        declared = kind(name)
        return declared.label if declared else name

    @property
    def marks(self) -> list[str]:
        """The injected faults the board shows beside this record (:func:`forced_failure`): a mutation on every
        record (each was made by the broken trainer), a forced failure only on the record it was forced on."""
        return [fault for fault in self.injected if not forced_failure(fault) or self.forced]

    @property
    def board_class(self) -> str:
        """The verdict cell's class (``reports.classes``): ``shown`` for a shown verdict that passed or a pass made
        by a mutated trainer (not a clean pass), else the status's."""
        shown = self.marks or (self.section is not None and self.section.shown)
        return "shown" if shown and self.status == "passed" else result_class(self.status)

    @property
    def board_verdict(self) -> str:
        """The board's verdict cell: ``shown: tie`` for a shown verdict that passed, ``tie (failed)`` when the
        record failed, the status alone when the section's verdict is its status; the injected faults after it."""
        if self.section and self.section.shown and self.status == "passed":
            text = f"shown: {self.verdict}"
        else:
            text = self.verdict if self.verdict == self.status else f"{self.verdict} ({self.status})"
        return text + "".join(f" · injected: {fault}" for fault in self.marks)

    @property
    def key_figure(self) -> str:
        return self.section.key_figure if self.section else self.integrity


@dataclass(frozen=True, kw_only=True)
class ReportContext:
    """The page: title, when it was made, the records, and the verdict.

    ``passed``: at least one record, every record verified, every record passed.
    ``skipped``: the ``*.json`` below the folder not read as records
    (``reports.records``), as links relative to the page.
    """

    title: str
    generated: str
    records: list[RecordView]
    skipped: list[str] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        counts = {"passed": 0, "failed": 0, "invalid": 0}
        for view in self.records:
            counts[view.status] += 1
        return counts

    @property
    def passed(self) -> bool:
        return bool(self.records) and self.counts["passed"] == len(self.records)

    @property
    def board(self) -> list[RecordView]:
        """The verdict board's rows: failed and invalid records first, then the rest, each in folder order."""
        return sorted(self.records, key=lambda view: view.status == "passed")

    @property
    def failures(self) -> list[RecordView]:
        """The records shown first, above the board: those that failed or do not verify."""
        return [view for view in self.records if view.status != "passed"]

    @property
    def injected(self) -> list[str]:
        """Every fault injected on purpose into some record of the page, once each, in board order."""
        return list(dict.fromkeys(fault for view in self.board for fault in view.injected))

    @property
    def injected_note(self) -> str:
        """What the injected faults mean for the page's records: a mutation made every record (a pass too), a
        forced failure only failed the record it names (every other record is the unchanged trainer's)."""
        caught = "a failure below is the injected fault being caught, not a defect of the trainer"
        if any(not forced_failure(fault) for fault in self.injected):
            return f"This run is a negative control: {caught}, and a pass was made by a deliberately broken trainer."
        return (
            f"This run is a negative control: {caught}; the trainer was not changed: the fault forced the "
            "record marked with it on the board to fail, and every other record was made as in any run."
        )

    @property
    def headline(self) -> list[Figure]:
        """The headline plots, in board order."""
        return [figure for view in self.board for figure in view.figures if figure.headline]
