"""The report's view of a mutation score (kind ``mutation-score``, written by ``validation.mutation_score``).

The key figure is each package's score (killed over checked, NOTE
[Mutation score] Rule 4); tables give the counts per package and every
survivor with its file, line and mutated lines, so a reader can write the
missing test or call it an equivalent mutant. It reads the record only.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from .context import Section
from .generic import base_section

__all__ = ["section"]


def _score(package: dict[str, Any]) -> str:
    score = package.get("score")
    return "nothing checked" if score is None else f"{score:.0%} ({package['killed']}/{package['checked']})"


def section(record: dict[str, Any], folder: Path) -> Section:
    """The mutation score's section (``folder`` is unused: no figures)."""
    m = record["measurements"]
    packages = m.get("by_package") or {}
    scores = pd.DataFrame(
        [{"package": name, "score": _score(p), **p.get("counts", {})} for name, p in packages.items()]
    ).fillna(0)
    survivors = pd.DataFrame(
        [
            {
                "file": f"{s['file']}:{s['line']}" if s.get("line") else s["file"],
                "status": s["status"],
                "mutated": " / ".join(s.get("removed", [])).strip(),
                "into": " / ".join(s.get("added", [])).strip(),
                "mutant": s["name"],
            }
            for s in m.get("survivors", [])
        ],
        columns=["file", "status", "mutated", "into", "mutant"],
    )
    line = (
        f"{m.get('sampled')} of {m.get('generated')} mutants sampled (seed {record['config'].get('seed')}), "
        f"judged by {', '.join(record['config'].get('tests', []))} with {m.get('tool')} in {m.get('seconds')} s; "
        f"{len(survivors)} survived"
    )
    built = base_section(record, lines=[line], tables={"score by package": scores, "survivors": survivors})
    figure = "; ".join(f"{name} {_score(p)}" for name, p in packages.items()) or "no mutant checked"
    return replace(built, key_figure=f"mutation score {figure}")
