"""The processes a harness run works on: a world ``torchrun`` gave it, or ranks it spawns itself.

NOTE [Joined worlds]: a multi-process check asks :func:`run_ranks` for
``fn(*args)`` on ``W`` processes and gets each rank's value, by rank. Where
that runs depends on how ``rtv`` was started:

1. Alone (no ``RANK``/``WORLD_SIZE`` in the environment): ``W`` gloo
   processes on this machine (``validation.spawn.spawn_ranks``).
2. Under ``torchrun`` (every process of the world runs the same ``rtv``
   command, on one node or many): :func:`joined` meets the world it
   describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
   ``MASTER_PORT``) at its rendezvous store, and nothing more. Rank 0 runs the
   command. Each of its :func:`run_ranks` calls is posted on the store; every
   process then makes a process group for that call alone (the backend the
   call asks for, NCCL on ``cuda:LOCAL_RANK``), runs ``fn``, leaves the group
   and posts its value back, which rank 0 returns as a spawn would have (a
   rank that raised: :class:`validation.spawn.SpawnError` with every rank's
   story). A watched call (NOTE [Hang reports]) posts each process's
   watchdog dumps with its value, so rank 0's folder holds every node's;
   once its watchdog fired, rank 0 waits for the other results at most the
   deadline plus ``validation.spawn.FIRED_MARGIN_S`` (a rank with none
   hangs or died). Between calls no process group exists, so rank 0's one-process
   checks stay one-process. The other ranks only serve calls until rank 0 is
   done; they write nothing, so every record is written once, by rank 0, and
   carries every process's facts (:func:`world_facts`: host, node rank, local
   rank, device), posted when the world met.

In a joined world ``W`` must be the world's size: the trainer's logical ranks
run on the default process group, so a check cannot use a part of it
(:class:`validation.errors.SetupError` says so). The store carries only
commands and pickled results, so this module needs no collective of its own.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import SetupError
from .hangs import Watch, next_watch, settle
from .spawn import FIRED_MARGIN_S, RankOutcome, SpawnError, group_timeout_s, spawn_ranks, to_plain

__all__ = ["GivenWorld", "given_world", "joined", "run_ranks", "spawn_watched", "world_facts"]

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class GivenWorld:
    """The world a launcher described: this process's ``rank`` of ``world_size``, where the rendezvous is."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def given_world(environ: Mapping[str, str] | None = None) -> GivenWorld | None:
    """The world ``torchrun`` describes in ``environ`` (default: this process's), or None when there is none.

    Raises :class:`SetupError` when only some of :data:`LAUNCHER_VARIABLES`
    are set or one is not a number where a number belongs.
    """
    environ = os.environ if environ is None else environ
    present = [name for name in LAUNCHER_VARIABLES if name in environ]
    if not present:
        return None
    missing = [name for name in LAUNCHER_VARIABLES if name not in environ]
    if missing:
        raise SetupError(
            f"a launcher world needs {', '.join(LAUNCHER_VARIABLES)}; found {', '.join(present)} "
            f"but not {', '.join(missing)}",
            fix="start rtv under torchrun, or unset those variables to let it spawn its own ranks",
        )
    try:
        world = GivenWorld(
            int(environ["RANK"]),
            int(environ["WORLD_SIZE"]),
            int(environ["LOCAL_RANK"]),
            environ["MASTER_ADDR"],
            int(environ["MASTER_PORT"]),
        )
    except ValueError:
        raise SetupError(
            f"launcher variables: expected integers in RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT, "
            f"found { ({n: environ[n] for n in LAUNCHER_VARIABLES}) }",
            fix="start rtv under torchrun, which sets them",
        ) from None
    if not 0 <= world.rank < world.world_size:
        raise SetupError(
            f"launcher variables: expected 0 <= RANK < WORLD_SIZE, found RANK={world.rank}, "
            f"WORLD_SIZE={world.world_size}",
            fix="start rtv under torchrun, which sets them",
        )
    return world


@dataclass
class _Joined:
    """The joined world of this process: its rendezvous store, every process's facts, the calls posted so far."""

    world: GivenWorld
    store: Any  # torch.distributed.Store
    facts: list[dict[str, Any]]
    calls: int = 0


_JOINED: _Joined | None = None
_DONE = "done"
_Posted = tuple[Any, "str | None", "dict[str, str]"]  # one rank's (value, error, dumps) of a call
_RESULT_POLL_S = 0.05
_WAIT = datetime.timedelta(hours=1)  # one wait of a serving rank (each timeout logs a warning); then it waits again


