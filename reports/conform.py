"""The report's view of a conformance run (kind ``conform``, written by ``validation.conform.record``).

A table of adapters x checks (``passed``, ``FAILED: <reason>``, ``not
applicable``; a negative control's expected failure reads ``failed, as it
must``), then one row per failure with its worst element: the parameter,
the index, the adapter's value and the oracle's. It reads the record only.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from .context import Section
from .generic import base_section

__all__ = ["section"]


def _cell(verdict: dict[str, Any], control: bool) -> str:
    status = verdict["status"]
    if status == "failed":
        return "failed, as it must (negative control)" if control else f"FAILED: {verdict['reason']}"
    return status


def _grid(adapters: dict[str, Any], controls: dict[str, str], order: list[str]) -> pd.DataFrame:
    """``order``: the suite's order of its checks, as the record states it; a check it does not name goes last."""
    seen = dict.fromkeys(c for a in adapters.values() for c in a["verdicts"])
    checks = [c for c in order if c in seen] + [c for c in seen if c not in order]
    rows = [
        {
            "adapter": name,
            "capabilities": ", ".join(a["capabilities"]) or "none",
            **{c: _cell(a["verdicts"][c], controls.get(name) == c) if c in a["verdicts"] else "" for c in checks},
        }
        for name, a in adapters.items()
    ]
    return pd.DataFrame(rows, columns=["adapter", "capabilities", *checks])


def _failures(adapters: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for name, a in adapters.items():
        for check, verdict in a["verdicts"].items():
            worst = verdict["evidence"].get("worst") or {}
            if verdict["status"] == "failed":
                rows.append(
                    {
                        "adapter": name,
                        "check": check,
                        "parameter": worst.get("parameter", ""),
                        "index": str(worst.get("index", "")),
                        "found": worst.get("found", ""),
                        "oracle": worst.get("oracle", ""),
                        "error": worst.get("error", ""),
                        "tolerance": worst.get("tolerance", ""),
                    }
                )
    return pd.DataFrame(
        rows, columns=["adapter", "check", "parameter", "index", "found", "oracle", "error", "tolerance"]
    )


def _as_required(checks: dict[str, bool], name: str, adapter: dict[str, Any], control: str | None) -> bool:
    """No check failed, and a negative control's check fired (the record's check of it passed)."""
    return all(
        checks.get(f"{name} {c} fails (negative control)") is True if c == control else v["status"] != "failed"
        for c, v in adapter["verdicts"].items()
    )


def section(record: dict[str, Any], folder: Path) -> Section:
    """The conformance section (``folder`` is unused: no figures)."""
    adapters = record["measurements"]["adapters"]
    controls = record["config"].get("negative_controls", {})
    spec = record["config"]["spec"]
    line = (
        f"spec: vocab {spec['vocab_size']}, hidden {spec['hidden_size']}, {spec['layers']} layer(s), seq "
        f"{spec['seq_len']}, batch {spec['batch']}, {spec['dtype']}, max staleness {spec['max_staleness']}, "
        f"seed {spec['seed']}"
    )
    notes = [f"{name}: {a['notes']}" for name, a in adapters.items() if a.get("notes")]
    grid = _grid(adapters, controls, record["config"].get("check_order", []))
    built = base_section(
        record, lines=[line, *notes], tables={"adapters x checks": grid, "failures": _failures(adapters)}
    )
    passing = sum(1 for name, a in adapters.items() if _as_required(record["checks"], name, a, controls.get(name)))
    return replace(built, key_figure=f"{passing} of {len(adapters)} adapters as required")
