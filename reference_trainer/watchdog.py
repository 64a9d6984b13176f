"""A process's trace of its collectives, and the dump it leaves when one of them hangs or fails.

NOTE [Collective watchdog]
  1. Trace: every collective issued through ``peers.Comm`` (control exchange,
     zero-mode command, data collective) is recorded with a sequence number
     from :func:`install`, its op, group, tensor shapes and dtypes, issuing
     call and start time; the last :data:`TRACE_LENGTH` stay. Every process
     makes the same collectives in the same order (NOTE [Logical ranks] Rule
     3), so one sequence number is comparable across processes.
  2. Deadline: with a watchdog installed, every wait of ``Comm`` is bounded
     by ``deadline_s``, so a lagging, dead or diverging peer ends it with
     ``PeerError`` in time. Making the control group (:func:`control_group`,
     whose connection would wait the group's long timeout) is preceded by a
     ``monitored_barrier`` bounded by the deadline and traced.
  3. Dump: a ``PeerError`` out of a collective writes
     ``rank-<r>-failed.json`` (every thread's stack via ``faulthandler``, the
     trace, the collective in flight, the error) and posts a request on the
     job's store; every other live process's listener thread then writes
     ``rank-<q>-asked.json`` at once, whatever its main thread is doing: the
     snapshot at detection time.
  4. Backstop: around each data collective's wait (NCCL may ignore its
     timeout) ``faulthandler.dump_traceback_later`` is armed for the deadline
     plus :data:`BACKSTOP_MARGIN_S` with ``exit``, so a wait that never
     returns still leaves its stack (``rank-<r>-backstop.txt``) and no
     process outlives its job.
  5. Diagnosis (:func:`first_disagreement`, pure): from each rank's earliest
     snapshot, the first sequence number where the ranks' records differ (op,
     group, call, dtypes, shapes for :data:`SAME_SHAPE_OPS`) or one has none;
     the reference is the majority record (ties: the lowest rank's); the
     ranks that differ, and those that left no snapshot (dead), are named.

What is torch's and what is ours: the deadline is gloo's own wait timeout
(``Work.wait(timeout)``); stacks come from ``faulthandler`` (Rules 3-4); on
NCCL, :func:`nccl_environment` turns on torch's flight recorder and its dump
on timeout (``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``,
``TORCH_FR_DUMP_TEMP_FILE``) into the same folder. Written here: the trace
(torch's flight recorder exists for NCCL only, and records the backend's
collectives, not the trainer call that issued them nor our control
messages) and the comparison of traces (the flight recorder's analyser reads
NCCL dumps only). ``monitored_barrier`` is used inside a job only before a
control group is made (Rule 2): ``Comm``'s control exchange already goes through rank 0 peer by peer with a
timeout each, which names a silent peer the way ``monitored_barrier`` does;
a watched spawned job ends with one, bounded by the deadline
(``validation.spawn``), so a rank that died after its last collective is
named there too.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .errors import ConfigError, PeerError, is_number

__all__ = [
    "BACKSTOP_MARGIN_S",
    "SAME_SHAPE_OPS",
    "TRACE_LENGTH",
    "CollectiveRecord",
    "Disagreement",
    "Watchdog",
    "bounded_wait_s",
    "control_group",
    "current",
    "first_disagreement",
    "install",
    "nccl_environment",
    "read_dumps",
    "recorded",
    "uninstall",
]

TRACE_LENGTH = 64
BACKSTOP_MARGIN_S = 30.0  # Rule 4: how long past the deadline a wait may block before the process is ended
SAME_SHAPE_OPS = ("all_gather", "broadcast", "gather")  # every rank passes the same shape (all_to_all's splits differ)
LISTENER_JOIN_S = 10.0  # how long uninstall waits for a listener in the middle of a look or a dump
_POLL_S = 0.1  # how often a listener looks for a dump request (Rule 3)
# (op, group, call, dtypes, shapes or None): what ranks must agree on at one sequence number (Rule 5)
Signature = tuple[str, str, str, tuple[str, ...], "tuple[tuple[int, ...], ...] | None"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective of this process (Rule 1); ``ended`` is None while it is in flight."""

    seq: int
    op: str
    group: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    call: str
    started: float  # time.time()
    ended: float | None = None

    def signature(self) -> Signature:
        """What must be equal on every rank at this sequence number (Rule 5)."""
        shapes = self.shapes if self.op in SAME_SHAPE_OPS else None
        return (self.op, self.group, self.call, self.dtypes, shapes)

    def describe(self) -> str:
        return f"#{self.seq} {self.op} on {self.group} ({self.call!r})"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CollectiveRecord:
        return cls(
            data["seq"],
            data["op"],
            data["group"],
            tuple(tuple(s) for s in data["shapes"]),
            tuple(data["dtypes"]),
            data["call"],
            data["started"],
            data["ended"],
        )


