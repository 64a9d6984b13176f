"""A save folder on disk: files written atomically, a manifest of digests, every byte verified when read.

NOTE [Durable saves]
  1. A save path is a folder of saves. ``LATEST`` names the one in force, its
     manifest's digest and a check of those two fields, so damage to
     ``LATEST`` itself is named as such (a two-field ``LATEST`` from before
     the check still loads). Each save is a folder ``save-NNNNNN`` of its
     files and ``manifest.json`` (every other file's name, size and SHA-256);
     the lock file ``.lock`` (Rule 6) stays.
  2. Writing: missing folders are made and fsynced into their parents; files
     and manifest go into a fresh staging folder ``.tmp-<pid>-<random>``, each
     fsynced, which is renamed to ``save-NNNNNN`` (one above the highest) with
     the save path fsynced; then ``LATEST`` is replaced atomically (fsynced
     temporary file, ``os.replace``, path fsynced again); only then are older
     saves and dead writers' leftovers removed. Every name is durable before
     anything names it, so a crash at any point leaves ``LATEST`` naming a
     complete save, never a half-written one.
  3. Reading checks ``LATEST``, the manifest (the digest ``LATEST`` names;
     plain names only), then every file's size and digest before any byte is
     interpreted; files are opened inside the save folder, never through a
     link or a FIFO, and must be regular. Anything missing, truncated, changed
     or irregular is a :class:`CorruptSaveError` naming it, and so is a folder
     of saves without ``LATEST`` (a first save killed before it was written:
     nothing was in force); a folder holding no save is a ``ConfigError``. A
     refused load wrote nothing.
  4. A file may be given as a function that makes its bytes, called in its
     turn and let go once written, so a save of many large files holds one at
     a time in memory.
  5. Failing: an error before ``LATEST`` moved removes what this save wrote
     (staging, renamed folder, temporary ``LATEST``, folders it made that no
     other writer used) and is raised as it came: the previous save stays in
     force. An error once ``LATEST`` moved is a ``SaveInForceError`` (an
     interrupt is raised as it came): the new save is in force. A bad path is
     a ``ConfigError`` and writes nothing.
  6. Concurrency, wherever ``fcntl.flock`` works (a ``ConfigError`` where it
     fails): the folder's lock and each writer's staging lock (NOTE [Save
     locks]). Writers stage in parallel and take the folder's lock only to
     make their staging folder and move it into force, so two writers both
     complete and ``LATEST`` names the later (the higher number). Clean-up
     removes only older saves and dead writers' leftovers. A reader holds the
     lock shared, so it reads one save whole, the previous or the new.
  7. What the files hold, and how the trainer's state maps onto them, is
     ``resume.py``'s business (NOTE [Resume]); this module only moves bytes.

Hand-written rather than ``torch.distributed.checkpoint``: the trainer's
state is replicated on every process (NOTE [Resume] Rule 5), so one writer
and a handful of files suffice, and DCP writes no digests to verify.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError, CorruptSaveError, SaveInForceError, int_at_least
from .save_locks import LOCK, STAGING, abandoned, lock_of, locked, stage, unstage

__all__ = ["LATEST", "LOCK", "MANIFEST", "FileData", "read_folder", "write_folder"]

FileData = bytes | memoryview | Callable[[], bytes | memoryview]  # a file's bytes, or what makes them (Rule 4)

LATEST = "LATEST"
MANIFEST = "manifest.json"
_SAVE = re.compile(r"save-(\d{6,})")
_RETRIES = 100  # makings of ``root`` while failed writers remove it (Rule 5)
_NOT_REGULAR = (errno.ELOOP, errno.ENXIO, errno.ENODEV)  # open of a symbolic link (O_NOFOLLOW), a socket, a device
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG)


def write_folder(path: str | os.PathLike[str], files: Mapping[str, FileData]) -> Path:
    """Write ``files`` (name -> bytes) as the new save in force under ``path`` (Rules 2, 5, 6); returns its folder."""
    root = _root(path)
    for name in files:
        if not _plain(name) or name == MANIFEST:
            raise ConfigError("file name", name, f"a plain file name (no '/', not '.', '..' or {MANIFEST!r})")
    created, staging, held = _begin(root)
    try:
        try:
            manifest_bytes = _stage(staging, files)
        except BaseException:
            _undo_locked(root, created, [staging, lock_of(staging)])
            raise
        return _commit(root, created, staging, manifest_bytes)
    finally:
        unstage(staging, held)


def _root(path: object) -> Path:
    """``path`` as a save path; a ``ConfigError`` unless a non-empty ``str`` or ``os.PathLike`` naming no file that
    the system accepts as a path (Rule 5)."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text or "\0" in text:
        raise ConfigError("path", path, "a non-empty str or os.PathLike (no NUL byte) naming a folder of saves")
    root = Path(text)
    try:
        is_file = root.exists() and not root.is_dir()
    except OSError as exc:
        raise ConfigError("path", text, "a path the system accepts", hint=str(exc)) from None
    if is_file:
        raise ConfigError("path", text, "a folder (or a path not yet used) to hold saves", hint="it is a file")
    return root


