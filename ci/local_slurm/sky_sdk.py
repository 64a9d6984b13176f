"""The stage's own SkyPilot SDK calls (the launches themselves go through ``rtv gpu launch|down``).

Run as ``python -m ci.local_slurm.sky_sdk COMMAND`` with the stage's
environment (``common.sh``: private HOME, SKY_RUNTIME_DIR and API port):

- ``check-bootstrap``: exit 1 unless SkyPilot's remote bootstrap still
  downloads what ``shims/`` serve locally (the uv installer from astral.sh and
  a Python 3.10) and its skylet still binds the line ``shims/uv`` rewrites,
  so a SkyPilot upgrade that changes either fails loudly here.
- ``start-server --pid-file F``: start the private API server in its own
  session (its pid leads the process group ``teardown.sh`` kills), wait until
  it answers, write its pid. ``serve`` is what that process runs.
- ``restart-server --pid-file F``: stop that server (SIGTERM, then SIGKILL
  to it and every process below it, by pid), wait for its port to close, and
  start it again: the restart case.
- ``job-status NAME``: print the status of the cluster's latest job, as the
  identity in the environment sees it.

The end-to-end tests import :func:`cluster_records` (across all users, as
their own third identity) and run ``job-status`` as the launcher's identity:
the probes behind their proofs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

__all__ = ["check_bootstrap", "cluster_records", "job_status", "main", "restart_server", "start_server"]

# What the shims replace (see shims/curl and shims/uv); both must still be in SkyPilot's bootstrap.
BOOTSTRAP_DOWNLOADS = {
    "SKY_UV_INSTALL_CMD": "https://astral.sh/uv/install.sh",
    "UV_INSTALLATION_COMMANDS": "--python 3.10",
}
# shims/uv rewrites this line of the remote runtime's skylet to bind 127.0.0.1.
SKYLET_BIND = "listen_addr = f'0.0.0.0:{port}'"
SKYPILOT_VERSION = "0.14.1"


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
        problems.append(
            f"sky/skylet/skylet.py no longer contains {SKYLET_BIND!r}: shims/uv rebinds the skylet "
            "to 127.0.0.1 by rewriting that line; check where the skylet listens now and update both"
        )
    if sky.__version__ != SKYPILOT_VERSION:
        problems.append(
            f"skypilot {sky.__version__} found, the shims were checked against {SKYPILOT_VERSION}: "
            "rerun the stage, then update SKYPILOT_VERSION"
        )
    return problems


def start_server(pid_file: Path, timeout_s: float = 120.0) -> int:
    """Start ``serve`` in a new session, wait for ``/api/health``, write and return its pid."""
    log = Path(os.environ["SKY_RUNTIME_DIR"]) / "api-server.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "serve"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    pid_file.write_text(f"{proc.pid}\n")
    url = f"http://127.0.0.1:{os.environ['SKYPILOT_API_SERVER_LOCAL_PORT']}/api/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"the API server exited with {proc.returncode}; the end of {log}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return proc.pid
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the API server did not answer {url} within {timeout_s:.0f} s; see {log}")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (by parent links: SkyPilot's workers start sessions of their own)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def restart_server(pid_file: Path, timeout_s: float = 30.0) -> int:
    """Stop the server recorded in ``pid_file`` and every process below it (by pid), then start it again."""
    import signal

    pid = int(pid_file.read_text())
    family = [pid, *_descendants(pid)]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.5)
    for member in family:  # what the TERM left, the server's own workers included
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass
    port = int(os.environ["SKYPILOT_API_SERVER_LOCAL_PORT"])
    while time.monotonic() < deadline + timeout_s and _answers(port):
        time.sleep(0.5)
    return start_server(pid_file)


def _answers(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def serve() -> None:
    """Replace this process with the API server, bound to 127.0.0.1 (never returns)."""
    import sky

    sky.api_start(foreground=True, host="127.0.0.1")


def cluster_records(cluster: str | None = None) -> list[str]:
    """Names of the clusters ``sky.status`` knows (all, or only ``cluster``)."""
    import sky

    records = sky.get(sky.status([cluster] if cluster else None, all_users=True))
    return sorted(record["name"] for record in records)


def job_status(cluster: str) -> str | None:
    """The status of ``cluster``'s latest job (``RUNNING``, ...), or None when it has no job yet."""
    import sky

    statuses = sky.get(sky.job_status(cluster, None))
    status = next(iter(statuses.values()), None) if statuses else None
    return None if status is None else status.value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.local_slurm.sky_sdk", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check-bootstrap")
    for name in ("start-server", "restart-server"):
        commands.add_parser(name).add_argument("--pid-file", type=Path, required=True)
    commands.add_parser("job-status").add_argument("cluster")
    commands.add_parser("serve")
    args = parser.parse_args(argv)

    if args.command == "check-bootstrap":
        problems = check_bootstrap()
        for problem in problems:
            print(f"check-bootstrap: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if args.command in ("start-server", "restart-server"):
        start = start_server if args.command == "start-server" else restart_server
        print(f"SkyPilot API server: pid {start(args.pid_file)}")
        return 0
    if args.command == "job-status":
        print(job_status(args.cluster))
        return 0
    serve()
    return 1


if __name__ == "__main__":
    sys.exit(main())
