"""Write-once, schema-versioned evidence records.

A record says what ran, with which configuration, on which environment and
source (fingerprints), each check's pass/fail and the measured values. It is
written once: to a temporary file in the same folder, fsynced, then renamed
into place. Writing the same content again is a no-op; writing different
content over an existing record is an error (evidence is never edited).
``verify`` re-reads a record, checks its schema and its content digest, so a
tampered file is detected.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = [
    "SCHEMA_VERSION",
    "EvidenceError",
    "environment_fingerprint",
    "source_fingerprint",
    "make_record",
    "write_once",
    "verify",
]

SCHEMA_VERSION = 1
_REQUIRED = {"schema_version", "kind", "created", "config", "environment", "source", "checks", "passed", "measurements", "digest"}
_PACKAGES = ("reference_trainer", "validation", "canaries")


class EvidenceError(RuntimeError):
    """An evidence record is invalid, tampered with, or would be overwritten."""


def source_fingerprint(root: Path | None = None) -> dict[str, str]:
    """SHA-256 over the project's Python sources, and the git commit when there is one."""
    root = root or Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    commit = "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"sha256": digest.hexdigest(), "git_commit": commit}


def environment_fingerprint() -> dict[str, Any]:
    import torch

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _digest(record: Mapping[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def make_record(
    kind: str,
    *,
    config: Mapping[str, Any],
    checks: Mapping[str, bool],
    measurements: Mapping[str, Any],
) -> dict[str, Any]:
    """A complete record; ``passed`` is True iff every check passed (and there is at least one)."""
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "created": datetime.now(timezone.utc).isoformat(),
        "config": dict(config),
        "environment": environment_fingerprint(),
        "source": source_fingerprint(),
        "checks": {name: bool(ok) for name, ok in checks.items()},
        "passed": bool(checks) and all(checks.values()),
        "measurements": dict(measurements),
    }
    record = json.loads(json.dumps(record, default=str))  # plain JSON types only
    record["digest"] = _digest(record)
    return record


def write_once(path: Path, record: Mapping[str, Any]) -> Path:
    """Write ``record`` to ``path`` atomically, once (see module docstring)."""
    path = Path(path)
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    if path.exists():
        if path.read_text() == text:
            return path
        raise EvidenceError(f"{path}: a different record already exists; evidence is written once, choose a new name")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        # link() refuses to replace, so two writers racing for one name cannot both win.
        os.link(tmp, path)
    except FileExistsError:
        if path.read_text() != text:
            raise EvidenceError(f"{path}: a different record was written concurrently") from None
    finally:
        os.unlink(tmp)
    return path


def verify(path: Path) -> dict[str, Any]:
    """Load a record and check its schema and digest; raises :class:`EvidenceError`."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise EvidenceError(f"{path}: not a readable JSON record ({error})") from error
    missing = _REQUIRED - set(record) if isinstance(record, dict) else _REQUIRED
    if missing:
        raise EvidenceError(f"{path}: expected fields {sorted(_REQUIRED)}, missing {sorted(missing)}")
    if record["schema_version"] != SCHEMA_VERSION:
        raise EvidenceError(f"{path}: expected schema_version {SCHEMA_VERSION}, found {record['schema_version']!r}")
    if record["digest"] != _digest(record):
        raise EvidenceError(f"{path}: content digest mismatch; the record was modified after it was written")
    if record["passed"] != (bool(record["checks"]) and all(record["checks"].values())):
        raise EvidenceError(f"{path}: 'passed' disagrees with its checks")
    return record
