"""The HTML page's CSS classes: a fixed vocabulary, chosen from a row's result, never from the text of its cells.

:data:`CLASSES` is the whole vocabulary the page's stylesheet knows:
``passed`` (green), ``failed`` (red: exactly what failed the record),
``shown`` (amber: a verdict shown, not enforced: ``regression``, ``worse``,
``inconclusive`` ...), ``skipped`` (grey). :func:`result_class` maps a
result word to one of them; a word it does not know is ``shown``, never
``failed``. A word alone cannot say whether a verdict was enforced (a
``regression`` fails a gated comparison and is only shown on a reported
one), so a section builder names the rows that failed its record
(``Section.failed_rows``) and :func:`classed_rows` gives their result cell
``failed`` whatever its word. A table's result cell is the cell of its
first column named in :data:`RESULT_COLUMNS`; every other cell gets no
class, so a description that says "failed" or "regression" is plain text.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import pandas as pd

__all__ = ["CLASSES", "RESULT_COLUMNS", "result_class", "classed_rows"]

CLASSES = ("passed", "failed", "shown", "skipped")
RESULT_COLUMNS = ("result", "verdict", "outcome", "state", "status")
_WORDS = {
    "passed": ("pass", "passed", "caught", "tie", "equivalent", "bitwise equal", "measured", "refused"),
    "failed": ("fail", "failed", "not caught", "invalid", "differs", "different"),
    "skipped": ("skipped", "inapplicable", "not run"),
}
_CLASS_OF = {word: css for css, words in _WORDS.items() for word in words}


def result_class(result: object) -> str:
    """The class of a result: its lower-cased text, else its first word, looked up in the vocabulary; else ``shown``."""
    text = str(result).strip().lower()
    return _CLASS_OF.get(text) or _CLASS_OF.get(text.split(" ")[0] if text else "", "shown")


def _result_column(columns: Sequence[str]) -> int | None:
    named = [i for i, column in enumerate(columns) if str(column).lower() in RESULT_COLUMNS]
    return named[0] if named else None


def classed_rows(frame: pd.DataFrame, failed: Collection[int] = ()) -> Iterable[list[tuple[object, str]]]:
    """Each row of ``frame`` as ``(value, class)`` pairs: the result cell's class (``failed`` in a row whose position
    is in ``failed``: it failed the record), ``""`` for every other cell."""
    where = _result_column(list(frame.columns))
    for position, row in enumerate(frame.itertuples(index=False)):
        failed_css = "failed" if position in failed else None
        yield [
            (value, (failed_css or result_class(value)) if index == where else "") for index, value in enumerate(row)
        ]
