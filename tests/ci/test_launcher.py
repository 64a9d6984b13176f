"""The launcher against a fake SkyPilot: the cancellation chaos matrix, the job-status gate and its cross-check.

Every case runs the real launcher (real threads, real signals delivered to
this process, real write-once receipts) against ``fake_sky.FakeSky``; only
the clock that drives deadlines, poll sleeps and the server's launch times
is fake, so a case takes milliseconds (a call timeout takes its 0.3 s for
real). The remote-server world (other runners, lost submissions, restarts,
tied evidence) is in ``test_launcher_remote``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from validation.evidence import verify

from .conftest import H200_TYPES

PHASES = {  # the SDK call a phase is interrupted in -> the phase's name in the receipt
    "launch": "launch",  # before launch: the launch request itself
    "stream_and_get": "provision",
    "job_status": "job",
    "tail_logs": "fetch",
}
SIGNALLED = {"error": 3, "timeout": 5, "sigint": 4, "sigterm": 4}


class FakeClock:
    """Drives deadlines and poll sleeps without waiting."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.001)


class _MinuteClock(FakeClock):
    """A clock each reading of which is a minute after the last."""

    def __call__(self) -> float:
        self.now += 60
        return self.now


def launch(fake, spec, out: Path, clock: FakeClock | None = None):
    from ci.launcher import Launcher, Timeouts

    clock = clock or FakeClock()
    # Per-call limits are real seconds (``bounded``); the clock fakes only deadlines and sleeps. Short only
    # where a call is made to hang, so a loaded machine's slow but answering fake never times out.
    hangs = any(fault in ("timeout", "slow_result", "lost_reply") for fault, _ in fake.faults.values())
    call = 0.3 if hangs else 10.0
    timeouts = Timeouts(
        request=call,
        provision=call,
        poll=call,
        poll_interval=15,
        logs=call,
        outputs=call,
        cancel=call,
        down=call,
        absence=60,
        absence_interval=10,
    )
    fake.server.wall = clock
    launcher = Launcher(fake, timeouts=timeouts, clock=clock, wall=clock, sleep=clock.sleep, echo=lambda line: None)
    try:
        return launcher.launch(spec, cluster="rtv-gate-42-1", out_dir=out)
    finally:
        fake.release()


def receipt_of(outcome) -> dict:
    record = verify(outcome.receipt)
    assert record["kind"] == "gpu-receipt"
    assert record["measurements"]["exit_code"] == outcome.exit_code
    return record


def assert_torn_down(fake, record: dict, *, absent: bool) -> None:
    calls = fake.calls
    assert "down" in calls, calls
    assert "status" in calls[calls.index("down") :], "absence was not polled after down"
    assert record["checks"]["absence_confirmed"] is absent
    assert record["measurements"]["absence"] == ("confirmed" if absent else "unproven")
    assert ("rtv-gate-42-1" in fake.clusters) is not absent


def _chaos_matrix() -> list[object]:
    """Every phase x fault pair. A Latin diagonal of it (each phase once, each fault once) runs by default; the other
    pairs are slow (each hung call waits its timeout for real)."""
    faults = sorted(SIGNALLED)
    diagonal = {(call, faults[i % len(faults)]) for i, call in enumerate(sorted(PHASES))}
    return [
        pytest.param(call, fault, marks=() if (call, fault) in diagonal else pytest.mark.slow)
        for call in sorted(PHASES)
        for fault in faults
    ]


@pytest.mark.parametrize(("call", "fault"), _chaos_matrix())
def test_interrupted_at_every_phase_tears_down_and_says_why(sky_fake, gate, tmp_path, call, fault):
    fake = sky_fake.FakeSky()
    fake.inject(call, fault, always=call == "job_status")  # one failed poll is tolerated; a hung one is not
    outcome = launch(fake, gate, tmp_path)
    record = receipt_of(outcome)
    assert_torn_down(fake, record, absent=True)
    assert outcome.exit_code == SIGNALLED[fault], record["measurements"]["observed"]
    interruption = record["measurements"]["observed"]["interruption"]
    assert interruption["phase"] == PHASES[call]
    assert interruption["kind"] == {"sigint": "signal", "sigterm": "signal"}.get(fault, fault)
    assert record["passed"] is False
    calls = fake.calls
    if PHASES[call] == "provision" and fault != "error":  # the launch request in flight is cancelled after down
        assert "api_cancel" in calls and calls.index("down") < calls.index("api_cancel")
    assert "cancel" not in calls, "down alone ends the job"


