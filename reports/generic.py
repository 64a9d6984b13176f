"""The section every record gets unless its kind has a builder: checks, skipped checks, declared measurements."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from validation.evidence import checks_of

from .context import Section
from .kinds import Kind, kind
from .numbers import number

__all__ = ["checks_table", "measurements_table", "section", "base_section"]


def checks_table(record: dict[str, Any]) -> pd.DataFrame:
    """One row per check (pass / FAIL) and per skipped check, with the detail the record gives for it (``checks_of``)."""
    rows = [
        {"check": c.name, "result": "skipped" if c.skipped else "pass" if c.ok else "FAIL", "detail": c.detail}
        for c in checks_of(record)
    ]
    return pd.DataFrame(rows, columns=["check", "result", "detail"])


def measurements_table(record: dict[str, Any], declared: Kind) -> pd.DataFrame:
    """The measurements ``declared`` names, in its order; a declared key the record lacks says so."""
    m = record.get("measurements", {})
    rows = [
        {"measurement": key, "value": _short(m[key]) if key in m else "(missing from the record)"}
        for key in declared.measurements
    ]
    return pd.DataFrame(rows, columns=["measurement", "value"])


def _short(value: Any) -> str:
    return number(value) if isinstance(value, float) else str(value)


def base_section(record: dict[str, Any], **extra: Any) -> Section:
    """A section with the verdict, checks table and declared measurements; builders add to it via ``extra``."""
    declared = kind(record.get("kind", "")) or Kind(
        name=record.get("kind", "unknown"), title=record.get("kind", "unknown")
    )
    m = record.get("measurements", {})
    key = declared.key_figure
    checks = record.get("checks", {})
    figure = (
        f"{key} {_short(m[key])}"
        if key and key in m
        else f"{sum(map(bool, checks.values()))} of {len(checks)} checks passed"
    )
    tables = {"checks": checks_table(record)}
    if declared.measurements:
        tables["measurements"] = measurements_table(record, declared)
    lines = [] if kind(declared.name) else [f"kind {declared.name!r} is not registered in reports.kinds"]
    fields = dict(
        kind=declared.name,
        title=declared.title,
        passed=record.get("passed", False),
        verdict="passed" if record.get("passed") else "failed",
        key_figure=figure,
        lines=lines,
        tables=tables,
        figures=[],
        failed_rows={},
    )
    for name, value in extra.items():
        fields[name] = {**fields[name], **value} if isinstance(value, dict) else [*fields[name], *value]
    return Section(**fields)


def section(record: dict[str, Any], folder: Path) -> Section:
    """The generic view (the ``section`` builder protocol of ``reports.context``)."""
    return base_section(record)
