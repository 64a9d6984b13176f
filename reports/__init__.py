"""Reports: evidence JSON files in, one Markdown and one HTML page per run out (pandas tables, matplotlib plots).

Reads files only: it imports neither ``reference_trainer`` nor ``canaries``
(``validation.evidence`` checks each record's schema and digest). Entry
point: :func:`render_report`; ``rtv report`` fronts it. A new evidence kind
gets its view with one line in ``reports.kinds`` (and, if it needs more than
checks and declared measurements, a section builder module).
"""

from .records import LoadedRecord, load_records
from .render import ReportPaths, build_context, render_report

__all__ = ["LoadedRecord", "ReportPaths", "build_context", "load_records", "render_report"]