def _begin(root: Path) -> tuple[list[Path], Path, int]:
    """Make ``root`` (Rule 2) and, under the lock, a staging folder held by this writer (Rule 6).

    Returns the folders made (top first), the staging folder and the descriptor holding its lock; on any
    failure the folders made are removed.
    """
    created: list[Path] = []
    attempts = 0
    try:
        while True:
            _make_folders(root, created)
            try:
                with locked(root, fcntl.LOCK_EX):
                    return created, *stage(root)
            except FileNotFoundError:
                attempts += 1
                if root.is_dir() or attempts > _RETRIES:
                    raise
                # a failed writer that made ``root`` removed it meanwhile (Rule 5): make it again
    except BaseException as exc:
        _undo(root, created, [])
        if isinstance(exc, OSError) and exc.errno in _UNWRITABLE:
            raise ConfigError(
                "path",
                str(root),
                "a folder this process can write saves in (or a path whose missing folders it can make)",
                hint=str(exc),
            ) from None
        raise


def _make_folders(root: Path, created: list[Path]) -> None:
    """Make ``root`` and its missing ancestors, top down, each one's entry fsynced into its parent (one another
    writer just made too); those this call made are added to ``created``, top first."""
    missing = []
    for folder in (root, *root.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            if not folder.is_dir():
                raise
        else:
            if folder not in created:
                created.append(folder)
        _fsync_dir(folder.parent)
    created.sort(key=lambda folder: len(folder.parts))


def _stage(staging: Path, files: Mapping[str, FileData]) -> bytes:
    """Write ``files`` and their manifest into the new folder ``staging``, each fsynced; returns the manifest."""
    manifest: dict[str, Any] = {"files": {}}
    for file, made in files.items():
        data = made() if callable(made) else made  # made at its turn, let go at the next (Rule 4)
        _write_synced(staging / file, data)
        manifest["files"][file] = {"bytes": len(data), "sha256": _digest(data)}
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
    _write_synced(staging / MANIFEST, manifest_bytes)
    _fsync_dir(staging)
    return manifest_bytes


def _commit(root: Path, created: list[Path], staging: Path, manifest_bytes: bytes) -> Path:
    """Under the lock: rename ``staging`` to the next save, move ``LATEST`` to it, then clean up (Rules 2, 5, 6)."""
    with locked(root, fcntl.LOCK_EX):
        numbers = [int(m.group(1)) for p in root.iterdir() if (m := _SAVE.fullmatch(p.name))]
        name = f"save-{max(numbers, default=0) + 1:06d}"
        pointer = root / f"{STAGING}{LATEST}-{os.getpid()}-{uuid.uuid4().hex}"
        written, replacing, step = [staging, lock_of(staging), pointer], False, f"the fsync of {root}"
        try:
            os.rename(staging, root / name)
            written[0] = root / name
            _fsync_dir(root)  # the save's entry is durable before LATEST can name it
            _write_synced(pointer, f"{_pointer(name, _digest(manifest_bytes))}\n".encode())
            replacing = True
            os.replace(pointer, root / LATEST)
            _fsync_dir(root)
            step = "the removal of older saves and leftovers"
            _clean(root, int(name[len("save-") :]))
        except BaseException as exc:
            if not (replacing and not os.path.lexists(pointer)):  # LATEST has not moved: the previous save in force
                _undo(root, created, written)
                raise
            if not isinstance(exc, Exception):  # an interrupt, raised as it came: the new save is in force
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"the new save {name!r} of {root} is in force (LATEST names it)")
                raise
            raise SaveInForceError(root, name, step, repr(exc)) from exc
    return root / name


