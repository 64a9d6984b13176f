"""The GPU CI launcher: launch a task, gate on the remote job status, fetch evidence, always tear down, prove it.

It drives the SkyPilot Python SDK (``sky.launch``, ``sky.stream_and_get``,
``sky.job_status``, ``sky.get``, ``sky.tail_logs``, ``sky.cancel``,
``sky.api_cancel``, ``sky.down``, ``sky.status``), passed in as ``sdk`` (the
``sky`` module, or a fake with the same functions in tests). Every call has
its own timeout (:func:`ci.interrupts.bounded`). Hand-written because
SkyPilot has no launcher that gates on job status, tears down on every
path and records a receipt (the CLI's ``sky launch`` has exited 0 on a
failed job).

The phases, in order: ``launch`` (submit the request), ``provision``
(wait for it: cluster up, job submitted), ``job`` (poll the job's status
until terminal or the task's deadline), ``fetch`` (logs and the evidence
folder). Then, in ``finally`` and with SIGINT/SIGTERM deferred,
``teardown``: cancel a launch request still in flight, cancel the job if it
is not finished, ``down``, and poll ``status`` until the cluster is absent.
Autodown in the task file stays as the cluster's own backstop; ``down=True``
is not passed to ``sky.launch`` because it would remove the cluster before
its evidence is copied back. A launch interrupted while its request was
being submitted has no request id to cancel: ``down`` and the absence poll
still run, and the workflow's always-run ``rtv gpu down`` and autodown are
the backstops for a cluster that appears later. The launcher never starts
or stops a SkyPilot API server itself (``sky`` starts a local one on first
use unless an endpoint is configured).

NOTE [Exit codes] (docs/harness.md#exit-codes; :func:`exit_code` implements them)

1. Absence of the cluster after teardown unproven: 6, whatever else happened.
2. The run was interrupted: by SIGINT/SIGTERM 4, by a call timeout or the
   job's deadline 5, by any other error 3.
3. Otherwise the job's final status: CANCELLED 4; FAILED, FAILED_SETUP,
   FAILED_DRIVER or no job 3; SUCCEEDED 0, but only if the evidence it
   produced came back, verifies and says passed (``ci.outputs``), else 3.
"""

from __future__ import annotations

import enum
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from validation.errors import SetupError
from validation.evidence import Checks

from .interrupts import CallTimeout, Interrupted, bounded, signals_deferred, signals_raise
from .outputs import EvidenceVerdict, judge_outputs, rsync_outputs
from .receipts import write_receipt
from .tasks import TaskSpec

__all__ = ["Phase", "Timeouts", "Outcome", "Launcher", "cluster_name", "default_run_id", "exit_code", "launched_gpus", "LABEL"]

LABEL = "rtv-ci-cluster"  # resources label carrying the cluster name, for a census by label


class Phase(str, enum.Enum):
    LAUNCH = "launch"
    PROVISION = "provision"
    JOB = "job"
    FETCH = "fetch"
    TEARDOWN = "teardown"


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
    absence: float = 600
    absence_interval: float = 10


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    outcome: str
    receipt: Path


class JobDeadline(Exception):
    """The job was not finished by the task's deadline."""


_WORDS = {0: "passed", 3: "failed", 4: "cancelled", 5: "timed out", 6: "absence unproven"}


def cluster_name(task_name: str, run_id: str, attempt: str | int) -> str:
    """``rtv-<task>-<run id>-<attempt>``: the same name for a run's launch and its always-run ``down``."""
    base = re.sub(r"[^a-z0-9]+", "-", task_name.lower()).strip("-")
    base = base if base.startswith("rtv") else f"rtv-{base}"
    name = f"{base}-{run_id}-{attempt}".lower()
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        raise ValueError(f"expected letters, digits and dashes in the run id and attempt, found {name!r}")
    return name


