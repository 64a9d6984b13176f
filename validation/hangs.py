"""The harness's side of the collective watchdog: a run's deadline, where its dumps go, what they say.

NOTE [Hang reports] (the processes' side: NOTE [Collective watchdog] in ``reference_trainer/watchdog.py``)
  1. Scope: :func:`watching` opens a run's deadline and evidence folder
     (``rtv run``, ``rtv canary``: ``--hang-timeout S``, default the
     preset's ``hang_timeout_s``). Each ``validation.world.run_ranks`` call
     inside takes a :class:`Watch` of its own (:func:`next_watch`): the
     deadline and a fresh dump folder ``<folder>/hangs/ranks-*``; each of its
     processes installs the watchdog with them and the job's store, in a
     process group whose timeout is at least the deadline plus
     ``validation.spawn.FIRED_MARGIN_S`` (``group_timeout_s``).
  2. Settling: after the call, :func:`settle` removes a dump folder that
     holds no dump (no rank's dump, backstop stack or NCCL flight-recorder
     file); otherwise the watchdog fired: :func:`diagnose` writes
     ``diagnosis.json`` beside the dumps (the ranks that dumped, the dead
     ranks, the first collective where the ranks differ and who differs)
     and, for a call that checks its ranks, :class:`HangDetected` is raised.
  3. Exit: :class:`HangDetected` is exit :data:`HANG_EXIT_CODE`
     (docs/harness.md#exit-codes): ``rtv canary`` and ``rtv run`` record the
     canary as failed (a ``canary-raised`` record carrying the diagnosis,
     ``canaries.registry.Canary.record_raised``); ``rtv canary`` exits with
     it, ``rtv run`` runs the others first.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spawn import RankOutcome, SpawnError

__all__ = ["HANG_EXIT_CODE", "HangDetected", "Watch", "diagnose", "next_watch", "settle", "watching"]

HANG_EXIT_CODE = 7
DIAGNOSIS = "diagnosis.json"


@dataclass(frozen=True)
class Watch:
    """One multi-process call's deadline (seconds) and dump folder (Rule 1); plain, so it travels to the ranks."""

    deadline_s: float
    folder: str


class HangDetected(SpawnError):
    """A collective hung or failed and the watchdog dumped every live process (Rule 3: exit 7).

    ``diagnosis`` is :func:`diagnose`'s; the dumps are in its ``folder``.
    """

    exit_code = HANG_EXIT_CODE

    def __init__(self, outcomes: list[RankOutcome], diagnosis: dict[str, Any]) -> None:
        super().__init__(outcomes, f"watchdog: {diagnosis['text']}; dumps and diagnosis in {diagnosis['folder']}")
        self.diagnosis = diagnosis
        self.fix = (
            f"read {Path(diagnosis['folder']) / DIAGNOSIS} and each rank's stack there; the named rank is where to look"
        )


_SCOPE: ContextVar[tuple[float, Path] | None] = ContextVar("hang_scope", default=None)


@contextmanager
def watching(deadline_s: float, folder: Path) -> Iterator[None]:
    """Within the block, multi-process calls are watched with ``deadline_s`` and dump under ``folder`` (Rule 1)."""
    if not deadline_s > 0:
        raise ValueError(f"expected a hang deadline > 0 seconds, found {deadline_s}")
    token = _SCOPE.set((float(deadline_s), Path(folder)))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def next_watch() -> Watch | None:
    """A :class:`Watch` for the next multi-process call (a new dump folder), or None outside :func:`watching`."""
    scope = _SCOPE.get()
    if scope is None:
        return None
    deadline_s, folder = scope
    (folder / "hangs").mkdir(parents=True, exist_ok=True)
    return Watch(deadline_s, tempfile.mkdtemp(prefix="ranks-", dir=folder / "hangs"))


def diagnose(folder: str | Path, world_size: int) -> dict[str, Any] | None:
    """Rule 2's diagnosis of the dumps in ``folder`` (also written there as ``diagnosis.json``); None without dumps."""
    from reference_trainer.watchdog import first_disagreement, read_dumps

    traces = read_dumps(folder)
    backstops, recorders = _backstops(Path(folder)), _flight_recorders(Path(folder))
    if not traces and not backstops and not recorders:
        return None
    found = first_disagreement(traces, world_size) if traces else None
    diagnosis: dict[str, Any] = {
        "folder": str(folder),
        "backstops": backstops,
        "flight_recorders": recorders,
        "dumped_ranks": sorted(traces),
        "dead_ranks": [r for r in range(world_size) if r not in traces],
        "seq": None if found is None else found.seq,
        "collective": None if found is None else found.reference.describe(),
        "call": None if found is None else found.reference.call,
        "odd_ranks": [] if found is None else list(found.odd_ranks),
        "by_rank": {}
        if found is None
        else {str(r): (None if rec is None else rec.describe()) for r, rec in found.records.items()},
        "text": found.describe()
        if found is not None
        else "the ranks' traces agree; a peer failed in a collective"
        if traces
        else f"a wait outlived its deadline; the stacks are in {', '.join(backstops)}"
        if backstops
        else f"an NCCL collective timed out; torch's flight recorder dumped {', '.join(recorders)}",
    }
    (Path(folder) / DIAGNOSIS).write_text(json.dumps(diagnosis, indent=1))
    return diagnosis


def settle(watch: Watch, outcomes: Sequence[RankOutcome], *, check: bool) -> dict[str, Any] | None:
    """Rule 2 after a watched call: remove an empty dump folder, or diagnose and (``check``) raise HangDetected."""
    folder = Path(watch.folder)
    if not any(folder.glob("rank-*.json")) and not _backstops(folder) and not _flight_recorders(folder):
        shutil.rmtree(folder, ignore_errors=True)
        if not any(folder.parent.iterdir()):
            folder.parent.rmdir()
        return None
    diagnosis = diagnose(folder, len(outcomes))
    if check and diagnosis is not None:
        raise HangDetected(list(outcomes), diagnosis)
    return diagnosis


def _backstops(folder: Path) -> list[str]:
    """The non-empty backstop stacks in ``folder`` (NOTE [Collective watchdog] Rule 4)."""
    return sorted(p.name for p in folder.glob("rank-*-backstop.txt") if p.stat().st_size)


def _flight_recorders(folder: Path) -> list[str]:
    """torch's NCCL flight-recorder dumps in ``folder`` (``reference_trainer.watchdog.nccl_environment``)."""
    return sorted(p.name for p in folder.glob("nccl-flight-recorder-rank-*"))
