"""The harness's process world read from the launcher's variables, and spawned ranks where there is none.

A torchrun world itself (two "nodes" on 127.0.0.1) is in tests/dist/test_torchrun_world.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from validation.errors import SetupError
from validation.world import GivenWorld, given_world, run_ranks, world_facts

WORLD = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.slow  # spawns two ranks (a forkserver start, about 4 s of CPU)
def test_no_launcher_variables_is_no_world_and_checks_are_spawned():
    assert given_world({"PATH": "/bin"}) is None
    assert world_facts() is None
    assert run_ranks(_rank_and_size, 2) == [(0, 2), (1, 2)]


def _rank_and_size() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def test_torchruns_variables_are_read_as_the_world():
    assert given_world(WORLD) == GivenWorld(
        rank=1, world_size=2, local_rank=0, master_addr="10.0.0.1", master_port=29500
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"MASTER_PORT": None}, "but not MASTER_PORT"),
        ({"RANK": "one"}, "expected integers"),
        ({"RANK": "2"}, "0 <= RANK < WORLD_SIZE"),
    ],
)
def test_a_partial_or_broken_world_is_refused_with_a_fix(change: dict, message: str):
    environ = {k: v for k, v in (WORLD | change).items() if v is not None}
    with pytest.raises(SetupError, match=message) as info:
        given_world(environ)
    assert "torchrun" in info.value.fix


def _listeners_of_master_port() -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) listening on this rank's MASTER_PORT."""
    port = f"{int(os.environ['MASTER_PORT']):04X}"
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and local.endswith(f":{port}"):  # 0A: LISTEN
                found.append(local.rsplit(":", 1)[0])
    return found


@pytest.mark.slow  # spawns two ranks (a forkserver start, about 4 s of CPU)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_the_spawned_ranks_rendezvous_listens_on_loopback_only():
    """A TCPStore binds every interface by itself; the harness's store must not be reachable from the network."""
    (found, _) = run_ranks(_listeners_of_master_port, 2)
    assert found == ["0100007F"], f"expected only 127.0.0.1 to listen on the rendezvous port, found {found}"


def test_a_watched_nccl_call_sets_the_flight_recorder_for_its_group_alone(monkeypatch, tmp_path):
    """Each joined-world call's NCCL settings are in ``os.environ`` while its group is made and gone after, so a
    later call (or check) in the same process does not inherit them."""
    import pickle

    import torch
    import torch.distributed as dist

    from validation import world as world_module
    from validation.hangs import Watch

    seen, timeouts = {}, []

    def init_process_group(backend, **options):
        seen.update({name: os.environ.get(name) for name in ("RT_DIST_TIMEOUT_S", "TORCH_FR_DUMP_TEMP_FILE")})
        timeouts.append(options["timeout"].total_seconds())
        raise RuntimeError("no NCCL here")

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setenv("RT_DIST_TIMEOUT_S", "1234")
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    store = dist.HashStore()
    joined = world_module._Joined(GivenWorld(0, 1, 0, "127.0.0.1", 1), store, [])
    world_module._run_call(joined, print, (), "nccl", 30.0, Watch(2.0, str(tmp_path)))
    assert seen == {"RT_DIST_TIMEOUT_S": "2", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "nccl-flight-recorder-rank-")}
    assert os.environ["RT_DIST_TIMEOUT_S"] == "1234" and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    value, error, _ = pickle.loads(store.get("rtv/result/0/0"))
    assert value is None and "no NCCL here" in error
    assert timeouts == [2.0 + world_module.FIRED_MARGIN_S], "the group outlives the deadline and the margin"


def test_a_watched_groups_timeout_comes_after_the_deadline_and_margin():
    from validation.hangs import Watch
    from validation.spawn import FIRED_MARGIN_S, group_timeout_s

    assert group_timeout_s(30.0, None) == 30.0
    assert group_timeout_s(30.0, Watch(120.0, "f")) == 120.0 + FIRED_MARGIN_S
    assert group_timeout_s(900.0, Watch(120.0, "f")) == 900.0, "a longer timeout asked for is kept"


