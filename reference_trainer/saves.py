"""A save folder on disk: files written atomically, a manifest of digests, every byte verified when read.

NOTE [Durable saves]
  1. A save path is a folder of saves: ``LATEST`` names the one in force and
     the digest of its manifest (``save-000003 <sha256>``); each save is a
     folder ``save-NNNNNN`` holding its files and ``manifest.json`` (every
     other file's name, size and SHA-256).
  2. Writing: the files and the manifest go into a fresh ``.tmp-*`` folder,
     each fsynced, the folder fsynced and renamed to ``save-NNNNNN``; then
     ``LATEST`` is replaced atomically (a fsynced temporary file and
     ``os.replace``) and the parent fsynced. Only then are older saves and
     leftover temporary folders removed. A crash at any point leaves
     ``LATEST`` naming a complete save (the previous one, or the new one once
     ``LATEST`` moved): never a half-written one.
  3. Reading: ``LATEST``, then the manifest (its digest must be the one
     ``LATEST`` names), then every file's size and digest, before any byte is
     interpreted. A missing, truncated or changed file is a
     :class:`CorruptSaveError` naming it; nothing is returned.
  4. What the files hold, and how the trainer's state maps onto them, is
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
from collections.abc import Mapping
from pathlib import Path

from .errors import ConfigError, CorruptSaveError

__all__ = ["LATEST", "MANIFEST", "read_folder", "write_folder"]

LATEST = "LATEST"
MANIFEST = "manifest.json"
_SAVE = re.compile(r"save-(\d{6,})")


def write_folder(path: str | os.PathLike, files: Mapping[str, bytes]) -> Path:
    """Write ``files`` (name -> bytes) as the new save in force under ``path`` (Rule 2); returns its folder."""
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ConfigError("path", str(root), "a folder (or a path not yet used) to hold saves")
    root.mkdir(parents=True, exist_ok=True)
    numbers = [int(m.group(1)) for p in root.iterdir() if (m := _SAVE.fullmatch(p.name))]
    name = f"save-{max(numbers, default=0) + 1:06d}"
    staging = root / f".tmp-{uuid.uuid4().hex}"
    staging.mkdir()
    manifest = {"files": {}}
    for file, data in files.items():
        _write_synced(staging / file, data)
        manifest["files"][file] = {"bytes": len(data), "sha256": _digest(data)}
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
    _write_synced(staging / MANIFEST, manifest_bytes)
    _fsync_dir(staging)
    os.rename(staging, root / name)
    _fsync_dir(root)
    pointer = root / f".tmp-{LATEST}-{uuid.uuid4().hex}"
    _write_synced(pointer, f"{name} {_digest(manifest_bytes)}\n".encode())
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    for old in root.iterdir():  # only after LATEST names the new save (Rule 2)
        if old.name != name and (old.name.startswith(".tmp-") or _SAVE.fullmatch(old.name)):
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return root / name


def read_folder(path: str | os.PathLike) -> dict[str, bytes]:
    """Every file of the save in force under ``path``, each verified against the manifest (Rule 3)."""
    root = Path(path)
    pointer = root / LATEST
    if not pointer.is_file():
        found = "no such folder" if not root.exists() else f"no {LATEST} file"
        raise ConfigError("path", str(root), f"a folder written by trainer.save ({found})")
    text = pointer.read_text().split()
    if len(text) != 2 or not _SAVE.fullmatch(text[0]):
        raise CorruptSaveError(root, LATEST, "changed", "'save-NNNNNN <sha256>'", " ".join(text)[:80])
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


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
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
