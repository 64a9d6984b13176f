"""Run one function on W gloo processes on this machine: the harness's launcher for distributed tests.

``spawn_ranks(fn, W, *args)`` starts W processes from a fork server that has
already imported torch (start-up is a fork, not an import), joins them into
one gloo process group on 127.0.0.1 (a TCPStore hosted by the caller, on a
port the OS picked, so there is no port race, listening on loopback only)
and runs ``fn(*args)`` in each with the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) and one intra-op thread. Each rank's result
comes back through its own pipe as plain Python objects, tensors turned into
numpy arrays: a tensor sent by a process that then exits would be lost
(design-notes, "Distributed tests"). Start-up costs about a second, so run
several scenarios per spawn and return all their results.

``fn`` must be importable by module and name (a module-level function).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from .errors import CheckFailed

__all__ = ["FIRED_MARGIN_S", "RankOutcome", "SpawnError", "group_timeout_s", "spawn_ranks", "to_plain"]

FIRED_MARGIN_S = 30.0  # once a watched job's watchdog fired, how long past its deadline its ranks may still run
_POLL_S = 0.1  # how often a watched job's store is looked at for the watchdog's dump request

# torch.optim imports torch._dynamo at the first optimizer (about 2 s): do it once, in the fork server.
_PRELOAD = ["torch", "torch._dynamo", "numpy", "reference_trainer"]


@dataclass(frozen=True)
class RankOutcome:
    """What one rank did: its ``value``, or the ``error`` it raised, and how its process ended."""

    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


class SpawnError(CheckFailed):
    """A spawned rank raised, died or outlived the timeout; the cause holds every rank's story (exit 1)."""

    def __init__(self, outcomes: list[RankOutcome], reason: str) -> None:
        self.outcomes = outcomes
        lines = [reason]
        for o in outcomes:
            lines.append(f"--- rank {o.rank}: exit code {o.exitcode}" + (f"\n{o.error}" if o.error else ""))
        super().__init__("\n".join(lines), fix="read each rank's story above; the first rank that raised is the cause")


def group_timeout_s(dist_timeout_s: float, watch: Any) -> float:
    """A call's process-group timeout: ``dist_timeout_s``, and in a watched call (``watch``: a
    ``validation.hangs.Watch``) at least its deadline plus :data:`FIRED_MARGIN_S`, so the backend's own timeout
    (on NCCL: its abort, which ends the process) comes after the watchdog's dumps, never before them."""
    return dist_timeout_s if watch is None else max(dist_timeout_s, watch.deadline_s + FIRED_MARGIN_S)


def to_plain(value: Any) -> Any:
    """``value`` with every tensor (also inside dicts, lists, tuples) replaced by a numpy copy."""
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        return tensor.numpy().copy()
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_plain(v) for v in value)
    return value


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    dist_timeout_s: float = 30.0,
    check: bool = True,
    backend: str = "gloo",
    watch: Any = None,
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` gloo processes; each rank's value, by rank.

    ``watch`` (a ``validation.hangs.Watch``): each rank installs the
    collective watchdog with its deadline and dump folder, and the rendezvous
    store for dump requests (NOTE [Hang reports]); the caller settles it.

    ``backend="nccl"``: rank r runs on ``cuda:r`` (``torch.cuda.set_device``
    and ``device_id``, as ``reference_trainer.init_distributed`` does under
    torchrun); ``world_size`` must not exceed the visible GPUs.

    ``check=False`` returns a :class:`RankOutcome` per rank instead of raising
    :class:`SpawnError` when a rank raises or dies (for tests that kill one).
    Processes still running after ``timeout_s`` are killed; in a watched
    job, also those still running :data:`FIRED_MARGIN_S` past the deadline
    after the watchdog's dump request (a rank stuck for good).
    """
    import torch.distributed as dist

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    # The caller hosts the rendezvous: it survives any rank, and port 0 lets the OS pick a free one. Its socket
    # is bound here, to loopback: a TCPStore binds every interface itself (the local-Slurm stage saw it).
    listener = socket.create_server(("127.0.0.1", 0), backlog=world_size * 4)
    port = listener.getsockname()[1]
    store = dist.TCPStore(  # type: ignore[attr-defined]  # torch's stubs re-export it without declaring it
        "127.0.0.1", port, world_size, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach()
    )  # the store owns (and closes) the socket from here
    readers: dict[Connection, int] = {}
    processes = []
    for rank in range(world_size):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker,
            args=(rank, world_size, store.port, dist_timeout_s, writer, fn, args, backend, watch),
            name=f"rank-{rank}",
            daemon=True,
        )
        process.start()
        writer.close()
        readers[reader] = rank
        processes.append(process)
    values: dict[int, tuple[Any, str | None]] = {}
    deadline = time.monotonic() + timeout_s
    timed_out = False
    fired = False
    while readers:
        if watch is not None and not fired and store.check(["rtv/watchdog/dump"]):
            fired = True  # the ranks dumped: what is still running after the deadline and a margin hangs for good
            deadline = min(deadline, time.monotonic() + watch.deadline_s + FIRED_MARGIN_S)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        for ready in wait(list(readers), timeout=remaining if watch is None else min(remaining, _POLL_S)):
            reader = cast(Connection, ready)  # wait returns some of the connections it was given
            rank = readers.pop(reader)
            try:
                values[rank] = reader.recv()
            except EOFError:
                pass  # it died before reporting: its exit code tells
            reader.close()
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
        if process.is_alive():
            timed_out = True
            process.kill()
            process.join()
    missing = (
        None,
        "no result (the process died or hung)"
        if not fired
        else f"no result: still running {watch.deadline_s + FIRED_MARGIN_S:g} s after the watchdog's dump request "
        "(it hangs for good), so it was killed",
    )
    outcomes = [RankOutcome(rank, *values.get(rank, missing), processes[rank].exitcode) for rank in range(world_size)]
    del store
    if not check:
        return outcomes
    if timed_out:
        raise SpawnError(outcomes, f"spawn_ranks: ranks still running after {timeout_s:g} s were killed")
    if not all(o.ok for o in outcomes):
        raise SpawnError(outcomes, "spawn_ranks: a rank failed")
    return [o.value for o in outcomes]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    dist_timeout_s: float,
    pipe: Connection,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str,
    watch: Any,
) -> None:
    import torch
    import torch.distributed as dist

    from reference_trainer import watchdog

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=dist_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
        options: dict[str, Any] = {}
        if backend == "nccl":
            options["device_id"] = torch.device("cuda", rank)
            torch.cuda.set_device(options["device_id"])
            if watch is not None:  # torch's flight recorder, read when the group is made
                os.environ.update(watchdog.nccl_environment(watch.folder, watch.deadline_s))
        group_timeout = datetime.timedelta(seconds=group_timeout_s(dist_timeout_s, watch))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=group_timeout, **options
        )
        if watch is not None:
            watchdog.install(watch.deadline_s, watch.folder, rank=rank, store=store)
        message: tuple[Any, str | None] = (to_plain(fn(*args)), None)
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
        message = (None, traceback.format_exc())
    try:  # let every peer read its last message before this process goes away
        if watch is not None and backend == "gloo":  # bounded by the deadline, naming a missing rank
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=watch.deadline_s), wait_all_ranks=True)
        else:
            dist.barrier()
    except Exception:  # noqa: BLE001 - a dead or broken peer: nothing left to wait for
        pass
    watchdog.uninstall()
    pipe.send(message)
    pipe.close()
    # Skip interpreter and process-group teardown: with a dead peer it can block.
    os._exit(0)
