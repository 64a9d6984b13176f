"""The CI task-file contract: what every ``ci/*.sky.yaml`` must say, checked on a real ``sky.Task``.

A task file is parsed by SkyPilot itself (``sky.Task.from_yaml``); this
module adds the rules SkyPilot does not know and the launcher relies on:

1. One resources entry with accelerators (``H200:2``, ``H200:8``), or
   ``cpus`` for the loopback Slurm variant (``infra: slurm``).
2. ``autostop`` with ``down: true``: the cluster's own backstop if every
   launcher and workflow step dies.
3. ``envs`` declares ``RTV_OUT`` (where the job writes its evidence,
   relative to the workdir: what the launcher fetches back) and
   ``RTV_TIME_LIMIT`` (``timeout`` syntax, e.g. ``40m``), and ``run`` wraps
   its work in ``timeout ... "$RTV_TIME_LIMIT"``: the job's own time limit.
4. ``setup`` exists (it installs the project the README's way).

A file that breaks a rule, or that SkyPilot refuses, raises
:class:`TaskFileError` (exit 2) naming the file, what was expected and
found, and the fix. ``sky`` is imported inside :func:`load_task` (it takes
seconds), so ``rtv --help`` stays instant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from validation.errors import SetupError

__all__ = ["TaskFileError", "TaskSpec", "load_task", "parse_duration"]

SETUP_BUDGET_S = 20 * 60  # installing the project on a fresh node, before the run's own limit starts
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class TaskFileError(SetupError):
    """A CI task file SkyPilot refuses, or one that breaks the contract in this module's docstring."""


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """A checked task file: the ``sky.Task`` and what the launcher needs from it.

    ``accelerators``: e.g. ``{"H200": 2}`` (empty for a CPU task);
    ``evidence_dir``: ``RTV_OUT`` (relative to the workdir);
    ``time_limit_s``: ``RTV_TIME_LIMIT`` in seconds; ``job_deadline_s``: how
    long the launcher waits for a terminal job status (setup budget + the
    run's limit + a margin for ``timeout --kill-after``).
    """

    path: Path
    task: Any  # sky.Task
    name: str
    accelerators: dict[str, int]
    num_nodes: int
    infra: str | None
    evidence_dir: str
    time_limit_s: float
    job_deadline_s: float
    envs: dict[str, str]
    setup: str
    run: str

    @property
    def gpus(self) -> int:
        """Accelerators over all nodes (what GPU-minutes count)."""
        return sum(self.accelerators.values()) * self.num_nodes

    def requested(self) -> dict[str, Any]:
        """What the receipt records as requested."""
        return {"task": str(self.path), "name": self.name, "accelerators": dict(self.accelerators),
                "num_nodes": self.num_nodes, "infra": self.infra, "time_limit_s": self.time_limit_s,
                "job_deadline_s": self.job_deadline_s, "evidence_dir": self.evidence_dir}


def parse_duration(text: str) -> float:
    """``timeout``'s duration syntax (``90``, ``30s``, ``40m``, ``2h``, ``1d``) in seconds."""
    match = _DURATION.match(str(text).strip())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"expected a positive duration like 90s, 40m or 2h, found {text!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _fail(path: Path, cause: str, fix: str) -> TaskFileError:
    return TaskFileError(f"task file {path}: {cause}", fix=fix)


def load_task(path: Path | str, *, validate: bool = False, envs: dict[str, str] | None = None) -> TaskSpec:
    """Parse ``path`` with SkyPilot and check the rules above; :class:`TaskFileError` otherwise.

    ``envs`` override or add the task's ``envs`` before the checks (``rtv gpu
    launch --env KEY=VALUE``), so an overridden ``RTV_OUT`` is what is fetched.

    ``validate=True`` also runs ``sky.Task.validate`` (resources against
    SkyPilot's catalog, which it downloads on first use; the launcher does
    this before launching, ``rtv gpu local`` does not need it).
    """
    path = Path(path)
    if not path.is_file():
        raise _fail(path, "expected a SkyPilot task YAML file, found nothing there",
                    "pass one of ci/*.sky.yaml (e.g. ci/gate.sky.yaml)")
    import sky

    try:
        task = sky.Task.from_yaml(str(path))
        task.update_envs(envs or {})
        if validate:
            task.validate()
    except Exception as error:  # noqa: BLE001 - SkyPilot raises several types for a bad file
        raise _fail(path, f"SkyPilot refused it: {type(error).__name__}: {error}",
                    "fix the field it names (see docs.skypilot.co, Task YAML)") from error
    resources = list(task.resources)
    if len(resources) != 1:
        raise _fail(path, f"expected one resources entry, found {len(resources)}",
                    "give a single `resources:` mapping (no any_of/ordered)")
    res = resources[0]
    accelerators = {str(k): int(v) for k, v in (res.accelerators or {}).items()}
    if not accelerators and res.cpus is None:
        raise _fail(path, "expected `resources.accelerators` (e.g. H200:2) or `resources.cpus`, found neither",
                    "say what the job needs: `accelerators: H200:2`")
    autostop = res.autostop_config
    if autostop is None or not autostop.enabled or not autostop.down:
        raise _fail(path, f"expected `resources.autostop` with `down: true` (the backstop), found {autostop}",
                    "add `autostop: {idle_minutes: 10, down: true}` under resources")
    envs = dict(task.envs)
    missing = [name for name in ("RTV_OUT", "RTV_TIME_LIMIT") if not envs.get(name)]
    if missing:
        raise _fail(path, f"expected envs RTV_OUT and RTV_TIME_LIMIT, missing {missing}",
                    "declare where evidence goes (RTV_OUT: rtv-out/ci) and the run's limit (RTV_TIME_LIMIT: 40m)")
    try:
        limit = parse_duration(envs["RTV_TIME_LIMIT"])
    except ValueError as error:
        raise _fail(path, f"RTV_TIME_LIMIT: {error}", "use timeout's syntax: 40m, 2h") from None
    run, setup = task.run or "", task.setup or ""
    if not isinstance(run, str) or "timeout" not in run or "$RTV_TIME_LIMIT" not in run:
        raise _fail(path, "expected `run` to wrap its work in `timeout ... \"$RTV_TIME_LIMIT\"`, found no such call",
                    'wrap the work: timeout --signal=TERM --kill-after=60s "$RTV_TIME_LIMIT" bash -c \'...\'')
    if not setup.strip():
        raise _fail(path, "expected a `setup` that installs the project, found none",
                    "add `setup: make install` (after a venv that sees the machine's torch)")
    infra = str(res.cloud).lower() if res.cloud is not None else None
    return TaskSpec(
        path=path, task=task, name=task.name or path.stem, accelerators=accelerators,
        num_nodes=int(task.num_nodes or 1), infra=infra, evidence_dir=envs["RTV_OUT"],
        time_limit_s=limit, job_deadline_s=SETUP_BUDGET_S + limit + 120, envs=envs, setup=setup, run=run,
    )
