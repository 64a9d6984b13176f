"""Evidence files in: every record under a folder, verified, with the status a reader needs first.

A record's status is ``passed`` / ``failed`` (it verifies, ``validation.evidence``:
schema, types, digest, and its checks all passed / did not) or ``invalid``
(anything else named ``*.json``: tampered with, truncated, not JSON, or not
a record at all; never counts as passed). Every writer in the project writes
records through ``validation.evidence``, so there is no other format to read.

Which files are records (:func:`find_records`): every ``*.json`` in the
folder named (``--in``: asked for by name, so ``rtv report --in
tests/fixtures/evidence`` reads the committed fixtures) and, below it, in
each folder the harness marked (``validation.evidence.EVIDENCE_MARKER``,
written by ``write_once`` into every folder it writes a record into) or
where some ``*.json`` verifies as evidence: a marker is lost where hidden
files are dropped (``actions/upload-artifact`` drops them unless told
otherwise) and is missing from folders written before it existed, and a
failing record must never be left out for that. Below the folder named, a
source tree is never entered, marked or not: a git checkout or worktree (a
``.git`` entry, e.g. ``rtv bench --baseline``'s ``<out>/sources/<commit>``)
or a ``tests/fixtures`` folder. So the committed records of a checkout
lying under ``--in`` are never taken for this run's. Every other ``*.json``
below the folder is skipped, and :attr:`Found.skipped` names it so that the
terminal and the page can say so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from validation.errors import SetupError
from validation.evidence import EVIDENCE_MARKER, EvidenceError, verify

__all__ = ["Found", "LoadedRecord", "find_records", "load_records", "record_files"]


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
        return LoadedRecord(
            path=path, name=name, record={}, status="invalid", integrity=f"does not verify: {error.cause}"
        )
    return LoadedRecord(
        path=path,
        name=name,
        record=record,
        status="passed" if record["passed"] else "failed",
        integrity="verified (schema and digest)",
    )


def _source_tree(folder: Path) -> bool:
    """A checkout or worktree (``.git``, a folder or a file) or a ``tests/fixtures`` folder: never a run's output."""
    return (folder / ".git").exists() or (folder.name == "fixtures" and folder.parent.name == "tests")


@dataclass(frozen=True)
class Found:
    """What :func:`find_records` found: the record files, and the ``*.json`` it skipped (module docstring)."""

    records: list[Path]
    skipped: list[Path]


def _verifies(path: Path) -> bool:
    try:
        verify(path)
    except EvidenceError:
        return False
    return True


def find_records(folder: Path) -> Found:
    """The files :func:`load_records` reads (module docstring) and the ``*.json`` it skips, each sorted by path."""
    root, found, skipped = Path(folder), [], []
    for here, folders, files in os.walk(root):
        here_path = Path(here)
        folders[:] = [name for name in folders if not _source_tree(here_path / name)]
        jsons = [here_path / name for name in files if name.endswith(".json") and not name.startswith(".")]
        evidence = here_path == root or EVIDENCE_MARKER in files or any(map(_verifies, jsons))
        (found if evidence else skipped).extend(jsons)
    return Found(records=sorted(found), skipped=sorted(skipped))


def record_files(folder: Path) -> list[Path]:
    """The record files of :func:`find_records`, sorted by path."""
    return find_records(folder).records


def load_records(folder: Path) -> list[LoadedRecord]:
    """Every record :func:`record_files` finds under ``folder``, sorted by path; :class:`SetupError` when it is no folder."""
    root = Path(folder)
    if not root.is_dir():
        raise SetupError(f"{root} is not a folder of evidence", fix="pass --in DIR, a folder of records")
    return [_load(path, root) for path in record_files(root)]