def _undo_locked(root: Path, created: list[Path], written: list[Path]) -> None:
    """``_undo`` under the lock; nothing to do once ``root`` is gone (the caller's own error is what it raises)."""
    try:
        with locked(root, fcntl.LOCK_EX):
            _undo(root, created, written)
    except FileNotFoundError:
        if root.is_dir():
            raise


def _undo(root: Path, created: list[Path], written: list[Path]) -> None:
    """Remove what a failed save wrote, and the folders it made when no other writer put anything in them."""
    for path in written:
        _remove(path)
    if root in created and root.is_dir() and all(p.name == LOCK for p in root.iterdir()):
        (root / LOCK).unlink(missing_ok=True)  # a writer waiting on it takes the next one (NOTE [Save locks] Rule 6)
    for folder in reversed(created):
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            return  # not empty: another writer's


def _clean(root: Path, number: int) -> None:
    """Remove the saves older than save ``number`` and the leftovers of dead writers (NOTE [Save locks] Rule 4)."""
    for entry in root.iterdir():
        match = _SAVE.fullmatch(entry.name)
        if (match and int(match.group(1)) < number) or (entry.name.startswith(STAGING) and abandoned(root, entry.name)):
            _remove(entry)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _pointer(name: str, manifest_digest: str) -> str:
    """``LATEST``'s text: the save, its manifest's digest, and the check of both (Rule 1)."""
    return f"{name} {manifest_digest} {_digest(f'{name} {manifest_digest}'.encode())[:16]}"


def _read_pointer(root: Path) -> tuple[str, str]:
    """The save ``LATEST`` names and its manifest's digest; ``CorruptSaveError`` naming ``LATEST`` if damaged."""
    handle = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        raw = _read(handle, LATEST, root, LATEST)
    finally:
        os.close(handle)
    try:
        fields = raw.decode("ascii").split()
    except UnicodeDecodeError:
        fields = []
    legacy = len(fields) == 2 and re.fullmatch(r"[0-9a-f]{64}", fields[1]) is not None
    if (
        not (len(fields) == 3 or legacy)
        or not _SAVE.fullmatch(fields[0])
        or (not legacy and _pointer(fields[0], fields[1]) != " ".join(fields))
    ):
        raise CorruptSaveError(
            root, LATEST, "changed", "'save-NNNNNN <sha256> <check>' whose check matches", repr(raw[:100])
        )
    return fields[0], fields[1]


