"""Listening sockets during the local-Slurm stage: only loopback may be new.

``stage.sh`` records ``ss -ltnuH`` once before it starts anything (the
baseline), then samples it every second in the background until the end.
``check`` fails when any sample shows a listener on a non-loopback address
(``0.0.0.0``, ``[::]``, ``*``, or any address outside 127.0.0.0/8 and ::1)
that the baseline did not already have. Samples are separated by lines
starting with ``---``.

Usage: ``python -m ci.local_slurm.listeners check BASELINE SAMPLES``
(exit 0 clean, 1 with one line per offending listener).
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path

__all__ = ["Listener", "parse", "is_loopback", "offenders", "main"]

Listener = tuple[str, str]  # (netid, local address:port), as ss prints them


def parse(text: str) -> set[Listener]:
    """The (netid, local address) of each ``ss -ltnuH`` line; ``---`` separators and blanks are skipped."""
    listeners = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5 or line.startswith("---"):
            continue
        listeners.add((fields[0], fields[4]))
    return listeners


def is_loopback(local: str) -> bool:
    """Whether ``address:port`` (``[v6]:port``, ``addr%iface:port``, ``*:port``) is on loopback only."""
    host = local.rsplit(":", 1)[0].strip("[]").split("%", 1)[0]
    if host == "*":
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name we cannot read is not proof of loopback


def offenders(baseline: str, samples: str) -> list[Listener]:
    """Listeners seen in ``samples`` that are neither loopback nor in ``baseline``, sorted."""
    before = parse(baseline)
    return sorted(item for item in parse(samples) - before if not is_loopback(item[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.local_slurm.listeners", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check"])
    parser.add_argument("baseline", type=Path)
    parser.add_argument("samples", type=Path)
    args = parser.parse_args(argv)
    samples = args.samples.read_text()
    count = sum(line.startswith("---") for line in samples.splitlines())
    found = offenders(args.baseline.read_text(), samples)
    for netid, local in found:
        print(f"listeners: {netid} {local} listened on a non-loopback address during the stage", file=sys.stderr)
    print(f"listeners: {count} samples, {len(found)} non-loopback listener(s) beyond the baseline")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
