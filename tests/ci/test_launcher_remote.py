"""The launcher in the world it runs in: a remote API server, many runners, lost and cancelled work.

Each test is one way the kind world (one machine, one HOME, one SkyPilot
user) hid a defect: evidence fetched through files only the server has,
queries blind to other runners' clusters, evidence that is not this run's,
backstops with holes, a judge stricter than ``rtv run``, receipts that bill
the wrong span. All run the real launcher against ``fake_sky`` (its server
holds users, lazy requests, cancels and restarts).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from validation.evidence import verify

from .test_launcher import FakeClock, launch, receipt_of


def launcher(fake, clock: FakeClock | None = None):
    from ci.launcher import Launcher, Timeouts

    clock = clock or FakeClock()
    fake.server.wall = clock
    return Launcher(
        fake,
        timeouts=Timeouts(request=10, provision=10, poll=10, logs=10, outputs=10, cancel=10, down=10, absence=60),
        clock=clock,
        wall=clock,
        sleep=clock.sleep,
        echo=lambda line: None,
    )


def lost_cluster(fake, gate, name: str = "rtv-gate-9-1"):
    """Runner A launched ``name`` and died: the cluster is up, no launcher is left."""
    fake.launch(gate.task, cluster_name=name)
    fake.server.run_pending()
    return name


# --- evidence through the remote path -------------------------------------------------------------


def test_evidence_comes_back_through_the_log_api_without_any_ssh_config(sky_fake, gate, tmp_path, sky_home):
    fake = sky_fake.FakeSky()
    outcome = launch(fake, gate, tmp_path)
    assert outcome.exit_code == 0, receipt_of(outcome)["measurements"]["observed"]["evidence"]
    assert not list(Path(sky_home["HOME"]).glob(".sky/generated/ssh/*")), "the client has no server files"
    records = sorted((tmp_path / "rtv-gate-42-1" / "evidence" / "records").glob("*.json"))
    assert sorted(p.name.split("-")[0] for p in records) == sorted(gate.expect)
    assert all(verify(p)["passed"] for p in records)
    assert "fetch_outputs" not in fake.calls and "tail_logs" in fake.calls


def test_a_log_without_a_whole_frame_is_evidence_not_fetched(sky_fake, gate, tmp_path):
    outcome = launch(sky_fake.FakeSky(evidence="no_frame"), gate, tmp_path)
    evidence = receipt_of(outcome)["measurements"]["observed"]["evidence"]
    assert outcome.exit_code == 3 and not evidence["fetched"] and "no RTV-EVIDENCE frame" in evidence["summary"]


# --- every identity sees every CI cluster ---------------------------------------------------------


def test_another_runner_sees_downs_and_bills_a_lost_runners_cluster(sky_fake, sky_sandbox, gate, tmp_path):
    from .conftest import H200_TYPES

    runner_a = sky_fake.FakeSky(user="runnera")
    name = lost_cluster(runner_a, gate)
    runner_b = runner_a.as_user("runnerb")
    clock = FakeClock()
    clock.now = runner_a.clusters[name].launched_at + 600  # B arrives ten minutes after the launch
    b = launcher(runner_b, clock)
    assert [r.name for r in b.census()] == [name], "rtv gpu status of runner B lists A's cluster"
    outcome = b.down(name, out_dir=tmp_path)
    m = receipt_of(outcome)["measurements"]
    assert outcome.exit_code == 0 and name not in runner_a.clusters
    assert m["observed"]["launched"] and m["billed_s"] >= 600
    gpus, hourly = H200_TYPES["gpu_2x_h200"]
    assert m["gpu_minutes"] == pytest.approx(gpus * m["billed_s"] / 60, abs=1e-3) and m["cost"]["hourly"] == hourly


def test_a_server_that_refuses_a_cross_user_down_leaves_absence_unproven(sky_fake, gate, tmp_path):
    runner_a = sky_fake.FakeSky(user="runnera")
    name = lost_cluster(runner_a, gate)
    runner_a.server.refuse_foreign_down = True
    outcome = launcher(runner_a.as_user("runnerb")).down(name, out_dir=tmp_path)
    assert outcome.exit_code == 6, "absence 'confirmed' by a query that could not see the cluster"
    assert name in runner_a.clusters


def test_every_status_query_asks_across_all_users(sky_fake, gate, tmp_path, monkeypatch):
    fake = sky_fake.FakeSky()
    seen = []
    status = fake.status
    monkeypatch.setattr(fake, "status", lambda *a, **k: (seen.append(k.get("all_users")), status(*a, **k))[1])
    launch(fake, gate, tmp_path)
    launcher(fake).census()
    assert seen and all(seen), seen


# --- evidence tied to the run ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("evidence", "reason"),
    [
        ("stale", "foreign or stale"),
        ("stale", "before this launch was submitted"),
        ("foreign", "derivative: 2 records, expected 1"),
        ("missing", "smoke: 0 record(s), expected 1"),
        ("cpu", "ran on no CUDA device, expected H200"),
        ("misreported", "the work exited 1"),
    ],
)
def test_evidence_that_is_not_this_runs_is_exit_3_with_the_reason(sky_fake, gate, tmp_path, evidence, reason):
    outcome = launch(sky_fake.FakeSky(evidence=evidence), gate, tmp_path)
    record = receipt_of(outcome)
    problems = record["measurements"]["observed"]["evidence"]["problems"]
    assert outcome.exit_code == 3 and outcome.outcome == "evidence mismatch"
    assert any(reason in p for p in problems), problems


def test_the_job_is_given_this_runs_id_commit_and_source_digest(sky_fake, gate, tmp_path):
    from validation.evidence import source_fingerprint

    fake = sky_fake.FakeSky()
    record = receipt_of(launch(fake, gate, tmp_path))
    envs = dict(fake.tasks[0].envs)
    assert envs["RTV_RUN_ID"] == record["measurements"]["observed"]["run_id"]
    assert envs["RTV_RUN_ID"].startswith("rtv-gate-42-1-")
    assert (
        envs["RTV_SOURCE_DIGEST"] == source_fingerprint()["sha256"]
        and envs["RTV_COMMIT"] == record["measurements"]["commit"]
    )


# --- backstops ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["sigint", "sigterm"])
@pytest.mark.parametrize("call", ["stream_and_get", "job_status"])
def test_on_a_signal_the_first_request_sent_is_down(sky_fake, gate, tmp_path, call, fault):
    fake = sky_fake.FakeSky()
    fake.inject(call, fault, always=call == "job_status")
    outcome = launch(fake, gate, tmp_path)
    after = fake.calls[fake.calls.index(call) + 1 :]
    requests = [c for c in after if c not in ("get", "stream_and_get", "job_status")]
    assert requests[0] == "down", after
    assert outcome.exit_code == 4 and "cancel" not in fake.calls
    # Within the cancel window the receipt comes first: no cost report is asked for after a signal.
    reported = receipt_of(outcome)["measurements"]["cost"]["sky_cost_report"]
    assert "cost_report" not in fake.calls and not reported["checked"], reported


def test_a_submission_that_timed_out_is_treated_as_possibly_launched(sky_fake, gate, tmp_path):
    fake = sky_fake.FakeSky()
    fake.inject("launch", "lost_reply")  # the server accepted the launch; the reply never came
    fake.server.on_api_status = fake.server.run_pending  # ... and it lands while the launcher looks for it
    outcome = launch(fake, gate, tmp_path)
    record = receipt_of(outcome)
    observed = record["measurements"]["observed"]
    assert observed["possibly_launched"] and outcome.exit_code == 5, observed
    assert "rtv-gate-42-1" not in fake.clusters and observed["absence_confirmed"]
    assert fake.calls.index("api_status") < len(fake.calls) - fake.calls[::-1].index("status") - 1


def test_a_lost_launch_still_pending_is_cancelled_by_the_id_the_server_lists(sky_fake, gate, tmp_path):
    fake = sky_fake.FakeSky()
    fake.inject("launch", "lost_reply")
    outcome = launch(fake, gate, tmp_path)
    steps = receipt_of(outcome)["measurements"]["observed"]["teardown"]
    assert any(s["step"] == "api_cancel" and s["ok"] and "lost launch" in s["detail"] for s in steps), steps
    fake.server.run_pending()
    assert "rtv-gate-42-1" not in fake.clusters, "the cancelled launch must never land"


def test_a_launch_request_the_server_is_running_is_waited_for_not_taken_for_absence(sky_fake, gate, tmp_path):
    fake = sky_fake.FakeSky()
    fake.inject("launch", "lost_reply")
    polls: list[str] = []

    def server_at_work() -> None:
        """The server runs the lost launch: RUNNING for two polls (a cancel cannot stop it), then its cluster is up."""
        polls.append("api_status")
        for entry in fake.server.requests.values():
            if "launch" in entry["name"] and entry["state"] in ("PENDING", "RUNNING"):
                entry["state"] = "RUNNING" if len(polls) < 3 else "PENDING"
        if len(polls) >= 3:
            fake.server.run_pending()

    fake.server.on_api_status = server_at_work
    outcome = launch(fake, gate, tmp_path)
    fake.server.on_api_status = None
    for entry in fake.server.requests.values():  # whatever the server was still running finishes
        entry["state"] = "PENDING" if entry["state"] == "RUNNING" else entry["state"]
    fake.server.run_pending()
    observed = receipt_of(outcome)["measurements"]["observed"]
    assert len(polls) >= 3, "absence declared while the launch request was running"
    assert observed["absence_confirmed"] and "rtv-gate-42-1" not in fake.clusters, observed


def test_a_failed_down_is_retried_with_backoff(sky_fake, gate, tmp_path):
    fake = sky_fake.FakeSky()
    fake.inject("down", "connection")
    clock = FakeClock()
    outcome = launch(fake, gate, tmp_path, clock)
    downs = [s for s in receipt_of(outcome)["measurements"]["observed"]["teardown"] if s["step"] == "down"]
    assert outcome.exit_code == 0 and [s["ok"] for s in downs] == [False, True], downs
    assert "ApiServerConnectionError" in downs[0]["detail"]
    first, second = [i for i, call in enumerate(fake.calls) if call == "down"][:2]
    assert "status" not in fake.calls[first:second], "retried at once, not left to the absence poll"


def test_the_task_puts_setup_and_run_under_their_own_deadlines(gate):
    assert gate.setup_limit_s == 20 * 60 and gate.time_limit_s == 40 * 60
    assert gate.job_deadline_s == gate.setup_limit_s + gate.time_limit_s + 120
    assert '"$RTV_SETUP_LIMIT"' in gate.setup and gate.run.strip().splitlines()[1] == 'rm -rf "$RTV_OUT"'


def test_sweep_downs_every_matching_cluster_of_any_user_with_a_receipt_each(sky_fake, gate, tmp_path):
    runner_a = sky_fake.FakeSky(user="runnera")
    clock = FakeClock()
    runner_a.server.wall = clock
    old = [
        lost_cluster(runner_a, gate, "rtv-gate-1-1"),
        lost_cluster(runner_a.as_user("runnerc"), gate, "rtv-gate-2-1"),
    ]
    clock.now += 3 * 3600
    young = lost_cluster(runner_a, gate, "rtv-gate-3-1")
    other = lost_cluster(runner_a, gate, "someone-elses")
    clock.now += 60
    outcomes = launcher(runner_a.as_user("sweeper"), clock).sweep(out_dir=tmp_path, older_than="2h")
    assert sorted(verify(o.receipt)["measurements"]["cluster"] for o in outcomes) == sorted(old)
    assert all(o.exit_code == 0 for o in outcomes) and sorted(runner_a.clusters) == sorted([young, other])
    assert [o.exit_code for o in launcher(runner_a.as_user("sweeper"), clock).sweep(out_dir=tmp_path)] == [0]
    assert sorted(runner_a.clusters) == [other]


def test_sweep_leaves_a_cluster_whose_launch_time_is_unknown(sky_fake, gate, tmp_path):
    """Its age is unknown, not old: another runner may have launched it a moment ago."""
    runner_a = sky_fake.FakeSky(user="runnera")
    clock = FakeClock()
    runner_a.server.wall = clock
    name = lost_cluster(runner_a, gate)
    runner_a.clusters[name] = runner_a.clusters[name].model_copy(update={"launched_at": None})  # no launch time
    clock.now += 3 * 3600
    assert launcher(runner_a.as_user("sweeper"), clock).sweep(out_dir=tmp_path, older_than="2h") == []
    assert name in runner_a.clusters


# --- the judge applies rtv run's rule -------------------------------------------------------------


def test_a_failed_benchmark_is_shown_not_enforced_as_in_rtv_run(sky_fake, gate, tmp_path):
    outcome = launch(sky_fake.FakeSky(evidence="shown"), gate, tmp_path)
    evidence = receipt_of(outcome)["measurements"]["observed"]["evidence"]
    assert outcome.exit_code == 0 and evidence["shown"] and not evidence["failed"], evidence
    failed = launch(sky_fake.FakeSky(evidence="failed"), gate, tmp_path / "enforced")  # smoke: enforced
    assert failed.exit_code == 3


# --- receipts -------------------------------------------------------------------------------------


def test_billing_runs_from_the_clusters_launch_to_proven_absence(sky_fake, gate, tmp_path):
    from .test_launcher import _MinuteClock

    m = receipt_of(launch(sky_fake.FakeSky(), gate, tmp_path, _MinuteClock()))["measurements"]
    observed = m["observed"]
    assert m["launcher_s"] == pytest.approx(observed["absent_at"] - observed["launched_at"], abs=1)
    assert m["billed_s"] >= m["launcher_s"]


def test_a_launch_that_provisioned_then_failed_bills_what_ran(sky_fake, gate, tmp_path):
    fake = sky_fake.FakeSky()
    fake.server.fail_after_provision = True  # the workdir sync failed: no handle came back, a VM existed
    from .test_launcher import _MinuteClock

    m = receipt_of(launch(fake, gate, tmp_path, _MinuteClock()))["measurements"]
    assert m["exit_code"] == 3 and m["observed"]["launched"] and m["gpu_minutes"] > 0, m


# --- the fake is faithful, and the launcher's calls fit the real SDK ------------------------------


def test_the_fake_server_behaves_as_skypilots_does(sky_fake, sky_sandbox, gate):
    errors = sky_sandbox.exceptions
    a = sky_fake.FakeSky(user="runnera")
    b = a.as_user("runnerb")
    request = a.launch(gate.task, cluster_name="c1")
    assert not a.clusters, "a cluster appears only once provisioning starts"
    a.get(request)
    assert [r.name for r in b.get(b.status(["c1"]))] == [] and [
        r.name for r in b.get(b.status(["c1"], all_users=True))
    ] == ["c1"]
    pending = a.launch(gate.task, cluster_name="c2")
    a.get(a.api_cancel(pending))
    with pytest.raises(errors.RequestCancelled):
        a.get(pending)
    interrupted = a.launch(gate.task, cluster_name="c3")
    a.server.restart()
    with pytest.raises(errors.RequestInterruptedError):
        a.stream_and_get(interrupted)
    assert sorted(a.clusters) == ["c1"]
    a.clusters["c1"] = a.clusters["c1"].model_copy(update={"status": sky_sandbox.ClusterStatus.INIT})
    with pytest.raises(errors.ClusterNotUpError):
        a.tail_logs("c1", 1, False, output_stream=None)
    a.inject("status", "connection")
    with pytest.raises(errors.ApiServerConnectionError):
        a.status()


def test_an_api_server_restart_during_provisioning_ends_in_proven_absence(sky_fake, gate, tmp_path):
    fake = sky_fake.FakeSky()
    fake.inject("stream_and_get", "restart")
    outcome = launch(fake, gate, tmp_path)
    observed = receipt_of(outcome)["measurements"]["observed"]
    assert outcome.exit_code == 3 and "RequestInterruptedError" in observed["interruption"]["detail"]
    assert observed["absence_confirmed"] and not fake.clusters


def test_the_launchers_sdk_calls_bind_to_the_installed_skypilot(sky_fake, sky_sandbox, gate, tmp_path):
    """Every call the launcher makes (arguments as made) binds to the real function's signature, and every answer
    the fake gives passes through SkyPilot's own response types."""
    from sky.schemas.api.responses import StatusResponse
    from sky.server.requests.payloads import RequestPayload

    fake = sky_fake.FakeSky()
    made: list[tuple[str, tuple, dict]] = []

    class Recording:
        def __getattr__(self, name):
            value = getattr(fake, name)
            if name not in sky_fake.REPLACES:
                return value
            return lambda *args, **kwargs: (made.append((name, args, kwargs)), value(*args, **kwargs))[1]

    fake.inject("launch", "lost_reply")  # reach api_status and api_cancel too
    from ci.launcher import Launcher, Timeouts

    clock = FakeClock()
    Launcher(
        Recording(),
        timeouts=Timeouts(request=0.3, absence=60),
        clock=clock,
        wall=clock,
        sleep=clock.sleep,
        echo=lambda line: None,
    ).launch(gate, cluster="rtv-gate-1-1", out_dir=tmp_path)
    fake.release()
    Launcher(Recording(), clock=clock, sleep=clock.sleep, echo=lambda line: None).launch(
        gate, cluster="rtv-gate-2-1", out_dir=tmp_path
    )
    assert {name for name, _, _ in made} >= {
        "launch",
        "stream_and_get",
        "get",
        "job_status",
        "tail_logs",
        "down",
        "status",
        "api_status",
        "api_cancel",
        "cost_report",
    }
    for name, args, kwargs in made:
        inspect.signature(getattr(sky_sandbox, name)).bind(*args, **kwargs)  # raises TypeError if it does not fit
    records = fake.get(fake.status(None, all_users=True)) + [fake._record("x", sky_sandbox.ClusterStatus.UP)]
    for record in records:
        StatusResponse.model_validate(record.model_dump())
    for payload in fake.api_status(None, True):
        RequestPayload(**payload.model_dump())


