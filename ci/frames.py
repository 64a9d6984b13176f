"""Evidence carried home in the job's own log: framed, digest-checked base64 lines that any SkyPilot client can read.

Why the log and not ssh or a bucket: a runner talks to a team's API server
through ``SKYPILOT_API_SERVER_ENDPOINT`` and has none of the server's files.
SkyPilot writes a client's ssh config for a cluster only from its CLI
(``sky status``'s ``_get_cluster_records_and_set_ssh_config``) and from the
server's backend, never from the SDK calls a launcher makes, and on Slurm and
Kubernetes that ssh goes through the server's websocket proxy. A bucket needs
credentials and a store the job can reach. The job's log, though, reaches
every client through ``sky.tail_logs`` (the server streams it), on a VM cloud
and a proxied one alike. So the job ends with :func:`emit`, which prints its
records as one frame, and the launcher reads the frame back with
:func:`collect` from the log it fetched.

A frame is ``RTV-EVIDENCE-BEGIN v1 <sha256> <bytes>``, then ``RTV-EVIDENCE
<base64>`` lines (76 characters), then ``RTV-EVIDENCE-END <sha256>``; the
payload is a gzipped tar of ``manifest.json`` (:func:`manifest`) and every
``*.json`` record under the folder with the folders' evidence markers
(``validation.evidence.EVIDENCE_MARKER``; the report and plots stay on the
cluster). A marker is matched anywhere in a line, so a prefix SkyPilot adds
(``(task, pid=...)``) does no harm. A frame whose payload does not have its
digest and length (a truncated or interleaved log, a retried stream that
repeated lines) is refused; when a log holds several frames the last whole
one counts.

Job side: ``python -m ci.frames emit DIR --status N`` (the task's ``run``
calls it last, with the work's own exit status; see ``ci.tasks``).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import re
import sys
import tarfile
from pathlib import Path
from typing import Any, TextIO

from validation.evidence import EVIDENCE_MARKER

__all__ = ["FrameError", "collect", "emit", "main", "manifest"]

FRAME_MANIFEST = "manifest.json"
_WIDTH = 76
_BEGIN = re.compile(r"RTV-EVIDENCE-BEGIN v1 ([0-9a-f]{64}) (\d+)\s*$")
_LINE = re.compile(r"RTV-EVIDENCE ([A-Za-z0-9+/=]+)\s*$")
_END = re.compile(r"RTV-EVIDENCE-END ([0-9a-f]{64})\s*$")


class FrameError(Exception):
    """The log holds no whole evidence frame: none at all, or only damaged ones (the reason says which)."""


def manifest(folder: Path, env: dict[str, str] | None = None, status: int | None = None) -> dict[str, Any]:
    """What the job says it made: the launcher's run id, commit and source digest it was given
    (``RTV_RUN_ID``, ``RTV_COMMIT``, ``RTV_SOURCE_DIGEST``), the records it was to make
    (``RTV_EXPECT``, space-separated canary names), the records it did make (path, digest) and
    the work's exit ``status`` (``rtv run``'s verdict under its own enforced/shown rule)."""
    env = dict(os.environ if env is None else env)
    records = []
    for path in sorted(Path(folder).rglob("*.json")) if Path(folder).is_dir() else []:
        try:
            digest = json.loads(path.read_text()).get("digest")
        except (OSError, ValueError, AttributeError):
            digest = None
        records.append({"path": str(path.relative_to(folder)), "digest": digest})
    return {
        "run_id": env.get("RTV_RUN_ID"),
        "commit": env.get("RTV_COMMIT"),
        "source_digest": env.get("RTV_SOURCE_DIGEST"),
        "expect": env.get("RTV_EXPECT", "").split(),
        "records": records,
        "status": status,
    }


def _payload(folder: Path, env: dict[str, str] | None, status: int | None) -> bytes:
    buffer = io.BytesIO()
    made = manifest(folder, env, status)
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        text = json.dumps(made, indent=1, sort_keys=True).encode()
        info = tarfile.TarInfo(FRAME_MANIFEST)
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
        for entry in made["records"]:
            tar.add(Path(folder) / entry["path"], arcname=f"records/{entry['path']}", recursive=False)
        for marker in sorted(Path(folder).rglob(EVIDENCE_MARKER)) if Path(folder).is_dir() else []:
            # the folders stay the harness's at home too (reports.records collects from marked folders only)
            tar.add(marker, arcname=f"records/{marker.relative_to(folder)}", recursive=False)
    return buffer.getvalue()


def emit(
    folder: Path, *, stream: TextIO | None = None, env: dict[str, str] | None = None, status: int | None = None
) -> str:
    """Print ``folder``'s records and manifest as one frame on ``stream``; returns the payload's sha256.

    A missing folder is framed too (a manifest with no records): the launcher
    then says which records are missing instead of "no frame".
    """
    stream = stream or sys.stdout  # looked up at the call: the stdout of the moment, not of the import
    payload = _payload(Path(folder), env, status)
    digest = hashlib.sha256(payload).hexdigest()
    text = base64.b64encode(payload).decode()
    lines = [f"RTV-EVIDENCE-BEGIN v1 {digest} {len(payload)}"]
    lines += [f"RTV-EVIDENCE {text[i : i + _WIDTH]}" for i in range(0, len(text), _WIDTH)]
    lines.append(f"RTV-EVIDENCE-END {digest}")
    stream.write("\n".join(lines) + "\n")
    stream.flush()
    return digest


def _frames(log: str) -> list[tuple[str, int, list[str], str | None]]:
    """Every frame's (digest, length, body lines, end digest or None) in log order."""
    frames: list[tuple[str, int, list[str], str | None]] = []
    current: tuple[str, int, list[str]] | None = None
    for line in log.splitlines():
        if begin := _BEGIN.search(line):
            if current:
                frames.append((*current, None))
            current = (begin.group(1), int(begin.group(2)), [])
        elif current and (body := _LINE.search(line)):
            current[2].append(body.group(1))
        elif current and (end := _END.search(line)):
            frames.append((*current, end.group(1)))
            current = None
    if current:
        frames.append((*current, None))
    return frames


