"""A fake SkyPilot SDK at the one boundary this machine cannot reach: a cloud that provisions GPUs.

It has the SDK functions the launcher calls (:data:`REPLACES`), with the
installed SkyPilot's names and parameters (``test_fake_sky`` checks them
with ``inspect.signature`` and feeds its answers through SkyPilot's own
response types), returns SkyPilot's own types (``RequestId``, ``JobStatus``,
``StatusResponse`` with ``ClusterStatus``, ``RequestPayload``, a handle whose
``launched_resources`` is a real ``sky.Resources`` priced by the seeded
catalog) and raises SkyPilot's own exceptions. It behaves as the API server
of 0.14.1 does where the launcher's correctness depends on it:

- One :class:`FakeServer` holds the state; each :class:`FakeSky` is a client
  with its own user hash (:meth:`FakeSky.as_user`: another runner).
  ``status`` lists only the caller's clusters unless ``all_users=True``,
  named clusters included. ``down`` of another user's cluster works, unless
  the server refuses it (``refuse_foreign_down``).
- A request runs when the server gets to it (:meth:`FakeServer.run_pending`,
  or a client waiting on it with ``get``/``stream_and_get``): a launch's
  cluster appears only then (provisioning started), never at submission.
- ``api_cancel`` cancels a request that has not run: waiting on it raises
  ``RequestCancelled`` and its cluster never appears.
- :meth:`FakeServer.restart` interrupts every request that has not run:
  waiting on it raises ``RequestInterruptedError`` (final: resubmit).
- ``cost_report`` lists every user's clusters, downed ones included, from a
  history row per launch: its usage interval opens when provisioning starts,
  ``provision_s`` before the status record's ``launched_at`` (SkyPilot stamps
  that when the cluster is up), and ``down`` closes it; duration and
  ``total_cost`` are computed at the query (a price the catalog lacks is
  0.0, as SkyPilot's own report does).
- ``tail_logs`` raises ``ClusterNotUpError`` unless the cluster is UP; the
  log it streams ends with the job's evidence frame, made by the real
  ``ci.frames.emit`` from records the fake job writes (:data:`EVIDENCE`).

Faults (:meth:`FakeSky.inject`) make one call fail at the boundary:
``error`` raises, ``connection`` raises ``ApiServerConnectionError``,
``timeout`` blocks until :meth:`FakeSky.release`, ``sigint``/``sigterm``
deliver that signal to this process and then let the call finish,
``slow_result``: the request is accepted, its result hangs;
``lost_reply``: the request is accepted, the reply (its id) never comes;
``restart``: the server restarts as the call arrives. A launch can also
fail after it provisioned (``fail_after_provision``: a sync or setup
error, the cluster left UP). Calls are serialised by one lock, as requests
are by the server; ``wall`` is the server's clock (cluster launch times).
"""

from __future__ import annotations

import io
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import sky
from sky.schemas.api.responses import StatusResponse
from sky.server.common import RequestId
from sky.server.requests.payloads import RequestPayload

from ci.frames import emit
from validation.evidence import content_digest, make_record

REPLACES = (
    "launch",
    "stream_and_get",
    "get",
    "job_status",
    "tail_logs",
    "cancel",
    "api_cancel",
    "down",
    "status",
    "api_status",
    "cost_report",
)
FAULTS = ("error", "connection", "timeout", "sigint", "sigterm", "slow_result", "lost_reply", "restart")
# What the fake job leaves: all expected records passing; one failed; one tampered; none written; one from an
# earlier run (another run id, created before); one record too many; the benchmark failed (shown, not enforced);
# the job's record created on a CPU; no evidence frame in the log at all; every record passed but the work
# exited 1 (a job SkyPilot reported SUCCEEDED although it failed).
# The request states the server's api_status lists without all_status (SkyPilot's RequestStatus.active_statuses()):
# a test may mark a launch RUNNING (being made; a cancel no longer stops it, only PENDING ones are cancelled).
ACTIVE = ("PENDING", "RUNNING")
EVIDENCE = ("passed", "failed", "tampered", "missing", "stale", "foreign", "shown", "cpu", "no_frame", "misreported")


