"""CPU-bound processes beside a test: started here, stopped by pid whatever happens (tests that prove the
timing checks survive a busy machine, NOTE [Machine load] in ``validation/load.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["hogs", "pinned_apart"]

# Busy until its parent is gone: a test process killed past its finally leaves no hog behind.
_BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


@contextmanager
def hogs(count: int = 2, cores: set[int] | None = None) -> Iterator[list[int]]:
    """``count`` busy-looping Python processes for the ``with`` block; yields their pids, kills each by pid after.
    ``cores``: the CPUs each hog may run on (``os.sched_setaffinity``); None: any."""
    started: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            started.append(subprocess.Popen([sys.executable, "-c", _BUSY]))
            if cores is not None:
                os.sched_setaffinity(started[-1].pid, cores)
        yield [p.pid for p in started]
    finally:
        for process in started:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


@contextmanager
def pinned_apart() -> Iterator[int]:
    """This process on one CPU and a hog on another for the ``with`` block: other work the process's own CPU share
    cannot see (it still gets its whole core). Yields the hog's pid; the affinity is restored after. Skips the test
    where fewer than two CPUs are allowed."""
    import pytest

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs two CPUs to pin a hog apart from the measurement; this process may use {allowed}")
    os.sched_setaffinity(0, {allowed[0]})
    try:
        with hogs(1, cores={allowed[1]}) as (pid,):
            yield pid
    finally:
        os.sched_setaffinity(0, allowed)