def test_the_receipt_is_cross_checked_against_skypilots_cost_report(sky_fake, gate, tmp_path):
    from .conftest import H200_TYPES
    from .test_launcher import _MinuteClock

    fake = sky_fake.FakeSky()
    m = receipt_of(launch(fake, gate, tmp_path, _MinuteClock()))["measurements"]
    (row,) = fake.server.history  # the server's own account: opened as provisioning starts, closed by down
    ((start, end),) = row["usage_intervals"]
    reported = m["cost"]["sky_cost_report"]
    assert reported["checked"] and reported["agrees"] and reported["reported_s"] == end - start > 0, reported
    assert reported["hourly"] == pytest.approx(H200_TYPES["gpu_2x_h200"][1])
    assert m["billed_s"] == max(m["launcher_s"], end - start) and m["billed_s"] >= end - start


def test_a_census_that_first_saw_the_cluster_late_bills_skypilots_count(sky_fake, gate, tmp_path):
    runner_a = sky_fake.FakeSky(user="runnera")
    name = lost_cluster(runner_a, gate)
    started = runner_a.server.history[0]["usage_intervals"][0][0]
    runner_a.clusters[name] = runner_a.clusters[name].model_copy(update={"launched_at": None})  # no launch time
    clock = FakeClock()
    clock.now = started + 600
    m = receipt_of(launcher(runner_a.as_user("runnerb"), clock).down(name, out_dir=tmp_path))["measurements"]
    assert m["observed"]["first_seen"] >= started + 600 and m["billed_from"] == "sky.cost_report"
    assert m["billed_s"] >= 600 > m["launcher_s"] and m["cost"]["sky_cost_report"]["agrees"]


def test_a_down_that_skypilot_has_not_counted_closed_is_a_disagreement_said_aloud(sky_fake, gate, tmp_path):
    fake = sky_fake.FakeSky()
    fake.server.history_closes_on_down = False  # a server whose history lags the teardown
    lines: list[str] = []
    from ci.launcher import Launcher

    clock = FakeClock()
    fake.server.wall = clock
    outcome = Launcher(fake, clock=clock, wall=clock, sleep=clock.sleep, echo=lines.append).launch(
        gate, cluster="rtv-gate-3-1", out_dir=tmp_path
    )
    reported = receipt_of(outcome)["measurements"]["cost"]["sky_cost_report"]
    assert not reported["agrees"] and reported["closed_at"] is None
    assert any("SkyPilot's cost report disagrees" in line for line in lines), lines


def test_a_cost_report_that_fails_leaves_the_receipt_unchecked_with_why(sky_fake, gate, tmp_path):
    fake = sky_fake.FakeSky()
    fake.inject("cost_report", "connection")
    outcome = launch(fake, gate, tmp_path)
    reported = receipt_of(outcome)["measurements"]["cost"]["sky_cost_report"]
    assert outcome.exit_code == 0 and not reported["checked"] and "ApiServerConnectionError" in reported["reason"]
