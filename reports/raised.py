"""The report's view of a canary that raised (kind ``canary-raised``, written by ``canaries.registry``).

The record has no verdict of the canary's own: ``rtv run`` wrote it failed
when the canary raised, so the board shows it under the canary's name
(``config["canary"]``), failed, with what it raised as the key figure. The
section says what was raised on which preset, shows the innermost frames
and, for a hang (``validation.hangs.HangDetected``), the watchdog's
diagnosis: its text, the first collective where the ranks differ, the odd
and dead ranks, and the folder of the dumps and ``diagnosis.json`` (``validation.hangs``), relative
to the run folder when it lies inside it. It reads the record only.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from .context import Section
from .generic import base_section

__all__ = ["section"]


def _ranks(ranks: list[int] | None) -> str:
    return ", ".join(map(str, ranks)) if ranks else "none"


def _diagnosis_table(diagnosis: dict[str, Any]) -> pd.DataFrame:
    rows = {
        "first collective where the ranks differ": diagnosis.get("collective") or "none named",
        "odd ranks": _ranks(diagnosis.get("odd_ranks")),
        "dead ranks (left no dump)": _ranks(diagnosis.get("dead_ranks")),
        "ranks that dumped": _ranks(diagnosis.get("dumped_ranks")),
    }
    return pd.DataFrame([{"what": what, "value": value} for what, value in rows.items()], columns=["what", "value"])


def section(record: dict[str, Any], folder: Path) -> Section:
    """A raised canary's section (``folder`` is unused: no figures)."""
    config, m = record["config"], record["measurements"]
    first_line = (m["message"].splitlines() or [""])[0]
    ran = f"on preset {config['preset']} (profile {config['profile']})"
    lines = [f"Canary {config['canary']} raised {m['error']} {ran} before it had a verdict: {first_line}"]
    tables = {"traceback, innermost frame last": pd.DataFrame({"frame": m["traceback"]}, columns=["frame"])}
    diagnosis = m.get("diagnosis")
    if diagnosis is not None:
        lines += [
            f"Hang diagnosis: {diagnosis['text']}",
            f"Dumps and diagnosis: `{m['dumps']}` (relative to the run folder unless absolute)",
        ]
        tables = {"hang diagnosis": _diagnosis_table(diagnosis), **tables}
    built = base_section(record, lines=lines, tables=tables)
    key = f"hung: {diagnosis['text']}" if diagnosis is not None else f"raised {m['error']}: {first_line}"
    return replace(
        built, verdict="hung" if diagnosis is not None else "raised", key_figure=key, canary=config["canary"]
    )
