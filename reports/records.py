"""Evidence files in: every record under a folder, verified, with the status a reader needs first.

A record's status is ``passed`` / ``failed`` (it verifies, ``validation.evidence``:
schema, types, digest, and its checks all passed / did not) or ``invalid``
(anything else named ``*.json``: tampered with, truncated, not JSON, or not
a record at all; never counts as passed). Every writer in the project writes
records through ``validation.evidence``, so there is no other format to read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from validation.errors import SetupError
from validation.evidence import EvidenceError, verify

__all__ = ["LoadedRecord", "load_records"]


@dataclass(frozen=True, kw_only=True)
class LoadedRecord:
    """One evidence file: its name (path under the folder, no suffix), content (``{}`` if invalid), status, integrity."""

    path: Path
    name: str
    record: dict[str, Any]
    status: str  # "passed" | "failed" | "invalid"
    integrity: str

    @property
    def kind(self) -> str:
        return str(self.record.get("kind", "unknown"))


def _load(path: Path, root: Path) -> LoadedRecord:
    name = str(path.relative_to(root).with_suffix(""))
    try:
        record = verify(path)
    except EvidenceError as error:
        return LoadedRecord(path=path, name=name, record={}, status="invalid", integrity=f"does not verify: {error.cause}")
    return LoadedRecord(path=path, name=name, record=record, status="passed" if record["passed"] else "failed",
                        integrity="verified (schema and digest)")


def load_records(folder: Path) -> list[LoadedRecord]:
    """Every ``*.json`` under ``folder``, recursively, sorted by path; :class:`SetupError` when it is no folder."""
    root = Path(folder)
    if not root.is_dir():
        raise SetupError(f"{root} is not a folder of evidence", fix="pass --in DIR, a folder of records")
    return [_load(path, root) for path in sorted(p for p in root.rglob("*.json") if not p.name.startswith("."))]