class _Trace:
    """The last :data:`TRACE_LENGTH` records of this process, numbered from 0 (Rule 1)."""

    def __init__(self) -> None:
        self.records: deque[CollectiveRecord] = deque(maxlen=TRACE_LENGTH)
        self.next_seq = 0
        self.lock = threading.Lock()  # the listener thread reads while the main thread writes

    def begin(self, op: str, group: str, tensors: Sequence[torch.Tensor], call: str) -> CollectiveRecord:
        record = CollectiveRecord(
            self.next_seq,
            op,
            group,
            tuple(tuple(t.shape) for t in tensors),
            tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
            call,
            time.time(),
        )
        with self.lock:
            self.records.append(record)
            self.next_seq += 1
        return record

    def end(self, record: CollectiveRecord) -> None:
        with self.lock:
            if self.records and self.records[-1] is record:
                self.records[-1] = replace(record, ended=time.time())

    def snapshot(self) -> list[CollectiveRecord]:
        with self.lock:
            return list(self.records)


_TRACE = _Trace()


@dataclass
class Watchdog:
    """This process's deadline and dump folder (Rules 2-4); ``store``/``key``: where dump requests are posted."""

    deadline_s: float
    folder: Path
    rank: int
    store: Any = None  # a torch.distributed.Store shared by the job, or None (no requests to peers)
    key: str = "rtv/watchdog/dump"
    _stop: threading.Event | None = None
    _backstop: Any = None
    _listener: threading.Thread | None = None

    def bound(self, timeout_s: float) -> float:
        return min(timeout_s, self.deadline_s)

    def dump(self, reason: str, error: BaseException | None = None, in_flight: CollectiveRecord | None = None) -> Path:
        """Write ``rank-<r>-<reason>.json``: stack of every thread, trace, the collective in flight, the error."""
        with tempfile.TemporaryFile("w+") as stream:
            faulthandler.dump_traceback(stream, all_threads=True)
            stream.seek(0)
            stack = stream.read()
        body = {
            "rank": self.rank,
            "pid": os.getpid(),
            "reason": reason,
            "deadline_s": self.deadline_s,
            "dumped_at": time.time(),
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "peer": getattr(error, "peer", None),
            "in_flight": None if in_flight is None else asdict(in_flight),
            "trace": [asdict(r) for r in _TRACE.snapshot()],
            "stack": stack,
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank-{self.rank}-{reason}.json"
        partial = path.with_name(path.name + ".partial")  # not rank-*.json: a reader never sees half a dump
        partial.write_text(json.dumps(body, indent=1))
        os.replace(partial, path)
        return path

    def fired(self, error: PeerError, record: CollectiveRecord) -> None:
        """Rule 3: this process's dump, then the request that makes every other live process dump."""
        path = self.dump("failed", error, record)
        if self.store is not None:
            try:
                self.store.set(self.key, str(self.rank))
            except Exception:  # noqa: BLE001 - the store's host died: the peers' own waits still end them
                pass
        if hasattr(error, "add_note"):
            error.add_note(f"watchdog: this process's stack and collective trace are in {path}")

    def _listen(self) -> None:
        assert self._stop is not None, "install starts a listener only with its stop event"
        while not self._stop.wait(_POLL_S):
            try:
                asked = self.store.check([self.key])
            except Exception:  # noqa: BLE001 - the store is gone: nobody can ask any more
                return
            if asked:
                if not (self.folder / f"rank-{self.rank}-failed.json").exists():
                    self.dump("asked")
                return

    @contextmanager
    def collective_wait(self) -> Iterator[None]:
        """Rule 4's backstop around one wait."""
        faulthandler.dump_traceback_later(self.deadline_s + BACKSTOP_MARGIN_S, exit=True, file=self._backstop)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


_ACTIVE: Watchdog | None = None


def install(
    deadline_s: float, folder: str | Path, *, rank: int, store: Any = None, key: str = "rtv/watchdog/dump"
) -> Watchdog:
    """Watch this process's collectives from now on (the trace restarts at 0); replaces a watchdog installed before."""
    global _ACTIVE, _TRACE
    if not is_number(deadline_s) or not deadline_s > 0:
        raise ConfigError("deadline_s", deadline_s, "a number of seconds > 0")
    uninstall()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    watchdog = Watchdog(float(deadline_s), folder, rank, store, key)
    watchdog._backstop = open(
        folder / f"rank-{rank}-backstop.txt", "w"
    )  # faulthandler keeps its fd: closed by uninstall
    if store is not None:
        watchdog._stop = threading.Event()
        watchdog._listener = threading.Thread(target=watchdog._listen, name="rtv-watchdog", daemon=True)
        watchdog._listener.start()
    _TRACE = _Trace()
    _ACTIVE = watchdog
    return watchdog


def uninstall() -> None:
    """Stop watching: the listener stops (joined, at most :data:`LISTENER_JOIN_S`), an empty backstop file is
    removed."""
    global _ACTIVE
    watchdog, _ACTIVE = _ACTIVE, None
    if watchdog is None:
        return
    if watchdog._stop is not None:
        watchdog._stop.set()
    if watchdog._listener is not None:
        watchdog._listener.join(LISTENER_JOIN_S)
    watchdog._backstop.close()
    backstop = Path(watchdog._backstop.name)
    if backstop.exists() and backstop.stat().st_size == 0:
        backstop.unlink()


def current() -> Watchdog | None:
    return _ACTIVE


def bounded_wait_s(timeout_s: float) -> float:
    """``timeout_s``, or the installed watchdog's deadline when shorter (NOTE [Collective watchdog])."""
    return timeout_s if _ACTIVE is None else _ACTIVE.bound(timeout_s)


@contextmanager
def recorded(op: str, group: str, tensors: Sequence[torch.Tensor], call: str) -> Iterator[CollectiveRecord]:
    """Record one collective (Rule 1); with a watchdog, a ``PeerError`` out of it dumps (Rule 3) and a data
    collective's wait is backstopped (Rule 4)."""
    record = _TRACE.begin(op, group, tensors, call)
    watchdog = _ACTIVE
    try:
        if watchdog is None or group != "data":
            yield record
        else:
            with watchdog.collective_wait():
                yield record
    except PeerError as error:
        if watchdog is not None:
            watchdog.fired(error, record)
        raise
    else:
        _TRACE.end(record)


def control_group(timeout: datetime.timedelta, call: str = "run_logical: control group") -> Any:
    """``dist.new_group(backend="gloo", timeout=timeout)`` for ``Comm``'s control messages (Rule 2).

    With a watchdog installed, every process first meets the others in a
    ``monitored_barrier`` of the default group (gloo; NCCL has none) bounded
    by the deadline, recorded as ``call`` and backstopped (Rule 4): a peer
    that never comes raises ``PeerError`` and dumps (Rule 3) instead of
    holding the group's making for ``timeout``.
    """
    watchdog = _ACTIVE
    if watchdog is None:
        return dist.new_group(backend="gloo", timeout=timeout)
    with recorded("monitored_barrier", "control", (), call), watchdog.collective_wait():
        if dist.get_backend() == "gloo":
            try:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=watchdog.deadline_s), wait_all_ranks=True)
            except RuntimeError as error:  # torch's DistError included: it names the ranks that did not come
                raise PeerError(
                    f"a peer did not come to make the control group within {watchdog.deadline_s:g} s: {error}",
                    command=call,
                ) from error
        return dist.new_group(backend="gloo", timeout=timeout)


