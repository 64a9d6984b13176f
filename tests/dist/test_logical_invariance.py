"""Logical ranks give the same bits on one process and on two (NOTE [Logical ranks] Rule 4), with default options.

W=2 results come from one spawned gloo suite (``two_process`` fixture); W=1
results are computed here, in the test process, with no process group. The
trainers use the default ``when_available`` correction, and the schedules
repeat tokens so that stale records are corrected (each run checks it).
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
def single_process(case: str) -> dict[str, Any]:
    return to_plain(ds.INVARIANCE_CASES[case]())


@functools.cache
def plain_trainer(kind: str, logical_dp: int) -> dict[str, Any]:
    return to_plain(ds.train_plain(ds.make_trainer(kind), logical_dp))


@pytest.mark.parametrize("case", list(ds.INVARIANCE_CASES))
def test_params_bitwise_equal_on_one_and_two_processes(case: str, two_process: dict, one_thread: None) -> None:
    """FP32 parameters after staleness-2 training: W=2 (both ranks) == W=1, bit for bit, corrections included."""
    rank0 = scenario(two_process, f"invariance/{case}", 0)
    rank1 = scenario(two_process, f"invariance/{case}", 1)
    one = single_process(case)
    before = to_plain(ds.params(ds.make_trainer("lora" if "lora" in case else "full")))
    assert any(not np.array_equal(before[n], rank0["params"][n]) for n in before), "training changed nothing"
    assert_bitwise_equal(rank1["params"], rank0["params"], f"{case}: rank 1 vs rank 0")
    assert_bitwise_equal(rank0["params"], one["params"], f"{case}: two processes vs one")
    # The same records were corrected (rank mode: each process counts its own logical ranks').
    assert rank0["corrected"] + rank1["corrected"] == one["corrected"]
    if "dropout" in case:  # no when_available pairs across dropout masks (NOTE [Importance correction] Rule 8)
        assert one["corrected"] == 0
    else:
        assert rank0["corrected"] > 0 and (case.startswith("zero") or rank1["corrected"] > 0), "nothing was corrected"


@pytest.mark.parametrize(("logical_dp", "kind"), [(2, "full"), (4, "full"), (4, "lora")])
def test_zero_mode_equals_plain_trainer_on_the_global_loss(logical_dp: int, kind: str, two_process: dict, one_thread: None) -> None:
    """Zero mode vs one plain Trainer that forwards each logical rank's micro-batch and backpropagates
    the sum of the per-rank losses in logical order (one backward per step), on W=1 and on W=2: bit for bit
    at L=2, where the tree of Rule 4 is the plain trainer's left-to-right sum; to rounding at L=4, where it is not."""
    expected = plain_trainer(kind, logical_dp)
    case = f"zero-L{logical_dp}-{kind}"
    assert expected["corrected"] > 0
    for found, where in ((single_process(case), "one process"), (scenario(two_process, f"invariance/{case}"), "two processes")):
        if logical_dp == 2:
            assert_bitwise_equal(found["params"], expected["params"], f"{case}, {where}, vs plain trainer")
        for name, value in expected["params"].items():
            np.testing.assert_allclose(found["params"][name], value, rtol=1e-4, atol=1e-6, err_msg=f"{case}, {where}: {name}")
        assert found["corrected"] == expected["corrected"], where


def test_rank_mode_equals_zero_mode_and_plain_trainer(one_thread: None) -> None:
    """Per-rank losses (rank mode) and one global loss (zero mode) give the same cotangents, hence the same bits;
    the plain trainer's left-to-right sum equals them at L=2 (the tree is left to right there)."""
    assert_bitwise_equal(single_process("rank-L4-full")["params"], single_process("zero-L4-full")["params"], "rank vs zero mode")
    expected = plain_trainer("full", 2)
    assert_bitwise_equal(single_process("rank-L2-full")["params"], expected["params"], "rank mode vs plain trainer")
    assert_bitwise_equal(single_process("zero-L2-full")["params"], expected["params"], "zero mode vs plain trainer")


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


def test_a_logical_rank_is_corrected_by_its_own_forwards_only_on_one_and_two_processes(two_process: dict, one_thread: None) -> None:
    """Logical ranks 0 and 1 hold stale records of the same tokens; only rank 0 scores them again. Rank 1
    must not be corrected with rank 0's log-probs on one process either (the mutation shared_correction_cache)."""
    one = to_plain(ds.shared_tokens())
    rank0, rank1 = scenario(two_process, "shared-tokens", 0), scenario(two_process, "shared-tokens", 1)
    assert one["corrected"] == {0: True, 1: False}
    assert (rank0["corrected"], rank1["corrected"]) == ({0: True}, {1: False})
    assert_bitwise_equal(rank1["params"], rank0["params"], "shared tokens: rank 1 vs rank 0")
    assert_bitwise_equal(rank0["params"], one["params"], "shared tokens: two processes vs one")