def exit_code(*, absence_confirmed: bool, interruption: str | None, job_status: str | None,
              evidence_passed: bool) -> int:
    """See NOTE [Exit codes]; ``interruption`` is ``signal``, ``timeout``, ``error`` or None."""
    if not absence_confirmed:
        return 6
    if interruption is not None:
        return {"signal": 4, "timeout": 5}.get(interruption, 3)
    if job_status == "CANCELLED":
        return 4
    if job_status == "SUCCEEDED":
        return 0 if evidence_passed else 3
    return 3


@dataclass
class _Run:
    """What one launch observed, filled in as it goes (the receipt's ``observed``)."""

    cluster: str
    request: str | None = None
    provisioned: bool = False
    job_id: int | None = None
    job_status: Any = None
    job_terminal: bool = False
    handle: Any = None
    phase: Phase = Phase.LAUNCH
    interruption: dict[str, str] | None = None
    error: BaseException | None = None
    evidence: EvidenceVerdict | None = None
    logs: str | None = None
    teardown: list[dict[str, Any]] = field(default_factory=list)
    absence_confirmed: bool = False
    last_seen: str | None = None
    signals: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    submitted_at: float | None = None

    def observed(self) -> dict[str, Any]:
        launched = getattr(self.handle, "launched_resources", None)
        return {
            "job_id": self.job_id,
            "job_status": getattr(self.job_status, "value", self.job_status),
            "launched": None if launched is None else {
                "resources": str(launched), "nodes": int(getattr(self.handle, "launched_nodes", 1) or 1)},
            "interruption": self.interruption,
            "signals_during_teardown": len(self.signals),
            "evidence": None if self.evidence is None else self.evidence.to_json(),
            "logs": self.logs,
            "teardown": self.teardown,
            "absence_confirmed": self.absence_confirmed,
            "last_seen": self.last_seen,
        }


def _interruption(error: BaseException, phase: Phase) -> dict[str, str]:
    if isinstance(error, Interrupted):
        kind = "signal"
    elif isinstance(error, (CallTimeout, JobDeadline)):
        kind = "timeout"
    else:
        kind = "error"
    return {"kind": kind, "phase": phase.value, "detail": f"{type(error).__name__}: {error}"}


