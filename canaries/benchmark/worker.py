"""One side of ``rtv bench --baseline``: a process that times one arm on whichever ``reference_trainer`` it imports.

``python -m canaries.benchmark.worker`` reads one JSON request per line on
stdin and answers one JSON line on stdout (``canaries.benchmark.baseline``
drives two of them, one per source tree, through ``PYTHONPATH``):

- ``{"op": "build", "workload": {...TimedWorkload fields}, "arm": NAME, "seed": S, "threads": N}``:
  sets torch's intra-op threads to N (as ``rtv bench --threads``), builds
X
- ``{"op": "step"}``: one step; answers ``{"seconds": s}``, the step's wall
  seconds on this process's clock (so the pipe's round trip is not timed).

Every answer also carries ``"cpu"``: the process's CPU seconds so far (the
driver's load probe).
- end of input: the process exits.

An error answers ``{"error": traceback}`` and the process exits 1.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from pathlib import Path

__all__ = ["main"]


def _build(request: dict) -> tuple[object, dict]:
    import torch

    import reference_trainer as rt

    from .arms import TimedWorkload
    from .canary import Group, build_arms

    torch.set_num_threads(request["threads"])
    workload = TimedWorkload(**request["workload"])
    arm = build_arms(Group(workload, (request["arm"],), False), request["seed"])[request["arm"]]
    loss = arm()
    while math.isnan(loss):
        loss = arm()
    return arm, {"loss": loss, "trainer": str(Path(rt.__file__).resolve().parent)}


def main() -> int:
    """Serve requests until stdin closes (module docstring)."""
    arm = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "build":
                arm, answer = _build(request)
            else:
                start = time.perf_counter()
                arm()
                answer = {"seconds": time.perf_counter() - start}
        except Exception:  # noqa: BLE001 - any failure goes back to the driver, which raises it there
            print(json.dumps({"error": traceback.format_exc()}), flush=True)
            return 1
        print(json.dumps({**answer, "cpu": time.process_time()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
