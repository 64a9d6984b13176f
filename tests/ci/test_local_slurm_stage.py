"""Real launches through ``rtv gpu launch|down|sweep`` on the local one-node Slurm cluster, in a runner's world.

Runs only inside ``.ci/local_slurm_stage`` (marker ``slurm``; the stage has run
``ci/local_slurm/setup.sh`` and exported its environment). The topology is a
team's: the API server is a service with its own HOME; every ``rtv gpu``
process is a client with another HOME and another SkyPilot user
(``SKYPILOT_USER_ID``), reaching the server only through
``SKYPILOT_API_SERVER_ENDPOINT`` (``common.sh``, ``client_env``): runner A
launches, runner B downs and sweeps, and this test process is a third
identity (``auditor``) whose ``sky.status(all_users=True)`` proves absence.
Each case reads the launcher's teardown line and receipt (``ci.receipts``),
then proves three absences: no Slurm job (``squeue`` empty), no SkyPilot
cluster record, no process of ours (the launcher has exited; the job user
runs nothing but the API server's idle ssh login sessions, which are
reported, not counted), and prints ``teardown: cluster NAME absent
(confirmed by auditor); receipt: PATH``. Chaos cases run when
``RTV_SLURM_CHAOS=1``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ci.local_slurm.sky_sdk import cluster_records

# Only inside .ci/local_slurm_stage (which sets RTV_LOCAL_SLURM=1 after setup.sh); skipped everywhere else.
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        os.environ.get("RTV_LOCAL_SLURM") != "1",
        reason="slurm: runs only in .ci/local_slurm_stage (root, apt, RTV_LOCAL_SLURM=1)",
    ),
]

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "ci" / "local_slurm"
OUT = Path(os.environ.get("RTV_SLURM_OUT", "rtv-out/local_slurm")).resolve()
CHAOS = pytest.mark.skipif(os.environ.get("RTV_SLURM_CHAOS") != "1", reason="chaos cases run with RTV_SLURM_CHAOS=1")
PASSED, FAILED, CANCELLED = 0, 3, 4  # rtv gpu's exit codes (docs/harness.md#exit-codes)
AUDITOR = os.environ.get("SKYPILOT_USER_ID", "auditor")  # this process: the third identity


def identity(name: str) -> dict[str, str]:
    """The environment of a client that is SkyPilot user ``name``, with a HOME of its own (``client_env``)."""
    root = Path(os.environ["RTV_SKY_CLIENTS"]) / name
    env = {
        **os.environ,
        "HOME": str(root / "home"),
        "SKY_RUNTIME_DIR": str(root / "runtime"),
        "SKYPILOT_USER_ID": name,
        "PYTHONUNBUFFERED": "1",
    }  # a SIGKILLed launcher's last lines still count
    for folder in ("HOME", "SKY_RUNTIME_DIR"):
        Path(env[folder]).mkdir(parents=True, exist_ok=True)
    return env


def rtv_gpu(*args: str) -> list[str]:
    """The project's launcher command line: ``rtv gpu ARGS``."""
    return [sys.executable, "-m", "canaries.cli", "gpu", *args]