def read_folder(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every file of the save in force under ``path``, each verified against the manifest (Rules 3, 6)."""
    root = _root(path)
    with locked(root, fcntl.LOCK_SH, lambda: _check_holds_saves(root)):
        if not os.path.lexists(root / LATEST):
            _check_holds_saves(root)
            raise CorruptSaveError(root, LATEST, "missing", "the pointer to the save in force", "no such file")
        return _read_save(root)


def _check_holds_saves(root: Path) -> None:
    """A ``ConfigError`` unless ``root`` is a folder holding ``LATEST`` or a save folder (Rule 3)."""
    hint = "there is no such folder"
    try:
        if os.path.lexists(root / LATEST) or any(_SAVE.fullmatch(p.name) for p in root.iterdir()):
            return
        hint = f"it holds no save (no {LATEST}, no save-NNNNNN folder)"
    except (FileNotFoundError, NotADirectoryError):
        pass
    raise ConfigError("path", str(root), "a folder written by trainer.save", hint=hint)


def _read_save(root: Path) -> dict[str, bytes]:
    save, manifest_digest = _read_pointer(root)
    handle = _open_save(root, save)
    try:
        manifest_bytes = _read(handle, MANIFEST, root, f"{save}/{MANIFEST}")
        if _digest(manifest_bytes) != manifest_digest:
            raise CorruptSaveError(
                root, f"{save}/{MANIFEST}", "changed", f"sha256 {manifest_digest}", f"sha256 {_digest(manifest_bytes)}"
            )
        files = {}
        for file, entry in _entries(manifest_bytes, root, save).items():
            where = f"{save}/{file}"
            data = _read(handle, file, root, where)
            if len(data) != entry["bytes"]:
                problem = "truncated" if len(data) < entry["bytes"] else "changed"
                raise CorruptSaveError(root, where, problem, f"{entry['bytes']} bytes", f"{len(data)} bytes")
            if _digest(data) != entry["sha256"]:
                raise CorruptSaveError(root, where, "changed", f"sha256 {entry['sha256']}", f"sha256 {_digest(data)}")
            files[file] = data
        return files
    finally:
        os.close(handle)


def _open_save(root: Path, save: str) -> int:
    """A descriptor of the folder ``save`` itself (not a symbolic link); a missing one reads as a missing manifest."""
    try:
        return os.open(root / save, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptSaveError(root, f"{save}/{MANIFEST}", "missing", "the file", "no such file") from None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise CorruptSaveError(root, save, "changed", "a folder", "a symbolic link or a file") from None


def _entries(manifest_bytes: bytes, root: Path, save: str) -> dict[str, dict[str, Any]]:
    """The manifest's entries, each a plain name with a size and a digest; else ``CorruptSaveError`` naming it."""
    where = f"{save}/{MANIFEST}"
    try:
        entries = json.loads(manifest_bytes)["files"]
    except (ValueError, KeyError, TypeError):
        entries = None
    if not isinstance(entries, dict):
        raise CorruptSaveError(root, where, "changed", "a JSON object with 'files'", repr(manifest_bytes[:100]))
    for name, entry in entries.items():
        if not _plain(name):
            raise CorruptSaveError(
                root, where, "changed", "entries that are plain names inside the save folder", f"the entry {name!r}"
            )
        if not (
            isinstance(entry, dict) and int_at_least(entry.get("bytes"), 0) and isinstance(entry.get("sha256"), str)
        ):
            raise CorruptSaveError(root, where, "changed", f"a size and a sha256 for the entry {name!r}", repr(entry))
    return entries


def _plain(name: object) -> bool:
    """Whether ``name`` names a file directly inside a folder (no separator, not ``.`` or ``..``)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\0" not in name
        and (os.altsep is None or os.altsep not in name)
    )


def _read(folder: int, file: str, root: Path, where: str) -> bytes:
    """The bytes of the regular file ``file`` directly in the open folder ``folder`` (Rule 3): never through a
    symbolic link, never waiting on a FIFO; else a ``CorruptSaveError`` naming ``where``."""
    try:
        handle = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except FileNotFoundError:
        raise CorruptSaveError(root, where, "missing", "the file", "no such file") from None
    except OSError as exc:
        if exc.errno not in _NOT_REGULAR:
            raise
        found = "a symbolic link" if exc.errno == errno.ELOOP else str(exc.strerror)
        raise CorruptSaveError(root, where, "changed", "a regular file", found) from None
    with os.fdopen(handle, "rb") as stream:
        mode = os.fstat(handle).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else f"a file of type {stat.filemode(mode)[0]!r}"
            raise CorruptSaveError(root, where, "changed", "a regular file", kind)
        return stream.read()


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
