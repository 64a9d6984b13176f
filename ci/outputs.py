"""A job's outputs: copying its evidence back from the cluster, and judging what came back.

The SkyPilot SDK downloads logs but not files, so :func:`rsync_outputs`
uses the route SkyPilot documents for copying files off a cluster: ``rsync``
over the ssh configuration SkyPilot writes for it
(``~/.sky/generated/ssh/<cluster>`` and its key), under a timeout.

:func:`judge_outputs` is the launcher's cross-check of a job SkyPilot
reports SUCCEEDED (SkyPilot has reported failed jobs as succeeded): the
evidence passes only if at least one record came back, every record
verifies (``validation.evidence.verify``: schema and digest) and every one
says passed, read as the report reads them
(``reports.records.load_records``, so the gate and the page agree).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from reports.records import load_records

__all__ = ["EvidenceVerdict", "judge_outputs", "rsync_outputs"]

_SESSION = re.compile(r"^\s*SetEnv\s+SKY_CLUSTER_NAME=(\S+)\s*$", re.M)  # SkyPilot's ssh config on Slurm


@dataclass(frozen=True, kw_only=True)
class EvidenceVerdict:
    """What the fetched evidence says: ``records`` found, how many ``verified``, and the ``problems``."""

    fetched: bool
    records: int
    verified: int
    failed: list[str] = field(default_factory=list)  # records that verify but say passed: false
    problems: list[str] = field(default_factory=list)  # one line per record that does not verify

    @property
    def passed(self) -> bool:
        return self.fetched and self.records > 0 and self.verified == self.records and not self.failed

    def summary(self) -> str:
        if not self.fetched:
            return "evidence was not fetched"
        if not self.records:
            return "no evidence record came back"
        if self.problems:
            return f"{len(self.problems)} of {self.records} records do not verify: {self.problems[0]}"
        if self.failed:
            return f"{len(self.failed)} of {self.records} records say failed: {', '.join(self.failed)}"
        return f"{self.records} records verify and say passed"

    def to_json(self) -> dict:
        return {"fetched": self.fetched, "records": self.records, "verified": self.verified,
                "failed": list(self.failed), "problems": list(self.problems), "passed": self.passed,
                "summary": self.summary()}


def judge_outputs(folder: Path | None) -> EvidenceVerdict:
    """Judge every ``*.json`` under ``folder`` as the report does; ``folder=None`` means nothing was fetched.

    A record counts as passing when it verifies and says passed (the
    mutation suite's own record passes when every deliberate bug was caught;
    the mutated runs write elsewhere); ``failed`` records fail the
    cross-check, and so does anything that does not verify.
    """
    if folder is None or not Path(folder).is_dir():
        return EvidenceVerdict(fetched=False, records=0, verified=0)
    records = load_records(Path(folder))
    problems = [f"{r.name}: {r.integrity}" for r in records if r.status == "invalid"]
    failed = [f"{r.name} ({r.status})" for r in records if r.status == "failed"]
    return EvidenceVerdict(fetched=True, records=len(records), verified=len(records) - len(problems),
                           failed=failed, problems=problems)


def rsync_outputs(cluster: str, remote_dir: str, local_dir: Path, *, timeout: float) -> Path:
    """Copy ``~/sky_workdir/<remote_dir>/`` from ``cluster`` into ``local_dir``; raises on failure or timeout.

    On Slurm the ssh config leads to the login node, and the cluster's home is
    a folder there that SkyPilot's ``~/.sky_ssh_rc`` enters for the session
    named by ``SetEnv SKY_CLUSTER_NAME`` in that config. A login node's sshd
    need not accept that variable, so rsync's remote side sets it and sources
    the rc file itself; without the ``SetEnv`` line (a VM) nothing changes.
    """
    config = Path(os.path.expanduser(f"~/.sky/generated/ssh/{cluster}"))
    if not config.is_file():
        raise FileNotFoundError(f"no ssh config for cluster {cluster} at {config} (SkyPilot writes it while it is up)")
    ssh = ["ssh", "-F", str(config), "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes"]
    key = Path(os.path.expanduser(f"~/.sky/generated/ssh-keys/{cluster}.key"))
    if key.is_file():  # older SkyPilot; 0.14 names its key in the config
        ssh += ["-i", str(key)]
    command = ["rsync", "-az", "-e", shlex.join(ssh)]
    session = _SESSION.search(config.read_text())
    if session:
        command += ["--rsync-path", f"export SKY_CLUSTER_NAME={shlex.quote(session.group(1))}; "
                                    "[ ! -f ~/.sky_ssh_rc ] || . ~/.sky_ssh_rc; rsync"]
    local_dir = Path(local_dir)
    local_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run([*command, f"{cluster}:sky_workdir/{remote_dir.rstrip('/')}/", f"{local_dir}/"],
                   check=True, timeout=timeout)
    return local_dir