@pytest.mark.parametrize("fault", ["error", pytest.param("timeout", marks=pytest.mark.slow)])  # a hung down waits
def test_a_failed_teardown_leaves_absence_unproven_exit_6(sky_fake, gate, tmp_path, fault):
    fake = sky_fake.FakeSky()
    fake.inject("down", fault, always=True)
    outcome = launch(fake, gate, tmp_path)
    record = receipt_of(outcome)
    assert outcome.exit_code == 6 and outcome.outcome == "absence unproven"
    assert_torn_down(fake, record, absent=False)
    down = [s for s in record["measurements"]["observed"]["teardown"] if s["step"] == "down"]
    assert down and down[0]["ok"] is False


@pytest.mark.parametrize("fault", ["sigint", "sigterm"])
def test_a_signal_during_teardown_does_not_stop_it(sky_fake, gate, tmp_path, fault):
    fake = sky_fake.FakeSky()
    fake.inject("down", fault)
    outcome = launch(fake, gate, tmp_path)
    record = receipt_of(outcome)
    assert_torn_down(fake, record, absent=True)
    assert outcome.exit_code == 4
    assert record["measurements"]["observed"]["interruption"]["phase"] == "teardown"


def test_six_wins_over_an_interruption(sky_fake, gate, tmp_path):
    fake = sky_fake.FakeSky()
    fake.inject("job_status", "sigterm")
    fake.inject("down", "error", always=True)
    outcome = launch(fake, gate, tmp_path)
    assert outcome.exit_code == 6
    assert_torn_down(fake, receipt_of(outcome), absent=False)


def test_a_succeeded_job_with_passing_evidence_passes_and_is_priced(sky_fake, sky_sandbox, gate, tmp_path):
    fake = sky_fake.FakeSky()
    outcome = launch(fake, gate, tmp_path)
    record = receipt_of(outcome)
    assert outcome.exit_code == 0 and record["passed"] is True
    assert_torn_down(fake, record, absent=True)
    m = record["measurements"]
    assert m["observed"]["job_status"] == sky_sandbox.JobStatus.SUCCEEDED.value
    assert m["requested"]["accelerators"] == {"H200": 2}
    assert m["cluster"] == "rtv-gate-42-1" and len(m["commit"]) == 40
    gpus, hourly = H200_TYPES["gpu_2x_h200"]
    assert m["billed_s"] > 0
    assert m["gpu_minutes"] == pytest.approx(gpus * m["billed_s"] / 60, rel=1e-3)
    assert m["cost"]["estimate"] == pytest.approx(hourly * m["billed_s"] / 3600, rel=1e-3)
    assert Path(m["observed"]["logs"]).read_text()
    launched = fake.tasks[0]
    assert next(iter(launched.resources)).labels["rtv-ci-cluster"] == "rtv-gate-42-1"


@pytest.mark.parametrize("evidence", ["failed", "tampered", "missing"])
def test_succeeded_without_passing_evidence_is_exit_3_with_both_facts(sky_fake, gate, tmp_path, evidence):
    fake = sky_fake.FakeSky(evidence=evidence)
    outcome = launch(fake, gate, tmp_path)
    record = receipt_of(outcome)
    assert outcome.exit_code == 3 and outcome.outcome == "evidence mismatch"
    assert record["checks"]["job_succeeded"] is True
    assert record["checks"]["evidence_passed"] is False
    assert record["measurements"]["observed"]["evidence"]["summary"]


@pytest.mark.parametrize(
    ("final", "code"), [("FAILED", 3), ("FAILED_SETUP", 3), ("FAILED_DRIVER", 3), ("CANCELLED", 4)]
)
def test_the_gate_is_the_job_status_not_the_log(sky_fake, sky_sandbox, gate, tmp_path, final, code):
    status = sky_sandbox.JobStatus[final]
    fake = sky_fake.FakeSky(job_statuses=(sky_sandbox.JobStatus.PENDING, status))
    outcome = launch(fake, gate, tmp_path)  # the fake's log always says SUCCEEDED
    assert outcome.exit_code == code
    assert receipt_of(outcome)["measurements"]["observed"]["job_status"] == final


