"""Real SkyPilot launches on the local one-node Slurm cluster, and proof nothing is left.

Runs only inside ``.ci/local_slurm_stage`` (marker ``slurm``; the stage has run
``ci/local_slurm/setup.sh`` and exported its environment: private HOME, API
port, SLURM_CONF). Each case drives the launcher as a separate process, as CI
does, then proves three absences: no Slurm job (``squeue`` empty), no
SkyPilot cluster record (``sky.status``), no process of ours (the launcher
has exited; the job user runs nothing but the API server's idle ssh login
sessions, which are reported, not counted). Each case writes a record of what
it observed next to the launcher's receipt. Chaos cases (and the negative
control: a failing job must fail the gate, exit 3, and still be torn down)
run when ``RTV_SLURM_CHAOS=1``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ci.local_slurm.sky_sdk import EXIT_CODES, cluster_records

# Only inside .ci/local_slurm_stage (which sets RTV_LOCAL_SLURM=1 after setup.sh); skipped everywhere else.
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(os.environ.get("RTV_LOCAL_SLURM") != "1",
                       reason="slurm: runs only in .ci/local_slurm_stage (root, apt, RTV_LOCAL_SLURM=1)"),
]

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "ci" / "local_slurm"
OUT = Path(os.environ.get("RTV_SLURM_OUT", "rtv-out/local_slurm"))
CHAOS = pytest.mark.skipif(os.environ.get("RTV_SLURM_CHAOS") != "1", reason="chaos cases run with RTV_SLURM_CHAOS=1")


def launcher(*args: str) -> list[str]:
    """The launcher's command line; the one line to change when ``rtv gpu launch|down`` land."""
    return [sys.executable, "-m", "ci.local_slurm.sky_sdk", *args]


