"""Real launches through ``rtv gpu launch|down`` on the local one-node Slurm cluster, and proof nothing is left.

Runs only inside ``.ci/local_slurm_stage`` (marker ``slurm``; the stage has run
``ci/local_slurm/setup.sh`` and exported its environment: private HOME, API
port, SLURM_CONF). Each case drives the project's launcher
(``python -m canaries.cli gpu ...``) as a separate process, as CI does, reads
its teardown line and receipt (``ci.receipts``), then proves three absences:
no Slurm job (``squeue`` empty), no SkyPilot cluster record (``sky.status``),
no process of ours (the launcher has exited; the job user runs nothing but
the API server's idle ssh login sessions, which are reported, not counted).
Each case writes a record of what it observed next to the launcher's
receipt. Chaos cases (and the negative control: a failing job must fail the
gate, exit 3, and still be torn down) run when ``RTV_SLURM_CHAOS=1``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ci.local_slurm.sky_sdk import cluster_records, job_status

# Only inside .ci/local_slurm_stage (which sets RTV_LOCAL_SLURM=1 after setup.sh); skipped everywhere else.
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(os.environ.get("RTV_LOCAL_SLURM") != "1",
                       reason="slurm: runs only in .ci/local_slurm_stage (root, apt, RTV_LOCAL_SLURM=1)"),
]

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "ci" / "local_slurm"
OUT = Path(os.environ.get("RTV_SLURM_OUT", "rtv-out/local_slurm")).resolve()
CHAOS = pytest.mark.skipif(os.environ.get("RTV_SLURM_CHAOS") != "1", reason="chaos cases run with RTV_SLURM_CHAOS=1")
PASSED, FAILED, CANCELLED = 0, 3, 4  # rtv gpu's exit codes (docs/harness.md#exit-codes)


def rtv_gpu(*args: str) -> list[str]:
    """The project's launcher command line: ``rtv gpu ARGS``."""
    return [sys.executable, "-m", "canaries.cli", "gpu", *args]


