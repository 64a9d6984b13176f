"""A save folder on disk: files written atomically, a manifest of digests, every byte verified when read.

NOTE [Durable saves]
  1. A save path is a folder of saves: ``LATEST`` names the one in force, the
     digest of its manifest, and a check of those two fields (``save-000003
     <sha256> <16 hex digits of the sha256 of the first two>``), so damage to
     ``LATEST`` itself is named as such; a two-field ``LATEST`` (written
     before the check was kept) still loads. Each save is a folder
     ``save-NNNNNN`` holding its files and ``manifest.json`` (every other
     file's name, size and SHA-256).
  2. Writing: the files and the manifest go into a fresh ``.tmp-*`` folder,
     each fsynced, the folder fsynced and renamed to ``save-NNNNNN``; then
     ``LATEST`` is replaced atomically (a fsynced temporary file and
     ``os.replace``) and the parent fsynced. Only then are older saves and
     leftover temporary folders removed. A crash at any point leaves
     ``LATEST`` naming a complete save (the previous one, or the new one once
     ``LATEST`` moved): never a half-written one. A write that raises
     (a full disk) first removes its temporary folder, and the save path too
     when this save created it, so a refused save leaves the path as it was.
  3. Reading: ``LATEST``, then the manifest (its digest must be the one
     ``LATEST`` names), then every file's size and digest, before any byte is
     interpreted. A missing, truncated or changed file is a
     :class:`CorruptSaveError` naming it; nothing is returned.
  4. A file may be given as a function that makes its bytes: it is called
     when its turn to be written comes, and its bytes are let go once
     written, so a save of many large files holds one at a time in memory.
  5. What the files hold, and how the trainer's state maps onto them, is
     ``resume.py``'s business (NOTE [Resume]); this module only moves bytes.

Hand-written rather than ``torch.distributed.checkpoint``: the trainer's
state is replicated on every process (NOTE [Resume] Rule 5), so one writer
and a handful of files suffice, and DCP writes no digests to verify.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from .errors import ConfigError, CorruptSaveError

__all__ = ["LATEST", "MANIFEST", "FileData", "read_folder", "write_folder"]

FileData = bytes | memoryview | Callable[[], bytes | memoryview]  # a file's bytes, or what makes them (Rule 4)

LATEST = "LATEST"
MANIFEST = "manifest.json"
_SAVE = re.compile(r"save-(\d{6,})")


def write_folder(path: str | os.PathLike, files: Mapping[str, FileData]) -> Path:
    """Write ``files`` (name -> bytes) as the new save in force under ``path`` (Rule 2); returns its folder."""
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ConfigError("path", str(root), "a folder (or a path not yet used) to hold saves")
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    if created:
        _fsync_dir(root.parent)  # the new folder's own entry survives a power loss too
    numbers = [int(m.group(1)) for p in root.iterdir() if (m := _SAVE.fullmatch(p.name))]
    name = f"save-{max(numbers, default=0) + 1:06d}"
    staging = root / f".tmp-{uuid.uuid4().hex}"
    try:
        manifest_bytes = _stage(staging, files)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(root, ignore_errors=True)
        raise
    os.rename(staging, root / name)
    _fsync_dir(root)
    pointer = root / f".tmp-{LATEST}-{uuid.uuid4().hex}"
    _write_synced(pointer, f"{_pointer(name, _digest(manifest_bytes))}\n".encode())
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    for old in root.iterdir():  # only after LATEST names the new save (Rule 2)
        if old.name != name and (old.name.startswith(".tmp-") or _SAVE.fullmatch(old.name)):
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return root / name


def _stage(staging: Path, files: Mapping[str, FileData]) -> bytes:
    """Write ``files`` and their manifest into the new folder ``staging``, each fsynced; returns the manifest."""
    staging.mkdir()
    manifest: dict = {"files": {}}
    for file, made in files.items():
        data = made() if callable(made) else made  # made at its turn, let go at the next (Rule 4)
        _write_synced(staging / file, data)
        manifest["files"][file] = {"bytes": len(data), "sha256": _digest(data)}
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
    _write_synced(staging / MANIFEST, manifest_bytes)
    _fsync_dir(staging)
    return manifest_bytes


def _pointer(name: str, manifest_digest: str) -> str:
    """``LATEST``'s text: the save, its manifest's digest, and the check of both (Rule 1)."""
    return f"{name} {manifest_digest} {_digest(f'{name} {manifest_digest}'.encode())[:16]}"


def _read_pointer(root: Path) -> tuple[str, str]:
    """The save ``LATEST`` names and its manifest's digest; ``CorruptSaveError`` naming ``LATEST`` if damaged."""
    raw = (root / LATEST).read_bytes()
    try:
        fields = raw.decode("ascii").split()
    except UnicodeDecodeError:
        fields = []
    legacy = len(fields) == 2 and re.fullmatch(r"[0-9a-f]{64}", fields[1]) is not None
    if not (len(fields) == 3 or legacy) or not _SAVE.fullmatch(fields[0]) or (
            not legacy and _pointer(fields[0], fields[1]) != " ".join(fields)):
        raise CorruptSaveError(root, LATEST, "changed", "'save-NNNNNN <sha256> <check>' whose check matches",
                               repr(raw[:100]))
    return fields[0], fields[1]


def read_folder(path: str | os.PathLike) -> dict[str, bytes]:
    """Every file of the save in force under ``path``, each verified against the manifest (Rule 3)."""
    root = Path(path)
    pointer = root / LATEST
    if not pointer.is_file():
        found = "no such folder" if not root.exists() else f"no {LATEST} file"
        raise ConfigError("path", str(root), f"a folder written by trainer.save ({found})")
    text = _read_pointer(root)
    folder, manifest_digest = root / text[0], text[1]
    manifest_bytes = _read(folder, MANIFEST, root)
    if _digest(manifest_bytes) != manifest_digest:
        raise CorruptSaveError(root, f"{text[0]}/{MANIFEST}", "changed", f"sha256 {manifest_digest}", f"sha256 {_digest(manifest_bytes)}")
    entries = json.loads(manifest_bytes)["files"]
    files = {}
    for file, entry in entries.items():
        data = _read(folder, file, root)
        where = f"{text[0]}/{file}"
        if len(data) != entry["bytes"]:
            problem = "truncated" if len(data) < entry["bytes"] else "changed"
            raise CorruptSaveError(root, where, problem, f"{entry['bytes']} bytes", f"{len(data)} bytes")
        if _digest(data) != entry["sha256"]:
            raise CorruptSaveError(root, where, "changed", f"sha256 {entry['sha256']}", f"sha256 {_digest(data)}")
        files[file] = data
    return files


def _read(folder: Path, file: str, root: Path) -> bytes:
    try:
        return (folder / file).read_bytes()
    except FileNotFoundError:
        raise CorruptSaveError(root, f"{folder.name}/{file}", "missing", "the file", "no such file") from None


def _digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_synced(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
