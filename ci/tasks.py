"""The CI task-file contract: what every ``ci/*.sky.yaml`` must say, checked on a real ``sky.Task``.

A task file is parsed by SkyPilot itself (``sky.Task.from_yaml``); this
module adds the rules SkyPilot does not know and the launcher relies on:

1. Resources with accelerators (``H200:2``, ``H200:8``), or ``cpus`` for
   the loopback Slurm variant (``infra: slurm``): one entry, or several
   alternatives (SkyPilot's ``any_of`` / ``ordered`` failover, e.g. RunPod,
   Nebius, Kubernetes and Slurm shapes that give the GPUs), each with a
   unique :data:`ALTERNATIVE_LABEL` label naming it, so the receipt can say
   which one ran (:func:`chosen_alternative`). ``accelerators`` is then the
   smallest alternative's (what the job needs).
2. ``autostop`` with ``down: true``: the cluster's own backstop if every
   launcher and workflow step dies. An alternative on a provider SkyPilot
   cannot autodown is refused with SkyPilot's reason, never left for the
   optimizer to drop silently (a provider whose support cannot be checked
   here, e.g. Kubernetes without ``skypilot[kubernetes]``, is let through).
3. ``envs`` declares ``RTV_OUT`` (where the job writes its evidence,
   relative to the workdir), ``RTV_EXPECT`` (the records the run is to make:
   canary names as ``rtv run`` names their files, ``smoke`` included) and
   ``RTV_TIME_LIMIT`` and ``RTV_SETUP_LIMIT`` (``timeout`` syntax, e.g.
   ``40m``).
4. ``run`` first empties ``RTV_OUT`` (``rm -rf "$RTV_OUT"``: a reused
   cluster's earlier records must not pass for this run's), wraps its work
   in ``timeout ... "$RTV_TIME_LIMIT"`` (the job's own limit), and ends with
   ``python -m ci.frames emit "$RTV_OUT" --status "$status"`` with the work's
   exit status (the evidence travels home in the log: ``ci.frames``).
5. ``setup`` installs the project the README's way, wrapped in ``timeout
   ... "$RTV_SETUP_LIMIT"``: SkyPilot's autodown starts only once the job
   runs, so a hung setup would otherwise hold the cluster forever.
6. A ``run`` that runs ``rtv run`` (``rtv" run`` or ``canaries.entry run``)
   passes it ``--hang-timeout "$RTV_HANG_TIMEOUT"``, declared in ``envs`` in
   seconds and below ``RTV_TIME_LIMIT``: a hung collective ends the job by
   the watchdog (exit 7, its dumps in the evidence frame) before the task's
   own limit, and the frame and the teardown still follow.

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

__all__ = ["ALTERNATIVE_LABEL", "TaskFileError", "TaskSpec", "chosen_alternative", "load_task", "parse_duration"]

ALTERNATIVE_LABEL = "rtv-alternative"  # the resources label naming each failover alternative (rule 1)

EMIT = '-m ci.frames emit "$RTV_OUT" --status "$status"'  # the run's last step (rule 4)
CLEAN = 'rm -rf "$RTV_OUT"'  # the run's first step (rule 4)
HANG_FLAG = '--hang-timeout "$RTV_HANG_TIMEOUT"'  # what rtv run is given (rule 6)
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class TaskFileError(SetupError):
    """A CI task file SkyPilot refuses, or one that breaks the contract in this module's docstring."""


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """A checked task file: the ``sky.Task`` and what the launcher needs from it.

    ``accelerators``: e.g. ``{"H200": 2}`` (empty for a CPU task);
    ``evidence_dir``: ``RTV_OUT`` (relative to the workdir);
    ``expect``: ``RTV_EXPECT`` split; ``time_limit_s`` and ``setup_limit_s``:
    ``RTV_TIME_LIMIT`` and ``RTV_SETUP_LIMIT`` in seconds; ``job_deadline_s``:
    how long the launcher waits for a terminal job status (both limits + a
    margin for ``timeout --kill-after``).
    """

    path: Path
    task: Any  # sky.Task
    name: str
    accelerators: dict[str, int]
    num_nodes: int
    infra: str | None
    evidence_dir: str
    expect: tuple[str, ...]
    time_limit_s: float
    setup_limit_s: float
    job_deadline_s: float
    envs: dict[str, str]
    setup: str
    run: str

    @property
    def gpus(self) -> int:
        """Accelerators over all nodes (what GPU-minutes count)."""
        return sum(self.accelerators.values()) * self.num_nodes

    def alternatives(self) -> list[str]:
        """The labels of the task's resource alternatives (empty for one entry)."""
        return sorted(label for label in (_label(res) for res in self.task.resources) if label is not None)

    def requested(self) -> dict[str, Any]:
        """What the receipt records as requested."""
        return {
            "task": str(self.path),
            "name": self.name,
            "accelerators": dict(self.accelerators),
            "alternatives": self.alternatives(),
            "num_nodes": self.num_nodes,
            "infra": self.infra,
            "time_limit_s": self.time_limit_s,
            "setup_limit_s": self.setup_limit_s,
            "expect": list(self.expect),
            "job_deadline_s": self.job_deadline_s,
            "evidence_dir": self.evidence_dir,
        }