def test_a_job_past_its_deadline_is_downed_and_times_out(sky_fake, sky_sandbox, gate, tmp_path):
    fake = sky_fake.FakeSky(job_statuses=(sky_sandbox.JobStatus.RUNNING,))
    clock = FakeClock()
    outcome = launch(fake, gate, tmp_path, clock)
    record = receipt_of(outcome)
    assert outcome.exit_code == 5
    assert "down" in fake.calls and "cancel" not in fake.calls
    assert record["measurements"]["billed_s"] >= gate.job_deadline_s


def test_down_alone_tears_down_and_proves_absence(sky_fake, gate, tmp_path):
    from ci.launcher import Launcher

    fake = sky_fake.FakeSky()
    fake.launch(gate.task, cluster_name="rtv-gate-7-1")  # a launcher that died after submitting
    fake.server.run_pending()
    clock = FakeClock()
    outcome = Launcher(fake, clock=clock, sleep=clock.sleep, echo=lambda line: None).down(
        "rtv-gate-7-1", out_dir=tmp_path
    )
    record = receipt_of(outcome)
    assert outcome.exit_code == 0 and "rtv-gate-7-1" not in fake.clusters
    assert record["config"]["command"] == "down" and record["checks"]["absence_confirmed"] is True

    stuck = sky_fake.FakeSky()
    stuck.launch(gate.task, cluster_name="rtv-gate-7-2")
    stuck.server.run_pending()
    stuck.inject("down", "error", always=True)
    outcome = Launcher(stuck, clock=clock, sleep=clock.sleep, echo=lambda line: None).down(
        "rtv-gate-7-2", out_dir=tmp_path
    )
    assert outcome.exit_code == 6 and receipt_of(outcome)["measurements"]["absence"] == "unproven"


def test_a_teardown_that_times_out_is_left_running_not_cancelled(sky_fake, gate, tmp_path):
    """Cancelling a slow ``down`` on the API server would stop the teardown itself."""
    fake = sky_fake.FakeSky()
    fake.inject("down", "slow_result")  # the down request is accepted; its result does not come in time
    record = receipt_of(launch(fake, gate, tmp_path))
    calls = fake.calls
    assert "api_cancel" not in calls[calls.index("down") :], calls
    assert next(s["ok"] for s in record["measurements"]["observed"]["teardown"] if s["step"] == "down") is False


def test_a_launch_that_never_came_up_bills_nothing(sky_fake, gate, tmp_path):
    """Billing starts at the cluster's own launch; a request that never provisioned bills 0, not its waits."""
    fake = sky_fake.FakeSky()
    fake.inject("stream_and_get", "error")
    m = receipt_of(launch(fake, gate, tmp_path, clock=_MinuteClock()))["measurements"]
    assert m["billed_s"] == 0 and m["gpu_minutes"] == 0
    assert m["requested"]["accelerators"] == {"H200": 2}


@pytest.mark.parametrize("error", ["NoCloudAccessError", "CloudUserIdentityError"])
def test_six_wins_over_missing_credentials(sky_fake, sky_sandbox, gate, tmp_path, monkeypatch, error):
    """Missing credentials alone are a setup error (exit 2); with absence unproven, 6 wins (NOTE [Exit codes] Rule 1)."""
    fake = sky_fake.FakeSky()

    def refuse(*args, **kwargs):  # the launch request provisioned, then the cloud refused it
        fake.calls.append("stream_and_get")
        fake.server.run_pending()
        raise getattr(sky_sandbox.exceptions, error)("Cloud access is not set up. Run: `sky check`")

    monkeypatch.setattr(fake, "stream_and_get", refuse)
    fake.inject("down", "error", always=True)
    outcome = launch(fake, gate, tmp_path)  # returns, rather than raising the credentials SetupError
    record = receipt_of(outcome)
    assert outcome.exit_code == 6 and outcome.outcome == "absence unproven"
    assert_torn_down(fake, record, absent=False)
    assert "Cloud access is not set up" in record["measurements"]["observed"]["interruption"]["detail"]