@pytest.mark.parametrize("call", ["memory", "conform"])
def test_the_memory_scale_and_conformance_processes_checks_spawn_watched(monkeypatch, tmp_path, call):
    """docs/harness.md#hangs: their spawned ranks get the run's watch like any ``run_ranks`` call."""
    from validation import spawn as spawn_module
    from validation import world as world_module
    from validation.hangs import watching

    watches = []

    def spawned(fn, world_size, *args, watch=None, **options):
        watches.append(watch)
        raise RuntimeError("stop before any process starts")

    monkeypatch.setattr(spawn_module, "spawn_ranks", spawned)
    monkeypatch.setattr(world_module, "spawn_ranks", spawned)
    with watching(5.0, tmp_path), pytest.raises(RuntimeError, match="stop before"):
        if call == "memory":
            from canaries.memory import scale

            monkeypatch.setattr(scale, "scale_readings", lambda cases, *rest: {})
            monkeypatch.setattr(scale, "spawn_ranks", spawned, raising=False)
            scale.scale_check("quick", None)
        else:
            from validation.conform import processes

            monkeypatch.setattr(processes, "run_job", lambda *a: None)
            monkeypatch.setattr(processes, "load_factory", lambda path: None)
            monkeypatch.setattr(processes, "spawn_ranks", spawned, raising=False)
            processes.processes("adapter:factory", None)
    assert len(watches) == 1 and watches[0] is not None and watches[0].deadline_s == 5.0


def _posted_results(monkeypatch, post, watched=True, wait_s=30.0):
    """Rank 0's collection of call 0's results on a store where ``post`` put some; run aside so that a collection
    that never ends fails the test instead of hanging it (after ``wait_s``, rank 1's result is posted to end it)."""
    import pickle
    import threading

    import torch.distributed as dist

    from validation import world as world_module
    from validation.hangs import Watch

    monkeypatch.setattr(world_module, "FIRED_MARGIN_S", 0.0)
    store = dist.HashStore()
    for key, value in post.items():
        store.set(key, value if isinstance(value, str) else pickle.dumps(value))
    found = []
    watch = Watch(0.01, "unused") if watched else None
    collector = threading.Thread(target=lambda: found.append(world_module._results(store, 0, 2, watch)), daemon=True)
    collector.start()
    collector.join(wait_s)
    given = list(found)
    store.set("rtv/result/0/1", pickle.dumps((None, "posted by the test", {})))
    collector.join(30.0)
    return given


@pytest.mark.parametrize("fired", ["rank 0 failed", "dump requested"])
def test_rank_0_stops_waiting_for_a_silent_rank_once_a_watched_call_failed(monkeypatch, fired):
    post = {"rtv/result/0/0": (None, "PeerError: rank 1 is silent", {"rank-0-failed.json": "{}"})}
    if fired == "dump requested":
        post = {"rtv/result/0/0": (7, None, {}), "rtv/watchdog/0": "0"}
    (results,) = _posted_results(monkeypatch, post) or [None]
    assert results is not None, "rank 0 kept waiting for rank 1's result"
    assert results[0] == post["rtv/result/0/0"]
    assert results[1][0] is None and "no result" in results[1][1] and "hangs or died" in results[1][1]


def test_unwatched_or_unfired_rank_0_waits_for_every_result(monkeypatch):
    assert _posted_results(monkeypatch, {"rtv/result/0/0": (7, None, {})}, watched=False, wait_s=0.5) == [], (
        "it gave up"
    )
    both = {"rtv/result/0/0": (7, None, {}), "rtv/result/0/1": (8, None, {})}
    assert _posted_results(monkeypatch, both) == [[(7, None, {}), (8, None, {})]]
