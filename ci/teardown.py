"""Tearing a CI cluster down and proving it is gone, for whoever launched it: the launcher's backstop half.

:class:`Teardown` holds the SDK calls every teardown makes; ``ci.launcher``'s
``Launcher`` builds on it. The rules (docs/harness.md, GPU CI):

1. Every query asks across all users (``sky.status(..., all_users=True)``):
   a runner, a later attempt or ``rtv gpu sweep`` runs as another SkyPilot
   user than the launcher that made the cluster, and the API server filters
   by the caller's user hash even for a named cluster.
2. After SIGINT/SIGTERM, ``down`` is the first request sent (nothing else
   is needed to tear down: it ends the job too), so it lands within GitHub's
   cancel window (SIGINT, 7.5 s, SIGTERM, 2.5 s, SIGKILL); one ``status`` of
   the server's table (no refresh) then records what existed (handle,
   launch time) for the receipt. Without a signal that census comes first. A failed ``down`` is
   retried with doubling backoff (``Timeouts.down_attempts``); an
   interrupted launch request is cancelled only after ``down`` was sent.
3. Absence is proven only by a ``status`` answer that lists no such cluster,
   and, after a launch whose submission timed out (it may still land), also
   an ``api_status`` answer with no launch request for it still pending or
   running (one found is cancelled by the id ``api_status`` gives, then
   looked for again). A cluster still listed is sent ``down`` again
   (within the same attempt budget).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .interrupts import CallTimeout, bounded

__all__ = ["RunState", "Teardown", "Timeouts"]

_PENDING = ("PENDING", "RUNNING")  # a request that may still create the cluster
_ECHO = functools.partial(print, flush=True)  # a line as soon as it is known


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Seconds each SDK call or wait may take (``request``: submitting any request)."""

    request: float = 60
    provision: float = 20 * 60
    poll: float = 60
    poll_interval: float = 15
    poll_failures: int = 3
    logs: float = 300
    outputs: float = 600
    cancel: float = 180
    down: float = 900
    down_attempts: int = 4
    down_backoff: float = 5
    absence: float = 600
    absence_interval: float = 10


@dataclass
class RunState:
    """What one launch or teardown observed, filled in as it goes (the receipt's ``observed``)."""

    cluster: str
    request: str | None = None
    possibly_launched: bool = False  # the launch submission timed out: a request may exist without our id
    provisioned: bool = False
    job_id: int | None = None
    job_status: Any = None
    job_terminal: bool = False
    handle: Any = None
    launched_at: float | None = None  # the cluster's own launch time (epoch s), from a status record
    first_seen: float | None = None  # when a status answer first listed it (epoch s)
    absent_at: float | None = None
    phase: Any = None
    interruption: dict[str, str] | None = None
    error: BaseException | None = None
    evidence: Any = None
    logs: str | None = None
    run_id: str | None = None
    teardown: list[dict[str, Any]] = field(default_factory=list)
    absence_confirmed: bool = False
    last_seen: str | None = None
    signals: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def billed_s(self, now: float) -> float:
        """Seconds from the cluster's launch (or first sighting) to proven absence (or ``now``); 0 if never seen."""
        start = self.launched_at if self.launched_at is not None else self.first_seen
        return 0.0 if start is None else max(0.0, (self.absent_at or now) - start)

    def observed(self) -> dict[str, Any]:
        launched = getattr(self.handle, "launched_resources", None)
        return {
            "run_id": self.run_id,
            "job_id": self.job_id,
            "job_status": getattr(self.job_status, "value", self.job_status),
            "launched": None
            if launched is None
            else {"resources": str(launched), "nodes": int(getattr(self.handle, "launched_nodes", 1) or 1)},
            "launched_at": self.launched_at,
            "first_seen": self.first_seen,
            "absent_at": self.absent_at,
            "possibly_launched": self.possibly_launched,
            "interruption": self.interruption,
            "signals_during_teardown": len(self.signals),
            "evidence": None if self.evidence is None else self.evidence.to_json(),
            "logs": self.logs,
            "teardown": self.teardown,
            "absence_confirmed": self.absence_confirmed,
            "last_seen": self.last_seen,
        }