def parse_duration(text: str) -> float:
    """``timeout``'s duration syntax (``90``, ``30s``, ``40m``, ``2h``, ``1d``) in seconds."""
    match = _DURATION.match(str(text).strip())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"expected a positive duration like 90s, 40m or 2h, found {text!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _fail(path: Path, cause: str, fix: str) -> TaskFileError:
    return TaskFileError(f"task file {path}: {cause}", fix=fix)


def _limit(path: Path, envs: dict[str, str], name: str) -> float:
    try:
        return parse_duration(envs[name])
    except ValueError as error:
        raise _fail(path, f"{name}: {error}", "use timeout's syntax: 40m, 2h") from None


def _label(resources: Any) -> str | None:
    return (resources.labels or {}).get(ALTERNATIVE_LABEL)


def chosen_alternative(handle: Any) -> str | None:
    """The :data:`ALTERNATIVE_LABEL` of what a launch handle says was launched (None: one entry, or nothing)."""
    resources = getattr(handle, "launched_resources", None)
    return None if resources is None else _label(resources)


def _alternatives(path: Path, entries: list[Any]) -> list[tuple[Any, dict[str, int]]]:
    """Each resources entry with its accelerators, checked against rules 1-2."""
    labels = [_label(res) for res in entries]
    if len(entries) > 1 and (None in labels or len(set(labels)) != len(labels)):
        raise _fail(
            path,
            f"expected each of the {len(entries)} resource alternatives to carry a unique "
            f"`labels: {{{ALTERNATIVE_LABEL}: NAME}}`, found {labels}",
            f"label each alternative, e.g. `labels: {{{ALTERNATIVE_LABEL}: runpod-h200x2}}`",
        )
    checked = []
    for res, label in zip(entries, labels):
        where = "resources" if label is None else f"resources alternative {label!r}"
        accelerators = {str(k): int(v) for k, v in (res.accelerators or {}).items()}
        if not accelerators and res.cpus is None:
            raise _fail(
                path,
                f"expected `{where}` to have `accelerators` (e.g. H200:2) or `cpus`, found neither",
                "say what the job needs: `accelerators: H200:2`",
            )
        autostop = res.autostop_config
        if autostop is None or not autostop.enabled or not autostop.down:
            raise _fail(
                path,
                f"expected `autostop` with `down: true` (the backstop) on `{where}`, found {autostop}",
                "add `autostop: {idle_minutes: 10, down: true}` under resources",
            )
        _check_autodown(path, res, where)
        checked.append((res, accelerators))
    return checked


def _check_autodown(path: Path, res: Any, where: str) -> None:
    """Rule 2's refusal: ``res`` names a provider SkyPilot says cannot autodown."""
    if res.cloud is None:
        return
    from sky import exceptions
    from sky.clouds import CloudImplementationFeatures

    try:
        res.cloud.check_features_are_supported(res, {CloudImplementationFeatures.AUTODOWN})
    except exceptions.NotSupportedError as error:
        raise _fail(
            path,
            f"`{where}` is on {res.cloud}, which SkyPilot cannot autodown: {error}",
            "remove that alternative or pick a provider with autodown: the cluster's own backstop "
            "must hold wherever it lands",
        ) from None
    except ImportError:
        pass  # the provider's SDK is not installed here: its support cannot be checked (module docstring)


