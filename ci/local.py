"""``rtv gpu local TASK``: a task file's own setup and run commands, on this machine.

So the script inside each task is exercised in CPU CI, and a person with a
GPU can run the gate by hand. What changes from a cluster, and why:

1. The commands run in the task's workdir with the task's ``envs``, like
   SkyPilot runs them (``bash -c``), under the run's own ``timeout``.
2. ``RTV_VENV`` is the environment ``rtv`` itself runs from (when it is a
   venv): the project is already installed there, so setup's
   ``make install`` finds it and a second environment is not built.
3. Without CUDA, every ``RTV_*PRESET`` that names a GPU preset (``gpu``,
   ``gpu-8b``) becomes ``cpu``, and the run says so: ``rtv run --preset gpu``
   refuses to run without CUDA (exit 2), by design.
4. ``RTV_OUT`` becomes a fresh folder (``--out``, default
   ``rtv-out/local/<task>-<time>``), so evidence from an earlier run is
   never judged again.

The outcome is judged as the launcher judges a remote job (``ci.outputs``;
NOTE [Exit codes] in ``ci.launcher``): setup or run failing is 3, the run's
``timeout`` expiring (exit 124) is 5, a run whose evidence is missing, does
not verify or says failed is 3, else 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .outputs import judge_outputs
from .tasks import TaskSpec

__all__ = ["GPU_PRESETS", "local_env", "run_local"]

GPU_PRESETS = ("gpu", "gpu-8b")
TIMEOUT_EXIT = 124  # coreutils timeout's status when the limit expired


def local_env(spec: TaskSpec, *, out: Path, cuda: bool, venv: Path | None = None) -> dict[str, str]:
    """The environment the task's commands see here (rules 2-4 of the module docstring).

    ``venv`` replaces rule 2's choice (``rtv gpu local --venv``).
    """
    env = dict(os.environ)
    env.update(spec.envs)
    if venv is not None:
        env["RTV_VENV"] = str(Path(venv).resolve())
    elif sys.prefix != sys.base_prefix:
        env["RTV_VENV"] = sys.prefix
    if not cuda:
        for name, value in spec.envs.items():
            if name.startswith("RTV_") and name.endswith("PRESET") and value in GPU_PRESETS:
                env[name] = "cpu"
    env["RTV_OUT"] = str(Path(out).resolve())
    return env


def _workdir(spec: TaskSpec) -> Path:
    workdir = spec.task.workdir
    return Path(workdir) if isinstance(workdir, str) and workdir else Path.cwd()


def run_local(spec: TaskSpec, *, out: Path | None = None, cuda: bool, skip_setup: bool = False,
              venv: Path | None = None, echo: Callable[[str], None] = print) -> int:
    """Run ``spec``'s setup (unless ``skip_setup``) and run here; returns the exit code (module docstring)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(out) if out is not None else Path("rtv-out") / "local" / f"{spec.name}-{stamp}"
    env = local_env(spec, out=out, cuda=cuda, venv=venv)
    swapped = {k: env[k] for k in spec.envs if env[k] != spec.envs[k] and k.endswith("PRESET")}
    if swapped:
        echo(f"rtv gpu local: no CUDA here, so {swapped} (the GPU presets need CUDA)")
    workdir = _workdir(spec)
    steps = [("run", spec.run)] if skip_setup else [("setup", spec.setup), ("run", spec.run)]
    for label, script in steps:
        echo(f"rtv gpu local: {label} of {spec.path} in {workdir}")
        code = subprocess.run(["bash", "-c", script], cwd=workdir, env=env).returncode
        if code != 0:
            timed_out = label == "run" and code == TIMEOUT_EXIT
            echo(f"rtv gpu local: {label} {'timed out' if timed_out else f'failed (exit {code})'}")
            return 5 if timed_out else 3
    verdict = judge_outputs(Path(env["RTV_OUT"]))
    reports = sorted(Path(env["RTV_OUT"]).rglob("report/index.md"))
    echo(f"rtv gpu local: evidence in {env['RTV_OUT']}: {verdict.summary()}")
    for report in reports:
        echo(f"rtv gpu local: report {report}")
    return 0 if verdict.passed else 3
