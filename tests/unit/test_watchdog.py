"""The collective watchdog (NOTE [Collective watchdog]): the trace, the dump, and the comparison of traces.

The comparison is checked on hand-built traces whose first disagreement is
known by construction; the trace and the dump on one process, with no
process group (the spawned cases are the liveness canary's and
``tests/canaries/test_liveness.py``'s).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from reference_trainer import watchdog
from reference_trainer.errors import ConfigError, PeerError
from reference_trainer.peers import Comm
from reference_trainer.watchdog import CollectiveRecord, first_disagreement, read_dumps


def rec(seq: int, op: str = "exchange", call: str = "run_logical (#1)", *, shapes=(), dtypes=(), ended=1.0):
    return CollectiveRecord(seq, op, "data" if op != "exchange" else "control", shapes, dtypes, call, 0.0, ended)


def steps(n: int, start: int = 0) -> list[CollectiveRecord]:
    """``n`` agreeing collectives from ``start``, each named by its number (the same on every rank)."""
    return [rec(seq, call=f"step {seq}") for seq in range(start, start + n)]


@pytest.fixture
def no_watchdog() -> Iterator[None]:
    yield
    watchdog.uninstall()


# --- the comparison (Rule 5), against hand-built expectations --------------------------


def test_agreeing_traces_have_no_disagreement() -> None:
    assert first_disagreement({0: steps(5), 1: steps(5), 2: steps(5)}, 3) is None


def test_a_lagging_rank_never_reached_the_collective_the_others_wait_in() -> None:
    waiting = [*steps(4), rec(4, call="optim_step", ended=None)]
    found = first_disagreement({0: waiting, 1: steps(4), 2: waiting}, 3)
    assert (found.seq, found.odd_ranks, found.dead_ranks) == (4, (1,), ())
    assert found.records[1] is None and found.reference.call == "optim_step"
    assert "rank 1 never reached it" in found.describe()


def test_the_majority_is_the_reference_and_the_odd_rank_is_named_with_its_call() -> None:
    odd = [*steps(3), rec(3, call="run_logical (#2)")]
    same = [*steps(3), rec(3, call="optim_step")]
    found = first_disagreement({0: odd, 1: same, 2: same}, 3)
    assert (found.seq, found.odd_ranks, found.reference.call) == (3, (0,), "optim_step")
    assert found.records[0].call == "run_logical (#2)"


def test_a_tie_takes_the_lowest_rank_as_the_reference() -> None:
    found = first_disagreement({0: [*steps(2), rec(2, call="a")], 1: [*steps(2), rec(2, call="b")]}, 2)
    assert (found.reference.call, found.odd_ranks) == ("a", (1,))


def test_a_rank_without_a_snapshot_is_dead_at_the_collective_in_flight() -> None:
    found = first_disagreement({0: [*steps(6), rec(6, call="backward agreement", ended=None)]}, 2)
    assert (found.seq, found.dead_ranks, found.odd_ranks) == (6, (1,), ())
    assert "rank 1 left no trace (it died)" in found.describe()


def test_a_dead_rank_after_agreeing_traces_is_named_at_the_last_collective() -> None:
    found = first_disagreement({0: steps(3), 2: steps(3)}, 3)
    assert (found.seq, found.dead_ranks) == (2, (1,))


def test_records_that_fell_out_of_one_buffer_are_not_a_disagreement() -> None:
    found = first_disagreement({0: steps(4, start=10), 1: [*steps(8, start=6), rec(14, call="x", ended=None)]}, 2)
    assert (found.seq, found.odd_ranks) == (14, (0,))


@pytest.mark.parametrize(
    ("op", "differs"), [("all_gather", True), ("broadcast", True), ("gather", True), ("all_to_all", False)]
)
def test_shapes_count_only_where_every_rank_passes_the_same_shape(op: str, differs: bool) -> None:
    a = [rec(0, op, shapes=((2, 3),), dtypes=("float32",))]
    b = [rec(0, op, shapes=((5,),), dtypes=("float32",))]
    assert (first_disagreement({0: a, 1: b}, 2) is not None) is differs


def test_dtypes_always_count() -> None:
    a = [rec(0, "all_to_all", dtypes=("float32",))]
    b = [rec(0, "all_to_all", dtypes=("bfloat16",))]
    assert first_disagreement({0: a, 1: b}, 2).odd_ranks == (1,)


# --- the trace and the dump (Rules 1-3) ---------------------------------------------------


def test_a_collective_is_recorded_with_its_shapes_dtypes_call_and_end(tmp_path: Path, no_watchdog: None) -> None:
    watchdog.install(5.0, tmp_path, rank=0)
    with watchdog.recorded("all_gather", "data", (torch.zeros(2, 3), torch.ones(4, dtype=torch.int64)), "optim_step"):
        pass
    with watchdog.recorded("exchange", "control", (), "run_logical (#1)"):
        pass
    first, second = watchdog._TRACE.snapshot()
    assert (first.seq, first.shapes, first.dtypes, first.call) == (
        0,
        ((2, 3), (4,)),
        ("float32", "int64"),
        "optim_step",
    )
    assert second.seq == 1 and second.ended is not None and second.ended >= second.started


def test_a_peer_error_in_a_collective_dumps_stack_trace_and_the_collective_in_flight(
    tmp_path: Path, no_watchdog: None
) -> None:
    watchdog.install(5.0, tmp_path, rank=3)
    with watchdog.recorded("exchange", "control", (), "step 0"):
        pass
    with pytest.raises(PeerError) as info:
        with watchdog.recorded("exchange", "control", (), "optim_step: origins"):
            raise PeerError("lost physical rank 1", command="optim_step: origins", peer=1)
    body = json.loads((tmp_path / "rank-3-failed.json").read_text())
    assert body["in_flight"]["call"] == "optim_step: origins" and body["in_flight"]["ended"] is None
    assert [r["call"] for r in body["trace"]] == ["step 0", "optim_step: origins"] and body["peer"] == 1
    assert "test_a_peer_error_in_a_collective_dumps" in body["stack"]
    assert any("rank-3-failed.json" in note for note in info.value.__notes__)


def test_without_a_watchdog_a_failed_collective_dumps_nothing(tmp_path: Path) -> None:
    with pytest.raises(PeerError):
        with watchdog.recorded("exchange", "control", (), "x"):
            raise PeerError("lost", command="x")
    assert not list(tmp_path.iterdir())


class AskingStore:
    """A store whose dump request is present; after a few looks it stops the listener, so no run waits forever."""

    def __init__(self, stop: threading.Event) -> None:
        self.store, self.stop, self.looks = dist.HashStore(), stop, 0
        self.store.set("rtv/watchdog/dump", "0")

    def check(self, keys: list[str]) -> bool:
        self.looks += 1
        if self.looks >= 3:
            self.stop.set()
        return self.store.check(keys)


def test_a_dump_request_on_the_store_makes_a_live_process_dump_its_stack(tmp_path: Path) -> None:
    stop = threading.Event()
    dog = watchdog.Watchdog(5.0, tmp_path, 1, AskingStore(stop), "rtv/watchdog/dump", stop)
    dog._listen()  # returns once it has seen the request
    body = json.loads((tmp_path / "rank-1-asked.json").read_text())
    assert body["reason"] == "asked" and "_listen" in body["stack"] and body["error"] is None


def test_each_ranks_earliest_dump_is_its_snapshot(tmp_path: Path) -> None:
    for name, rank, at, trace in (
        ("rank-1-asked", 1, 5.0, [rec(0)]),
        ("rank-1-failed", 1, 9.0, [rec(0), rec(1)]),
        ("rank-0-failed", 0, 6.0, [rec(0), rec(1, ended=None)]),
    ):
        body = {"rank": rank, "dumped_at": at, "trace": [r.__dict__ for r in trace]}
        (tmp_path / f"{name}.json").write_text(json.dumps(body))
    traces = read_dumps(tmp_path)
    assert [len(traces[0]), len(traces[1])] == [2, 1]
    assert first_disagreement(traces, 2).odd_ranks == (1,)


def test_the_deadline_bounds_every_wait_of_a_comm_while_installed(tmp_path: Path, no_watchdog: None) -> None:
    comm = Comm(300.0, 3600.0, torch.device("cpu"))
    assert comm.wait_s == 300.0
    watchdog.install(2.5, tmp_path, rank=0)
    assert comm.wait_s == 2.5
    watchdog.uninstall()
    assert comm.wait_s == 300.0
    assert not list(tmp_path.iterdir()), "an unused backstop file is removed"


@pytest.mark.parametrize("deadline", [0, -1.0, float("nan"), True, "2"])
def test_a_bad_deadline_is_refused_and_the_installed_watchdog_stays(
    tmp_path: Path, no_watchdog: None, deadline: object
) -> None:
    installed = watchdog.install(3.0, tmp_path, rank=0)
    with pytest.raises(ConfigError, match="deadline_s"):
        watchdog.install(deadline, tmp_path, rank=0)  # type: ignore[arg-type]
    assert watchdog.current() is installed


def test_the_nccl_settings_point_the_flight_recorder_at_the_dump_folder(tmp_path: Path) -> None:
    env = watchdog.nccl_environment(tmp_path, 90.0)
    assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith(str(tmp_path)) and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and env["RT_DIST_TIMEOUT_S"] == "90"


def test_a_dump_appears_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dump is written aside and renamed into place: a writer that fails before the rename leaves no
    ``rank-*.json`` for a reader to find half-written."""

    def fails(source: object, target: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(watchdog.os, "replace", fails)
    with pytest.raises(OSError, match="disk full"):
        watchdog.Watchdog(5.0, tmp_path, 0).dump("failed")
    assert not list(tmp_path.glob("rank-*.json")) and read_dumps(tmp_path) == {}


def test_read_dumps_skips_a_file_that_is_not_readable_json(tmp_path: Path) -> None:
    (tmp_path / "rank-1-asked.json").write_text('{"rank": 1, "dumped_at": 5.0, "tra')  # cut off mid-write
    (tmp_path / "rank-0-failed.json").write_text(json.dumps({"rank": 0, "dumped_at": 6.0, "trace": [rec(0).__dict__]}))
    assert list(read_dumps(tmp_path)) == [0]


class SlowStore:
    """A store whose every look takes a while: the listener is inside one when uninstall is called."""

    def __init__(self) -> None:
        self.looking = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.looking.set()
        threading.Event().wait(0.3)
        return False


def test_uninstall_joins_the_listener(tmp_path: Path, no_watchdog: None) -> None:
    store = SlowStore()
    dog = watchdog.install(5.0, tmp_path, rank=1, store=store)
    assert store.looking.wait(5.0), "the listener never looked"
    watchdog.uninstall()
    assert dog._listener is not None and not dog._listener.is_alive(), "the listener outlived uninstall"


def test_the_control_group_is_made_after_a_barrier_bounded_by_the_deadline(
    tmp_path: Path, no_watchdog: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that never comes to make the control group (whose connection would wait for the group's long
    timeout) fails the barrier before it, within the deadline: a ``PeerError`` and a dump naming the call."""
    import datetime

    made, barriers = [], []

    def monitored_barrier(timeout: datetime.timedelta, wait_all_ranks: bool) -> None:
        barriers.append(timeout.total_seconds())
        raise RuntimeError("Ranks 1 failed to pass monitoredBarrier in 2500 ms")

    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "monitored_barrier", monitored_barrier)
    monkeypatch.setattr(dist, "new_group", lambda **options: made.append(options) or "group")
    assert watchdog.control_group(datetime.timedelta(hours=1)) == "group" and barriers == [], "unwatched: no barrier"
    watchdog.install(2.5, tmp_path, rank=0)
    with pytest.raises(PeerError, match="Ranks 1 failed"):
        watchdog.control_group(datetime.timedelta(hours=1))
    assert barriers == [2.5] and len(made) == 1, "the group is not made after a failed barrier"
    body = json.loads((tmp_path / "rank-0-failed.json").read_text())
    assert body["in_flight"]["op"] == "monitored_barrier" and body["in_flight"]["call"] == "run_logical: control group"