def nccl_environment(folder: str | Path, deadline_s: float) -> dict[str, str]:
    """The ``TORCH_NCCL_*`` settings that make torch's flight recorder dump into ``folder`` on an NCCL timeout.

    Set them before the process group is made (``torchrun``'s environment, a task file's ``envs``).
    """
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(Path(folder) / "nccl-flight-recorder-rank-"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "RT_DIST_TIMEOUT_S": f"{deadline_s:g}",
    }


# --- diagnosis (Rule 5) ----------------------------------------------------------------


@dataclass(frozen=True)
class Disagreement:
    """The first collective where the ranks differ: ``records[r]`` is rank r's (None: it never got there)."""

    seq: int
    reference: CollectiveRecord
    records: Mapping[int, CollectiveRecord | None]
    odd_ranks: tuple[int, ...]  # ranks whose record differs from the reference, or who have none there
    dead_ranks: tuple[int, ...]  # ranks that left no snapshot at all

    def describe(self) -> str:
        parts = []
        for rank in self.odd_ranks:
            found = self.records.get(rank)
            parts.append(f"rank {rank} never reached it" if found is None else f"rank {rank} issued {found.describe()}")
        parts += [f"rank {rank} left no trace (it died)" for rank in self.dead_ranks]
        return f"first disagreement at collective {self.reference.describe()}: " + "; ".join(parts)


