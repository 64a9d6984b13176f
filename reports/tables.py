"""Evidence files as pandas tables: one row per record, per check, per measurement, per series point.

A record's *status* is what a reader needs first:

- ``passed`` / ``failed``: a record that verifies (``validation.evidence``:
  schema, types, digest) and whose checks all passed / did not;
- ``caught`` / ``missed``: a verified record of a run under a deliberately
  injected bug (``config.mutation`` set): it must fail (caught); one that
  passed missed the bug and counts as a failure;
- ``invalid``: a file that claims to be evidence (it has a ``digest``) but does
  not verify — tampered with, truncated, or not JSON. Never counts as passed;
- ``unverified``: JSON of another schema (an older benchmark format, say):
  listed with its own ``passed`` flag if it has one, never verified.

Conventions read from ``measurements`` (all optional): ``details`` or
``failures`` (check name -> text shown beside the check), ``skipped_checks``
(check name -> reason: shown as skipped, counted neither way),
``lifecycle_bytes`` (placement -> lifecycle point -> pool -> bytes), and any
nested object with ``median_ratio`` plus ``ci95`` (or ``ratio_ci95_low`` /
``ratio_ci95_high``): a ratio with its confidence interval.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from validation.evidence import EvidenceError, verify

__all__ = [
    "LoadedRecord",
    "load_records",
    "records_table",
    "checks_table",
    "measurements_table",
    "lifecycle_table",
    "ratio_table",
    "flatten",
]

# Measurement keys shown elsewhere (beside checks), not as measurements.
_ANNOTATIONS = ("details", "failures", "skipped_checks")


@dataclass(frozen=True)
class LoadedRecord:
    """One evidence file: its content (``{}`` if unreadable), status and integrity verdict."""

    path: Path
    name: str
    record: dict[str, Any]
    status: str  # "passed" | "failed" | "caught" | "missed" | "invalid" | "unverified"
    integrity: str

    @property
    def kind(self) -> str:
        return str(self.record.get("kind") or self.record.get("schema") or "unknown")

    @property
    def checks(self) -> dict[str, Any]:
        checks = self.record.get("checks")
        if isinstance(checks, list):  # an older layout: [{"name": ..., "passed": ...}, ...]
            return {str(c.get("name")): c.get("passed") for c in checks if isinstance(c, dict) and "name" in c}
        return checks if isinstance(checks, dict) else {}

    @property
    def measurements(self) -> dict[str, Any]:
        measurements = self.record.get("measurements")
        return measurements if isinstance(measurements, dict) else {}

    def annotation(self, key: str) -> dict[str, str]:
        value = self.measurements.get(key)
        return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _load(path: Path, root: Path) -> LoadedRecord:
    name = str(path.relative_to(root).with_suffix("")) if path.is_relative_to(root) else path.stem
    try:
        record = verify(path)
    except EvidenceError as error:
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return LoadedRecord(path, name, {}, "invalid", f"unreadable: {error}")
        raw = raw if isinstance(raw, dict) else {"content": raw}
        if "digest" in raw:
            return LoadedRecord(path, name, raw, "invalid", f"does not verify: {error}")
        return LoadedRecord(path, name, raw, "unverified", "another schema: not verified")
    if record["config"].get("mutation"):
        status = "missed" if record["passed"] else "caught"
    else:
        status = "passed" if record["passed"] else "failed"
    return LoadedRecord(path, name, record, status, "verified (schema and digest)")


def load_records(source: Path | Iterable[Path]) -> list[LoadedRecord]:
    """Every ``*.json`` under a folder (recursively, sorted by path), or the given files."""
    if isinstance(source, (str, Path)):
        root = Path(source)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: expected a folder of evidence JSON files")
        paths = sorted(p for p in root.rglob("*.json") if not p.name.startswith("."))
    else:
        paths = [Path(p) for p in source]
        root = Path(*_common_parts(paths)) if paths else Path(".")
    return [_load(path, root) for path in paths]


def _common_parts(paths: list[Path]) -> tuple[str, ...]:
    parents = [p.resolve().parent.parts for p in paths]
    common: list[str] = []
    for parts in zip(*parents):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return tuple(common) or (".",)


def _short(value: Any, width: int = 12) -> str:
    return str(value)[:width] if value else ""


def records_table(records: list[LoadedRecord]) -> pd.DataFrame:
    """One row per record: status, check counts, environment and source fingerprint."""
    rows = []
    for r in records:
        checks = r.checks
        env = r.record.get("environment") if isinstance(r.record.get("environment"), dict) else {}
        source = r.record.get("source") if isinstance(r.record.get("source"), dict) else {}
        rows.append(
            {
                "record": r.name,
                "kind": r.kind,
                "status": r.status,
                "checks": len(checks),
                "passed": sum(1 for ok in checks.values() if ok is True),
                "failed": sum(1 for ok in checks.values() if ok is not True),
                "skipped": len(r.annotation("skipped_checks")),
                "created": r.record.get("created") or r.record.get("created_utc") or "",
                "git_commit": _short(source.get("git_commit")),
                "source_sha256": _short(source.get("sha256") or source.get("script_sha256")),
                "python": env.get("python", ""),
                "torch": env.get("torch", ""),
                "platform": env.get("platform", ""),
                "cuda": env.get("cuda") or "",
                "integrity": r.integrity,
                "path": str(r.path),
            }
        )
    columns = ["record", "kind", "status", "checks", "passed", "failed", "skipped", "created", "git_commit",
               "source_sha256", "python", "torch", "platform", "cuda", "integrity", "path"]
    return pd.DataFrame(rows, columns=columns)


def checks_table(records: list[LoadedRecord]) -> pd.DataFrame:
    """One row per check: ``result`` is passed, failed or skipped, with the record's detail text."""
    rows = []
    for r in records:
        details = {**r.annotation("details"), **r.annotation("failures")}
        for check, ok in r.checks.items():
            result = "passed" if ok is True else "failed"
            rows.append({"record": r.name, "kind": r.kind, "check": str(check), "result": result,
                         "detail": details.get(str(check), "")})
        for check, reason in r.annotation("skipped_checks").items():
            if check not in r.checks:
                rows.append({"record": r.name, "kind": r.kind, "check": check, "result": "skipped", "detail": reason})
    return pd.DataFrame(rows, columns=["record", "kind", "check", "result", "detail"])


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted.key, scalar)`` leaves of nested JSON; short lists of scalars stay one value."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value):
            yield prefix, value if len(value) <= 8 else f"[{len(value)} values]"
        else:
            for index, item in enumerate(value):
                yield from flatten(item, f"{prefix}[{index}]")
    else:
        yield prefix, value


