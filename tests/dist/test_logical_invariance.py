"""Logical ranks give the same bits on one process and on two (contract §8).

W=2 results come from one spawned gloo suite (``two_process`` fixture); W=1
results are computed here, in the test process, with no process group.
"""

from __future__ import annotations

import functools
from typing import Any

import dist_scenarios as ds
import numpy as np
import pytest

from reference_trainer.ranks import spread
from validation.spawn import to_plain

pytestmark = pytest.mark.dist


def scenario(two_process: dict[str, Any], name: str, rank: int = 0) -> Any:
    """One scenario's value on one rank; the scenario's own traceback if it crashed."""
    entry = two_process["ranks"][rank][name]
    if "crash" in entry:
        pytest.fail(f"scenario {name!r} crashed on rank {rank}:\n{entry['crash']}")
    return entry["value"]


def assert_bitwise_equal(found: dict[str, np.ndarray], expected: dict[str, np.ndarray], what: str) -> None:
    assert found.keys() == expected.keys(), what
    differ = [n for n in expected if not np.array_equal(found[n].view(np.uint32), expected[n].view(np.uint32))]
    if differ:
        worst = max(float(np.abs(found[n] - expected[n]).max()) for n in differ)
        pytest.fail(f"{what}: {len(differ)} of {len(expected)} parameters differ (first {differ[0]}, max |diff| {worst:.3e})")


@functools.cache
def single_process(case: str) -> dict[str, np.ndarray]:
    return to_plain(ds.INVARIANCE_CASES[case]())


@functools.cache
def plain_trainer(kind: str, logical_dp: int) -> dict[str, np.ndarray]:
    return to_plain(ds.train_plain(ds.make_trainer(kind), logical_dp))


@pytest.mark.parametrize("case", list(ds.INVARIANCE_CASES))
def test_params_bitwise_equal_on_one_and_two_processes(case: str, two_process: dict, one_thread: None) -> None:
    """FP32 parameters after staleness-2 training: W=2 (both ranks) == W=1, bit for bit."""
    rank0 = scenario(two_process, f"invariance/{case}", 0)
    rank1 = scenario(two_process, f"invariance/{case}", 1)
    before = to_plain(ds.params(ds.make_trainer("lora" if "lora" in case else "full")))
    assert any(not np.array_equal(before[n], rank0[n]) for n in before), "training changed nothing"
    assert_bitwise_equal(rank1, rank0, f"{case}: rank 1 vs rank 0")
    assert_bitwise_equal(rank0, single_process(case), f"{case}: two processes vs one")


@pytest.mark.parametrize(("logical_dp", "kind"), [(2, "full"), (4, "full"), (4, "lora")])
def test_zero_mode_equals_plain_trainer_on_the_global_loss(logical_dp: int, kind: str, two_process: dict, one_thread: None) -> None:
    """Zero mode == one plain Trainer that forwards each logical rank's micro-batch and backpropagates
    the sum of the per-rank losses in logical order (one backward per step), on W=1 and on W=2."""
    expected = plain_trainer(kind, logical_dp)
    case = f"zero-L{logical_dp}-{kind}"
    assert_bitwise_equal(single_process(case), expected, f"{case}, one process, vs plain trainer")
    assert_bitwise_equal(scenario(two_process, f"invariance/{case}"), expected, f"{case}, two processes, vs plain trainer")


def test_rank_mode_equals_zero_mode_and_plain_trainer(one_thread: None) -> None:
    """Per-rank losses (rank mode) and one global loss (zero mode) give the same cotangents, hence the same bits."""
    expected = plain_trainer("full", 4)
    assert_bitwise_equal(single_process("rank-L4-full"), expected, "rank mode vs plain trainer")
    assert_bitwise_equal(single_process("zero-L4-full"), expected, "zero mode vs plain trainer")


def test_eight_logical_ranks_on_two_processes_in_zero_mode(two_process: dict) -> None:
    """8 logical ranks on 2 processes: uneven and empty chunks, outputs back in source order, a real step."""
    rank0 = scenario(two_process, "zero-eight-ranks", 0)
    rank1 = scenario(two_process, "zero-eight-ranks", 1)
    result = rank0["result"]
    assert result["lengths"] == [4 + (i % 5) for i in range(13)]
    for index, (found, expected) in enumerate(zip(result["values"], rank0["reference"], strict=True)):
        assert np.array_equal(found, expected), f"output {index} is not its chunk's plain forward (source order broken?)"
    # One record per logical rank with inputs: 8 for 13 inputs, 3 for 3 inputs.
    assert result["records"] == sum(1 for c in spread(13, 8) if c) + sum(1 for c in spread(3, 8) if c) == 11
    assert result["stepped"] and rank0["changed"] > 0 and rank0["finite"]
    assert "no reduce" in result["no_reduce"]
    assert rank1["result"] is None  # fn ran on rank 0 only
    assert_bitwise_equal(rank1["params"], rank0["params"], "8 logical ranks: rank 1 vs rank 0")