def first_disagreement(traces: Mapping[int, Sequence[CollectiveRecord]], world_size: int) -> Disagreement | None:
    """Rule 5 over each rank's trace (a rank absent from ``traces`` is dead); None when the traces agree."""
    dead = tuple(rank for rank in range(world_size) if rank not in traces)
    by_seq = {rank: {r.seq: r for r in trace} for rank, trace in traces.items()}
    firsts = [min(seqs) for seqs in by_seq.values() if seqs]
    start = max(firsts, default=0)  # older records fell out of some rank's buffer
    every = sorted({seq for seqs in by_seq.values() for seq in seqs if seq >= start})
    for seq in every:
        records = {rank: seqs.get(seq) for rank, seqs in sorted(by_seq.items())}
        reference = _reference([r for r in records.values() if r is not None])
        odd = tuple(rank for rank, r in records.items() if r is None or r.signature() != reference.signature())
        if odd:
            return Disagreement(seq, reference, records, odd, dead)
    if not dead or not every:
        return None
    last = every[-1]  # the live ranks agree to the end: the dead ranks are missing from the collective they were in
    records = {rank: seqs.get(last) for rank, seqs in sorted(by_seq.items())}
    return Disagreement(last, _reference([r for r in records.values() if r is not None]), records, (), dead)


def _reference(records: list[CollectiveRecord]) -> CollectiveRecord:
    """The record most ranks hold at one sequence number; ties go to the lowest rank's (``records`` in rank order)."""
    counts: dict[Signature, int] = {}
    for record in records:
        counts[record.signature()] = counts.get(record.signature(), 0) + 1
    return max(records, key=lambda r: counts[r.signature()])  # max keeps the first of equals


def read_dumps(folder: str | Path) -> dict[int, list[CollectiveRecord]]:
    """Each rank's trace from its earliest dump in ``folder`` (its snapshot at detection time, Rule 5).

    A file that is no readable JSON (a dump cut off by a process that died while writing it) is skipped.
    """
    earliest: dict[int, dict[str, Any]] = {}
    for path in Path(folder).glob("rank-*.json"):
        try:
            body = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if body["rank"] not in earliest or body["dumped_at"] < earliest[body["rank"]]["dumped_at"]:
            earliest[body["rank"]] = body
    return {rank: [CollectiveRecord.from_json(r) for r in body["trace"]] for rank, body in earliest.items()}