def _check_hang_timeout(path: Path, envs: dict[str, str], run: str, time_limit_s: float) -> None:
    """Rule 6."""
    if not re.search(r'(rtv"? |canaries\.entry )run\b', run):
        return
    if HANG_FLAG not in run:
        raise _fail(
            path,
            f"expected `rtv run` in `run` to pass `{HANG_FLAG}`, found no such flag",
            f"add {HANG_FLAG} to the rtv run command and RTV_HANG_TIMEOUT (seconds) to envs",
        )
    try:
        seconds = float(envs.get("RTV_HANG_TIMEOUT", ""))
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < time_limit_s:
        raise _fail(
            path,
            f"expected envs RTV_HANG_TIMEOUT in seconds, > 0 and below RTV_TIME_LIMIT "
            f"({time_limit_s:g} s), found {envs.get('RTV_HANG_TIMEOUT')!r}",
            'declare RTV_HANG_TIMEOUT: "300" (the watchdog must end a hung job before the task\'s limit)',
        )


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
        raise _fail(
            path,
            "expected a SkyPilot task YAML file, found nothing there",
            "pass one of ci/*.sky.yaml (e.g. ci/gate.sky.yaml)",
        )
    import sky

    try:
        task = sky.Task.from_yaml(str(path))
        task.update_envs(envs or {})
        if validate:
            task.validate()
    except Exception as error:  # SkyPilot raises several types for a bad file
        raise _fail(
            path,
            f"SkyPilot refused it: {type(error).__name__}: {error}",
            "fix the field it names (see docs.skypilot.co, Task YAML)",
        ) from error
    alternatives = _alternatives(path, list(task.resources))
    res, accelerators = min(alternatives, key=lambda pair: (sum(pair[1].values()), _label(pair[0]) or ""))
    envs = dict(task.envs)
    missing = [name for name in ("RTV_OUT", "RTV_EXPECT", "RTV_TIME_LIMIT", "RTV_SETUP_LIMIT") if not envs.get(name)]
    if missing:
        raise _fail(
            path,
            f"expected envs RTV_OUT, RTV_EXPECT, RTV_TIME_LIMIT and RTV_SETUP_LIMIT, missing {missing}",
            "declare where evidence goes (RTV_OUT: rtv-out/ci), the records the run makes "
            "(RTV_EXPECT: smoke memory ...) and both limits (RTV_TIME_LIMIT: 40m, RTV_SETUP_LIMIT: 20m)",
        )
    limits = {name: _limit(path, envs, name) for name in ("RTV_TIME_LIMIT", "RTV_SETUP_LIMIT")}
    run, setup = task.run or "", task.setup or ""
    run = run if isinstance(run, str) else ""
    if "timeout" not in run or "$RTV_TIME_LIMIT" not in run:
        raise _fail(
            path,
            'expected `run` to wrap its work in `timeout ... "$RTV_TIME_LIMIT"`, found no such call',
            "wrap the work: timeout --signal=TERM --kill-after=60s \"$RTV_TIME_LIMIT\" bash -c '...'",
        )
    lines = [line.strip() for line in run.splitlines() if line.strip() and not line.strip().startswith(("#", "set "))]
    if not lines or lines[0] != CLEAN or EMIT not in lines[-1]:
        raise _fail(
            path,
            f"expected `run` to start with `{CLEAN}` and end with `python {EMIT}`, "
            f"found first {lines[:1]} and last {lines[-1:]}",
            f'begin run with {CLEAN}; end it with `"$RTV_VENV/bin/python" {EMIT}; exit $status` '
            "(keep the work's status: `timeout ... || status=$?`)",
        )
    if "timeout" not in setup or "$RTV_SETUP_LIMIT" not in setup:
        raise _fail(
            path,
            'expected `setup` to install the project under `timeout ... "$RTV_SETUP_LIMIT"`, '
            f"found {'no setup' if not setup.strip() else 'no such call'}",
            "wrap it: timeout --kill-after=30s \"$RTV_SETUP_LIMIT\" bash -euxc 'make install ...'",
        )
    _check_hang_timeout(path, envs, run, limits["RTV_TIME_LIMIT"])
    infra = str(res.cloud).lower() if res.cloud is not None else None
    return TaskSpec(
        path=path,
        task=task,
        name=task.name or path.stem,
        accelerators=accelerators,
        num_nodes=int(task.num_nodes or 1),
        infra=infra,
        evidence_dir=envs["RTV_OUT"],
        expect=tuple(envs["RTV_EXPECT"].split()),
        time_limit_s=limits["RTV_TIME_LIMIT"],
        setup_limit_s=limits["RTV_SETUP_LIMIT"],
        job_deadline_s=sum(limits.values()) + 120,
        envs=envs,
        setup=setup,
        run=run,
    )
