"""Write-once, schema-versioned evidence records.

A record says what ran, with which configuration, on which environment and
source (fingerprints), each check's pass/fail and the measured values. It is
written once: to a temporary file in the same folder, fsynced, then renamed
into place. Writing the same content again is a no-op; writing different
content over an existing record is an error (evidence is never edited),
and so is writing a record that would not verify (wrong field types, a
digest that does not match its content). ``verify`` re-reads a record,
checks its schema (fields and their types) and its content digest, so a
tampered file is detected.

Checks are recorded one way: a :class:`Checks` collector
(``checks.check(name, ok, detail)``, ``checks.skip(name, why)``) handed to
:func:`make_record`; readers get them back with :func:`checks_of`, whatever
the record's schema version, and never probe ``measurements`` for reasons.

Schema changelog (:data:`SCHEMA_CHANGELOG`; ``verify`` reads every version listed):

- 1: ``checks`` is ``{name: bool}``; a check's reason, when a writer kept
  one, lives in ``measurements["failures"]`` or ``measurements["details"]``
  and skipped checks in ``measurements["skipped_checks"]``.
- 2: adds ``details`` (``{name: str}``, exactly the names of ``checks``: why
  each check passed or failed) and ``skips`` (``{name: why}``, names disjoint
  from ``checks``) as fields of their own; ``checks`` keeps its shape.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .errors import CheckFailed, OutOfSpace
from .world import world_facts

__all__ = [
    "DEFAULT_OUT",
    "EVIDENCE_MARKER",
    "mark_evidence_folder",
    "injected",
    "injected_faults",
    "SCHEMA_VERSION",
    "SCHEMA_CHANGELOG",
    "Check",
    "Checks",
    "checks_of",
    "EvidenceError",
    "evidence_path",
    "environment_fingerprint",
    "source_fingerprint",
    "make_record",
    "content_digest",
    "write_once",
    "verify",
]

SCHEMA_VERSION = 2
SCHEMA_CHANGELOG = {  # version -> what changed (module docstring); the last one is what make_record writes
    1: "checks {name: bool}; reasons, if any, in measurements failures/details, skips in measurements skipped_checks",
    2: "details {name: str} for every check and skips {name: why} as fields of their own",
}
DEFAULT_OUT = Path("rtv-out")  # where every command writes (and the report reads) unless --out/--in says
EVIDENCE_MARKER = ".rtv-evidence"  # in every folder write_once writes into: the folders the report collects from
_REQUIRED_V1 = {
    "schema_version",
    "kind",
    "created",
    "config",
    "environment",
    "source",
    "checks",
    "passed",
    "measurements",
    "digest",
}
_REQUIRED = {1: _REQUIRED_V1, 2: _REQUIRED_V1 | {"details", "skips"}}
_TYPES = {
    "schema_version": int,
    "kind": str,
    "created": str,
    "config": dict,
    "environment": dict,
    "source": dict,
    "checks": dict,
    "passed": bool,
    "measurements": dict,
    "digest": str,
    "details": dict,
    "skips": dict,
}
_PACKAGES = ("reference_trainer", "validation", "canaries")


@dataclass(frozen=True)
class Check:
    """One check as a record holds it: its verdict and why; a skipped check has ``skipped`` and ``ok`` true.

    A skip is not a failure (it does not make a record fail) and not a pass
    (``passed`` counts only checks that ran): readers that count use ``failed``.
    """

    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False

    @property
    def failed(self) -> bool:
        return not self.ok and not self.skipped

    @property
    def line(self) -> str:
        """The one way a verdict is shown: ``PASS|FAIL|SKIP  name: detail`` (``: detail`` only with a detail)."""
        state = "SKIP" if self.skipped else "PASS" if self.ok else "FAIL"
        return f"{state}  {self.name}: {self.detail}" if self.detail else f"{state}  {self.name}"


@dataclass
class Checks:
    """The collector every writer records its checks with (the one way; see the module docstring).

    A name is checked or skipped once: recording it again is a programming
    error (``ValueError``), since two verdicts under one name would hide one.
    ``echo`` is shown each verdict as it is recorded (:attr:`Check.line`; ``None``: silent).
    """

    _checks: dict[str, Check] = field(default_factory=dict)
    echo: Callable[[str], None] | None = field(default=None, compare=False, kw_only=True)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record ``name`` as passed or failed with ``detail`` (why); returns ``ok`` for chaining."""
        self._add(Check(name, bool(ok), str(detail)))
        return bool(ok)

    def skip(self, name: str, why: str) -> None:
        """Record that ``name`` did not run, and why (a skip neither passes nor fails the record)."""
        self._add(Check(name, True, str(why), skipped=True))

    def _add(self, check: Check) -> None:
        if check.name in self._checks:
            raise ValueError(f"check {check.name!r} recorded twice; give each check its own name")
        self._checks[check.name] = check
        if self.echo is not None:
            self.echo(check.line)

    def __iter__(self) -> Iterator[Check]:
        return iter(self._checks.values())

    def __len__(self) -> int:
        return len(self._checks)

    @property
    def passed(self) -> bool:
        """True iff at least one check ran and every check that ran passed."""
        ran = [c for c in self if not c.skipped]
        return bool(ran) and all(c.ok for c in ran)

    @classmethod
    def of(cls, verdicts: Mapping[str, bool]) -> Checks:
        """A collector from plain ``{name: ok}`` verdicts with no details (records of tests and stubs)."""
        collected = cls()
        for name, ok in verdicts.items():
            collected.check(name, ok)
        return collected


