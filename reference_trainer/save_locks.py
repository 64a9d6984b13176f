"""Who may write, read and remove what in a folder of saves: its lock file, and each writer's staging and lock.

NOTE [Save locks]
  1. The folder's lock is the regular file ``.lock``, taken with
     ``fcntl.flock``: exclusively (opened read-write) by a writer to make its
     staging folder, move a save into force and clean up; shared (read-only)
     by a reader while it reads. A ``.lock`` that is a symbolic link or not a
     regular file is a ``ConfigError``, and so is a filesystem whose
     ``flock`` fails (``ENOLCK``, ``ENOSYS``, ``EOPNOTSUPP``, ``EBADF``):
     there is no unlocked fallback. Exclusive locks go through a regular file
     opened for writing because NFS emulates ``flock`` with byte-range locks.
  2. Every lock is unlocked (``LOCK_UN``) before its descriptor is closed: a
     ``flock`` lock belongs to the open file, which a forked child shares,
     and would otherwise outlive its holder.
  3. A writer stages in ``.tmp-<pid>-<random>``, made under the folder's lock
     after its own ``.tmp-<pid>-<random>.lock``, which it holds exclusively
     until the staging folder is renamed into a save or removed. Writers so
     stage in parallel, each known to be alive by its lock.
  4. Clean-up, under the folder's lock, removes a ``.tmp-`` entry whose lock
     file is missing, free, or not one a writer makes (a link, a folder, a
     device); one whose lock cannot be tested (no descriptors, no permission)
     is kept: only a dead writer's leftovers go.
  5. A reader writes nothing in a folder that holds no save: it makes a
     missing ``.lock`` only beside ``LATEST`` or a ``save-NNNNNN`` folder, and
     reads without it where it cannot (a read-only folder written before
     locks). It holds the lock shared while it reads every byte, so a long
     load delays a save's move into force.
  6. A lock file removed while a process waited for it is not the lock: the
     waiter takes the one now there (a failed first save removes the folder
     it made). A reader whose folder is gone gets the caller's
     ``ConfigError``; a writer gets ``FileNotFoundError`` and makes the folder
     again (``saves.py``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import ConfigError

__all__ = ["LOCK", "STAGING", "abandoned", "lock_of", "locked", "stage", "unstage"]

LOCK = ".lock"
STAGING = ".tmp-"
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF)  # flock on a filesystem without it
_NOT_OURS = (errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV)  # no lock file, or not one of ours
_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


@contextmanager
def locked(root: Path, mode: int, check: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold ``root``'s lock (Rules 1, 5, 6): ``LOCK_EX`` to write, ``LOCK_SH`` to read.

    A reader calls ``check`` (which raises when ``root`` is no folder of saves) before it makes a missing
    ``.lock`` and when ``root`` is gone; a writer gets ``FileNotFoundError`` when ``root`` is gone.
    """
    lock = root / LOCK
    while True:
        handle = _open_lock(root, mode, check)
        if handle is None:  # a reader in a folder it cannot write, written before locks
            yield
            return
        try:
            _flock(handle, mode, root)
            if _same_file(handle, lock):
                yield
                return
        finally:
            _release(handle)


def _open_lock(root: Path, mode: int, check: Callable[[], None]) -> int | None:
    """A descriptor of the regular file ``root/.lock``, made if missing (by a reader: once ``check`` passed)."""
    flags = (os.O_RDWR if mode == fcntl.LOCK_EX else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    reader = mode == fcntl.LOCK_SH
    try:
        try:
            handle = os.open(root / LOCK, flags)
        except (FileNotFoundError, NotADirectoryError):
            if reader:
                check()  # no folder of saves: written nothing (Rule 5)
            handle = os.open(root / LOCK, flags | os.O_CREAT, 0o644)
    except OSError as exc:
        if reader and exc.errno in (errno.ENOENT, errno.ENOTDIR):
            check()  # ``root`` went meanwhile (Rule 6)
        if reader and exc.errno in _READ_ONLY:
            return None
        if exc.errno in (errno.ELOOP, errno.EISDIR):
            raise _not_a_lock(root, "a symbolic link" if exc.errno == errno.ELOOP else "a folder") from None
        raise
    if not stat.S_ISREG(os.fstat(handle).st_mode):
        _release(handle)
        raise _not_a_lock(root, "not a regular file")
    return handle


def _not_a_lock(root: Path, found: str) -> ConfigError:
    return ConfigError(
        "path",
        str(root),
        f"a folder of saves whose {LOCK} is a regular file (its lock)",
        hint=f"{LOCK} is {found}: remove it (no save or load is running there), and retry",
    )


def _flock(handle: int, mode: int, root: Path) -> None:
    """``fcntl.flock``; a ``ConfigError`` naming the filesystem's missing lock support (Rule 1)."""
    try:
        fcntl.flock(handle, mode)
    except OSError as exc:
        if exc.errno not in _NO_LOCKS:
            raise
        raise ConfigError(
            "path",
            str(root),
            "a folder on a filesystem whose file locks (fcntl.flock) work",
            hint=f"locking {LOCK} failed ({exc.strerror}): this filesystem does not support "
            "file locks; save to a local disk, or mount it with lock support (NFS: without "
            "'nolock')",
        ) from None


def _same_file(handle: int, path: Path) -> bool:
    try:
        found = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(handle)
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def _release(handle: int) -> None:
    """Unlock, then close, a lock's descriptor (Rule 2)."""
    try:
        with contextlib.suppress(OSError):  # unlocked already, or never locked: the close lets go either way
            fcntl.flock(handle, fcntl.LOCK_UN)
    finally:
        os.close(handle)


def stage(root: Path) -> tuple[Path, int]:
    """Under ``root``'s lock: a fresh staging folder and the descriptor holding its lock file (Rule 3)."""
    staging = root / f"{STAGING}{os.getpid()}-{uuid.uuid4().hex}"
    lock = lock_of(staging)
    held = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        _flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB, root)
        staging.mkdir()
    except BaseException:
        lock.unlink(missing_ok=True)
        _release(held)
        raise
    return staging, held


def unstage(staging: Path, held: int) -> None:
    """Let go of ``staging``'s lock once the folder is renamed or removed: its lock file goes, then the lock."""
    try:
        lock_of(staging).unlink(missing_ok=True)
    finally:
        _release(held)


def abandoned(root: Path, name: str) -> bool:
    """Whether the ``.tmp-`` entry ``name`` of ``root`` is no live writer's (Rule 4)."""
    lock = lock_of(root / name.removesuffix(LOCK))
    try:
        handle = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return exc.errno in _NOT_OURS
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live writer holds it, or it cannot be tested: kept
    finally:
        _release(handle)
    return True


def lock_of(staging: Path) -> Path:
    """The lock file of the staging folder ``staging`` (Rule 3)."""
    return staging.with_name(staging.name + LOCK)
