"""A job's outputs: its log and evidence fetched through the API server, and the cross-check of what came back.

:func:`fetch_outputs` asks the SDK for the job's log (``sky.tail_logs``, which
a remote API server streams to any client: no ssh config or server file is
needed, see ``ci.frames`` for why) and unpacks the evidence frame the job
printed at its end (``python -m ci.frames emit``).

:func:`judge_outputs` is the launcher's cross-check of a job SkyPilot reports
SUCCEEDED (SkyPilot has reported failed jobs as succeeded). Records are read
as the report reads them (``reports.records.load_records``, so the gate and
the page agree). Against the :class:`Expectation` of this launch, every
record must verify, carry this run's id (``environment.run_id``), the
launched source digest and commit (a job without git says ``unknown``: the
digest is then the tie), be created after the launch was submitted and ran
on the requested accelerator kind (CUDA's device name; none for a CPU task);
the manifest must be this run's and list exactly these records; and the
records must be exactly the expected canaries, as many of each as ``RTV_EXPECT`` lists them,
named as ``rtv run`` names them (``<canary>-<preset>-<stamp>-<pid>.json``,
``smoke-...``). A missing, stale or foreign record is a problem (exit 3, the
reason in the receipt). A record that verifies but says failed is judged by
``rtv run``'s own rule, reached as ``ci`` reaches ``canaries``, through the
command line: the manifest carries the work's exit status, which is 0
exactly when every enforced verdict passed (``canaries.suite``: a failed
benchmark is shown, not enforced). So with status 0 a failed record is
``shown``; with any other status, or none, it fails (and a non-zero status
under a SUCCEEDED job is a problem of its own: SkyPilot misreported it).
A record of a canary that raised (``reports.kinds.RAISED_KIND``, written by
``rtv run`` in its name) fails whatever the status: a crash is no verdict to
show, even of a canary that is not enforced (its record would be missing
otherwise, a problem).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from reports.kinds import RAISED_KIND
from reports.records import LoadedRecord, load_records

from .frames import collect

__all__ = ["EvidenceVerdict", "Expectation", "fetch_outputs", "judge_outputs"]


@dataclass(frozen=True, kw_only=True)
class Expectation:
    """What this launch's evidence must say: run id, source, submission time (epoch s), canaries, accelerators."""

    run_id: str
    commit: str
    source_digest: str
    submitted_at: float
    expect: tuple[str, ...]
    accelerators: tuple[str, ...] = ()  # accelerator kinds asked for (e.g. "H200"); empty: a CPU task


@dataclass(frozen=True, kw_only=True)
class EvidenceVerdict:
    """What the fetched evidence says: ``records`` found, how many ``verified``, and the ``problems``."""

    fetched: bool
    records: int
    verified: int
    failed: list[str] = field(default_factory=list)  # enforced records that verify but say passed: false
    shown: list[str] = field(default_factory=list)  # shown-not-enforced records that say failed (not a failure)
    problems: list[str] = field(default_factory=list)  # missing, stale, foreign or unverifiable records

    @property
    def passed(self) -> bool:
        return (
            self.fetched
            and self.records > 0
            and self.verified == self.records
            and not self.failed
            and not self.problems
        )

    def summary(self) -> str:
        if not self.fetched:
            return "evidence was not fetched" + (f": {self.problems[0]}" if self.problems else "")
        if self.problems:
            return f"{len(self.problems)} problem(s) with the evidence: {self.problems[0]}"
        if not self.records:
            return "no evidence record came back"
        if self.failed:
            return f"{len(self.failed)} of {self.records} records say failed: {', '.join(self.failed)}"
        return f"{self.records} records verify, are this run's and say passed" + (
            f" ({len(self.shown)} shown failed, not enforced)" if self.shown else ""
        )

    def to_json(self) -> dict:
        return {
            "fetched": self.fetched,
            "records": self.records,
            "verified": self.verified,
            "failed": list(self.failed),
            "shown": list(self.shown),
            "problems": list(self.problems),
            "passed": self.passed,
            "summary": self.summary(),
        }


def fetch_outputs(
    sdk: Any, cluster: str, job_id: int, cluster_dir: Path, bounded: Callable[..., Any]
) -> tuple[Path, Path | None, dict | None, str | None]:
    """The job's log (``cluster_dir/job-<id>.log``) and its evidence frame unpacked under ``cluster_dir/evidence``.

    Returns (log path, records folder or None, manifest or None, why there is no frame or None).
    ``bounded(call, *args, **kwargs)`` applies the caller's timeout.
    """
    cluster_dir.mkdir(parents=True, exist_ok=True)
    log_path = cluster_dir / f"job-{job_id}.log"
    with open(log_path, "w") as log:
        bounded(sdk.tail_logs, cluster, job_id, False, output_stream=log)
    try:
        made = collect(log_path.read_text(errors="replace"), cluster_dir / "evidence")
    except Exception as error:  # noqa: BLE001 - FrameError or a payload that is no tar: the reason is the verdict
        return log_path, None, None, f"{type(error).__name__}: {error}"
    return log_path, cluster_dir / "evidence" / "records", made, None


