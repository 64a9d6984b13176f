"""Reports: evidence JSON files in, tables (pandas), plots (matplotlib, Agg) and a page per run out.

Reads files only: it imports neither ``reference_trainer`` nor ``canaries``
(``validation.evidence`` is used to check each record's schema and digest).
Entry point: :func:`render_report`; ``rtv report`` fronts it.
"""

from .render import ReportPaths, render_report
from .tables import (
    LoadedRecord,
    checks_table,
    lifecycle_table,
    load_records,
    measurements_table,
    ratio_table,
    records_table,
)

__all__ = [
    "LoadedRecord",
    "ReportPaths",
    "checks_table",
    "lifecycle_table",
    "load_records",
    "measurements_table",
    "ratio_table",
    "records_table",
    "render_report",
]
