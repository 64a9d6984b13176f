"""The view of ``rtv bench --baseline``: HEAD / REV per arm with its interval against the tie band, and its lines.

:func:`section` (``section(record, folder) -> Section``, see ``reports.context``)
reads one ``benchmark-baseline`` record (NOTE [Source against its base] in
``canaries/benchmark/baseline.py``) and draws the benchmark's ratio plot
(``reports.benchmark.plot_ratios``) for its comparisons: each arm's median
ratio of HEAD's step time to REV's with its interval, ``plain`` the A/A
control; one line per comparison says which source scope the figure is for.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .benchmark import comparison_line, plot_ratios
from .context import Figure, Section
from .generic import base_section

__all__ = ["section"]


def _comparisons(record: dict) -> pd.DataFrame:
    workload = f"{record['config']['workload']} ({record['config']['scope']})"
    return pd.DataFrame([{"workload": workload, "arm": c["arm"], "baseline": c["baseline"], "blocks": c["blocks"],
                          "ratio": c["ratio"], "ci_low": c["ci95"][0], "ci_high": c["ci95"][1],
                          "loaded": len(c.get("loaded", ())), "verdict": c["verdict"]}
                         for c in record["measurements"]["comparisons"]])


def section(record: dict, folder: Path) -> Section:
    """The baseline section (module docstring); writes ``baseline-<digest>-ratios.png`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    config, table = record["config"], _comparisons(record)
    plot = plot_ratios(table, config["gate"], folder / f"baseline-{record['digest'][:12]}-ratios.png")
    lines = [comparison_line(c, config["workload"], config["gate"]) for c in record["measurements"]["comparisons"]]
    lines.append(f"ratio = HEAD's step seconds / {config['scope'].split(' ')[0]}'s, for {config['source_scope']}")
    return base_section(record, lines=lines, tables={"HEAD against its base": table},
                        figures=[Figure(path=plot, caption=f"{config['scope']}: each arm's median ratio of step "
                                        "times with its interval, against the tie band (plain: the A/A control).",
                                        headline=True)])