class EvidenceError(CheckFailed):
    """An evidence record is invalid, tampered with, or would be overwritten."""

    def __init__(self, cause: str, *, fix: str = "re-run the command that wrote it; evidence is never edited") -> None:
        super().__init__(cause, fix=fix)


def evidence_path(out_dir: Path, kind: str) -> Path:
    """Where a new record of ``kind`` goes: ``out_dir/<kind>-<UTC time>-<pid>.json``.

    The one place evidence file names are made. The time has microseconds
    and the pid is added, so two records written by one run, or by two
    processes at once, never share a name. ``kind`` may carry a suffix that
    tells records apart (``"derivative-cpu-offload_alias"``).
    """
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return Path(out_dir) / f"{kind}-{stamp}-{os.getpid()}.json"


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
    """Interpreter, platform, torch and CUDA device, and ``run_id``: the GPU CI run that asked for the record
    (``$RTV_RUN_ID``, set by ``rtv gpu launch`` for its job; None elsewhere), which its cross-check requires."""
    import torch

    return {
        "run_id": os.environ.get("RTV_RUN_ID"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "world": world_facts(),  # every process of a torchrun world (NOTE [Joined worlds]); None: this one alone
    }


_INJECTED: list[str] = []  # the faults put in on purpose for the records made now (:func:`injected`)


@contextmanager
def injected(fault: str) -> Iterator[None]:
    """Every record :func:`make_record` makes inside the block carries ``fault`` in ``config["injected"]``.

    A negative control (``rtv run --inject-mutation NAME``, ``--inject-failure``)
    wraps its whole run in it, so each record says it was made with a fault
    put in on purpose (a failure is the control caught, a pass was made by a
    broken trainer) and the report shows it. Nests; ``fault`` is a short
    phrase, e.g. ``"mutation staleness_off_by_one"``.
    """
    _INJECTED.append(str(fault))
    try:
        yield
    finally:
        _INJECTED.remove(str(fault))


def injected_faults() -> list[str]:
    """The faults :func:`injected` has put in for the records made now (empty outside a negative control)."""
    return list(_INJECTED)


def content_digest(record: Mapping[str, Any]) -> str:
    """SHA-256 of the record's content without its ``digest`` field (what ``verify`` recomputes)."""
    body = {k: v for k, v in record.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def make_record(
    kind: str,
    *,
    config: Mapping[str, Any],
    checks: Checks | Mapping[str, bool],
    measurements: Mapping[str, Any],
) -> dict[str, Any]:
    """A complete record of the current schema; ``passed`` is True iff every check passed (and there is at least one).

    ``checks`` is a :class:`Checks` collector; a plain ``{name: ok}`` mapping
    is shorthand for checks without details (:meth:`Checks.of`).
    """
    collected = checks if isinstance(checks, Checks) else Checks.of(checks)
    ran = [c for c in collected if not c.skipped]
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "created": datetime.now(timezone.utc).isoformat(),
        "config": {**config, "injected": injected_faults()} if _INJECTED else dict(config),
        "environment": environment_fingerprint(),
        "source": source_fingerprint(),
        "checks": {c.name: c.ok for c in ran},
        "details": {c.name: c.detail for c in ran},
        "skips": {c.name: c.detail for c in collected if c.skipped},
        "passed": collected.passed,
        "measurements": dict(measurements),
    }
    record = json.loads(json.dumps(record, default=str))  # plain JSON types only
    record["digest"] = content_digest(record)
    return record


def write_once(path: Path, record: Mapping[str, Any]) -> Path:
    """Write ``record`` to ``path`` atomically, once (see module docstring).

    The record must pass the checks :func:`verify` makes (build it with
    :func:`make_record`); raises :class:`EvidenceError` otherwise, or when a
    different record already has this name. Nothing is left behind on failure.
    """
    path = Path(path)
    _check(dict(record), path)
    try:
        text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as error:
        raise EvidenceError(f"{path}: the record is not plain JSON ({error}); build it with make_record") from error
    if path.exists():
        if path.read_text() == text:
            return path
        raise EvidenceError(f"{path}: a different record already exists; evidence is written once, choose a new name")
    try:
        _write_new(path, text)
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        raise OutOfSpace(
            f"no space left on the device while writing evidence {path} ({error})",
            fix=f"free space under {path.parent} (old runs under rtv-out/ can go), or pass --out "
            "DIR on a disk with room",
        ) from error
    mark_evidence_folder(path.parent)  # once the record is there: a failed write leaves nothing behind
    _fsync_dir(path.parent)
    return path


def mark_evidence_folder(folder: Path) -> Path:
    """Mark ``folder`` (made if missing) as one the harness writes records into; returns the marker file.

    :func:`write_once` marks every folder it writes into, so a run folder is
    marked from its first record on. ``reports.records.load_records`` collects
    records below the folder it is given from marked folders, and from an
    unmarked one only where its records verify (a marker lost in an upload),
    never from a source tree (a baseline's worktree, ``tests/fixtures``):
    its committed records are not this harness's output. Idempotent.
    """
    marker = Path(folder) / EVIDENCE_MARKER
    if not marker.is_file():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("records in this folder were written by rtv (validation.evidence.write_once)\n")
    return marker


def _write_new(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then link it to ``path`` (never replacing one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; evidence is for others to read
        # link() refuses to replace, so two writers racing for one name cannot both win.
        os.link(tmp, path)
    except FileExistsError:
        if path.read_text() != text:
            raise EvidenceError(f"{path}: a different record was written concurrently") from None
    finally:
        os.unlink(tmp)


def _fsync_dir(folder: Path) -> None:
    """Make the new name durable too (a crash after link must not lose it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check(record: Any, where: object) -> dict[str, Any]:
    """Schema (fields and types), version, digest and verdict; raises :class:`EvidenceError`."""
    if not isinstance(record, dict):
        raise EvidenceError(
            f"{where}: expected a JSON object with fields {sorted(_REQUIRED[SCHEMA_VERSION])}, "
            f"found {type(record).__name__}"
        )
    version = record.get("schema_version")
    if type(version) is int and version not in _REQUIRED:
        raise EvidenceError(f"{where}: expected schema_version one of {sorted(SCHEMA_CHANGELOG)}, found {version!r}")
    # A missing or mistyped version is named below with the other missing or mistyped fields.
    required = _REQUIRED.get(version, _REQUIRED[SCHEMA_VERSION]) if type(version) is int else _REQUIRED[SCHEMA_VERSION]
    missing = required - set(record)
    if missing:
        raise EvidenceError(f"{where}: expected fields {sorted(required)}, missing {sorted(missing)}")
    wrong = {
        name: type(record[name]).__name__
        for name, kind in _TYPES.items()
        if name in required and (not isinstance(record[name], kind) or (kind is int and isinstance(record[name], bool)))
    }
    if wrong:
        expected = {name: _TYPES[name].__name__ for name in wrong}
        raise EvidenceError(f"{where}: fields of the wrong type: expected {expected}, found {wrong}")
    if type(version) is int and version >= 2:  # an int here: the type check above held
        _check_reasons(record, where)
    bad_checks = {name: type(ok).__name__ for name, ok in record["checks"].items() if not isinstance(ok, bool)}
    if bad_checks:
        raise EvidenceError(f"{where}: every check must be true or false; found {bad_checks}")
    if record["digest"] != content_digest(record):
        raise EvidenceError(f"{where}: content digest mismatch; the record was modified after it was made")
    if record["passed"] != (bool(record["checks"]) and all(record["checks"].values())):
        raise EvidenceError(f"{where}: 'passed' disagrees with its checks")
    return record


def _check_reasons(record: dict[str, Any], where: object) -> None:
    """Schema 2: ``details`` names exactly the checks, ``skips`` none of them, every reason is text."""
    if set(record["details"]) != set(record["checks"]):
        raise EvidenceError(
            f"{where}: expected a detail for exactly the checks {sorted(record['checks'])}, "
            f"found details for {sorted(record['details'])}"
        )
    both = set(record["skips"]) & set(record["checks"])
    if both:
        raise EvidenceError(f"{where}: a check is either run or skipped; found {sorted(both)} in checks and skips")
    not_text = sorted(n for part in ("details", "skips") for n, why in record[part].items() if not isinstance(why, str))
    if not_text:
        raise EvidenceError(f"{where}: every detail and skip reason must be text; found others for {not_text}")


def checks_of(record: Mapping[str, Any]) -> list[Check]:
    """The record's checks, then its skips, each with its reason: the one reader, for every schema version.

    Schema 1 kept reasons (if any) in ``measurements["failures"]`` (preferred)
    or ``measurements["details"]``, and skips in ``measurements["skipped_checks"]``.
    """
    m = record.get("measurements", {})
    if record.get("schema_version", 1) >= 2:
        details, skips = record.get("details", {}), record.get("skips", {})
    else:
        details, skips = {**m.get("details", {}), **m.get("failures", {})}, m.get("skipped_checks", {})
    ran = [Check(name, bool(ok), str(details.get(name, ""))) for name, ok in record.get("checks", {}).items()]
    return ran + [Check(name, True, str(why), skipped=True) for name, why in skips.items()]


def verify(path: Path) -> dict[str, Any]:
    """Load a record and check its schema and digest; raises :class:`EvidenceError`."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise EvidenceError(f"{path}: not a readable JSON record ({error})") from error
    return _check(record, path)