def _this_process(world: GivenWorld) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "rank": world.rank,
        "local_rank": world.local_rank,
        "node_rank": int(os.environ.get("GROUP_RANK", os.environ.get("SKYPILOT_NODE_RANK", "0"))),
        "host": socket.gethostname(),
        "device": torch.cuda.get_device_name(world.local_rank) if cuda else "cpu",
    }


def joined(world: GivenWorld, command: Callable[[], int]) -> int:
    """Run ``command`` in ``world`` (NOTE [Joined worlds]): rank 0 runs it and returns its exit code, every other
    rank serves rank 0's :func:`run_ranks` calls until it is done and returns 0."""
    global _JOINED
    import torch.distributed as dist

    # torch's stubs re-export rendezvous and PrefixStore without declaring them:
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(minutes=10)))  # type: ignore[attr-defined]
    store.set(f"rtv/facts/{world.rank}", pickle.dumps(_this_process(world)))
    facts = [pickle.loads(_get(store, f"rtv/facts/{rank}")) for rank in range(world.world_size)]
    _JOINED = _Joined(world, store, facts)
    try:
        if world.rank != 0:
            _serve(_JOINED)
            return 0
        try:
            return command()
        finally:
            store.set(f"rtv/call/{_JOINED.calls}", pickle.dumps(_DONE))
    finally:
        _JOINED = None