# tarfile's "data" filter (no absolute paths, links or devices) exists from Python 3.11.4 on; Debian 12's
# python3.11 is 3.11.2, where extractall has no ``filter`` at all. _plain_members holds the same line on every
# version; the filter is passed too where it exists (and keeps 3.12+ from warning about its default).
def _data_filter() -> dict[str, str]:
    return {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def _plain_members(tar: tarfile.TarFile, digest: str) -> list[tarfile.TarInfo]:
    """The frame's members, each a file or folder at a relative path inside the target; FrameError otherwise."""
    members = tar.getmembers()
    for member in members:
        path = Path(member.name)
        if not (member.isfile() or member.isdir()) or path.is_absolute() or ".." in path.parts:
            raise FrameError(
                f"frame {digest[:12]}: member {member.name!r} is not a plain file or folder inside "
                "the frame (a link, a device, an absolute path or one leaving it): refused"
            )
    return members


def collect(log: str, into: Path) -> dict[str, Any]:
    """Unpack the last whole frame of ``log`` into ``into`` (records under ``into/records``); returns its manifest.

    Raises :class:`FrameError` naming why when no frame is whole.
    """
    reasons = []
    for digest, length, body, end in reversed(_frames(log)):
        try:
            payload = base64.b64decode("".join(body), validate=True)
        except ValueError as error:
            reasons.append(f"frame {digest[:12]}: not base64 ({error})")
            continue
        found = hashlib.sha256(payload).hexdigest()
        if end != digest or found != digest or len(payload) != length:
            reasons.append(
                f"frame {digest[:12]}: expected {length} bytes with that sha256 and its end line, "
                f"found {len(payload)} bytes, sha256 {found[:12]}, end {'missing' if end is None else end[:12]}"
            )
            continue
        into = Path(into)
        into.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(payload), mode="r:gz") as tar:
            tar.extractall(into, members=_plain_members(tar, digest), **_data_filter())
        return json.loads((into / FRAME_MANIFEST).read_text())
    raise FrameError(
        "; ".join(reasons)
        if reasons
        else "the job's log has no RTV-EVIDENCE frame (its run did not reach `python -m ci.frames emit`)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.frames", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    emit_parser = sub.add_parser("emit", help="print DIR's records and manifest as one frame")
    emit_parser.add_argument("folder", type=Path)
    emit_parser.add_argument("--status", type=int, default=None, help="the work's exit status")
    args = parser.parse_args(argv)
    # The summary goes to stdout after the frame, never to stderr: SkyPilot merges the job's two streams,
    # and a stderr line has landed inside a frame line (seen on the local-Slurm stage; the digest refused it).
    print(f"rtv evidence frame: sha256 {emit(args.folder, status=args.status)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