class FakeServer:
    """The API server's state: clusters (with their owner's user hash), jobs, requests, faults."""

    def __init__(self, *, job_statuses: tuple[Any, ...], evidence: str, instance_type: str) -> None:
        assert evidence in EVIDENCE, evidence
        self.job_statuses = list(job_statuses)
        self.evidence = evidence
        self.instance_type = instance_type
        self.clusters: dict[str, StatusResponse] = {}
        self.jobs: dict[str, list[Any]] = {}
        self.requests: dict[str, dict[str, Any]] = {}  # id -> {thunk, state, name, cluster, user, result}
        self.calls: list[str] = []
        self.faults: dict[str, tuple[str, bool]] = {}
        self.lock = threading.RLock()
        self.released = threading.Event()
        self.tasks: list[Any] = []
        self.logs: dict[str, str] = {}  # cluster -> what its job printed
        self.history: list[dict[str, Any]] = []  # one row per launch: name, launched_at, usage intervals, ...
        self.provision_s = 20  # provisioning before the status record's launch stamp
        self.history_closes_on_down = True  # False: a server whose cost history lags the teardown
        self.refuse_foreign_down = False
        self.fail_after_provision = False
        self.on_api_status: Any = None  # called on each api_status (a test lets a lost launch land then)
        self.wall: Any = time.time
        self._slow_result = False
        self._lost_reply = False

    def run_pending(self) -> None:
        """The server gets to every request not yet run (a launch nobody waits on still lands)."""
        with self.lock:
            for request_id, entry in list(self.requests.items()):
                if entry["state"] == "PENDING":
                    self._run(request_id)

    def restart(self) -> None:
        """An API-server restart: every request not yet run is interrupted."""
        with self.lock:
            for entry in self.requests.values():
                if entry["state"] == "PENDING":
                    entry["state"] = "INTERRUPTED"

    def _run(self, request_id: str) -> Any:
        entry = self.requests[request_id]
        if entry["state"] == "CANCELLED":
            raise sky.exceptions.RequestCancelled(f"request {request_id} was cancelled")
        if entry["state"] == "INTERRUPTED":
            raise sky.exceptions.RequestInterruptedError(f"request {request_id} was interrupted: resubmit it")
        if entry["state"] == "PENDING":
            try:
                entry["result"], entry["state"] = entry["thunk"](), "SUCCEEDED"
            except Exception as error:  # noqa: BLE001 - a failed request, as the SDK reports it
                entry["result"], entry["state"] = error, "FAILED"
        if entry["state"] == "FAILED":
            raise entry["result"]
        return entry["result"]