def world_facts() -> list[dict[str, Any]] | None:
    """Every process's facts in the joined world (rank order), or None outside one."""
    return None if _JOINED is None else [dict(f) for f in _JOINED.facts]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    dist_timeout_s: float = 30.0,
    **spawn_options: Any,
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` processes; each rank's value, by rank (NOTE [Joined worlds]).

    ``backend`` and ``dist_timeout_s`` are the process group's, spawned or
    joined; the other ``spawn_options`` (``timeout_s``, ``check``) apply to
    spawned ranks only. Inside ``validation.hangs.watching`` the ranks are
    watched (NOTE [Hang reports]): a hang raises ``HangDetected``.
    """
    if _JOINED is None:
        return spawn_watched(fn, world_size, *args, backend=backend, dist_timeout_s=dist_timeout_s, **spawn_options)
    watch = next_watch()
    if world_size != _JOINED.world.world_size:
        raise SetupError(
            f"a check asked for {world_size} processes; the torchrun world has {_JOINED.world.world_size}",
            fix=f"run rtv under torchrun with {world_size} processes in all, or alone (it spawns its own)",
        )
    call = _JOINED.calls
    _JOINED.store.set(f"rtv/call/{call}", pickle.dumps((fn, args, backend, dist_timeout_s, watch)))
    _run_call(_JOINED, fn, args, backend, dist_timeout_s, watch)
    messages = _results(_JOINED.store, call, world_size, watch)
    outcomes = [RankOutcome(rank, value, error, 0) for rank, (value, error, _) in enumerate(messages)]
    if watch is not None:
        for _, _, dumps in messages:  # another node's dumps were written on its own disk
            for name, text in dumps.items():
                if not (Path(watch.folder) / name).exists():
                    (Path(watch.folder) / name).write_text(text)
        return _checked(outcomes, watch, True, "run_ranks: a rank of the torchrun world failed")
    if not all(o.ok for o in outcomes):
        raise SpawnError(outcomes, "run_ranks: a rank of the torchrun world failed")
    return [o.value for o in outcomes]


def spawn_watched(
    fn: Callable[..., Any], world_size: int, *args: Any, check: bool = True, **spawn_options: Any
) -> list[Any]:
    """``validation.spawn.spawn_ranks(fn, world_size, *args, check=check, **spawn_options)`` on this machine, even in
    a joined world (a check whose process counts differ from the world's); inside ``validation.hangs.watching``
    the ranks are watched (NOTE [Hang reports]) and a hang raises ``HangDetected``."""
    watch = next_watch()
    if watch is None:
        return spawn_ranks(fn, world_size, *args, check=check, **spawn_options)
    outcomes = spawn_ranks(fn, world_size, *args, check=False, watch=watch, **spawn_options)
    return _checked(outcomes, watch, check, "spawn_ranks: a rank failed")


def _checked(outcomes: list[RankOutcome], watch: Watch, check: bool, reason: str) -> list[Any]:
    """A watched call's values (``check``) or outcomes, once its watch is settled (``HangDetected`` first)."""
    settle(watch, outcomes, check=check)
    if not check:
        return outcomes
    if not all(o.ok for o in outcomes):
        raise SpawnError(outcomes, reason)
    return [o.value for o in outcomes]


def _run_call(
    joined_world: _Joined,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str,
    timeout_s: float,
    watch: Watch | None,
) -> None:
    """This process's part of call number ``joined_world.calls``: a group of its own, ``fn``, the value posted."""
    import torch
    import torch.distributed as dist

    from reference_trainer import watchdog

    world, call = joined_world.world, joined_world.calls
    joined_world.calls += 1
    recorder = {} if backend != "nccl" or watch is None else watchdog.nccl_environment(watch.folder, watch.deadline_s)
    saved = {name: os.environ.get(name) for name in recorder}
    try:
        options: dict[str, Any] = {}
        if backend == "nccl":
            options["device_id"] = torch.device("cuda", world.local_rank)
            torch.cuda.set_device(options["device_id"])
        os.environ.update(recorder)  # torch's flight recorder, read when the group is made; this call's alone
        group_store = dist.PrefixStore(f"rtv/group/{call}", joined_world.store)  # type: ignore[attr-defined]
        dist.init_process_group(
            backend,
            store=group_store,
            rank=world.rank,
            world_size=world.world_size,
            timeout=datetime.timedelta(seconds=group_timeout_s(timeout_s, watch)),
            **options,
        )
        try:
            if watch is not None:
                watchdog.install(
                    watch.deadline_s,
                    watch.folder,
                    rank=world.rank,
                    store=joined_world.store,
                    key=f"rtv/watchdog/{call}",
                )
            message: tuple[Any, str | None] = (to_plain(fn(*args)), None)
        finally:
            watchdog.uninstall()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every rank's story goes back to rank 0, as from a spawned rank
        message = (None, traceback.format_exc())
    finally:
        _restore(saved)
    dumps = {} if watch is None else {p.name: p.read_text() for p in Path(watch.folder).glob(f"rank-{world.rank}-*")}
    joined_world.store.set(f"rtv/result/{call}/{world.rank}", pickle.dumps((*message, dumps)))


def _results(store: Any, call: int, world_size: int, watch: Watch | None) -> list[_Posted]:
    """Every rank's posted (value, error, dumps) for call number ``call``, by rank.

    Unwatched, it waits as long as it takes. Watched, once the watchdog fired
    (its request is on the store) or a rank posted an error, it waits at most
    the deadline plus :data:`FIRED_MARGIN_S` more: a rank with nothing
    posted by then hangs or died, and gets an error saying so.
    """
    import time

    keys = {rank: f"rtv/result/{call}/{rank}" for rank in range(world_size)}
    messages: dict[int, _Posted] = {}
    grace_s = None if watch is None else watch.deadline_s + FIRED_MARGIN_S
    cutoff: float | None = None
    while True:
        for rank in [r for r, key in keys.items() if r not in messages and store.check([key])]:
            messages[rank] = pickle.loads(store.get(keys[rank]))
        if len(messages) == world_size:
            return [messages[rank] for rank in range(world_size)]
        if (
            grace_s is not None
            and cutoff is None
            and (store.check([f"rtv/watchdog/{call}"]) or any(m[1] is not None for m in messages.values()))
        ):
            cutoff = time.monotonic() + grace_s
        if cutoff is not None and time.monotonic() >= cutoff:
            missing: _Posted = (
                None,
                f"no result {grace_s:g} s after the watchdog fired (the process hangs or died)",
                {},
            )
            return [messages.get(rank, missing) for rank in range(world_size)]
        time.sleep(_RESULT_POLL_S)


def _restore(saved: Mapping[str, str | None]) -> None:
    """``os.environ`` as it was where ``saved`` says (None: the variable was not set)."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _get(store: Any, key: str) -> bytes:
    """``store[key]``, waiting as long as it takes (rank 0 may run one-process checks for minutes between calls)."""
    import torch.distributed as dist

    while True:
        try:
            store.wait([key], _WAIT)
            value: bytes = store.get(key)
            return value
        except dist.DistStoreError as error:
            if "timeout" not in str(error):  # only a wait that ran out is waited again
                raise


def _serve(joined_world: _Joined) -> None:
    """A rank other than 0: run each call rank 0 posts, until rank 0 is done."""
    while True:
        posted = pickle.loads(_get(joined_world.store, f"rtv/call/{joined_world.calls}"))
        if posted == _DONE:
            return
        fn, args, backend, timeout_s, watch = posted
        _run_call(joined_world, fn, args, backend, timeout_s, watch)
