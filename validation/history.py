"""Benchmark history: every benchmark record's step times in an SQLite store, and change points per series.

NOTE [Benchmark history]
1. One row per (record, arm): commit and source digest, arm, workload label,
   machine identity (:func:`machine_identity`: CPU model, core count, torch
   build, device) and the arm's median step seconds with its order-statistic
   interval (``validation.stats.median_ci``). The store is ``sqlite3``: a
   filter and an ordering do not earn DuckDB as a dependency.
2. A series is one (machine, workload, arm); series of different machines are
   never compared or merged, or a runner change would read as a regression.
   A commit's value is the median of its rows, commits in first-recorded
   order.
3. Change points: ``ruptures``' PELT (maintained, numpy/scipy only) on the
   series relative to its median, penalty ``PENALTY * sigma**2 * log(n)``,
   ``sigma`` the median absolute first difference (robust to the steps it
   looks for). Each change names the first commit after it.
4. Verdict per change: the segments after and before, two-sided Mann-Whitney;
   ``regression`` (slower) or ``improvement`` (faster) when ``p < ALPHA`` and
   the change is at least ``MIN_CHANGE``, else ``suspicious``, a class that
   keeps noise from reading as a regression (simulated, 12 commits at 1%
   noise: a 5% step is a regression in ~95% of series, a flat series is at
   most ``suspicious``). A series' verdict is its worst change, ``no change``
   without one, ``insufficient data`` below ``MIN_COMMITS`` commits.
5. Schema versions: ``meta.schema``; an older store gets the newer columns
   added (NULL for old rows) when opened, so old stores always load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import ruptures
from scipy import stats as scipy_stats

from . import stats

__all__ = [
    "SCHEMA",
    "COLUMNS",
    "Change",
    "Series",
    "machine_identity",
    "open_store",
    "append",
    "record_rows",
    "load",
    "series",
    "detect",
    "MIN_COMMITS",
]

SCHEMA = 2
# Column name -> SQL type, in the order of the current schema; version 1 lacked the last two (Rule 5).
COLUMNS = {
    "recorded": "TEXT",
    "record": "TEXT",
    "commit_id": "TEXT",
    "digest": "TEXT",
    "arm": "TEXT",
    "workload": "TEXT",
    "machine_id": "TEXT",
    "machine": "TEXT",
    "seconds": "REAL",
    "ci_low": "REAL",
    "ci_high": "REAL",
}
V1_COLUMNS = tuple(COLUMNS)[:-2]
MIN_COMMITS = 6
PENALTY = 5.0  # Rule 3; the rates it gives are in Rule 4
ALPHA = 0.01
MIN_CHANGE = 0.02
SEVERITY = ("regression", "suspicious", "improvement")


def machine_identity(environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """CPU model, core count, torch build and device name of this machine (or of a record's ``environment``)."""
    import torch

    model = platform.processor()
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    env = environment or {}
    return {
        "cpu": model,
        "cores": env.get("cpu_count", os.cpu_count()),
        "torch": env.get("torch", torch.__version__) + f" cuda={torch.version.cuda}",
        "device": env.get("cuda") or "cpu",
    }


def _machine_id(machine: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:12]


def open_store(path: Path) -> sqlite3.Connection:
    """Open (creating, or upgrading an older schema: Rule 5) the store at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
    db.execute(f"CREATE TABLE IF NOT EXISTS results ({', '.join(f'{c} {t}' for c, t in COLUMNS.items())})")
    present = {row[1] for row in db.execute("PRAGMA table_info(results)")}
    for column, kind in COLUMNS.items():
        if column not in present:
            db.execute(f"ALTER TABLE results ADD COLUMN {column} {kind}")
    db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
    db.commit()
    return db


def _interval(seconds: list[float], confidence: float) -> tuple[float, float]:
    low, high = stats.median_ci(np.asarray(seconds), confidence)
    return float(low), float(high)


def record_rows(record: dict[str, Any], path: str = "") -> list[dict[str, Any]]:
    """Rule 1's rows of a ``benchmark`` or ``benchmark-baseline`` record (HEAD's side of the latter)."""
    machine = machine_identity(record["environment"])
    common = {
        "recorded": record["created"],
        "record": path,
        "commit_id": record["source"]["git_commit"],
        "digest": record["source"]["sha256"],
        "machine_id": _machine_id(machine),
        "machine": json.dumps(machine, sort_keys=True),
    }
    rows = []
    if record["kind"] == "benchmark-baseline":
        common.update(
            commit_id=record["measurements"]["sources"]["head"]["commit"],
            digest=record["measurements"]["sources"]["head"]["digest"],
        )
        for c in record["measurements"]["comparisons"]:
            rows.append(
                {
                    "arm": c["arm"],
                    "workload": record["config"]["workload"],
                    "seconds": float(np.median(c["arm_seconds"])),
                    **dict(zip(("ci_low", "ci_high"), _interval(c["arm_seconds"], c["confidence"]))),
                }
            )
    for group in record["measurements"].get("groups", []):
        comparisons = group["comparisons"]
        blocks = {"plain": comparisons[0]["baseline_seconds"], **{c["arm"]: c["arm_seconds"] for c in comparisons}}
        for arm, seconds in blocks.items():
            rows.append(
                {
                    "arm": arm,
                    "workload": group["label"],
                    "seconds": float(np.median(seconds)),
                    **dict(zip(("ci_low", "ci_high"), _interval(seconds, comparisons[0]["confidence"]))),
                }
            )
    return [{**common, **row} for row in rows]


def append(path: Path, record: dict[str, Any], record_path: str = "") -> int:
    """Append ``record``'s rows to the store at ``path``; returns how many."""
    rows = record_rows(record, record_path)
    with open_store(path) as db:
        db.executemany(
            f"INSERT INTO results ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
            [tuple(row[c] for c in COLUMNS) for row in rows],
        )
    return len(rows)


