"""Every SkyPilot SDK call of the local-Slurm stage, in one module.

Run as ``python -m ci.local_slurm.sky_sdk COMMAND`` with the stage's
environment (``common.sh``: private HOME, SKY_RUNTIME_DIR and API port):

- ``check-bootstrap``: exit 1 unless SkyPilot's remote bootstrap still
  downloads what ``shims/`` serve locally (the uv installer from astral.sh and
  a Python 3.10) and its skylet still binds the line ``shims/uv`` rewrites,
  so a SkyPilot upgrade that changes either fails loudly here.
- ``start-server --pid-file F``: start the private API server in its own
  session (its pid leads the process group ``teardown.sh`` kills), wait until
  it answers, write its pid. ``serve`` is what that process runs.
- ``launch TASK --cluster NAME [--env K=V]... [--timeout-s S] [--receipts D]``:
  launch, follow the job, gate on its final status, always ``down``, prove the
  cluster's absence (``sky.status`` has no record of it) and write a receipt.
  SIGINT/SIGTERM cancel: the in-flight request and the job are cancelled
  before the ``down``. Exit codes as ``rtv gpu launch`` (contract §11): 0 the
  job SUCCEEDED, 3 it failed (or the launch did), 4 cancelled, 5 timed out,
  6 absence unproven (wins over every other code).
- ``down NAME``: ``down`` by name and prove absence (0, or 6).

This is the stand-in for the project's launcher until ``rtv gpu launch`` and
``rtv gpu down`` exist; the end-to-end tests then call those instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["EXIT_CODES", "check_bootstrap", "cluster_records", "down_and_prove", "launch", "main"]

EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 3, "CANCELLED": 4, "TIMED_OUT": 5, "ABSENCE_UNPROVEN": 6}
# What the shims replace (see shims/curl and shims/uv); both must still be in SkyPilot's bootstrap.
BOOTSTRAP_DOWNLOADS = {
    "SKY_UV_INSTALL_CMD": "https://astral.sh/uv/install.sh",
    "UV_INSTALLATION_COMMANDS": "--python 3.10",
}
# shims/uv rewrites this line of the remote runtime's skylet to bind 127.0.0.1.
SKYLET_BIND = "listen_addr = f'0.0.0.0:{port}'"
SKYPILOT_VERSION = "0.14.1"


class Interrupted(BaseException):
    """A cancel signal (SIGINT/SIGTERM) or the timeout arrived; BaseException so no ``except Exception`` eats it."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def check_bootstrap() -> list[str]:
    """Why the shims no longer match SkyPilot's bootstrap (empty when they do)."""
    import sky
    from sky.skylet import constants

    problems = [
        f"sky.skylet.constants.{name} no longer contains {needle!r}: SkyPilot's remote bootstrap changed; "
        "recheck ci/local_slurm/shims (still needed? still enough?) and update BOOTSTRAP_DOWNLOADS"
        for name, needle in BOOTSTRAP_DOWNLOADS.items()
        if needle not in getattr(constants, name, "")
    ]
    skylet = Path(constants.__file__).with_name("skylet.py").read_text()
    if SKYLET_BIND not in skylet:
        problems.append(f"sky/skylet/skylet.py no longer contains {SKYLET_BIND!r}: shims/uv rebinds the skylet "
                        "to 127.0.0.1 by rewriting that line; check where the skylet listens now and update both")
    if sky.__version__ != SKYPILOT_VERSION:
        problems.append(f"skypilot {sky.__version__} found, the shims were checked against {SKYPILOT_VERSION}: "
                        "rerun the stage, then update SKYPILOT_VERSION")
    return problems


def start_server(pid_file: Path, timeout_s: float = 120.0) -> int:
    """Start ``serve`` in a new session, wait for ``/api/health``, write and return its pid."""
    log = Path(os.environ["SKY_RUNTIME_DIR"]) / "api-server.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", __spec__.name, "serve"], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pid_file.write_text(f"{proc.pid}\n")
    url = f"http://127.0.0.1:{os.environ['SKYPILOT_API_SERVER_LOCAL_PORT']}/api/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return proc.pid
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the API server did not answer {url} within {timeout_s:.0f} s; see {log}")


def serve() -> None:
    """Replace this process with the API server, bound to 127.0.0.1 (never returns)."""
    import sky

    sky.api_start(foreground=True, host="127.0.0.1")


def cluster_records(cluster: str | None = None) -> list[str]:
    """Names of the clusters ``sky.status`` knows (all, or only ``cluster``)."""
    import sky

    records = sky.get(sky.status([cluster] if cluster else None, all_users=True))
    return sorted(record["name"] for record in records)


def down_and_prove(cluster: str) -> dict[str, Any]:
    """``sky.down`` then ``sky.status``: what each said, and whether the cluster is proven absent."""
    import sky

    observed: dict[str, Any] = {}
    try:
        sky.get(sky.down(cluster))
        observed["down"] = "ok"
    except sky.exceptions.ClusterDoesNotExist:
        observed["down"] = "no such cluster"
    except Exception as error:  # the status check below decides; the error goes in the receipt
        observed["down"] = f"error: {type(error).__name__}: {error}"
    try:
        observed["status_after_down"] = cluster_records(cluster)
        observed["absent"] = observed["status_after_down"] == []
    except Exception as error:
        observed["status_after_down"] = f"error: {type(error).__name__}: {error}"
        observed["absent"] = False
    return observed