def _canary(record: LoadedRecord, expect: tuple[str, ...]) -> str | None:
    """The expected canary a record is named after (the longest matching name), or None."""
    names = [n for n in expect if record.path.name.startswith(f"{n}-")]
    return max(names, key=len) if names else None


def _record_problems(r: LoadedRecord, want: Expectation) -> list[str]:
    """Why one verified record is not this run's (empty when it is)."""
    env, source = r.record.get("environment", {}), r.record.get("source", {})
    created = datetime.fromisoformat(r.record["created"]).timestamp()
    cuda = env.get("cuda") or ""
    problems = [
        f"{r.name}: run id {env.get('run_id')!r}, expected {want.run_id!r} (foreign or stale)"
        if env.get("run_id") != want.run_id
        else "",
        f"{r.name}: created {r.record['created']}, before this launch was submitted (stale)"
        if created < want.submitted_at
        else "",
        f"{r.name}: source digest {str(source.get('sha256'))[:12]}, expected {want.source_digest[:12]}"
        if source.get("sha256") != want.source_digest
        else "",
        f"{r.name}: commit {source.get('git_commit')}, expected {want.commit}"
        if source.get("git_commit") not in (want.commit, "unknown")
        else "",
        f"{r.name}: ran on {cuda or 'no CUDA device'}, expected {', '.join(want.accelerators) or 'a CPU task'}"
        if (not all(kind.lower() in cuda.lower() for kind in want.accelerators) or (cuda and not want.accelerators))
        else "",
    ]
    return [p for p in problems if p]


def judge_outputs(
    folder: Path | None, made: dict | None = None, want: Expectation | None = None, *, why_not: str | None = None
) -> EvidenceVerdict:
    """Cross-check the records under ``folder`` against ``made`` (the job's manifest) and ``want``.

    ``folder=None`` means nothing was fetched (``why_not`` says why). Without
    ``want`` only integrity and verdicts are judged (``rtv gpu local``'s reading).
    """
    if folder is None or not Path(folder).is_dir():
        return EvidenceVerdict(fetched=False, records=0, verified=0, problems=[why_not] if why_not else [])
    records = load_records(Path(folder))
    problems = [f"{r.name}: {r.integrity}" for r in records if r.status == "invalid"]
    valid = [r for r in records if r.status != "invalid"]
    failed, shown = [], []
    if want is not None:
        problems += _run_problems(records, valid, made or {}, want)
    shown_by_run = want is not None and (made or {}).get("status") == 0  # rtv run passed: a failed record is shown
    for r in (r for r in valid if r.status == "failed"):
        raised = r.kind == RAISED_KIND  # a crash is never shown, only failed (module docstring)
        (shown if shown_by_run and not raised else failed).append(f"{r.name} ({'raised' if raised else r.status})")
    return EvidenceVerdict(
        fetched=True, records=len(records), verified=len(valid), failed=failed, shown=shown, problems=problems
    )


def _run_problems(records: list[LoadedRecord], valid: list[LoadedRecord], made: dict, want: Expectation) -> list[str]:
    """Problems tying the records to this run: manifest, expected set, each record's own fields."""
    problems = []
    if made.get("run_id") != want.run_id:
        problems.append(f"manifest: run id {made.get('run_id')!r}, expected {want.run_id!r} (foreign or stale)")
    if made.get("status") != 0:
        problems.append(f"manifest: the work exited {made.get('status')}, expected 0 (the job was not a success)")
    if list(made.get("expect", [])) != list(want.expect):
        problems.append(f"manifest: expected records {made.get('expect')}, the launcher asked for {list(want.expect)}")
    listed = {entry.get("digest") for entry in made.get("records", [])}
    problems += [f"{r.name}: not in the job's manifest" for r in valid if r.record.get("digest") not in listed]
    names = [_canary(r, want.expect) for r in records]
    problems += [f"{r.name}: no expected canary has this name (foreign)" for r, n in zip(records, names) if n is None]
    for name in sorted(set(want.expect)):
        found, wanted = names.count(name), want.expect.count(name)
        if found < wanted:
            problems.append(f"{name}: {found} record(s), expected {wanted} (missing: the canary raised or never ran)")
        elif found > wanted:
            problems.append(f"{name}: {found} records, expected {wanted} (stale or foreign extras)")
    for r in valid:
        problems += _record_problems(r, want)
    return problems