def load(path: Path, *, arm: str | None = None, workload: str | None = None) -> pd.DataFrame:
    """Every row of the store (filtered by ``arm`` and ``workload`` when given), in recorded order."""
    with open_store(path) as db:
        table = pd.read_sql_query("SELECT rowid AS row, * FROM results ORDER BY rowid", db)
    if arm is not None:
        table = table[table["arm"] == arm]
    if workload is not None:
        table = table[table["workload"] == workload]
    return table.reset_index(drop=True)


@dataclass(frozen=True)
class Change:
    """A change point: the first commit after it, the relative change of the median, its p-value and verdict."""

    commit: str
    index: int
    change: float
    p_value: float
    verdict: str


@dataclass(frozen=True)
class Series:
    """One (machine, workload, arm) series (Rule 2): per-commit values, the changes found, the series' verdict."""

    machine_id: str
    workload: str
    arm: str
    commits: tuple[str, ...]
    seconds: tuple[float, ...]
    ci_low: tuple[float, ...]
    ci_high: tuple[float, ...]
    changes: tuple[Change, ...]
    verdict: str


def _classify(values: np.ndarray, index: int, end: int, start: int) -> tuple[float, float, str]:
    before, after = values[start:index], values[index:end]
    change = float(np.median(after) / np.median(before) - 1)
    p_value = float(scipy_stats.mannwhitneyu(after, before, alternative="two-sided").pvalue)
    if p_value < ALPHA and abs(change) >= MIN_CHANGE:
        return change, p_value, "regression" if change > 0 else "improvement"
    return change, p_value, "suspicious"


def detect(values: np.ndarray) -> list[tuple[int, float, float, str]]:
    """Rule 3-4 on one series: ``(index of the first point after, change, p-value, verdict)`` per change point."""
    values = np.asarray(values, dtype=float)
    relative = values / np.median(values)
    sigma = np.median(np.abs(np.diff(relative))) / (math.sqrt(2) * 0.6745) or 1e-12
    breaks = (
        ruptures.Pelt(model="l2", min_size=2, jump=1)
        .fit(relative)
        .predict(pen=PENALTY * sigma**2 * math.log(values.size))
    )
    bounds = [0, *breaks]
    return [(bounds[i], *_classify(values, bounds[i], bounds[i + 1], bounds[i - 1])) for i in range(1, len(bounds) - 1)]


def series(table: pd.DataFrame) -> list[Series]:
    """Every (machine, workload, arm) series of ``table`` (:func:`load`), with its change points and verdict."""
    found = []
    for (machine, workload, arm), rows in table.groupby(["machine_id", "workload", "arm"], sort=True):
        per_commit = rows.groupby("commit_id", sort=False)[["seconds", "ci_low", "ci_high"]].median()
        values = per_commit["seconds"].to_numpy()
        if values.size < MIN_COMMITS:
            changes: tuple[Change, ...] = ()
            verdict = "insufficient data"
        else:
            commits = list(per_commit.index)
            changes = tuple(Change(commits[i], i, change, p, v) for i, change, p, v in detect(values))
            verdict = next((s for s in SEVERITY if any(c.verdict == s for c in changes)), "no change")
        found.append(
            Series(
                machine,
                workload,
                arm,
                tuple(per_commit.index),
                tuple(values),
                tuple(per_commit["ci_low"]),
                tuple(per_commit["ci_high"]),
                changes,
                verdict,
            )
        )
    return found
