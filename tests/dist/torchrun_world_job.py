"""Run under ``torchrun`` (one "node" of a world): the harness's joined world, as ``rtv`` under torchrun uses it.

Rank 0 asks :func:`validation.world.run_ranks` for the logical-rank schedule of
the derivative canary's Rule 1 check on every process of the world, then for a
call whose rank 1 raises, then for each rank's place in a group made for that
call (the world outlives a failed call), and prints one ``RESULT`` JSON line: each call's outcome and
:func:`validation.world.world_facts`. The other ranks only serve.
"""

from __future__ import annotations

import json
import os
import sys

from canaries.derivative.intersections import logical_run
from canaries.presets import preset
from validation.spawn import SpawnError
from validation.world import given_world, joined, run_ranks, world_facts


def fails_on_rank_one() -> int:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank 1 fails on purpose")
    return 0


def rank_and_size() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def command() -> int:
    config = preset("cpu", 2)
    first = run_ranks(logical_run, 2, config, 2)
    try:
        run_ranks(fails_on_rank_one, 2)
        failure = None
    except SpawnError as error:
        failure = [(o.rank, o.ok, (o.error or "").strip().splitlines()[-1:]) for o in error.outcomes]
    again = run_ranks(rank_and_size, 2)
    print("RESULT " + json.dumps({"first": first, "failure": failure, "again": again, "facts": world_facts()}))
    return 0


if __name__ == "__main__":
    sys.exit(joined(given_world(), command))
