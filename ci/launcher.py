"""The GPU CI launcher: launch a task, gate on the remote job status, fetch evidence, always tear down, prove it.

It drives the SkyPilot Python SDK (``sky.launch``, ``sky.stream_and_get``,
``sky.job_status``, ``sky.get``, ``sky.tail_logs``, ``sky.api_cancel``,
``sky.down``, ``sky.status``, ``sky.api_status``), passed in as ``sdk`` (the
``sky`` module, or a fake with the same functions in tests), only through
calls a remote API server answers (a runner has none of the server's
files). Every call has its own timeout (:func:`ci.interrupts.bounded`).
Hand-written because SkyPilot has no launcher that gates on job status,
tears down on every path and records a receipt (the CLI's ``sky launch``
has exited 0 on a failed job).

The phases, in order: ``launch`` (submit the request; the task gets this
run's ``RTV_RUN_ID``, ``RTV_COMMIT`` and ``RTV_SOURCE_DIGEST``),
``provision`` (wait for it: cluster up, job submitted), ``job`` (poll the
job's status until terminal or the task's deadline), ``fetch`` (the job's
log through the API server, and the evidence frame in it: ``ci.outputs``,
``ci.frames``), cross-checked against this launch (``ci.outputs.Expectation``).
Then, in ``finally`` and with SIGINT/SIGTERM deferred, the teardown of
``ci.teardown``: ``down`` first, across users, retried, absence proven.
A submission that timed out counts as possibly launched (absence then also
needs the API server to hold no pending launch for the cluster); a launch
request the server interrupted (``RequestInterruptedError``, after a
restart) ends in the same teardown, which proves the cluster absent.
Autodown and the setup/run deadlines in the task file are the cluster's own
backstops (``ci.tasks``); ``down=True`` is not passed to ``sky.launch``
because it would remove the cluster before its log is read. The launcher
never starts or stops a SkyPilot API server itself.

NOTE [Exit codes] (docs/harness.md#exit-codes; :func:`exit_code` implements them)

1. Absence of the cluster after teardown unproven: 6, whatever else happened.
2. The run was interrupted: by SIGINT/SIGTERM 4, by a call timeout or the
   job's deadline 5, by any other error 3.
3. Otherwise the job's final status: CANCELLED 4; FAILED, FAILED_SETUP,
   FAILED_DRIVER or no job 3; SUCCEEDED 0, but only if the evidence it
   produced came back, verifies, is this run's and says passed
   (``ci.outputs``), else 3.
"""

from __future__ import annotations

import enum
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from validation.errors import SetupError
from validation.evidence import Checks, source_fingerprint

from .interrupts import CallTimeout, Interrupted, bounded, signals_deferred, signals_raise
from .outputs import Expectation, fetch_outputs, judge_outputs
from .receipts import commit, cost_cross_check, hourly_price, write_receipt
from .tasks import TaskSpec, parse_duration
from .teardown import RunState, Teardown, Timeouts

__all__ = [
    "Phase",
    "Timeouts",
    "Outcome",
    "Launcher",
    "cluster_name",
    "default_run_id",
    "exit_code",
    "launched_gpus",
    "LABEL",
]

LABEL = "rtv-ci-cluster"  # resources label carrying the cluster name, for a census by label


class Phase(str, enum.Enum):
    LAUNCH = "launch"
    PROVISION = "provision"
    JOB = "job"
    FETCH = "fetch"
    TEARDOWN = "teardown"


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


def exit_code(
    *, absence_confirmed: bool, interruption: str | None, job_status: str | None, evidence_passed: bool
) -> int:
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


def _interruption(error: BaseException, phase: Phase) -> dict[str, str]:
    if isinstance(error, Interrupted):
        kind = "signal"
    elif isinstance(error, (CallTimeout, JobDeadline)):
        kind = "timeout"
    else:
        kind = "error"
    return {"kind": kind, "phase": phase.value, "detail": f"{type(error).__name__}: {error}"}


