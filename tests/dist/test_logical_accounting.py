"""What logical ranks hold and move, measured by the harness: the storage census and the counting transport.

Held: :func:`validation.memory.reachable_bytes` of ``trainer.rank_gradients``,
sampled in every logical rank's ``fn`` before its backward and at rest
(``canaries.memory.scale``); moved: ``rt.logical_traffic`` over one step.
The bounds of ``canaries.memory.scale``: held <= (ceil(log2(L/W)) + 2) x the gradient bytes,
received <= 2.2 x the gradient bytes (control messages apart). W = 1 and a
W = 2 sample by default; the whole grid (L up to 64, W up to 4) is ``slow``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest

from canaries.memory.scale import RECEIVED_FACTOR, scale_readings
from validation.spawn import spawn_ranks

pytestmark = pytest.mark.dist

KINDS = ("full", "lora")


@functools.cache
def _readings(world: int, sizes: tuple[int, ...]) -> list[dict[str, dict[str, Any]]]:
    cases = [(kind, size) for kind in KINDS for size in sizes if size % world == 0]
    if world == 1:
        return [scale_readings(cases)]
    return spawn_ranks(scale_readings, world, cases, (), timeout_s=600.0, dist_timeout_s=120.0)


def _check(world: int, sizes: tuple[int, ...]) -> None:
    for rank, per_case in enumerate(_readings(world, sizes)):
        for case, r in per_case.items():
            per = int(case.rsplit("L", 1)[1]) // world
            where = f"{case}, W={world}, rank {rank}"
            grad = r["grad_bytes"]
            assert r["held_rest"] > 0, f"{where}: the census saw nothing pending (vacuous)"
            assert r["held_peak"] <= (math.ceil(math.log2(per)) + 2) * grad, f"{where}: held {r['held_peak']} of {grad}"
            assert r["received"] <= RECEIVED_FACTOR * grad, f"{where}: received {r['received']} of {grad}"
            if world > 1:  # the sums really crossed: each process's shard came from its peers
                assert r["received"] >= (world - 1) / world * grad, f"{where}: received only {r['received']}"
                assert r["control_received"] > 0
            else:
                assert r["received"] == 0 and r["oracle_equal"], where


def test_one_process_holds_a_binary_counters_partial_sums(one_thread: None) -> None:
    _check(1, (1, 4, 16))
    held = {case: r["held_peak"] / r["grad_bytes"] for case, r in _readings(1, (1, 4, 16))[0].items()}
    assert held["full-L16"] > held["full-L1"], "the census cannot see the partial sums mid-round (vacuous)"


@pytest.mark.slow  # spawns two ranks: the forkserver's start alone (torch imported afresh) is about 4 s of CPU
def test_two_processes_hold_and_receive_within_the_bounds(one_thread: None) -> None:
    _check(2, (2, 8))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_layout_up_to_64_logical_ranks(world: int, one_thread: None) -> None:
    _check(world, (1, 2, 4, 8, 16, 64))