class FakeSky:
    """SkyPilot's SDK surface for the launcher, as one user of a :class:`FakeServer`."""

    JobStatus = sky.JobStatus
    ClusterStatus = sky.ClusterStatus
    StatusRefreshMode = sky.StatusRefreshMode
    exceptions = sky.exceptions

    def __init__(
        self,
        *,
        job_statuses: tuple[Any, ...] = (sky.JobStatus.RUNNING, sky.JobStatus.SUCCEEDED),
        evidence: str = "passed",
        instance_type: str = "gpu_2x_h200",
        user: str = "runnera",
        server: FakeServer | None = None,
    ) -> None:
        self.server = server or FakeServer(job_statuses=job_statuses, evidence=evidence, instance_type=instance_type)
        self.user = user

    def as_user(self, user: str) -> FakeSky:
        """Another client (another runner's SkyPilot user hash) of the same server."""
        return FakeSky(user=user, server=self.server)

    @property
    def clusters(self) -> dict[str, StatusResponse]:
        return self.server.clusters

    @property
    def calls(self) -> list[str]:
        return self.server.calls

    @property
    def faults(self) -> dict[str, tuple[str, bool]]:
        return self.server.faults

    @property
    def tasks(self) -> list[Any]:
        return self.server.tasks

    # --- faults -----------------------------------------------------------------------

    def inject(self, call: str, fault: str, *, always: bool = False) -> None:
        assert fault in FAULTS, fault
        self.server.faults[call] = (fault, always)

    def release(self) -> None:
        self.server.released.set()

    def _enter(self, name: str) -> None:
        server = self.server
        server.calls.append(name)
        fault, always = server.faults.get(name, (None, False))
        if fault is None:
            return
        if not always:
            del server.faults[name]
        if fault == "error":
            raise RuntimeError(f"injected failure in {name}")
        if fault == "connection":
            raise sky.exceptions.ApiServerConnectionError("http://127.0.0.1:1")
        if fault in ("slow_result", "lost_reply"):
            setattr(server, f"_{fault}", True)
            return
        if fault == "restart":
            server.restart()
            return
        if fault == "timeout":
            self._hang(name)
        os.kill(os.getpid(), signal.SIGINT if fault == "sigint" else signal.SIGTERM)
        time.sleep(0.1)  # the main thread handles the signal while this call is still in flight

    def _hang(self, name: str) -> None:
        """Hang without holding the lock (the server goes on answering others) until the test releases it."""
        self.server.lock.release()
        try:
            self.server.released.wait()
        finally:
            self.server.lock.acquire()
        raise RuntimeError(f"{name} released after the test")

    def _request(self, thunk: Any, name: str, cluster: str | None = None) -> RequestId:
        server = self.server
        request_id = RequestId(f"req-{len(server.requests)}")
        if server._slow_result:
            server._slow_result = False
            inner, thunk = thunk, lambda: (self._hang(f"result of {request_id}"), inner)[1]
        server.requests[request_id] = {
            "thunk": thunk,
            "state": "PENDING",
            "name": name,
            "cluster": cluster,
            "user": self.user,
            "result": None,
            "created": server.wall(),
        }
        if server._lost_reply:
            server._lost_reply = False
            self._hang(f"reply to {request_id}")
        return request_id

    # --- requests -----------------------------------------------------------------------

    def launch(
        self,
        task: Any,
        cluster_name: str | None = None,
        retry_until_up: bool = False,
        idle_minutes_to_autostop: int | None = None,
        wait_for: Any = None,
        dryrun: bool = False,
        down: bool = False,
    ) -> RequestId:
        with self.server.lock:
            self._enter("launch")
            self.server.tasks.append(task)

            def provision() -> tuple[int, Any]:
                record = self._record(cluster_name, sky.ClusterStatus.UP, self._optimize(task))
                self.server.clusters[cluster_name] = record
                started = record.launched_at - self.server.provision_s
                self.server.history.append(
                    {
                        "name": cluster_name,
                        "launched_at": started,
                        "usage_intervals": [[started, None]],
                        "num_nodes": 1,
                        "resources": record.handle.launched_resources,
                        "user_hash": self.user,
                    }
                )
                self.server.jobs[cluster_name] = list(self.server.job_statuses)
                self._job_log(cluster_name, task)
                if self.server.fail_after_provision:
                    raise RuntimeError(f"rsync of the workdir to {cluster_name} failed (exit 23)")
                return 1, self.server.clusters[cluster_name].handle

            return self._request(provision, "sky.launch", cluster_name)

    def stream_and_get(
        self,
        request_id: RequestId | None = None,
        log_path: str | None = None,
        tail: int | None = None,
        follow: bool = True,
        output_stream: Any = None,
        relay_rich_status: bool = False,
    ) -> Any:
        with self.server.lock:
            self._enter("stream_and_get")
            return self.server._run(request_id)

    def get(self, request_id: RequestId) -> Any:
        with self.server.lock:
            self._enter("get")
            return self.server._run(request_id)

    def job_status(self, cluster_name: str, job_ids: list[int] | None = None) -> RequestId:
        with self.server.lock:
            self._enter("job_status")

            def statuses() -> dict[int, Any]:
                self._require(cluster_name)
                queue = self.server.jobs[cluster_name]
                status = queue.pop(0) if len(queue) > 1 else queue[0]
                return {job_id: status for job_id in (job_ids or [1])}

            return self._request(statuses, "sky.job_status", cluster_name)

    def cancel(
        self,
        cluster_name: str,
        all: bool = False,  # noqa: A002 - SkyPilot's name
        all_users: bool = False,
        job_ids: list[int] | None = None,
    ) -> RequestId:
        with self.server.lock:
            self._enter("cancel")

            def cancel_jobs() -> None:
                self._require(cluster_name)
                self.server.jobs[cluster_name] = [sky.JobStatus.CANCELLED]

            return self._request(cancel_jobs, "sky.cancel", cluster_name)

    def api_cancel(self, request_ids: Any = None, all_users: bool = False, silent: bool = False) -> RequestId:
        with self.server.lock:
            self._enter("api_cancel")
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or [])
            cancelled = []
            for request_id in ids:
                entry = self.server.requests.get(request_id)
                if entry is not None and entry["state"] == "PENDING":
                    entry["state"] = "CANCELLED"
                    cancelled.append(request_id)
            return self._request(lambda: cancelled, "sky.api_cancel")

    def api_status(
        self,
        request_ids: Any = None,
        all_status: bool = False,
        limit: int | None = None,
        fields: list[str] | None = None,
        cluster_name: str | None = None,
    ) -> list[RequestPayload]:
        with self.server.lock:
            self._enter("api_status")
            if self.server.on_api_status is not None:
                self.server.on_api_status()
            return [
                RequestPayload(
                    request_id=rid,
                    name=e["name"],
                    entrypoint="",
                    request_body="{}",
                    status="PENDING" if e["state"] == "PENDING" else e["state"],
                    created_at=e["created"],
                    user_id=e["user"],
                    return_value="null",
                    error="null",
                    pid=None,
                    schedule_type="long",
                    cluster_name=e["cluster"],
                )
                for rid, e in self.server.requests.items()
                if (all_status or e["state"] in ACTIVE) and cluster_name in (None, e["cluster"])
            ]

    def down(
        self, cluster_name: str, purge: bool = False, graceful: bool = False, graceful_timeout: int | None = None
    ) -> RequestId:
        with self.server.lock:
            self._enter("down")

            def remove() -> None:
                self._require(cluster_name)
                if self.server.refuse_foreign_down and self.server.clusters[cluster_name].user_hash != self.user:
                    raise sky.exceptions.ClusterOwnerIdentityMismatchError(
                        f"cluster {cluster_name!r} belongs to {self.server.clusters[cluster_name].user_hash}"
                    )
                del self.server.clusters[cluster_name]
                self.server.jobs.pop(cluster_name, None)
                for row in self.server.history if self.server.history_closes_on_down else []:
                    if row["name"] == cluster_name and row["usage_intervals"][-1][1] is None:
                        row["usage_intervals"][-1][1] = int(self.server.wall())

            return self._request(remove, "sky.down", cluster_name)

    def status(
        self, cluster_names: list[str] | None = None, refresh: Any = sky.StatusRefreshMode.NONE, all_users: bool = False
    ) -> RequestId:
        with self.server.lock:
            self._enter("status")
            return self._request(
                lambda: [
                    r
                    for name, r in self.server.clusters.items()
                    if (cluster_names is None or name in cluster_names) and (all_users or r.user_hash == self.user)
                ],
                "sky.status",
            )

    def cost_report(self, days: int | None = None) -> RequestId:
        with self.server.lock:
            self._enter("cost_report")
            return self._request(self._cost_rows, "sky.cost_report")

    def _cost_rows(self) -> list[dict[str, Any]]:
        now, rows = int(self.server.wall()), []
        for row in self.server.history:
            duration = sum((now if end is None else end) - start for start, end in row["usage_intervals"])
            try:
                cost = row["resources"].get_cost(duration) * row["num_nodes"]
            except Exception:  # noqa: BLE001 - SkyPilot's report shows 0.0 when the catalog has no price
                cost = 0.0
            status = self.server.clusters[row["name"]].status if row["name"] in self.server.clusters else None
            rows.append(
                {
                    **row,
                    "usage_intervals": [tuple(i) for i in row["usage_intervals"]],
                    "duration": duration,
                    "total_cost": cost,
                    "status": status,
                }
            )
        return rows

    def tail_logs(
        self, cluster_name: str, job_id: int | None, follow: bool, tail: int = 0, output_stream: Any = None
    ) -> int:
        with self.server.lock:
            self._enter("tail_logs")
            self._require(cluster_name)
            record = self.server.clusters[cluster_name]
            if record.status != sky.ClusterStatus.UP:
                raise sky.exceptions.ClusterNotUpError(
                    f"cluster {cluster_name} is {record.status.value}", cluster_status=record.status
                )
            output_stream.write(self.server.logs[cluster_name])
            return 0

    # --- the fake job -----------------------------------------------------------------

    def _job_log(self, cluster: str, task: Any) -> None:
        """What the job prints: a line, then (unless ``no_frame``) its evidence frame (module docstring)."""
        server = self.server
        envs = dict(task.envs)
        log = io.StringIO()
        log.write(f"(rtv-gate, pid=4242) job 1 on {cluster}: the log says SUCCEEDED whatever happened\n")
        if server.evidence != "no_frame":
            with tempfile.TemporaryDirectory() as folder:
                self._write_records(Path(folder), envs)
                failed = server.evidence in ("failed", "misreported")  # rtv run exited 1
                emit(Path(folder), stream=log, env=envs, status=1 if failed else 0)
        server.logs[cluster] = log.getvalue()

    def _write_records(self, folder: Path, envs: dict[str, str]) -> None:
        evidence, names = self.server.evidence, envs.get("RTV_EXPECT", "").split()
        if evidence == "missing":
            names = names[1:]
        if evidence == "foreign":
            names = [*names, "derivative"]
        template = make_record("fake", config={}, checks={"ok": True}, measurements={"worst": 1e-7})
        for i, name in enumerate(names):
            record = json.loads(json.dumps(template))
            record["kind"] = name
            record["environment"] |= {"run_id": envs.get("RTV_RUN_ID"), "cuda": "NVIDIA H200"}
            if evidence == "cpu":
                record["environment"]["cuda"] = None
            if evidence == "stale" and i == 0:
                record["environment"]["run_id"] = "rtv-gate-41-1-0ld0ld00"
                record["created"] = "2020-01-01T00:00:00+00:00"
            if (evidence == "failed" and i == 0) or (evidence == "shown" and name == "benchmark"):
                record["checks"], record["passed"] = {"ok": False}, False
            record["digest"] = content_digest(record)
            if evidence == "tampered" and i == 0:
                record["measurements"]["worst"] = 0.0
            stem = name if name == "smoke" else f"{name}-gpu"
            (folder / f"{stem}-20260101T000000{i:06d}Z-{os.getpid()}.json").write_text(json.dumps(record))

    # --- helpers ------------------------------------------------------------------------

    def _require(self, cluster_name: str) -> None:
        if cluster_name not in self.server.clusters:
            raise sky.exceptions.ClusterDoesNotExist(f"cluster {cluster_name!r} does not exist")

    @staticmethod
    def _optimize(task: Any) -> Any:
        """The alternative SkyPilot's optimizer would take: an ordered list's first; of an any_of set, here the
        first by label (the real one takes the cheapest, which this fake's one price cannot tell apart)."""
        entries = task.resources
        if isinstance(entries, list):
            return entries[0]
        return min(entries, key=lambda res: sorted((res.labels or {}).items()))

    def _record(self, name: str, status: Any, chosen: Any = None) -> StatusResponse:
        labels = None if chosen is None else chosen.labels  # SkyPilot keeps the chosen resources' labels
        handle = SimpleNamespace(
            launched_resources=sky.Resources(
                infra="lambda/us-east-1", instance_type=self.server.instance_type, labels=labels
            ),
            launched_nodes=1,
        )
        return StatusResponse(
            name=name,
            launched_at=int(self.server.wall()),
            handle=handle,
            status=status,
            autostop=10,
            to_down=True,
            cluster_hash="fake",
            cluster_ever_up=status == sky.ClusterStatus.UP,
            user_hash=self.user,
            user_name=self.user,
            workspace="default",
            is_managed=False,
            nodes=1,
        )