def as_runner_b(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``rtv gpu ARGS`` as runner B (another runner, which launched nothing)."""
    return subprocess.run(
        rtv_gpu(*args), capture_output=True, text=True, cwd=REPO, env=identity("runnerb"), timeout=timeout, check=False
    )


class Launch:
    """One ``rtv gpu launch`` by runner A on its own cluster; output in OUT/<case>.log, receipt under OUT/<case>/."""

    def __init__(self, case: str, task: str | Path, *envs: str) -> None:
        self.cluster = f"rtv-{case}-{os.getpid()}"
        self.out = OUT / case
        self.log = OUT / f"{case}.log"
        self.out.mkdir(parents=True, exist_ok=True)
        env_args = [arg for env in (f"RTV_JOB_VENV={os.environ['RTV_JOB_VENV']}", *envs) for arg in ("--env", env)]
        command = rtv_gpu("launch", str(TASKS / task), "--cluster", self.cluster, "--out", str(self.out), *env_args)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=identity("runnera")
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> None:
        assert self.proc.poll() is None, f"launcher exited {self.proc.returncode} too early:\n{self.tail()}"

    def wait_until(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        """Block until ``ready()``; fail if the launcher exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            self.alive()
            assert time.monotonic() < deadline, f"not {what} within {timeout_s:.0f} s:\n{self.tail()}"
            time.sleep(1)

    def job_status(self) -> str:
        """The latest job's status as runner A sees it (a probe process of its identity)."""
        result = subprocess.run(
            [sys.executable, "-m", "ci.local_slurm.sky_sdk", "job-status", self.cluster],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=identity("runnera"),
            timeout=120,
            check=False,
        )
        return result.stdout.strip()

    def wait_for_running_job(self) -> None:
        self.wait_until("job submitted", lambda: "Job submitted" in self.output(), timeout_s=300)
        self.wait_until("job RUNNING", lambda: self.job_status() == "RUNNING", timeout_s=120)

    def term_then_kill(self, grace_s: float = 10) -> int | None:
        """SIGTERM, then SIGKILL ``grace_s`` later if it still runs (a GitHub cancel); the exit code, or None if killed."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            return None

    def finish(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def tail(self) -> str:
        return "\n".join(self.output().splitlines()[-40:])

    def receipt(self) -> tuple[Path, dict]:
        return confirmed(self.output(), self.cluster, "launch")


def confirmed(output: str, cluster: str, command: str) -> tuple[Path, dict]:
    """Check ``rtv gpu COMMAND`` printed a confirmed teardown and a receipt; (receipt path, its measurements)."""
    from validation.evidence import verify

    assert f"teardown: cluster {cluster} absent (confirmed)" in output.splitlines(), output[-3000:]
    found = re.search(rf"^rtv gpu {command}: .* \(exit \d+\); receipt: (\S+)$", output, re.M)
    assert found, f"no receipt line:\n{output[-3000:]}"
    path = Path(found.group(1))
    path = path if path.is_absolute() else REPO / path
    measurements = verify(path)["measurements"]
    assert measurements["cluster"] == cluster and measurements["absence"] == "confirmed", measurements
    # The real server's cost report (every user's clusters, downed ones too) closed the cluster's interval by the
    # proven absence, and the receipt bills no fewer seconds than it counted.
    # After a signal the receipt comes first and the report is not asked for (the cancel window).
    reported = measurements["cost"]["sky_cost_report"]
    if (measurements["observed"].get("interruption") or {}).get("kind") == "signal":
        assert not reported["checked"] and "signal" in reported["reason"], reported
    else:
        assert reported["checked"] and reported["agrees"] and reported["reported_s"] > 0, reported
        assert measurements["billed_s"] >= reported["reported_s"], measurements
    return path, measurements


def sweep_as_runner_b(cluster: str, out: Path) -> Path:
    """The backstop for a launcher that had no time: runner B sweeps the cluster; the receipt.

    When the launcher's own ``down`` (sent first, before it was killed) already removed it, the sweep finds
    nothing, and runner B's ``rtv gpu down NAME`` (the workflow's always-run step) proves it absent.
    """
    swept = as_runner_b("sweep", "--prefix", cluster, "--out", str(out))
    assert swept.returncode == 0, swept.stdout + swept.stderr
    if f"teardown: cluster {cluster} absent (confirmed)" in swept.stdout.splitlines():
        return confirmed(swept.stdout, cluster, "sweep")[0]
    assert "0 cluster(s)" in swept.stdout, swept.stdout
    down = as_runner_b("down", cluster, "--out", str(out))
    assert down.returncode == 0, down.stdout + down.stderr
    return confirmed(down.stdout, cluster, "down")[0]


def slurm_jobs() -> list[str]:
    result = subprocess.run(["squeue", "-h", "-o", "%i %j %u %T"], capture_output=True, text=True, check=True)
    return result.stdout.split("\n")[:-1]


def job_user_processes() -> tuple[list[str], list[str]]:
    """(processes of the job user, its idle sshd login sessions): ``ps`` lines."""
    result = subprocess.run(
        ["ps", "-o", "pid=,comm=,args=", "-u", os.environ["RTV_SLURM_USER"]],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line.strip() for line in result.stdout.splitlines()]
    sessions = [line for line in lines if line.split()[1] == "sshd"]
    return [line for line in lines if line not in sessions], sessions


def prove_nothing_left(
    case: str, launches: list[Launch], receipt: Path | list[Path], observed: dict | None = None
) -> None:
    """Wait (up to 60 s) for no Slurm job, no cluster record (as the auditor) and no process of ours; record it."""
    from validation.evidence import evidence_path, make_record, write_once

    receipts = receipt if isinstance(receipt, list) else [receipt]
    deadline = time.monotonic() + 60
    while True:
        jobs, records = slurm_jobs(), cluster_records()
        processes, sessions = job_user_processes()
        launchers_exited = all(launch.proc.poll() is not None for launch in launches)
        if (not (jobs or records or processes) and launchers_exited) or time.monotonic() > deadline:
            break
        time.sleep(1)
    observed = (observed or {}) | {
        "receipts": [str(r) for r in receipts],
        "squeue": jobs,
        "sky_status_all_users": records,
        "confirmed_by": AUDITOR,
        "job_user_processes": processes,
        "idle_login_sessions": sessions,
        "launcher_exits": [launch.proc.returncode for launch in launches],
    }
    record = make_record(
        f"local-slurm-{case}",
        config={"clusters": [launch.cluster for launch in launches], "case": case},
        checks={
            "no_slurm_job": not jobs,
            "no_cluster_record": not records,
            "no_process_of_ours": not processes and launchers_exited,
        },
        measurements=observed,
    )
    path = write_once(evidence_path(OUT, f"local-slurm-{case}"), record)
    assert record["passed"], f"{case} left something behind: {observed}\n{launches[0].tail()}"
    for launch, receipt_path in zip(launches, receipts, strict=True):
        print(
            f"teardown: cluster {launch.cluster} absent (confirmed by {AUDITOR}); receipt: {receipt_path}", flush=True
        )
    print(f"{case}: squeue empty, no cluster of any user, no process of ours; record: {path}", flush=True)


def fetched_records(launch: Launch) -> list[Path]:
    return sorted((launch.out / launch.cluster / "evidence" / "records").rglob("memory-cpu-*.json"))


def test_happy_path_then_stale_evidence_is_refused(tmp_path: Path) -> None:
    """The gate through the remote path (exit 0); then that run's record, planted as a later run's, is refused."""
    from validation.evidence import verify

    launch = Launch("happy", "gate-cpu.sky.yaml")
    code = launch.finish(timeout_s=400)
    assert code == PASSED, launch.tail()
    path, receipt = launch.receipt()
    observed = receipt["observed"]
    assert (receipt["outcome"], receipt["exit_code"], observed["job_status"]) == ("passed", PASSED, "SUCCEEDED")
    assert observed["evidence"]["passed"] and observed["evidence"]["records"] == 1, observed["evidence"]
    # What came back (through the job's log, never ssh) is the canary's own record, this run's, verified here too.
    (fetched,) = fetched_records(launch)
    record = verify(fetched)
    assert record["passed"] and record["environment"]["run_id"] == observed["run_id"]
    assert "rtv canary memory: PASSED" in Path(observed["logs"]).read_text()
    assert not list(Path(identity("runnera")["HOME"]).glob(".sky/generated/ssh/*")), "the launcher used ssh"
    prove_nothing_left("happy", [launch], path)

    # An earlier run's record in the workdir, passed off as this run's evidence.
    workdir = tmp_path / "workdir"
    (workdir / "stale").mkdir(parents=True)
    (workdir / "stale" / fetched.name).write_bytes(fetched.read_bytes())
    task = tmp_path / "stale-cpu.sky.yaml"
    text = (TASKS / "gate-cpu.sky.yaml").read_text()
    work = '"$RTV_JOB_VENV/bin/rtv" canary memory --preset cpu --out "$RTV_OUT"'
    assert work in text
    text = text.replace(work, 'bash -c \'mkdir -p "$RTV_OUT" && cp stale/*.json "$RTV_OUT"/\'')
    task.write_text(text.replace("name: rtv-gate-cpu", f"name: rtv-stale-cpu\n\nworkdir: {workdir}"))
    stale = Launch("stale", task)
    assert stale.finish(timeout_s=400) == FAILED, stale.tail()
    path, receipt = stale.receipt()
    evidence = receipt["observed"]["evidence"]
    assert receipt["outcome"] == "evidence mismatch" and receipt["observed"]["job_status"] == "SUCCEEDED", receipt
    problems = " ".join(evidence["problems"])
    assert "foreign or stale" in problems and "before this launch was submitted" in problems, evidence
    prove_nothing_left("stale-evidence", [stale], path, {"problems": evidence["problems"]})


@CHAOS
def test_a_hung_setup_ends_at_its_deadline_and_the_cluster_goes() -> None:
    launch = Launch("setup-hangs", "hold-cpu.sky.yaml", "RTV_SETUP_HANG_S=900")  # the setup limit is 20 s
    started = time.monotonic()
    assert launch.finish(timeout_s=400) == FAILED, launch.tail()
    assert time.monotonic() - started < 400
    path, receipt = launch.receipt()
    assert receipt["observed"]["job_status"] == "FAILED_SETUP", receipt
    prove_nothing_left("setup-hangs", [launch], path)


@CHAOS
def test_lost_runners_clusters_are_found_and_removed_by_another_identity() -> None:
    """Runner A's launchers die (SIGKILL) mid-job; runner B sees both, downs one by name and sweeps the other."""
    lost = [Launch("lost-down", "hold-cpu.sky.yaml"), Launch("lost-sweep", "hold-cpu.sky.yaml")]
    for launch in lost:
        launch.wait_for_running_job()
    for launch in lost:
        launch.proc.send_signal(signal.SIGKILL)
        launch.finish(timeout_s=30)
    assert sorted(cluster_records()) == sorted(launch.cluster for launch in lost), "nothing to clean up: case is void"
    status = as_runner_b("status")
    assert all(launch.cluster in status.stdout for launch in lost), status.stdout + status.stderr
    down = as_runner_b("down", lost[0].cluster, "--out", str(lost[0].out))
    assert down.returncode == 0, down.stdout + down.stderr
    path, receipt = confirmed(down.stdout, lost[0].cluster, "down")
    # B's census saw what A launched: the handle, its launch time, real seconds billed.
    assert receipt["observed"]["launched"] and receipt["observed"]["launched_at"] and receipt["billed_s"] > 0, receipt
    assert any(s["step"] == "down" and s["ok"] for s in receipt["observed"]["teardown"])
    swept = sweep_as_runner_b(lost[1].cluster, lost[1].out)
    assert json.loads(swept.read_text())["measurements"]["observed"]["launched"], swept
    prove_nothing_left("lost-runners", lost, [path, swept])


