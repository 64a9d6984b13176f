"""Launch paths beyond the default suite (nightly): torchrun with the example script, and four processes.

``torchrun`` starts its own processes (env:// rendezvous through ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); the four-process spawn
exercises the rank-0 star with more than one follower.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import dist_scenarios as ds
import numpy as np
import pytest

from validation.spawn import spawn_ranks, to_plain

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_example_prints_the_same_digests_and_corrections_for_one_and_two_processes(one_thread: None) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import torchrun_logical
    finally:
        sys.path.remove(str(ROOT / "examples"))
    expected = torchrun_logical.main(["--logical-dp", "4"])  # no launcher: one process
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(ROOT / "examples" / "torchrun_logical.py"), "--logical-dp", "4"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    found = {mode: (value, int(n)) for mode, value, n in re.findall(r"(\w+)-mode digest (\w+) corrected (\d+)", done.stdout)}
    assert "processes=2" in done.stdout and found == expected, done.stdout
    assert all(corrected > 0 for _, corrected in expected.values()), "default options, yet nothing was corrected"


def test_four_processes_match_one_and_all_survivors_name_a_dead_peer(one_thread: None) -> None:
    outcomes = spawn_ranks(ds.four_process_suite, 4, timeout_s=240.0, check=False)
    assert outcomes[2].exitcode == 17, outcomes[2]
    expected = {"rank": to_plain(ds.train_rank(ds.make_trainer("full"), 8)),
                "zero": to_plain(ds.train_zero(ds.make_trainer("lora"), 8))}
    for outcome in (outcomes[0], outcomes[1], outcomes[3]):
        assert outcome.ok, outcome.error
        # Corrections happened: each process's logical ranks have their share, zero mode's rank 0 sees all.
        assert 0 < outcome.value["rank"]["corrected"] < expected["rank"]["corrected"]
        assert outcome.value["zero"]["corrected"] == (expected["zero"]["corrected"] if outcome.rank == 0 else 0)
        for mode, run in expected.items():
            for name, value in run["params"].items():
                assert np.array_equal(outcome.value[mode]["params"][name], value), f"rank {outcome.rank}, {mode} mode, {name}"
        death = outcome.value["death"]
        assert death["type"] == "PeerError" and death["peer"] == 2, (outcome.rank, death)
        assert outcome.value["seconds"] < 10.0