def _cancel(cluster: str, request_id: str | None, job_id: int | None) -> dict[str, str]:
    """Cancel the in-flight request and the job, best effort; what each call answered."""
    import sky

    answers = {}
    if request_id is not None:
        try:
            answers["request"] = f"cancelled {sky.get(sky.api_cancel(request_id))}"
        except Exception as error:
            answers["request"] = f"error: {type(error).__name__}: {error}"
    if job_id is not None:
        try:
            sky.get(sky.cancel(cluster, job_ids=[job_id]))
            answers["job"] = f"cancelled job {job_id}"
        except Exception as error:
            answers["job"] = f"error: {type(error).__name__}: {error}"
    return answers


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted("TIMED_OUT" if signum == signal.SIGALRM else "CANCELLED")


def launch(task_path: Path, cluster: str, envs: dict[str, str], timeout_s: int, receipts: Path) -> int:
    """Launch, gate on the job, always down and prove absence, write a receipt; returns the exit code."""
    import sky

    observed: dict[str, Any] = {"events": []}
    started = time.monotonic()
    request_id: str | None = None
    job_id: int | None = None

    def event(what: str) -> None:
        observed["events"].append([round(time.monotonic() - started, 1), what])
        print(f"launch {cluster}: {what}", flush=True)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
        signal.signal(signum, _raise_interrupted)
    signal.alarm(timeout_s)
    try:
        task = sky.Task.from_yaml(str(task_path))
        task.update_envs(envs)
        request_id = sky.launch(task, cluster_name=cluster)
        event(f"launch request {request_id}")
        job_id, _ = sky.stream_and_get(request_id)
        request_id = None
        event(f"job {job_id} submitted")
        sky.tail_logs(cluster, job_id, follow=True)
        status = sky.get(sky.job_status(cluster, [job_id]))[job_id]
        observed["job_status"] = str(status.value if status else None)
        outcome = {"SUCCEEDED": "SUCCEEDED", "CANCELLED": "CANCELLED"}.get(observed["job_status"], "FAILED")
    except Interrupted as stop:
        outcome = stop.outcome
    except Exception as error:  # a launch that fails is a failed job; the cluster still goes down
        observed["error"] = f"{type(error).__name__}: {error}"
        outcome = "FAILED"
    finally:
        signal.alarm(0)
        for signum in (signal.SIGINT, signal.SIGTERM):  # the teardown below must not be interrupted
            signal.signal(signum, signal.SIG_IGN)
    event(f"outcome {outcome}")
    if outcome != "SUCCEEDED":
        observed["cancel"] = _cancel(cluster, request_id, job_id)
    observed.update(down_and_prove(cluster))
    event(f"down: {observed['down']}; absent: {observed['absent']}")
    code = EXIT_CODES["ABSENCE_UNPROVEN"] if not observed["absent"] else EXIT_CODES[outcome]
    receipt = _write_receipt(receipts, task_path, cluster, envs, outcome, code, job_id, observed)
    _print_teardown(cluster, observed["absent"], receipt)
    return code


def _write_receipt(receipts: Path, task_path: Path, cluster: str, envs: dict[str, str], outcome: str,
                   code: int, job_id: int | None, observed: dict[str, Any]) -> Path:
    from validation.evidence import evidence_path, make_record, write_once

    record = make_record(
        "launch-receipt",
        config={"task": str(task_path), "cluster": cluster, "envs": envs},
        checks={"job_succeeded": outcome == "SUCCEEDED", "cluster_absent": observed["absent"]},
        measurements={"outcome": outcome, "exit_code": code, "job_id": job_id, **observed},
    )
    receipts.mkdir(parents=True, exist_ok=True)
    return write_once(evidence_path(receipts, "launch-receipt"), record)


def _print_teardown(cluster: str, absent: bool, receipt: Path | None) -> None:
    state = "absent (confirmed)" if absent else "absence UNPROVEN"
    print(f"teardown: cluster {cluster} {state}" + (f"; receipt: {receipt}" if receipt else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.local_slurm.sky_sdk", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check-bootstrap")
    start = commands.add_parser("start-server")
    start.add_argument("--pid-file", type=Path, required=True)
    commands.add_parser("serve")
    run = commands.add_parser("launch")
    run.add_argument("task", type=Path)
    run.add_argument("--cluster", required=True)
    run.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--timeout-s", type=int, default=600)
    run.add_argument("--receipts", type=Path, default=Path("rtv-out/receipts"))
    down = commands.add_parser("down")
    down.add_argument("cluster")
    args = parser.parse_args(argv)

    if args.command == "check-bootstrap":
        problems = check_bootstrap()
        for problem in problems:
            print(f"check-bootstrap: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if args.command == "start-server":
        print(f"SkyPilot API server: pid {start_server(args.pid_file)}")
        return 0
    if args.command == "serve":
        serve()
        return 1
    if args.command == "launch":
        bad = [item for item in args.env if "=" not in item]
        if bad:
            parser.error(f"--env expects KEY=VALUE, found {bad[0]!r}")
        envs = dict(item.split("=", 1) for item in args.env)
        return launch(args.task, args.cluster, envs, args.timeout_s, args.receipts)
    observed = down_and_prove(args.cluster)
    _print_teardown(args.cluster, observed["absent"], None)
    return 0 if observed["absent"] else EXIT_CODES["ABSENCE_UNPROVEN"]


if __name__ == "__main__":
    sys.exit(main())
