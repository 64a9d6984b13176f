"""Run under ``torchrun`` (one "node" of a world): a watched call whose rank 1 lags past the deadline.

Rank 0 asks :func:`validation.world.run_ranks`, inside
:func:`validation.hangs.watching` (2 s, the folder given as the argument),
for the liveness job's ``lag`` case on every process of the world; it prints
one ``RESULT`` JSON line, the diagnosis of the :class:`HangDetected` it got,
and exits with its code. The other rank only serves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from canaries.liveness.job import job
from validation.hangs import HangDetected, watching
from validation.world import given_world, joined, run_ranks


def command(out: Path) -> int:
    pids = out / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    with watching(2.0, out):
        try:
            run_ranks(job, 2, "lag", 2.0, str(pids))
        except HangDetected as error:
            print("RESULT " + json.dumps(error.diagnosis), flush=True)
            return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(joined(given_world(), lambda: command(Path(sys.argv[1]))))