def measurements_table(records: list[LoadedRecord]) -> pd.DataFrame:
    """One row per measured scalar (dotted key path), check annotations left out."""
    rows = []
    for r in records:
        source = r.measurements if r.status != "unverified" else {
            k: v for k, v in r.record.items() if k in ("summary", "measurements", "config")
        }
        for key, value in flatten({k: v for k, v in source.items() if k not in _ANNOTATIONS}):
            rows.append({"record": r.name, "kind": r.kind, "key": key, "value": value})
    return pd.DataFrame(rows, columns=["record", "kind", "key", "value"])


def lifecycle_table(records: list[LoadedRecord]) -> pd.DataFrame:
    """Bytes per lifecycle point, placement and pool (from ``measurements.lifecycle_bytes``).

    Rows follow the record's ``config.placements`` and ``config.points`` when
    it names them (a written record's keys are sorted), else file order.
    """
    rows = []
    for r in records:
        series = r.measurements.get("lifecycle_bytes")
        if not isinstance(series, dict):
            continue
        config = r.record.get("config") if isinstance(r.record.get("config"), dict) else {}
        placements = _ordered(series, config.get("placements"))
        for placement in placements:
            points = series[placement] or {}
            for point in _ordered(points, config.get("points")):
                for pool, nbytes in (points[point] or {}).items():
                    rows.append({"record": r.name, "placement": placement, "point": point, "pool": pool,
                                 "bytes": int(nbytes)})
    return pd.DataFrame(rows, columns=["record", "placement", "point", "pool", "bytes"])


def _ordered(keys: dict[str, Any], preferred: Any) -> list[str]:
    order = [k for k in preferred if k in keys] if isinstance(preferred, list) else []
    return order + [k for k in keys if k not in order]


def _ratios(value: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(value, dict):
        if "median_ratio" in value and ("ci95" in value or "ratio_ci95_low" in value):
            yield path, value
            return
        for key, item in value.items():
            yield from _ratios(item, f"{path}.{key}" if path else str(key))


def ratio_table(records: list[LoadedRecord]) -> pd.DataFrame:
    """Every ratio with a confidence interval found in the records (benchmarks, throughput)."""
    rows = []
    for r in records:
        for label, found in _ratios({"measurements": r.measurements, "summary": r.record.get("summary")}, ""):
            low, high = found.get("ci95") or (found.get("ratio_ci95_low"), found.get("ratio_ci95_high"))
            median = float(found["median_ratio"])
            if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (median, low, high)):
                continue
            short = label.removeprefix("measurements.").removeprefix("summary")
            rows.append({"record": r.name, "label": short or "summary", "median_ratio": median,
                         "ci_low": float(low), "ci_high": float(high), "verdict": found.get("verdict", "")})
    return pd.DataFrame(rows, columns=["record", "label", "median_ratio", "ci_low", "ci_high", "verdict"])
