"""Section builders for the CPU canaries' evidence: derivative cells, memory lifecycle, mutation verdicts, kill points.

One ``section(record, folder) -> Section`` (``reports.context``) serves the
four kinds ``reports.kinds`` points here; it dispatches on ``record["kind"]``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from .context import Figure, Section
from .generic import base_section
from .numbers import number
from .plots import plot_lifecycle

__all__ = ["section"]


def _derivative(record: dict[str, Any], folder: Path) -> Section:
    m = record["measurements"]
    cells = pd.DataFrame(m["cells"], columns=["staleness", "placement", "corrected", "checkpoint", "records"])
    grid = cells.pivot_table(
        index=["checkpoint", "staleness"],
        columns=["placement", "corrected"],
        values="records",
        aggfunc="sum",
        fill_value=0,
    )
    grid.columns = [f"{p} {'corrected' if c else 'plain'}" for p, c in grid.columns]
    line = (
        f"{m['examples_backpropagated']} of {m['examples']} explored examples backpropagated; "
        f"{number(m['stale_share_of_checked'], '.0%')} of {m['records_checked']} judged records were stale"
    )
    built = base_section(record, lines=[line], tables={"judged records per cell": grid.reset_index()})
    threshold = record["config"]["tolerances"]["gradient"]
    return replace(
        built,
        key_figure=(
            f"worst gradient error {number(m['worst_gradient_relative_l2'], '.2g')} vs "
            f"threshold {number(threshold, '.2g')} "
            f"({number(m['worst_gradient_error_over_threshold'], '.0%')} of it)"
        ),
    )


def _lifecycle_order(record: dict[str, Any]) -> list[str]:
    """The lifecycle points in the order a step passes them: the record's ``config["points"]`` (its JSON keys
    come sorted, so alphabetically), then any point the config does not list."""
    found = [point for points in record["measurements"]["lifecycle_bytes"].values() for point in points]
    return list(dict.fromkeys([*(p for p in record["config"].get("points", []) if p in found), *found]))


def _memory(record: dict[str, Any], folder: Path) -> Section:
    lifecycle, order = record["measurements"]["lifecycle_bytes"], _lifecycle_order(record)
    rows = [
        {"placement": placement, "point": point, "pool": pool, "bytes": value}
        for point in order
        for placement, points in lifecycle.items()
        if point in points
        for pool, value in points[point].items()
    ]
    table = pd.DataFrame(rows, columns=["placement", "point", "pool", "bytes"])
    figures = []
    if not table.empty:
        path = plot_lifecycle(table, folder / f"lifecycle-{record['digest'][:12]}.png", title="bytes held")
        figures.append(
            Figure(path=path, caption="Bytes held at each lifecycle point, per placement and pool", headline=True)
        )
    grid = table.pivot_table(index="placement", columns=["point", "pool"], values="bytes", aggfunc="first", sort=False)
    grid.columns = [f"{point} ({pool})" for point, pool in grid.columns]
    built = base_section(record, tables={"bytes held at each lifecycle point": grid.reset_index()}, figures=figures)
    after = table[table["point"] == "after_backward"]
    left = ", ".join(
        f"{pool} {int(after[after['pool'] == pool]['bytes'].max())} B" for pool in dict.fromkeys(after["pool"])
    )
    placements = ", ".join(dict.fromkeys(after["placement"]))
    return replace(built, key_figure=f"bytes left after backward (most over {placements}): {left or 'not measured'}")


def _mutations(record: dict[str, Any], folder: Path) -> Section:
    rows = [
        {
            "mutation": name,
            "caught by": o["caught_by"],
            "verdict": "inapplicable" if not o["applicable"] else "caught" if o["caught"] else "NOT CAUGHT",
            "failed checks": ", ".join(o["failed_checks"]),
            "description": o["description"],
        }
        for name, o in record["measurements"]["mutations"].items()
    ]
    m = record["measurements"]
    built = base_section(record, tables={"injected bugs": pd.DataFrame(rows)})
    return replace(
        built,
        key_figure=f"{len(m['caught'])} of {len(m['run'])} injected bugs caught"
        + (f" ({len(m['inapplicable'])} inapplicable)" if m["inapplicable"] else ""),
    )


def _resume(record: dict[str, Any], folder: Path) -> Section:
    m = record["measurements"]
    rows = [
        {
            "kill point": p["where"],
            "killed": p["killed"],
            "resumed from a save": p["resumed_from_save"],
            "outcome": "bitwise equal" if p["bitwise_equal"] else f"DIFFERS at {p['first_difference']}",
        }
        for p in m["kill_points"]
    ]
    equal = sum(p["killed"] and p["bitwise_equal"] for p in m["kill_points"])
    built = base_section(record, tables={"kill points and outcomes": pd.DataFrame(rows)})
    return replace(
        built,
        key_figure=f"{equal} of {m['kills']} killed jobs resumed bitwise equal "
        f"({m['kills_inside_a_save']} killed inside a save)",
    )


_BUILDERS = {
    "derivative-canary": _derivative,
    "memory-canary": _memory,
    "mutation-suite": _mutations,
    "resume-canary": _resume,
}


def section(record: dict[str, Any], folder: Path) -> Section:
    """The section for a derivative, memory, mutation-suite or resume record."""
    return _BUILDERS[record["kind"]](record, folder)
