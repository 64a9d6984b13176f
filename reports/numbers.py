"""Numbers as the page, the summary and the terminal write them: ``n/a`` where a value is missing, never ``nan``.

A comparison with too few blocks has no interval, a drift over two points
no correlation: the record keeps NaN (JSON's ``NaN``), and every text a
person reads says ``n/a`` instead (:func:`number`, :func:`interval`).
"""

from __future__ import annotations

import math

__all__ = ["MISSING", "number", "interval"]

MISSING = "n/a"


def number(value: object, spec: str = ".4g") -> str:
    """``value`` formatted with ``spec``; :data:`MISSING` for None, NaN or an infinity; a non-number as its text."""
    if value is None or isinstance(value, bool):
        return MISSING if value is None else str(value)
    try:
        finite = math.isfinite(float(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(value)
    return format(value, spec) if finite else MISSING


def interval(low: object, high: object, spec: str = ".3f", *, between: str = ", ") -> str:
    """``[low, high]`` formatted with ``spec``, or ``no interval`` when either end is missing or not finite."""
    ends = number(low, spec), number(high, spec)
    return "no interval" if MISSING in ends else f"[{ends[0]}{between}{ends[1]}]"
