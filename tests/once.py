"""Session fixtures computed once per test run, however many pytest-xdist workers ask for them.

A session fixture runs once per worker: with ``pytest -n auto`` every worker
that needs the two-process suite, the rendered fixture report or the tiny
learning record would compute its own copy. :func:`once_per_run` makes the
first worker compute it and the others read its pickle, behind a file lock in
the run's shared temporary folder (the parent of each worker's base temp,
named by xdist's ``PYTEST_XDIST_TESTRUNUID``). Without xdist it just computes.

A computation that raises is not stored: the next worker computes it again
and fails the same way, with its own traceback.
"""

from __future__ import annotations

import fcntl
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

__all__ = ["once_per_run", "shared_folder"]

T = TypeVar("T")


def shared_folder(tmp_path_factory: pytest.TempPathFactory, key: str) -> Path:
    """A folder every worker of this run sees under the same path (one per ``key``); made if missing."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    folder = base.parent / f"{key}-{run}" if run else base / key
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def once_per_run(tmp_path_factory: pytest.TempPathFactory, key: str, compute: Callable[[Path], T]) -> T:
    """``compute(folder)`` the first time any worker of this run asks for ``key``; its pickled value afterwards.

    ``folder`` is :func:`shared_folder`'s, so files the value names stay readable by every worker.
    """
    folder = shared_folder(tmp_path_factory, key)
    stored = folder / "value.pkl"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stored.exists():
            return pickle.loads(stored.read_bytes())
        value = compute(folder)
        stored.write_bytes(pickle.dumps(value))
        return value