class Launch:
    """One ``rtv gpu launch`` process on its own cluster; output in OUT/<case>.log, receipt under OUT/<case>/."""

    def __init__(self, case: str, task: str, *envs: str) -> None:
        self.cluster = f"rtv-{case}-{os.getpid()}"
        self.out = OUT / case
        self.log = OUT / f"{case}.log"
        self.out.mkdir(parents=True, exist_ok=True)
        env_args = [arg for env in (f"RTV_JOB_VENV={os.environ['RTV_JOB_VENV']}", *envs) for arg in ("--env", env)]
        command = rtv_gpu("launch", str(TASKS / task), "--cluster", self.cluster, "--out", str(self.out), *env_args)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

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

    def wait_for_running_job(self) -> None:
        self.wait_until("job submitted", lambda: "Job submitted" in self.output(), timeout_s=240)
        self.wait_until("job RUNNING", lambda: job_status(self.cluster) == "RUNNING", timeout_s=120)

    def finish(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def tail(self) -> str:
        return "\n".join(self.output().splitlines()[-40:])

    def receipt(self) -> tuple[Path, dict]:
        """The confirmed teardown line and the receipt it names (verified); prints both as one line."""
        return confirmed(self.output(), self.cluster, "launch")


def confirmed(output: str, cluster: str, command: str) -> tuple[Path, dict]:
    """Check ``rtv gpu COMMAND`` printed a confirmed teardown and a receipt; (receipt path, its measurements)."""
    from validation.evidence import verify

    assert f"teardown: cluster {cluster} absent (confirmed)" in output.splitlines(), output[-3000:]
    found = re.search(rf"^rtv gpu {command}: .* \(exit \d+\); receipt: (\S+)$", output, re.M)
    assert found, f"no receipt line:\n{output[-3000:]}"
    path = Path(found.group(1))
    path = path if path.is_absolute() else REPO / path
    print(f"teardown: cluster {cluster} absent (confirmed); receipt: {path}", flush=True)
    measurements = verify(path)["measurements"]
    assert measurements["cluster"] == cluster and measurements["absence"] == "confirmed", measurements
    return path, measurements


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


def test_happy_path_launch_gate_fetch_down_absent() -> None:
    from validation.evidence import verify

    launch = Launch("happy", "gate-cpu.sky.yaml")
    code = launch.finish(timeout_s=300)
    assert code == PASSED, launch.tail()
    path, receipt = launch.receipt()
    observed = receipt["observed"]
    assert (receipt["outcome"], receipt["exit_code"], observed["job_status"]) == ("passed", PASSED, "SUCCEEDED")
    assert observed["evidence"]["passed"] and observed["evidence"]["records"] >= 1, observed["evidence"]
    # What came back is the canary's own record, and it verifies here too (independently of the launcher).
    fetched = sorted((launch.out / launch.cluster / "evidence").glob("memory-cpu-*.json"))
    assert len(fetched) == 1 and verify(fetched[0])["passed"], fetched
    assert "rtv canary memory: PASSED" in Path(observed["logs"]).read_text()  # the job's log came back
    prove_nothing_left("happy", launch, {"launcher_receipt": str(path)})


@CHAOS
def test_cancel_during_provisioning() -> None:
    launch = Launch("cancel-provisioning", "hold-cpu.sky.yaml")
    # The sbatch "instance" exists: provisioning is under way, and no job was submitted yet.
    launch.wait_until("provisioning", lambda: bool(slurm_jobs()), timeout_s=120)
    assert "Job submitted" not in launch.output(), "the job started before the cancel; the case tests nothing"
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.finish(timeout_s=240) == CANCELLED, launch.tail()
    path, receipt = launch.receipt()
    observed = receipt["observed"]
    assert receipt["outcome"] == "cancelled" and observed["job_id"] is None, receipt
    assert observed["interruption"]["kind"] == "signal" and observed["interruption"]["phase"] in ("launch", "provision")
    prove_nothing_left("cancel-provisioning", launch, {"launcher_receipt": str(path)})


@CHAOS
def test_cancel_during_the_job() -> None:
    launch = Launch("cancel-job", "hold-cpu.sky.yaml")
    launch.wait_for_running_job()
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.finish(timeout_s=240) == CANCELLED, launch.tail()
    path, receipt = launch.receipt()
    observed = receipt["observed"]
    assert receipt["outcome"] == "cancelled" and observed["interruption"]["phase"] == "job", receipt
    steps = {step["step"]: step["ok"] for step in observed["teardown"]}
    assert steps.get("cancel") and steps.get("down"), observed["teardown"]  # the job was cancelled, then down
    prove_nothing_left("cancel-job", launch, {"launcher_receipt": str(path)})


@CHAOS
def test_sigkill_the_launcher_then_down_by_name() -> None:
    launch = Launch("sigkill", "hold-cpu.sky.yaml")
    launch.wait_for_running_job()
    launch.proc.send_signal(signal.SIGKILL)
    launch.finish(timeout_s=30)
    assert slurm_jobs() and cluster_records(launch.cluster) == [launch.cluster], "nothing to clean up: case is void"
    down = subprocess.run(rtv_gpu("down", launch.cluster, "--out", str(launch.out)),
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    path, receipt = confirmed(down.stdout, launch.cluster, "down")
    assert receipt["outcome"] == "absent" and any(s["step"] == "down" and s["ok"] for s in receipt["observed"]["teardown"])
    prove_nothing_left("sigkill", launch, {"down_exit": down.returncode, "down_receipt": str(path)})


@CHAOS
def test_a_failed_job_fails_the_gate_and_the_cluster_still_goes() -> None:
    launch = Launch("job-fails", "hold-cpu.sky.yaml", "RTV_HOLD_S=not-a-number")  # `sleep` rejects it: exit 1
    assert launch.finish(timeout_s=300) == FAILED, launch.tail()
    path, receipt = launch.receipt()
    assert (receipt["outcome"], receipt["observed"]["job_status"]) == ("failed", "FAILED"), receipt
    prove_nothing_left("job-fails", launch, {"launcher_receipt": str(path)})
