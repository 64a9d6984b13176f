"""An error on any rank fails every rank the same way with nothing committed; dead or silent peers are named.

Values come from the spawned two-process suite (``two_process`` fixture).
"""

from __future__ import annotations

from typing import Any

import dist_scenarios as ds
import numpy as np
import pytest

pytestmark = pytest.mark.dist


def scenario(two_process: dict[str, Any], name: str, rank: int = 0) -> Any:
    source = two_process["peers"] if rank == 0 and name in two_process["peers"] else two_process["ranks"][rank]
    entry = source[name]
    if "crash" in entry:
        pytest.fail(f"scenario {name!r} crashed on rank {rank}:\n{entry['crash']}")
    return entry["value"]


def assert_nothing_changed(result: dict[str, Any], where: str, *, expect_pending: bool = True) -> None:
    before, after = result["before"], result["after"]
    assert before["revision"] == after["revision"], where
    for name, value in before["params"].items():
        assert np.array_equal(value, after["params"][name]), f"{where}: parameter {name} changed"
    for name, value in before["grads"].items():
        found = after["grads"][name]
        assert (value is None) == (found is None), f"{where}: .grad of {name} appeared or vanished"
        assert value is None or np.array_equal(value, found), f"{where}: .grad of {name} changed"
    pending, now = before["buffers"], after["buffers"]
    assert pending.keys() == now.keys(), f"{where}: pending logical-rank sums appeared or vanished"
    for key, value in pending.items():
        assert np.array_equal(value, now[key]), f"{where}: the pending logical-rank sum {key} changed"
    if expect_pending:  # the check above means something only with state to lose
        assert pending and any(v is not None for v in before["grads"].values()), f"{where}: nothing was pending"


@pytest.mark.parametrize("name", ["rank-fault", "zero-fault"])
def test_fault_on_rank_one_fails_both_ranks_and_commits_nothing(two_process: dict, name: str) -> None:
    """inject_fault("model_backward") armed on physical rank 1 only: both raise GradientCommitError, same message."""
    results = [scenario(two_process, name, rank) for rank in (0, 1)]
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0]["type"] == "GradientCommitError", errors
    assert errors[0] == errors[1], "ranks raised different errors"
    assert "injected fault" in errors[0]["message"]
    for rank, result in enumerate(results):
        assert_nothing_changed(result, f"{name}, rank {rank}")


def test_training_goes_on_in_step_after_a_failed_backward(two_process: dict) -> None:
    after = [scenario(two_process, "zero-fault", rank)["after_retry"] for rank in (0, 1)]
    changed = [n for n in after[0] if not np.array_equal(after[0][n], scenario(two_process, "zero-fault", 0)["after"]["params"][n])]
    assert changed, "the retried step changed nothing"
    for name in after[0]:
        assert np.array_equal(after[0][name], after[1][name]), f"ranks diverged after recovery: {name}"


def test_stale_gradient_on_one_logical_rank_fails_every_rank_with_its_facts(two_process: dict) -> None:
    """Logical rank 3 (physical rank 1) is stale: both processes raise StaleGradientError with the same attributes."""
    results = [scenario(two_process, "rank-stale", rank) for rank in (0, 1)]
    expected = {"type": "StaleGradientError", "checkpoint": "policy", "staleness": 1, "bound": 0,
                "forward_revision": 0, "current_revision": 1}
    for rank, result in enumerate(results):
        assert expected.items() <= result["error"].items(), (rank, result["error"])
        assert_nothing_changed(result, f"rank-stale, rank {rank}")
    assert results[0]["error"] == results[1]["error"]


def test_user_error_on_one_logical_rank_is_raised_everywhere(two_process: dict) -> None:
    """Logical rank 1 raises ValueError while the others wait in reduce: every process raises that ValueError."""
    for rank in (0, 1):
        result = scenario(two_process, "rank-user-error", rank)
        assert result["error"] == {"type": "ValueError", "message": "boom on logical rank 1"}, (rank, result["error"])
        assert_nothing_changed(result, f"rank-user-error, rank {rank}", expect_pending=False)


def test_hung_peer_is_named_within_the_timeout(two_process: dict) -> None:
    """Rank 1 stalls 2 s with timeout_s=0.5: rank 0 raises PeerError naming physical rank 1 and the command."""
    result = scenario(two_process, "hung-peer")
    error = result["error"]
    assert error is not None and error["type"] == "PeerError", error
    assert error["peer"] == 1 and "physical rank 1" in error["message"]
    assert error["command"].startswith("run_logical") and error["command"] in error["message"]
    assert result["seconds"] < ds.HANG_S - 0.3, f"took {result['seconds']:.2f} s: waited for the peer, not the timeout"


def test_killed_peer_is_named_promptly(two_process: dict) -> None:
    """Rank 1 exits (os._exit) while serving a zero-mode backward: rank 0 raises PeerError at once, no hang."""
    result = scenario(two_process, "killed-peer")
    error = result["error"]
    assert error is not None and error["type"] == "PeerError", error
    assert error["peer"] == 1 and "physical rank 1" in error["message"]
    assert error["command"].startswith("zero.backward"), error["command"]
    # timeout_s is 20 s in the suite: a prompt failure proves the connection loss was noticed, not waited out.
    assert result["seconds"] < 10.0, f"took {result['seconds']:.2f} s"
