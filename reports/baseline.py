"""The view of ``rtv bench --baseline``: HEAD / REV per arm with its interval against the tie band, and its lines.

:func:`section` (``section(record, folder) -> Section``, see ``reports.context``)
reads one ``benchmark-baseline`` record (NOTE [Source against its base] in
``canaries/benchmark/baseline.py``) and draws the benchmark's ratio plot
(``reports.benchmark.plot_ratios``) for its comparisons: each arm's median
ratio of HEAD's step time to REV's with its interval, ``plain`` the A/A
control; one line per comparison says which source scope the figure is for.
A run whose two sides have the same trainer source (``config["a_a"]``: equal
source digests) is labelled an A/A run
first. Revision labels are short (:func:`short_revisions`): a record written
before they were kept short still plots readable labels.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pandas as pd

from .benchmark import comparison_line, plot_ratios
from .context import Figure, Section
from .generic import base_section

__all__ = ["section", "short_revisions", "A_A_LINE"]


A_A_LINE = (
    "A/A run: REV's trainer source is HEAD's (equal digests), so both sides run the same trainer; a "
    "decided difference here is the method's noise, not a change between revisions"
)


def short_revisions(text: str) -> str:
    """``text`` with every commit hash longer than 12 hex digits cut to its first 12."""
    return re.sub(r"\b([0-9a-f]{12})[0-9a-f]{1,28}\b", r"\1", str(text))


def _comparisons(record: dict) -> pd.DataFrame:
    workload = f"{record['config']['workload']} ({short_revisions(record['config']['scope'])})"
    return pd.DataFrame(
        [
            {
                "workload": workload,
                "arm": c["arm"],
                "baseline": short_revisions(c["baseline"]),
                "blocks": c["blocks"],
                "ratio": c["ratio"],
                "ci_low": c["ci95"][0],
                "ci_high": c["ci95"][1],
                "loaded": len(c.get("loaded", ())),
                "verdict": c["verdict"],
            }
            for c in record["measurements"]["comparisons"]
        ]
    )


def _failed_rows(table: pd.DataFrame, control: str) -> list[int]:
    """The rows that fail the record (its checks): the A/A ``control`` arm decided either way, an arm's regression."""
    decided = {control: ("regression", "gain")}
    return [i for i, row in enumerate(table.itertuples()) if row.verdict in decided.get(row.arm, ("regression",))]


def section(record: dict, folder: Path) -> Section:
    """The baseline section (module docstring); writes ``baseline-<digest>-ratios.png`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    config, table = record["config"], _comparisons(record)
    scope = short_revisions(config["scope"])
    plot = plot_ratios(table, config["gate"], folder / f"baseline-{record['digest'][:12]}-ratios.png")
    lines = [A_A_LINE] if config.get("a_a") else []
    lines += [
        comparison_line(dict(c, baseline=short_revisions(c["baseline"])), config["workload"], config["gate"])
        for c in record["measurements"]["comparisons"]
    ]
    lines.append(f"ratio = HEAD's step seconds / {scope.split(' ')[0]}'s, for {config['source_scope']}")
    built = base_section(
        record,
        lines=lines,
        tables={"HEAD against its base": table},
        failed_rows={"HEAD against its base": _failed_rows(table, config["control"])},
        figures=[
            Figure(
                path=plot,
                caption=f"{scope}: each arm's median ratio of step "
                "times with its interval, against the tie band (plain: the A/A control).",
                headline=True,
            )
        ],
    )
    if not config.get("a_a"):
        return built
    return replace(built, key_figure=f"A/A run (the same trainer source): {built.key_figure}")