@CHAOS
@pytest.mark.parametrize("when", ["provisioning", "job"])
def test_sigterm_then_sigkill_and_the_cluster_is_gone_by_the_end(when: str) -> None:
    launch = Launch(f"cancel-{when}", "hold-cpu.sky.yaml")
    if when == "provisioning":  # the sbatch "instance" exists; no job was submitted yet
        launch.wait_until("provisioning", lambda: bool(slurm_jobs()), timeout_s=180)
        assert "Job submitted" not in launch.output(), "the job started before the cancel; the case tests nothing"
    else:
        launch.wait_for_running_job()
    code = launch.term_then_kill(grace_s=10)
    downs = [line for line in launch.output().splitlines() if "tearing down" in line]
    assert downs, f"no teardown began within GitHub's cancel window:\n{launch.tail()}"
    if code is None or "absent (confirmed)" not in launch.output():  # no time: the sweeper is the backstop
        path = sweep_as_runner_b(launch.cluster, launch.out)
    else:
        assert code == CANCELLED, launch.tail()
        path, receipt = launch.receipt()
        assert receipt["observed"]["interruption"]["kind"] == "signal", receipt
    prove_nothing_left(f"cancel-{when}", [launch], path, {"launcher_exit": code})


@CHAOS
def test_the_api_server_restarted_while_a_launch_is_in_flight() -> None:
    launch = Launch("server-restart", "hold-cpu.sky.yaml")
    launch.wait_until("provisioning", lambda: bool(slurm_jobs()), timeout_s=180)
    restart = subprocess.run(
        [
            "bash",
            "-c",
            (
                f"source {os.environ['RTV_COMMON_SH']} && server_env && "
                f'exec "{sys.executable}" -m ci.local_slurm.sky_sdk restart-server --pid-file "$API_PID"'
            ),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert restart.returncode == 0, restart.stdout + restart.stderr
    try:  # the launch ends in teardown (interrupted request), or it survived the restart and its job holds
        code: int | None = launch.finish(timeout_s=180)
    except subprocess.TimeoutExpired:
        code = launch.term_then_kill(grace_s=10)
    if code is not None and "absent (confirmed)" in launch.output():
        path, _ = launch.receipt()
    else:
        path = sweep_as_runner_b(launch.cluster, launch.out)
    prove_nothing_left("server-restart", [launch], path, {"launcher_exit": code, "launcher_tail": launch.tail()})