class Launcher:
    """Runs one task file on one cluster, or tears a cluster down; both write a receipt (``ci.receipts``)."""

    def __init__(
        self,
        sdk: Any,
        *,
        fetch_outputs: Callable[..., Path] = rsync_outputs,
        timeouts: Timeouts = Timeouts(),
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        echo: Callable[[str], None] = print,
    ) -> None:
        self.sdk = sdk
        self.fetch_outputs = fetch_outputs
        self.t = timeouts
        self.clock = clock
        self.sleep = sleep
        self.echo = echo

    # --- launch ---------------------------------------------------------------------

    def launch(self, spec: TaskSpec, *, cluster: str, out_dir: Path) -> Outcome:
        """Launch ``spec`` on ``cluster``; evidence, logs and the receipt go under ``out_dir``."""
        out_dir = Path(out_dir)
        run = _Run(cluster=cluster)
        self.echo(f"rtv gpu launch: cluster {cluster} (tear down by hand: rtv gpu down {cluster})")
        with signals_deferred(run.signals):  # outermost, so no signal falls between the body and teardown
            try:
                try:
                    with signals_raise():
                        self._launch_and_wait(spec, run)
                        self._fetch(spec, run, out_dir)
                except (Exception, Interrupted) as error:  # every interruption ends in teardown and a receipt
                    run.interruption, run.error = _interruption(error, run.phase), error
                    self.echo(f"rtv gpu launch: interrupted during {run.phase.value}: {run.interruption['detail']}")
            finally:
                self._teardown(run)
                if run.signals and run.interruption is None:
                    run.interruption = {"kind": "signal", "phase": Phase.TEARDOWN.value,
                                        "detail": f"{len(run.signals)} signal(s) during teardown"}
                outcome = self._receipt(run, spec, out_dir)
        self._refuse_without_credentials(run, outcome)
        return outcome

    def _refuse_without_credentials(self, run: _Run, outcome: Outcome) -> None:
        """SkyPilot refused for want of cloud credentials: a setup error (exit 2), unless absence is unproven (6 wins)."""
        errors = self.sdk.exceptions
        if outcome.exit_code == 6 or not isinstance(run.error, (errors.NoCloudAccessError, errors.CloudUserIdentityError)):
            return
        raise SetupError(f"SkyPilot cannot use a cloud: {run.error} (nothing was launched; receipt {outcome.receipt})",
                         fix="set up credentials for a cloud with H200s and check them with `sky check`, "
                             "then run rtv gpu launch again")

    def _timed(self, run: _Run, phase: Phase) -> float:
        run.phase = phase
        return self.clock()

    def _launch_and_wait(self, spec: TaskSpec, run: _Run) -> None:
        task = spec.task
        resources = list(task.resources)[0]
        task.set_resources(resources.copy(labels={**(resources.labels or {}), LABEL: run.cluster}))
        start = self._timed(run, Phase.LAUNCH)
        run.submitted_at = start
        run.request = bounded(self.sdk.launch, task, cluster_name=run.cluster, retry_until_up=False,
                              timeout=self.t.request, name="launch")
        run.timings["launch"] = self.clock() - start
        start = self._timed(run, Phase.PROVISION)
        job_id, handle = bounded(self.sdk.stream_and_get, run.request, timeout=self.t.provision,
                                 name="stream_and_get(launch)")
        run.provisioned, run.job_id, run.handle = True, job_id, handle
        run.timings["provision"] = self.clock() - start
        if job_id is None:
            raise RuntimeError(f"the launch returned no job id for {run.cluster}; nothing ran")
        start = self._timed(run, Phase.JOB)
        try:
            self._wait_for_job(spec, run)
        finally:
            run.timings["job"] = self.clock() - start

    def _request(self, name: str, call: Callable[..., Any], *args: Any, timeout: float,
                 cancel_on_timeout: bool = True, **kwargs: Any) -> Any:
        """Submit one request and wait for its result, each under its own timeout.

        A request whose result times out is cancelled on the API server, unless
        ``cancel_on_timeout`` is False: a teardown request (cancel, down) is
        left running, since cancelling it would stop the very teardown.
        """
        request_id = bounded(call, *args, timeout=self.t.request, name=name, **kwargs)
        try:
            return bounded(self.sdk.get, request_id, timeout=timeout, name=f"get({name})")
        except CallTimeout:
            if not cancel_on_timeout:
                raise
            try:  # a request left running on the API server is cancelled, not forgotten
                bounded(self.sdk.api_cancel, request_id, timeout=self.t.request, name="api_cancel")
            except Exception:  # noqa: BLE001 - the timeout is what gets reported
                pass
            raise

    def _wait_for_job(self, spec: TaskSpec, run: _Run) -> None:
        deadline = self.clock() + spec.job_deadline_s
        failures = 0
        while True:
            try:
                statuses = self._request("job_status", self.sdk.job_status, run.cluster, [run.job_id],
                                         timeout=self.t.poll)
                failures = 0
                run.job_status = statuses.get(run.job_id, statuses.get(str(run.job_id)))
                if run.job_status is None or run.job_status.is_terminal():
                    run.job_terminal = True
                    self.echo(f"rtv gpu launch: job {run.job_id} is "
                              f"{getattr(run.job_status, 'value', 'gone from the queue')}")
                    return
            except Exception:  # noqa: BLE001 - a few failed polls are tolerated, not more
                failures += 1
                if failures >= self.t.poll_failures:
                    raise
            if self.clock() >= deadline:
                raise JobDeadline(f"job {run.job_id} not finished after {spec.job_deadline_s:g} s")
            self.sleep(self.t.poll_interval)

    def _fetch(self, spec: TaskSpec, run: _Run, out_dir: Path) -> None:
        start = self._timed(run, Phase.FETCH)
        cluster_dir = out_dir / run.cluster
        cluster_dir.mkdir(parents=True, exist_ok=True)
        log_path = cluster_dir / f"job-{run.job_id}.log"
        with open(log_path, "w") as log:
            bounded(self.sdk.tail_logs, run.cluster, run.job_id, False, output_stream=log,
                    timeout=self.t.logs, name="tail_logs")
        run.logs = str(log_path)
        evidence_dir = bounded(lambda: self.fetch_outputs(run.cluster, spec.evidence_dir, cluster_dir / "evidence",
                                                          timeout=self.t.outputs),
                               timeout=self.t.outputs, name="fetch_outputs")
        run.evidence = judge_outputs(evidence_dir)
        run.timings["fetch"] = self.clock() - start

    # --- teardown -------------------------------------------------------------------

    def _step(self, run: _Run, name: str, call: Callable[..., Any], *args: Any, timeout: float,
              **kwargs: Any) -> None:
        """One teardown request; its failure is recorded, never raised (the next step still runs)."""
        start = self.clock()
        try:
            self._request(name, call, *args, timeout=timeout, cancel_on_timeout=False, **kwargs)
            ok, detail = True, "done"
        except self.sdk.exceptions.ClusterDoesNotExist:
            ok, detail = True, "the cluster does not exist"
        except Exception as error:  # noqa: BLE001
            ok, detail = False, f"{type(error).__name__}: {error}"
        run.teardown.append({"step": name, "ok": ok, "detail": detail, "seconds": round(self.clock() - start, 3)})

    def _teardown(self, run: _Run) -> None:
        start = self._timed(run, Phase.TEARDOWN)
        self.echo(f"rtv gpu: tearing down {run.cluster}")
        if run.request is not None and not run.provisioned:
            self._step(run, "api_cancel", self.sdk.api_cancel, run.request, timeout=self.t.cancel)
        if run.job_id is not None and not run.job_terminal:
            self._step(run, "cancel", self.sdk.cancel, run.cluster, job_ids=[run.job_id], timeout=self.t.cancel)
        self._step(run, "down", self.sdk.down, run.cluster, timeout=self.t.down)
        self._prove_absence(run)
        run.timings["teardown"] = self.clock() - start
        state = "absent (confirmed)" if run.absence_confirmed else f"absence UNPROVEN (last seen: {run.last_seen})"
        self.echo(f"teardown: cluster {run.cluster} {state}")

    def _prove_absence(self, run: _Run) -> None:
        deadline = self.clock() + self.t.absence
        while True:
            try:
                records = self._request("status", self.sdk.status, [run.cluster],
                                        refresh=self.sdk.StatusRefreshMode.FORCE, timeout=self.t.poll)
                listed = [r for r in records if r.name == run.cluster]
                if not listed:
                    run.absence_confirmed = True
                    return
                run.last_seen = getattr(listed[0].status, "value", str(listed[0].status))
            except Exception as error:  # noqa: BLE001 - absence is proven only by a status answer
                run.last_seen = f"status failed: {type(error).__name__}: {error}"
            if self.clock() >= deadline:
                return
            self.sleep(self.t.absence_interval)

    # --- receipt --------------------------------------------------------------------

    def _receipt(self, run: _Run, spec: TaskSpec | None, out_dir: Path, *, command: str = "launch",
                 gpus: int | None = None, billed_s: float | None = None) -> Outcome:
        status = getattr(run.job_status, "value", run.job_status)
        evidence_passed = run.evidence is not None and run.evidence.passed
        kind = None if run.interruption is None else run.interruption["kind"]
        checks = Checks()
        checks.check("absence_confirmed", run.absence_confirmed, f"last seen: {run.last_seen}")
        checks.check("not_interrupted", run.interruption is None, f"interruption: {run.interruption}")
        if command == "launch":
            code = exit_code(absence_confirmed=run.absence_confirmed, interruption=kind, job_status=status,
                             evidence_passed=evidence_passed)
            mismatch = code == 3 and status == "SUCCEEDED" and kind is None
            word = "evidence mismatch" if mismatch else _WORDS[code]
            evidence = run.evidence
            checks.check("job_succeeded", status == "SUCCEEDED", f"job status {status}")
            checks.check("evidence_verified", evidence is not None and evidence.fetched
                         and evidence.records > 0 and evidence.verified == evidence.records,
                         "no evidence fetched" if evidence is None or not evidence.fetched
                         else f"{evidence.verified} of {evidence.records} records verified")
            checks.check("evidence_passed", evidence_passed, "every fetched record passed" if evidence_passed
                         else "a fetched record failed, or none was fetched")
        else:  # down: only absence and interruption count
            code = 6 if not run.absence_confirmed else (4 if kind else 0)
            word = "absent" if code == 0 else _WORDS[code]
        if billed_s is None:
            billed_s = 0.0 if run.submitted_at is None else self.clock() - run.submitted_at
        requested = spec.requested() if spec is not None else {"task": None, "cluster": run.cluster}
        path = write_receipt(
            out_dir, command=command, cluster=run.cluster, requested=requested, observed=run.observed(),
            checks=checks, outcome=word, exit_code=code, timings=run.timings,
            gpus=launched_gpus(run.handle) if gpus is None else gpus, billed_s=billed_s, handle=run.handle,
        )
        self.echo(f"rtv gpu {command}: {word} (exit {code}); receipt: {path}")
        return Outcome(code, word, path)

    # --- census ---------------------------------------------------------------------

    def census(self) -> list[Any]:
        """SkyPilot's records of the clusters this launcher names (``rtv-`` prefix or its label)."""
        records = self._request("status", self.sdk.status, None, timeout=self.t.poll)
        return [r for r in records if r.name.startswith("rtv-") or (r.labels or {}).get(LABEL) == r.name]

    # --- down -----------------------------------------------------------------------

    def down(self, cluster: str, *, out_dir: Path) -> Outcome:
        """Tear ``cluster`` down and prove it is gone (for a launcher that died); writes a receipt."""
        run = _Run(cluster=cluster)
        gpus, billed_s = 0, 0.0
        with signals_deferred(run.signals):
            try:
                records = self._request("status", self.sdk.status, [cluster], timeout=self.t.poll)
                for record in (r for r in records if r.name == cluster):
                    run.handle = record.handle
                    billed_s = max(0.0, time.time() - float(record.launched_at))
                    gpus = launched_gpus(run.handle)
            except Exception as error:  # noqa: BLE001 - teardown goes on without the census
                run.teardown.append({"step": "census", "ok": False, "detail": f"{type(error).__name__}: {error}"})
            self._teardown(run)
            if run.signals:
                run.interruption = {"kind": "signal", "phase": Phase.TEARDOWN.value,
                                    "detail": f"{len(run.signals)} signal(s) during teardown"}
            return self._receipt(run, None, Path(out_dir), command="down", gpus=gpus, billed_s=billed_s)


def launched_gpus(handle: Any) -> int:
    """GPUs a cluster handle says were launched (accelerators per node x nodes); 0 when nothing launched."""
    resources = getattr(handle, "launched_resources", None)
    per_node = sum((getattr(resources, "accelerators", None) or {}).values())
    return int(per_node * int(getattr(handle, "launched_nodes", 1) or 1))


def default_run_id() -> tuple[str, str]:
    """(run id, attempt): GitHub's when set, else a local stamp and 1."""
    return (os.environ.get("GITHUB_RUN_ID") or time.strftime("l%Y%m%d%H%M%S", time.gmtime()),
            os.environ.get("GITHUB_RUN_ATTEMPT") or "1")

