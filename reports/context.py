"""The report context: what a page shows, built from evidence, rendered by the Markdown and HTML templates.

Each evidence kind that has its own view provides a section builder::

    def section(record: dict, folder: Path) -> Section

in a module of this package (registered in ``reports.kinds``). It reads only
the record (never re-runs anything), writes its figures into ``folder`` and
returns a :class:`Section`: the data the templates render. Kinds without a
builder get the generic view (checks and declared measurements).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

__all__ = ["Figure", "Section"]


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