def _signalled(run: RunState) -> None:
    if run.signals and run.interruption is None:
        run.interruption = {
            "kind": "signal",
            "phase": Phase.TEARDOWN.value,
            "detail": f"{len(run.signals)} signal(s) during teardown",
        }


class Launcher(Teardown):
    """Runs one task file on one cluster, tears clusters down, sweeps; each writes a receipt (``ci.receipts``)."""

    # --- launch ---------------------------------------------------------------------

    def launch(self, spec: TaskSpec, *, cluster: str, out_dir: Path) -> Outcome:
        """Launch ``spec`` on ``cluster``; evidence, logs and the receipt go under ``out_dir``."""
        out_dir = Path(out_dir)
        run = RunState(cluster=cluster, phase=Phase.LAUNCH, run_id=f"{cluster}-{secrets.token_hex(4)}")
        self.echo(f"rtv gpu launch: cluster {cluster}, run {run.run_id} (tear down by hand: rtv gpu down {cluster})")
        with signals_deferred(run.signals):  # outermost, so no signal falls between the body and teardown
            try:
                try:
                    with signals_raise():
                        want = self._expectation(spec, run)
                        self._launch_and_wait(spec, run)
                        self._fetch(run, out_dir, want)
                # every interruption ends in teardown and a receipt
                except (Exception, Interrupted) as error:  # noqa: BLE001
                    run.interruption, run.error = _interruption(error, run.phase), error
                    self.echo(f"rtv gpu launch: interrupted during {run.phase.value}: {run.interruption['detail']}")
            finally:
                run.phase = Phase.TEARDOWN
                self.tear_down(run)
                _signalled(run)
                outcome = self._receipt(run, spec, out_dir)
        self._refuse_without_credentials(run, outcome)
        return outcome

    def _refuse_without_credentials(self, run: RunState, outcome: Outcome) -> None:
        """SkyPilot refused for want of cloud credentials: a setup error (exit 2), unless absence is unproven (6 wins)."""
        errors = self.sdk.exceptions
        if outcome.exit_code == 6 or not isinstance(
            run.error, (errors.NoCloudAccessError, errors.CloudUserIdentityError)
        ):
            return
        raise SetupError(
            f"SkyPilot cannot use a cloud: {run.error} (nothing was launched; receipt {outcome.receipt})",
            fix="set up credentials for a cloud with H200s and check them with `sky check`, "
            "then run rtv gpu launch again",
        )

    def _expectation(self, spec: TaskSpec, run: RunState) -> Expectation:
        """What this run's evidence must say; the task gets the run id, commit and source digest it is tied to."""
        want = Expectation(
            run_id=str(run.run_id),
            commit=commit(),
            source_digest=source_fingerprint()["sha256"],
            submitted_at=self.wall(),
            expect=tuple(spec.expect),
            accelerators=tuple(spec.accelerators),
        )
        spec.task.update_envs(
            {"RTV_RUN_ID": want.run_id, "RTV_COMMIT": want.commit, "RTV_SOURCE_DIGEST": want.source_digest}
        )
        return want

    def _timed(self, run: RunState, phase: Phase) -> float:
        run.phase = phase
        return self.clock()

    def _launch_and_wait(self, spec: TaskSpec, run: RunState) -> None:
        task = spec.task
        alternatives = task.resources  # one entry, or a set (any_of) / list (ordered) of failover alternatives
        task.set_resources(
            type(alternatives)(res.copy(labels={**(res.labels or {}), LABEL: run.cluster}) for res in alternatives)
        )
        start = self._timed(run, Phase.LAUNCH)
        run.possibly_launched = True  # until the server hands back a request id, a launch may exist without it
        run.request = bounded(
            self.sdk.launch, task, cluster_name=run.cluster, retry_until_up=False, timeout=self.t.request, name="launch"
        )
        run.possibly_launched = False
        run.timings["launch"] = self.clock() - start
        start = self._timed(run, Phase.PROVISION)
        job_id, handle = bounded(
            self.sdk.stream_and_get, run.request, timeout=self.t.provision, name="stream_and_get(launch)"
        )
        run.provisioned, run.job_id, run.handle = True, job_id, handle
        run.timings["provision"] = self.clock() - start
        if job_id is None:
            raise RuntimeError(f"the launch returned no job id for {run.cluster}; nothing ran")
        start = self._timed(run, Phase.JOB)
        try:
            self._wait_for_job(spec, run)
        finally:
            run.timings["job"] = self.clock() - start

    def _wait_for_job(self, spec: TaskSpec, run: RunState) -> None:
        deadline = self.clock() + spec.job_deadline_s
        failures = 0
        while True:
            try:
                statuses = self.request(
                    "job_status", self.sdk.job_status, run.cluster, [run.job_id], timeout=self.t.poll
                )
                failures = 0
                run.job_status = statuses.get(run.job_id, statuses.get(str(run.job_id)))
                if run.job_status is None or run.job_status.is_terminal():
                    run.job_terminal = True
                    self.echo(
                        f"rtv gpu launch: job {run.job_id} is {getattr(run.job_status, 'value', 'gone from the queue')}"
                    )
                    return
            except Exception:  # a few failed polls are tolerated, not more
                failures += 1
                if failures >= self.t.poll_failures:
                    raise
            if self.clock() >= deadline:
                raise JobDeadline(f"job {run.job_id} not finished after {spec.job_deadline_s:g} s")
            self.sleep(self.t.poll_interval)

    def _fetch(self, run: RunState, out_dir: Path, want: Expectation) -> None:
        start = self._timed(run, Phase.FETCH)
        log, folder, made, why_not = fetch_outputs(
            self.sdk,
            run.cluster,
            int(run.job_id),
            out_dir / run.cluster,
            lambda call, *args, **kwargs: bounded(call, *args, timeout=self.t.logs, name="tail_logs", **kwargs),
        )
        run.logs = str(log)
        run.evidence = judge_outputs(folder, made, want, why_not=why_not)
        run.timings["fetch"] = self.clock() - start

    # --- receipt --------------------------------------------------------------------

    def _receipt(self, run: RunState, spec: TaskSpec | None, out_dir: Path, *, command: str = "launch") -> Outcome:
        status = getattr(run.job_status, "value", run.job_status)
        evidence_passed = run.evidence is not None and run.evidence.passed
        kind = None if run.interruption is None else run.interruption["kind"]
        checks = Checks()
        checks.check("absence_confirmed", run.absence_confirmed, f"last seen: {run.last_seen}")
        checks.check("not_interrupted", run.interruption is None, f"interruption: {run.interruption}")
        if command == "launch":
            code = exit_code(
                absence_confirmed=run.absence_confirmed,
                interruption=kind,
                job_status=status,
                evidence_passed=evidence_passed,
            )
            mismatch = code == 3 and status == "SUCCEEDED" and kind is None
            word = "evidence mismatch" if mismatch else _WORDS[code]
            evidence = run.evidence
            checks.check("job_succeeded", status == "SUCCEEDED", f"job status {status}")
            checks.check(
                "evidence_verified",
                evidence is not None
                and evidence.fetched
                and not evidence.problems
                and evidence.records > 0
                and evidence.verified == evidence.records,
                "no evidence fetched" if evidence is None else evidence.summary(),
            )
            checks.check(
                "evidence_passed",
                evidence_passed,
                "every fetched record is this run's and passed"
                if evidence_passed
                else "a record failed, is missing, stale or foreign, or none came back",
            )
        else:  # down, sweep: only absence and interruption count
            code = 6 if not run.absence_confirmed else (4 if kind else 0)
            word = "absent" if code == 0 else _WORDS[code]
        requested = spec.requested() if spec is not None else {"task": None, "cluster": run.cluster}
        path = write_receipt(
            out_dir,
            command=command,
            cluster=run.cluster,
            requested=requested,
            observed=run.observed(),
            checks=checks,
            outcome=word,
            exit_code=code,
            timings=run.timings,
            gpus=launched_gpus(run.handle),
            billed_s=run.billed_s(self.wall()),
            handle=run.handle,
            reported=self._cost_report(run, command),
        )
        self.echo(f"rtv gpu {command}: {word} (exit {code}); receipt: {path}")
        return Outcome(code, word, path)

    def _cost_report(self, run: RunState, command: str) -> dict[str, Any] | None:
        """SkyPilot's cost report cross-checked against this receipt (``ci.receipts``), once absence is proven.

        Not asked after a signal: within GitHub's cancel window the receipt
        itself comes first (one more request could outlast the window)."""
        if not run.absence_confirmed:
            return None
        if (run.interruption or {}).get("kind") == "signal" or run.signals:
            return {"checked": False, "reason": "a signal: the receipt was written before any further request"}
        try:
            rows = self.request("cost_report", self.sdk.cost_report, days=1, timeout=self.t.poll)
        except Exception as error:  # noqa: BLE001 - a report that cannot be had leaves the receipt unchecked, says why
            return {"checked": False, "reason": f"sky.cost_report failed: {type(error).__name__}: {error}"}
        price = hourly_price(run.handle)[0]
        check = cost_cross_check(rows, run.cluster, until=run.absent_at or self.wall(), price=price)
        if check["checked"] and not check["agrees"]:
            self.echo(
                f"rtv gpu {command}: SkyPilot's cost report disagrees with the receipt of {run.cluster}: "
                f"interval closed at {check['closed_at']} (absence proven at {run.absent_at}), "
                f"hourly {check.get('hourly')} against the catalog's {price}"
            )
        return check

    # --- census, down, sweep --------------------------------------------------------

    def census(self) -> list[Any]:
        """SkyPilot's records, across all users, of the clusters this launcher names (``rtv-`` prefix or its label)."""
        return [r for r in self.records(None) if r.name.startswith("rtv-") or (r.labels or {}).get(LABEL) == r.name]

    def down(self, cluster: str, *, out_dir: Path, command: str = "down") -> Outcome:
        """Tear ``cluster`` down, whoever launched it, and prove it is gone; writes a receipt."""
        run = RunState(cluster=cluster, phase=Phase.TEARDOWN)
        with signals_deferred(run.signals):
            self.tear_down(run)
            _signalled(run)
            return self._receipt(run, None, Path(out_dir), command=command)

    def sweep(self, *, out_dir: Path, prefix: str = "rtv-", older_than: str | None = None) -> list[Outcome]:
        """``down`` every cluster of any user named ``prefix...`` and launched at least ``older_than`` ago."""
        age = 0.0 if older_than is None else parse_duration(older_than)
        now = self.wall()
        names = [
            r.name for r in self.records(None) if r.name.startswith(prefix) and now - float(r.launched_at or now) >= age
        ]
        self.echo(
            f"rtv gpu sweep: {len(names)} cluster(s) named {prefix}* older than {older_than or '0s'}: "
            f"{', '.join(names) or 'none'}"
        )
        return [self.down(name, out_dir=out_dir, command="sweep") for name in names]


def launched_gpus(handle: Any) -> int:
    """GPUs a cluster handle says were launched (accelerators per node x nodes); 0 when nothing launched."""
    resources = getattr(handle, "launched_resources", None)
    per_node = sum((getattr(resources, "accelerators", None) or {}).values())
    return int(per_node * int(getattr(handle, "launched_nodes", 1) or 1))


def default_run_id() -> tuple[str, str]:
    """(run id, attempt): GitHub's when set, else a local stamp and 1."""
    return (
        os.environ.get("GITHUB_RUN_ID") or time.strftime("l%Y%m%d%H%M%S", time.gmtime()),
        os.environ.get("GITHUB_RUN_ATTEMPT") or "1",
    )
