"""The harness's side of the watchdog (NOTE [Hang reports]): the scope, the settling, the diagnosis, exit 7.

Dumps are written here by hand in the format ``reference_trainer.watchdog``
writes, so each diagnosis is known by construction; the spawned cases are
``tests/canaries/test_liveness.py``'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from reference_trainer.watchdog import CollectiveRecord
from validation.hangs import HANG_EXIT_CODE, HangDetected, Watch, diagnose, next_watch, settle, watching
from validation.spawn import RankOutcome
from validation.trainers import trainer_with_policy


def dump(folder: Path, rank: int, reason: str, at: float, calls: list[str], in_flight: bool = False) -> None:
    trace = [
        CollectiveRecord(
            seq, "exchange", "control", (), (), call, 0.0, None if in_flight and seq == len(calls) - 1 else 1.0
        )
        for seq, call in enumerate(calls)
    ]
    body = {"rank": rank, "reason": reason, "dumped_at": at, "trace": [asdict(r) for r in trace], "stack": "..."}
    (folder / f"rank-{rank}-{reason}.json").write_text(json.dumps(body))


OUTCOMES = [RankOutcome(0, None, "PeerError", 0), RankOutcome(1, None, "PeerError", 0)]


def test_outside_a_scope_a_call_is_not_watched() -> None:
    assert next_watch() is None


def test_each_call_in_a_scope_gets_the_deadline_and_a_fresh_folder_under_hangs(tmp_path: Path) -> None:
    with watching(3.0, tmp_path):
        first, second = next_watch(), next_watch()
    assert first.deadline_s == second.deadline_s == 3.0 and first.folder != second.folder
    assert Path(first.folder).parent == tmp_path / "hangs"
    assert next_watch() is None, "the scope ends with the block"


@pytest.mark.parametrize("deadline", [0, -1.0, float("nan")])
def test_a_scope_refuses_a_deadline_that_is_not_positive(tmp_path: Path, deadline: float) -> None:
    with pytest.raises(ValueError, match="hang deadline"):
        with watching(deadline, tmp_path):
            pass


def test_a_call_without_dumps_leaves_no_folder_behind(tmp_path: Path) -> None:
    with watching(3.0, tmp_path):
        watch = next_watch()
    (Path(watch.folder) / "rank-0-backstop.txt").write_text("")  # armed, never fired
    assert settle(watch, OUTCOMES, check=True) is None
    assert not (tmp_path / "hangs").exists()


def test_a_lagging_rank_is_named_at_the_collective_rank_0_waited_in_and_the_call_exits_7(tmp_path: Path) -> None:
    with watching(3.0, tmp_path):
        watch = next_watch()
    folder = Path(watch.folder)
    dump(folder, 0, "failed", 10.0, ["a", "b", "run_logical (#2)"], in_flight=True)
    dump(folder, 1, "asked", 10.1, ["a", "b"])  # its snapshot: it never got there
    dump(folder, 1, "failed", 12.0, ["a", "b", "run_logical (#2)"])  # later, once it woke: not its snapshot
    with pytest.raises(HangDetected) as info:
        settle(watch, OUTCOMES, check=True)
    found = info.value.diagnosis
    assert (found["seq"], found["odd_ranks"], found["dead_ranks"], found["call"]) == (2, [1], [], "run_logical (#2)")
    assert info.value.exit_code == HANG_EXIT_CODE == 7
    assert "rank 1 never reached it" in str(info.value) and "diagnosis.json" in info.value.fix
    assert json.loads((folder / "diagnosis.json").read_text()) == found


def test_a_rank_with_no_dump_is_named_dead_and_check_false_returns_the_diagnosis(tmp_path: Path) -> None:
    folder = tmp_path / "one-call"
    folder.mkdir()
    dump(folder, 0, "failed", 1.0, ["a", "backward (#1)"], in_flight=True)
    found = settle(Watch(2.0, str(folder)), OUTCOMES, check=False)
    assert (found["dead_ranks"], found["odd_ranks"], found["call"]) == ([1], [], "backward (#1)")
    assert "rank 1 left no trace (it died)" in found["text"]


def test_a_backstop_stack_alone_is_a_hang_too(tmp_path: Path) -> None:
    (tmp_path / "rank-1-backstop.txt").write_text("Thread 0x01 (most recent call first):\n  File ...")
    found = diagnose(tmp_path, 2)
    assert found["backstops"] == ["rank-1-backstop.txt"] and "rank-1-backstop.txt" in found["text"]


def test_no_dump_no_diagnosis(tmp_path: Path) -> None:
    assert diagnose(tmp_path, 2) is None


def test_a_call_whose_only_evidence_is_nccls_flight_recorder_keeps_it_and_exits_7(tmp_path: Path) -> None:
    """torch's flight recorder dumps on an NCCL timeout under the name ``nccl_environment`` gives it; settling
    keeps such a folder (it is evidence) and reports the hang."""
    from reference_trainer.watchdog import nccl_environment

    with watching(3.0, tmp_path):
        watch = next_watch()
    recorder = Path(nccl_environment(watch.folder, 3.0)["TORCH_FR_DUMP_TEMP_FILE"] + "1")  # torch appends the rank
    recorder.write_bytes(b"\x80pickled entries")
    with pytest.raises(HangDetected) as info:
        settle(watch, OUTCOMES, check=True)
    assert recorder.exists() and info.value.diagnosis["flight_recorders"] == [recorder.name]
    assert recorder.name in str(info.value)


def _rank_1_stuck_for_good(deadline_s: float) -> str:
    """After one step together, rank 1 never reaches the second step (nor the closing barrier); rank 0 waits."""
    import time

    import torch
    import torch.distributed as dist

    import reference_trainer as rt

    trainer = trainer_with_policy(lora=rt.LoRAConfig(rank=2), optimizer=rt.AdamWConfig(lr=1e-2))

    def body(view):
        out = view.forward(rt.ForwardInput(torch.arange(6)), checkpoint="policy")
        view.backward(-out.target_logprobs.sum())

    try:
        rt.run_logical(body, trainer, logical_dp=2, timeout_s=60.0)
        if dist.get_rank() == 1:
            time.sleep(3600)
        rt.run_logical(body, trainer, logical_dp=2, timeout_s=60.0)
    except rt.PeerError as error:
        return f"PeerError: {error}"
    return "ok"


@pytest.mark.slow  # two processes, a 1 s deadline waited out, and a 1 s margin
@pytest.mark.dist
def test_a_spawned_rank_still_running_a_margin_past_the_dump_request_is_killed(tmp_path: Path, monkeypatch) -> None:
    from validation import spawn

    monkeypatch.setattr(spawn, "FIRED_MARGIN_S", 1.0)
    watch = Watch(1.0, str(tmp_path))
    outcomes = spawn.spawn_ranks(_rank_1_stuck_for_good, 2, 1.0, check=False, timeout_s=120.0, watch=watch)
    assert outcomes[0].ok and outcomes[0].value.startswith("PeerError"), outcomes[0]
    assert outcomes[1].exitcode == -9 and "after the watchdog's dump request" in outcomes[1].error, outcomes[1]
    with pytest.raises(HangDetected) as info:
        settle(watch, outcomes, check=True)
    assert info.value.diagnosis["odd_ranks"] == [1] or 1 in info.value.diagnosis["dead_ranks"]


def _rank_1_late_to_its_first_step(deadline_s: float) -> str:
    """Rank 1 comes to the trainer's first ``run_logical`` (which makes the control group) past the deadline."""
    import time

    import torch
    import torch.distributed as dist

    import reference_trainer as rt

    trainer = trainer_with_policy(lora=rt.LoRAConfig(rank=2), optimizer=rt.AdamWConfig(lr=1e-2))
    if dist.get_rank() == 1:
        time.sleep(deadline_s + 2.0)

    def body(view):
        out = view.forward(rt.ForwardInput(torch.arange(6)), checkpoint="policy")
        view.backward(-out.target_logprobs.sum())

    try:
        rt.run_logical(body, trainer, logical_dp=2, timeout_s=60.0)
    except rt.PeerError as error:
        return f"PeerError: {error}"
    return "ok"


@pytest.mark.slow  # two processes and a 1 s deadline waited out
@pytest.mark.dist
def test_a_rank_late_to_make_the_control_group_is_named_within_the_deadline(tmp_path: Path) -> None:
    from validation.spawn import spawn_ranks

    watch = Watch(1.0, str(tmp_path))
    outcomes = spawn_ranks(_rank_1_late_to_its_first_step, 2, 1.0, check=False, timeout_s=120.0, watch=watch)
    assert outcomes[0].value.startswith("PeerError"), outcomes
    with pytest.raises(HangDetected) as info:
        settle(watch, outcomes, check=True)
    found = info.value.diagnosis
    assert found["odd_ranks"] == [1] and found["call"] == "run_logical: control group", found
    asked = json.loads((tmp_path / "rank-1-asked.json").read_text())
    assert "_rank_1_late_to_its_first_step" in asked["stack"], "rank 1's stack at detection shows where it lags"