class Teardown:
    """SDK calls shared by launch, down, sweep and status (see the module docstring)."""

    def __init__(
        self,
        sdk: Any,
        *,
        timeouts: Timeouts = Timeouts(),
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        wall: Callable[[], float] = time.time,
        echo: Callable[[str], None] = _ECHO,
    ) -> None:
        self.sdk = sdk
        self.t = timeouts
        self.clock = clock
        self.sleep = sleep
        self.wall = wall
        self.echo = echo

    def request(
        self,
        name: str,
        call: Callable[..., Any],
        *args: Any,
        timeout: float,
        cancel_on_timeout: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Submit one request and wait for its result, each under its own timeout.

        A request whose result times out is cancelled on the API server, unless
        ``cancel_on_timeout`` is False: a teardown request is left running,
        since cancelling it would stop the very teardown.
        """
        request_id = bounded(call, *args, timeout=self.t.request, name=name, **kwargs)
        return self.result(name, request_id, timeout=timeout, cancel_on_timeout=cancel_on_timeout)

    def result(self, name: str, request_id: Any, *, timeout: float, cancel_on_timeout: bool = True) -> Any:
        try:
            return bounded(self.sdk.get, request_id, timeout=timeout, name=f"get({name})")
        except CallTimeout:
            if cancel_on_timeout:
                try:  # a request left running on the API server is cancelled, not forgotten
                    bounded(self.sdk.api_cancel, request_id, timeout=self.t.request, name="api_cancel")
                except Exception:  # noqa: BLE001 - the timeout is what gets reported
                    pass
            raise

    def records(self, names: list[str] | None) -> list[Any]:
        """``sky.status`` across all users (refreshed from the cloud when names are given)."""
        refresh = self.sdk.StatusRefreshMode.FORCE if names else self.sdk.StatusRefreshMode.NONE
        return self.request("status", self.sdk.status, names, refresh=refresh, all_users=True, timeout=self.t.poll)

    def _note(self, run: RunState, step: str, ok: bool, detail: str, start: float) -> None:
        run.teardown.append({"step": step, "ok": ok, "detail": detail, "seconds": round(self.clock() - start, 3)})

    def _seen(self, run: RunState, records: list[Any]) -> list[Any]:
        listed = [r for r in records if r.name == run.cluster]
        for record in listed:
            run.handle = run.handle if getattr(run.handle, "launched_resources", None) else record.handle
            run.launched_at = run.launched_at or (float(record.launched_at) if record.launched_at else None)
            run.first_seen = run.first_seen or self.wall()
            run.last_seen = getattr(record.status, "value", str(record.status))
        return listed

    def _census(self, run: RunState) -> None:
        """One ``status`` of the server's table (no cloud refresh: it must not wait for a ``down`` in progress)."""
        start = self.clock()
        try:
            self._seen(
                run,
                self.request(
                    "status",
                    self.sdk.status,
                    [run.cluster],
                    refresh=self.sdk.StatusRefreshMode.NONE,
                    all_users=True,
                    timeout=self.t.poll,
                ),
            )
            self._note(run, "census", True, f"seen: {run.last_seen}", start)
        except Exception as error:  # noqa: BLE001 - the teardown goes on without it
            self._note(run, "census", False, f"{type(error).__name__}: {error}", start)

    def _down_once(self, run: RunState, census: bool) -> bool:
        start = self.clock()
        try:
            try:
                request_id = bounded(self.sdk.down, run.cluster, timeout=self.t.request, name="down")
            finally:
                if census:  # while down runs: what the server's table still holds, for the receipt
                    self._census(run)
            self.result("down", request_id, timeout=self.t.down, cancel_on_timeout=False)
            ok, detail = True, "done"
        except self.sdk.exceptions.ClusterDoesNotExist:
            ok, detail = True, "the cluster does not exist"
        except Exception as error:  # noqa: BLE001 - recorded, retried
            ok, detail = False, f"{type(error).__name__}: {error}"
        self._note(run, "down", ok, detail, start)
        return ok

    def down_with_retry(self, run: RunState) -> bool:
        """``down`` until one succeeds or the attempts are spent, with doubling backoff between them.

        Without a signal to answer, the census comes first (a real server may finish ``down`` before a
        ``status`` sent beside it is answered); after a signal, ``down`` is sent first and the census
        reads the table while it runs.
        """
        downs = sum(step["step"] == "down" for step in run.teardown)
        hurry = bool(run.signals) or (run.interruption or {}).get("kind") == "signal"
        if downs == 0 and not hurry:
            self._census(run)
        for attempt in range(downs, self.t.down_attempts):
            if self._down_once(run, census=attempt == 0 and hurry):
                return True
            if attempt + 1 < self.t.down_attempts:
                self.sleep(self.t.down_backoff * 2 ** (attempt - downs))
        return False

    def cancel_launch(self, run: RunState) -> None:
        """Cancel a launch request that was still in flight (after ``down`` was sent)."""
        if run.request is None or run.provisioned:
            return
        start = self.clock()
        try:
            self.request("api_cancel", self.sdk.api_cancel, run.request, timeout=self.t.cancel, cancel_on_timeout=False)
            self._note(run, "api_cancel", True, "done", start)
        except Exception as error:  # noqa: BLE001
            self._note(run, "api_cancel", False, f"{type(error).__name__}: {error}", start)

    def _pending_launch(self, run: RunState) -> bool:
        """Whether the API server still holds a launch request for the cluster; one found is cancelled by its id."""
        requests = bounded(
            self.sdk.api_status, None, False, cluster_name=run.cluster, timeout=self.t.poll, name="api_status"
        )
        pending = [
            r.request_id
            for r in requests
            if r.cluster_name == run.cluster and r.status in _PENDING and "launch" in r.name
        ]
        if pending:
            start = self.clock()
            try:
                self.request("api_cancel", self.sdk.api_cancel, pending, timeout=self.t.cancel, cancel_on_timeout=False)
                self._note(run, "api_cancel", True, f"the lost launch request(s) {pending}", start)
            except Exception as error:  # noqa: BLE001 - the next poll looks again
                self._note(run, "api_cancel", False, f"{type(error).__name__}: {error}", start)
        return bool(pending)

    def prove_absence(self, run: RunState) -> None:
        """Poll until the cluster is absent (module docstring, rule 3) or ``Timeouts.absence`` passes."""
        deadline = self.clock() + self.t.absence
        while True:
            try:
                # Pending launches first: one that finishes between the two answers has made its cluster
                # before status is asked, so it cannot slip through.
                pending = run.possibly_launched and self._pending_launch(run)
                listed = self._seen(run, self.records([run.cluster]))
                if not listed and not pending:
                    run.absence_confirmed, run.absent_at = True, self.wall()
                    return
                if pending and not listed:
                    run.last_seen = "a launch request for it is still pending on the API server"
                elif listed and not self.down_with_retry(run) and self.clock() >= deadline:
                    return
            except Exception as error:  # noqa: BLE001 - absence is proven only by a status answer
                run.last_seen = f"status failed: {type(error).__name__}: {error}"
            if self.clock() >= deadline:
                return
            self.sleep(self.t.absence_interval)

    def tear_down(self, run: RunState) -> None:
        """Rules 2 and 3 of the module docstring; prints the teardown line."""
        start = self.clock()
        self.echo(f"rtv gpu: tearing down {run.cluster}")
        self.down_with_retry(run)
        self.cancel_launch(run)
        self.prove_absence(run)
        run.timings["teardown"] = self.clock() - start
        state = "absent (confirmed)" if run.absence_confirmed else f"absence UNPROVEN (last seen: {run.last_seen})"
        self.echo(f"teardown: cluster {run.cluster} {state}")
