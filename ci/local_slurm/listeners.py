"""Listening sockets during the local-Slurm stage: only loopback may be new.

``stage.sh`` records ``ss -ltnuH`` once before it starts anything (the
baseline), then runs ``sample`` in the background until the end: every second
it appends ``--- <time>`` and the ``ss -ltnupH`` lines. ``check`` fails when a
sample shows a listener on a non-loopback address (``0.0.0.0``, ``[::]``,
``*``, anything outside 127.0.0.0/8 and ::1) that the baseline did not have.

Attribution, for machines the stage shares: a non-loopback listener whose
processes are all someone else's is written with the prefix ``FOREIGN`` and
reported, not failed. A process is the stage's when it runs as the job user
or its environment carries the stage's marker (``RTV_LOCAL_SLURM_STAGE``,
which every daemon the stage starts inherits); a listener whose process is
unknown or already gone counts as the stage's.

Usage: ``python -m ci.local_slurm.listeners sample OUT --job-user NAME`` and
``python -m ci.local_slurm.listeners check BASELINE SAMPLES`` (exit 0 clean,
1 with one line per offending listener).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import pwd
import re
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["MARKER", "Listener", "parse", "is_loopback", "is_ours", "offenders", "foreign", "main"]

MARKER = "RTV_LOCAL_SLURM_STAGE"
FOREIGN = "FOREIGN "
Listener = tuple[str, str]  # (netid, local address:port), as ss prints them


def parse(text: str, *, foreign: bool = False) -> set[Listener]:
    """The (netid, local address) of the ``ss`` lines (only the FOREIGN-marked ones when ``foreign``)."""
    listeners = set()
    for line in text.splitlines():
        marked = line.startswith(FOREIGN)
        fields = line.removeprefix(FOREIGN).split()
        if len(fields) < 5 or line.startswith("---") or marked != foreign:
            continue
        listeners.add((fields[0], fields[4]))
    return listeners


def is_loopback(local: str) -> bool:
    """Whether ``address:port`` (``[v6]:port``, ``addr%iface:port``, ``*:port``, v4-mapped v6) is loopback only."""
    host = local.rsplit(":", 1)[0].strip("[]").split("%", 1)[0]
    if host == "*":
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name we cannot read is not proof of loopback
    mapped = getattr(address, "ipv4_mapped", None)  # [::ffff:127.0.0.1]: Python 3.11 does not call it loopback
    return (mapped or address).is_loopback


def is_ours(pid: int, marker: str, job_uid: int) -> bool:
    """Whether process ``pid`` belongs to the stage: the job user's, or it carries ``MARKER=marker``; gone counts."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return True
    uid = int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))
    return uid == job_uid or f"{MARKER}={marker}".encode() in environ


def offenders(baseline: str, samples: str) -> list[Listener]:
    """The stage's listeners seen in ``samples`` that are neither loopback nor in ``baseline``, sorted.

    A listener seen without an owner (its process was gone by the time ``ss`` looked) counts as the
    stage's, unless another sample names its owner and that owner is someone else's (FOREIGN) and no
    sample names an owner of ours: on a shared machine, other users' test workers open such sockets.
    """
    owned_by_us = {
        (f[0], f[4])
        for f in (line.split() for line in samples.splitlines() if "users:(" in line and not line.startswith(FOREIGN))
        if len(f) >= 5
    }
    unowned_foreign = parse(samples, foreign=True) - owned_by_us
    return sorted(item for item in parse(samples) - parse(baseline) - unowned_foreign if not is_loopback(item[1]))


def foreign(samples: str) -> list[Listener]:
    """Non-loopback listeners seen in ``samples`` that belonged to other processes on the machine, sorted."""
    return sorted(parse(samples, foreign=True))


def sample_listeners(out: Path, marker: str, job_user: str, interval_s: float) -> None:
    """Append one ``ss -ltnupH`` sample every ``interval_s`` until killed (lines flushed at once)."""
    with open(out, "a", buffering=1) as log:
        while True:
            lines = subprocess.run(["ss", "-ltnupH"], capture_output=True, text=True, check=False).stdout.splitlines()
            log.write(f"--- {time.time():.0f}\n")
            for line in lines:
                log.write(_attributed(line, marker, job_user) + "\n")
            time.sleep(interval_s)


def _attributed(line: str, marker: str, job_user: str) -> str:
    fields = line.split()
    if len(fields) < 5 or is_loopback(fields[4]):
        return line
    try:
        job_uid = pwd.getpwnam(job_user).pw_uid
    except KeyError:
        job_uid = -1  # before setup made the job user, or after teardown removed it
    pids = [int(pid) for pid in re.findall(r"pid=(\d+)", line)]
    return FOREIGN + line if pids and not any(is_ours(pid, marker, job_uid) for pid in pids) else line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.local_slurm.listeners", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sampler = commands.add_parser("sample")
    sampler.add_argument("out", type=Path)
    sampler.add_argument("--job-user", required=True)
    sampler.add_argument("--interval-s", type=float, default=1.0)
    checker = commands.add_parser("check")
    checker.add_argument("baseline", type=Path)
    checker.add_argument("samples", type=Path)
    args = parser.parse_args(argv)
    if args.command == "sample":
        sample_listeners(args.out, os.environ[MARKER], args.job_user, args.interval_s)
        return 0
    samples = args.samples.read_text()
    count = sum(line.startswith("---") for line in samples.splitlines())
    found = offenders(args.baseline.read_text(), samples)
    for netid, local in found:
        print(f"listeners: {netid} {local} listened on a non-loopback address during the stage", file=sys.stderr)
    others = foreign(samples)
    if others:
        print(
            f"listeners: ignored {len(others)} non-loopback listener(s) of other processes on this machine: "
            + ", ".join(local for _, local in others)
        )
    print(f"listeners: {count} samples, {len(found)} non-loopback listener(s) of the stage beyond the baseline")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
