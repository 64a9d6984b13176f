"""A fake SkyPilot SDK at the one boundary this machine cannot reach: a cloud that provisions GPUs.

It has the SDK functions the launcher calls (:data:`REPLACES`), with the
installed SkyPilot's names and parameters (``test_fake_sky`` checks them
with ``inspect.signature``), returns SkyPilot's own types (``RequestId``,
``JobStatus``, ``StatusResponse`` with ``ClusterStatus``, a handle whose
``launched_resources`` is a real ``sky.Resources`` priced by the seeded
catalog) and raises SkyPilot's own ``ClusterDoesNotExist``. Like the real
API server, a launch request starts provisioning when it is submitted (the
cluster appears as INIT) and ``down`` removes whatever exists.

Faults (:meth:`FakeSky.inject`) make one call fail at the boundary:
``error`` raises, ``timeout`` blocks until :meth:`FakeSky.release`,
``sigint``/``sigterm`` deliver that signal to this process and then let the
call finish. Calls are serialised by one lock, as requests are by the server,
so an interrupted call that is still finishing cannot race the teardown.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import sky
from sky.schemas.api.responses import StatusResponse
from sky.server.common import RequestId

from validation.evidence import evidence_path, make_record, write_once

REPLACES = ("launch", "stream_and_get", "get", "job_status", "tail_logs", "cancel", "api_cancel", "down", "status")
FAULTS = ("error", "timeout", "sigint", "sigterm", "slow_result")  # slow_result: the request is accepted, its result hangs
EVIDENCE = ("passed", "failed", "tampered", "missing")


class FakeSky:
    """SkyPilot's SDK surface for the launcher, over an in-memory cloud."""

    JobStatus = sky.JobStatus
    ClusterStatus = sky.ClusterStatus
    StatusRefreshMode = sky.StatusRefreshMode
    exceptions = sky.exceptions

    def __init__(self, *, job_statuses: tuple[Any, ...] = (sky.JobStatus.RUNNING, sky.JobStatus.SUCCEEDED),
                 evidence: str = "passed", instance_type: str = "gpu_2x_h200") -> None:
        assert evidence in EVIDENCE, evidence
        self.job_statuses = list(job_statuses)
        self.evidence = evidence
        self.instance_type = instance_type
        self.clusters: dict[str, StatusResponse] = {}
        self.jobs: dict[str, list[Any]] = {}  # cluster -> remaining statuses (the last one repeats)
        self.requests: dict[str, Any] = {}
        self.calls: list[str] = []
        self.faults: dict[str, tuple[str, bool]] = {}
        self.lock = threading.RLock()
        self.released = threading.Event()
        self.tasks: list[Any] = []
        self._slow_result = False  # the next request's result hangs (fault "slow_result")

    # --- faults -----------------------------------------------------------------------

    def inject(self, call: str, fault: str, *, always: bool = False) -> None:
        assert fault in FAULTS, fault
        self.faults[call] = (fault, always)

    def release(self) -> None:
        self.released.set()

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        fault, always = self.faults.get(name, (None, False))
        if fault is None:
            return
        if not always:
            del self.faults[name]
        if fault == "error":
            raise RuntimeError(f"injected failure in {name}")
        if fault == "slow_result":
            self._slow_result = True
            return
        if fault == "timeout":
            self._hang(name)
        os.kill(os.getpid(), signal.SIGINT if fault == "sigint" else signal.SIGTERM)
        time.sleep(0.1)  # the main thread handles the signal while this call is still in flight

    def _hang(self, name: str) -> None:
        """Hang without holding the lock (the server goes on answering others) until the test releases it."""
        self.lock.release()
        try:
            self.released.wait()
        finally:
            self.lock.acquire()
        raise RuntimeError(f"{name} released after the test")

    def _request(self, thunk: Any) -> RequestId:
        request_id = RequestId(f"req-{len(self.requests)}")
        if self._slow_result:
            self._slow_result = False
            self.requests[request_id] = lambda: self._hang(f"result of {request_id}")
        else:
            self.requests[request_id] = thunk
        return request_id

    # --- requests -----------------------------------------------------------------------

    def launch(self, task: Any, cluster_name: str | None = None, retry_until_up: bool = False,
               idle_minutes_to_autostop: int | None = None, wait_for: Any = None, dryrun: bool = False,
               down: bool = False) -> RequestId:
        with self.lock:
            self._enter("launch")
            self.tasks.append(task)
            self.clusters[cluster_name] = self._record(cluster_name, sky.ClusterStatus.INIT)

            def provision() -> tuple[int, Any]:
                self.clusters[cluster_name] = self._record(cluster_name, sky.ClusterStatus.UP)
                self.jobs[cluster_name] = list(self.job_statuses)
                return 1, self.clusters[cluster_name].handle

            return self._request(provision)

    def stream_and_get(self, request_id: RequestId | None = None, log_path: str | None = None, tail: int | None = None,
                       follow: bool = True, output_stream: Any = None, relay_rich_status: bool = False) -> Any:
        with self.lock:
            self._enter("stream_and_get")
            return self.requests[request_id]()

    def get(self, request_id: RequestId) -> Any:
        with self.lock:
            self._enter("get")
            return self.requests[request_id]()

    def job_status(self, cluster_name: str, job_ids: list[int] | None = None) -> RequestId:
        with self.lock:
            self._enter("job_status")

            def statuses() -> dict[int, Any]:
                self._require(cluster_name)
                queue = self.jobs[cluster_name]
                status = queue.pop(0) if len(queue) > 1 else queue[0]
                return {job_id: status for job_id in (job_ids or [1])}

            return self._request(statuses)

    def cancel(self, cluster_name: str, all: bool = False, all_users: bool = False,  # noqa: A002 - SkyPilot's name
               job_ids: list[int] | None = None) -> RequestId:
        with self.lock:
            self._enter("cancel")

            def cancel_jobs() -> None:
                self._require(cluster_name)
                self.jobs[cluster_name] = [sky.JobStatus.CANCELLED]

            return self._request(cancel_jobs)

    def api_cancel(self, request_ids: Any = None, all_users: bool = False, silent: bool = False) -> RequestId:
        with self.lock:
            self._enter("api_cancel")
            return self._request(lambda: [request_ids])

    def down(self, cluster_name: str, purge: bool = False, graceful: bool = False,
             graceful_timeout: int | None = None) -> RequestId:
        with self.lock:
            self._enter("down")

            def remove() -> None:
                self._require(cluster_name)
                del self.clusters[cluster_name]
                self.jobs.pop(cluster_name, None)

            return self._request(remove)

    def status(self, cluster_names: list[str] | None = None, refresh: Any = sky.StatusRefreshMode.NONE,
               all_users: bool = False) -> RequestId:
        with self.lock:
            self._enter("status")
            return self._request(lambda: [r for name, r in self.clusters.items()
                                          if cluster_names is None or name in cluster_names])

    def tail_logs(self, cluster_name: str, job_id: int | None, follow: bool, tail: int = 0,
                  output_stream: Any = None) -> int:
        with self.lock:
            self._enter("tail_logs")
            self._require(cluster_name)
            output_stream.write(f"job {job_id} on {cluster_name}: the log says SUCCEEDED whatever happened\n")
            return 0

    # --- outputs (rsync in real life) -------------------------------------------------

    def fetch_outputs(self, cluster: str, remote_dir: str, local_dir: Path, *, timeout: float) -> Path:
        """Stands in for ``ci.outputs.rsync_outputs``: the job's evidence, as :attr:`evidence` says."""
        with self.lock:
            self._enter("fetch_outputs")
            self._require(cluster)
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        if self.evidence == "missing":
            return local_dir
        record = make_record("canary-fake", config={"remote": remote_dir},
                             checks={"gradients_exact": self.evidence != "failed"}, measurements={"worst": 1e-7})
        path = write_once(evidence_path(local_dir, "canary-fake"), record)
        if self.evidence == "tampered":
            data = json.loads(path.read_text())
            data["measurements"]["worst"] = 0.0
            path.chmod(0o644)
            path.write_text(json.dumps(data))
        return local_dir

    # --- helpers ------------------------------------------------------------------------

    def _require(self, cluster_name: str) -> None:
        if cluster_name not in self.clusters:
            raise sky.exceptions.ClusterDoesNotExist(f"cluster {cluster_name!r} does not exist")

    def _record(self, name: str, status: Any) -> StatusResponse:
        handle = SimpleNamespace(
            launched_resources=sky.Resources(infra="lambda/us-east-1", instance_type=self.instance_type),
            launched_nodes=1)
        return StatusResponse(
            name=name, launched_at=int(time.time()), handle=handle, status=status, autostop=10, to_down=True,
            cluster_hash="fake", cluster_ever_up=status == sky.ClusterStatus.UP, user_hash="fake",
            user_name="ci", workspace="default", is_managed=False, nodes=1,
        )