class Launch:
    """One launcher process, its output in a log file under OUT."""

    def __init__(self, case: str, task: str, *envs: str) -> None:
        self.cluster = f"rtv-{case}-{os.getpid()}"
        self.log = OUT / f"{case}.log"
        OUT.mkdir(parents=True, exist_ok=True)
        env_args = [arg for env in (f"RTV_JOB_VENV={os.environ['RTV_JOB_VENV']}", *envs) for arg in ("--env", env)]
        command = launcher("launch", str(TASKS / task), "--cluster", self.cluster, "--receipts", str(OUT), *env_args)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> None:
        """Block until ``pattern`` (a regex) shows in the output; fail if the launcher exits first."""
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.output()):
            assert self.proc.poll() is None, f"launcher exited {self.proc.returncode} before {pattern!r}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout_s:.0f} s:\n{self.tail()}"
            time.sleep(0.5)

    def finish(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def tail(self) -> str:
        return "\n".join(self.output().splitlines()[-40:])

    def receipt(self) -> Path:
        found = re.search(r"^teardown: cluster \S+ absent \(confirmed\); receipt: (\S+)$", self.output(), re.M)
        assert found, f"no confirmed teardown line:\n{self.tail()}"
        print(found.group(0), flush=True)
        return Path(found.group(1))


def slurm_jobs() -> list[str]:
    result = subprocess.run(["squeue", "-h", "-o", "%i %j %u %T"], capture_output=True, text=True, check=True)
    return result.stdout.split("\n")[:-1]


def job_user_processes() -> tuple[list[str], list[str]]:
    """(processes of the job user, its idle sshd login sessions): ``ps`` lines."""
    result = subprocess.run(["ps", "-o", "pid=,comm=,args=", "-u", os.environ["RTV_SLURM_USER"]],
                            capture_output=True, text=True)
    lines = [line.strip() for line in result.stdout.splitlines()]
    sessions = [line for line in lines if line.split()[1] == "sshd"]
    return [line for line in lines if line not in sessions], sessions


def prove_nothing_left(case: str, launch: Launch, observed: dict) -> None:
    """Wait (up to 60 s) for no Slurm job, no cluster record and no process of ours; record what was seen."""
    from validation.evidence import evidence_path, make_record, write_once

    deadline = time.monotonic() + 60
    while True:
        jobs, records = slurm_jobs(), cluster_records()
        processes, sessions = job_user_processes()
        launcher_exited = launch.proc.poll() is not None
        if not (jobs or records or processes) and launcher_exited or time.monotonic() > deadline:
            break
        time.sleep(1)
    observed |= {"squeue": jobs, "sky_status": records, "job_user_processes": processes,
                 "idle_login_sessions": sessions, "launcher_exit": launch.proc.returncode}
    record = make_record(f"local-slurm-{case}", config={"cluster": launch.cluster, "case": case},
                         checks={"no_slurm_job": not jobs, "no_cluster_record": not records,
                                 "no_process_of_ours": not processes and launcher_exited},
                         measurements=observed)
    path = write_once(evidence_path(OUT, f"local-slurm-{case}"), record)
    print(f"{case}: squeue empty, no cluster in sky.status, no process of ours: {record['passed']}; record: {path}")
    assert record["passed"], f"{case} left something behind: {observed}\n{launch.tail()}"


def receipt_measurements(path: Path) -> dict:
    from validation.evidence import verify

    return verify(path)["measurements"]


def test_happy_path_launch_gate_down_absent() -> None:
    launch = Launch("happy", "gate-cpu.sky.yaml")
    code = launch.finish(timeout_s=300)
    assert code == EXIT_CODES["SUCCEEDED"], launch.tail()
    assert "rtv canary memory: PASSED" in launch.output()  # the canary ran in the job, from the job venv
    path = launch.receipt()
    receipt = receipt_measurements(path)
    assert (receipt["job_status"], receipt["absent"], receipt["status_after_down"]) == ("SUCCEEDED", True, [])
    prove_nothing_left("happy", launch, {"launcher_receipt": str(path)})


@CHAOS
def test_cancel_during_provisioning() -> None:
    launch = Launch("cancel-provisioning", "hold-cpu.sky.yaml")
    launch.wait_for(r"launch request", timeout_s=60)
    deadline = time.monotonic() + 90
    while not slurm_jobs():  # the sbatch "instance" exists: provisioning is under way
        assert time.monotonic() < deadline and launch.proc.poll() is None, launch.tail()
        time.sleep(0.5)
    assert "submitted" not in launch.output(), "the job started before the cancel; the case tests nothing"
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.finish(timeout_s=180) == EXIT_CODES["CANCELLED"], launch.tail()
    path = launch.receipt()
    receipt = receipt_measurements(path)
    assert receipt["outcome"] == "CANCELLED" and receipt["job_id"] is None
    prove_nothing_left("cancel-provisioning", launch, {"launcher_receipt": str(path)})


@CHAOS
def test_cancel_during_the_job() -> None:
    launch = Launch("cancel-job", "hold-cpu.sky.yaml")
    launch.wait_for(r"holding for \d+ s", timeout_s=240)
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.finish(timeout_s=180) == EXIT_CODES["CANCELLED"], launch.tail()
    path = launch.receipt()
    receipt = receipt_measurements(path)
    assert receipt["outcome"] == "CANCELLED" and receipt["cancel"]["job"].startswith("cancelled job")
    prove_nothing_left("cancel-job", launch, {"launcher_receipt": str(path)})


@CHAOS
def test_sigkill_the_launcher_then_down_by_name() -> None:
    launch = Launch("sigkill", "hold-cpu.sky.yaml")
    launch.wait_for(r"holding for \d+ s", timeout_s=240)
    launch.proc.send_signal(signal.SIGKILL)
    launch.finish(timeout_s=30)
    assert slurm_jobs() and cluster_records(launch.cluster) == [launch.cluster], "nothing to clean up: case is void"
    down = subprocess.run(launcher("down", launch.cluster), capture_output=True, text=True, cwd=REPO, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"teardown: cluster {launch.cluster} absent (confirmed)" in down.stdout
    print(down.stdout.strip().splitlines()[-1], flush=True)
    prove_nothing_left("sigkill", launch, {"down_exit": down.returncode, "down_output": down.stdout[-2000:]})


@CHAOS
def test_a_failed_job_fails_the_gate_and_the_cluster_still_goes() -> None:
    launch = Launch("job-fails", "hold-cpu.sky.yaml", "RTV_HOLD_S=not-a-number")  # `sleep` rejects it: exit 1
    assert launch.finish(timeout_s=300) == EXIT_CODES["FAILED"], launch.tail()
    path = launch.receipt()
    receipt = receipt_measurements(path)
    assert receipt["outcome"] == "FAILED" and receipt["job_status"] == "FAILED", receipt
    prove_nothing_left("job-fails", launch, {"launcher_receipt": str(path)})
