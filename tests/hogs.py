"""CPU-bound processes beside a test: started here, stopped by pid whatever happens (tests that prove the
timing checks survive a busy machine, NOTE [Machine load] in ``validation/load.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["hogs"]

# Busy until its parent is gone: a test process killed past its finally leaves no hog behind.
_BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


@contextmanager
def hogs(count: int = 2) -> Iterator[list[int]]:
    """``count`` busy-looping Python processes for the ``with`` block; yields their pids, kills each by pid after."""
    started: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            started.append(subprocess.Popen([sys.executable, "-c", _BUSY]))
        yield [p.pid for p in started]
    finally:
        for process in started:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
