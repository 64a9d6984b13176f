"""``rtv gpu local TASK``: a task file's own setup and run commands, on this machine.

So the script inside each task is exercised in CPU CI, and a person with a
GPU can run the gate by hand. What changes from a cluster, and why:

1. The commands run in the task's workdir with the task's ``envs``, like
   SkyPilot runs them (``bash -c``), under the run's own ``timeout``.
2. ``RTV_VENV`` is the environment ``rtv`` itself runs from (when it is a
   venv): the project is already installed there, so setup's
   ``ci/node_install.sh`` keeps it as it is and a second environment is not built.
3. Without CUDA, every ``RTV_*PRESET`` that names a GPU preset (``gpu``,
   ``gpu-8b``) becomes ``cpu``, and the run says so: ``rtv run --preset gpu``
   refuses to run without CUDA (exit 2), by design. ``RTV_CUDA`` (the CUDA
   build the node install checks) becomes ``none``.
4. ``RTV_OUT`` becomes a fresh folder (``--out``, default
   ``rtv-out/local/<task>-<time>``), so evidence from an earlier run is
   never judged again.
5. A task of ``num_nodes: N`` runs setup once and its run N times at once,
   one per "node" on 127.0.0.1, each with the variables SkyPilot sets on a
   node (``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS``: 127.0.0.1 N times,
   ``SKYPILOT_NUM_NODES``, ``SKYPILOT_NUM_GPUS_PER_NODE``: the GPUs each
   node is given here, one a node without CUDA) and a free port for
   ``RTV_MASTER_PORT`` when the task declares one (so two local runs never
   meet). The run fails when any node's does; the nodes share ``RTV_OUT``,
   as only the world's rank 0 writes there.

The outcome is judged as the launcher judges a remote job (``ci.outputs``;
NOTE [Exit codes] in ``ci.launcher``): setup or run failing is 3, the run's
``timeout`` expiring (exit 124) is 5, a run whose evidence is missing, does
not verify or says failed is 3, else 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .outputs import judge_outputs
from .tasks import TaskSpec

__all__ = ["GPU_PRESETS", "local_env", "node_envs", "run_local"]

GPU_PRESETS = ("gpu", "gpu-8b")
TIMEOUT_EXIT = 124  # coreutils timeout's status when the limit expired
NODE_GRACE_S = 10.0  # a stopped node's time to exit before SIGKILL


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
        if "RTV_CUDA" in env:
            env["RTV_CUDA"] = "none"
        for name, value in spec.envs.items():
            if name.startswith("RTV_") and name.endswith("PRESET") and value in GPU_PRESETS:
                env[name] = "cpu"
    env["RTV_OUT"] = str(Path(out).resolve())
    return env


def node_envs(env: dict[str, str], num_nodes: int, *, cuda: bool) -> list[dict[str, str]]:
    """One environment per node (rule 5 of the module docstring); ``[env]`` with node variables for one node."""
    visible = _visible_gpus() if cuda else 0
    per_node = max(1, visible // num_nodes)
    shared = {
        "SKYPILOT_NUM_NODES": str(num_nodes),
        "SKYPILOT_NODE_IPS": "\n".join(["127.0.0.1"] * num_nodes),
        "SKYPILOT_NUM_GPUS_PER_NODE": str(per_node),
    }
    if "RTV_MASTER_PORT" in env:
        shared["RTV_MASTER_PORT"] = str(_free_port())
    nodes = []
    for rank in range(num_nodes):
        node = env | shared | {"SKYPILOT_NODE_RANK": str(rank)}
        if visible:  # each "node" its own GPUs, as on separate machines
            node["CUDA_VISIBLE_DEVICES"] = ",".join(str((rank * per_node + i) % visible) for i in range(per_node))
        nodes.append(node)
    return nodes


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_nodes(script: str, workdir: Path, nodes: list[dict[str, str]]) -> int:
    """``script`` once per node environment, all at once; the first non-zero exit code by node rank, else 0.

    A node that fails takes the others down, every process group of their
    sessions (SIGTERM, then SIGKILL after :data:`NODE_GRACE_S`): its peers
    would otherwise wait for it until the run's own limit.
    """
    running = [
        subprocess.Popen(["bash", "-c", script], cwd=workdir, env=node, start_new_session=True) for node in nodes
    ]
    try:
        while any(process.poll() is None for process in running):
            if any(process.poll() not in (None, 0) for process in running):
                break
            time.sleep(0.2)
    finally:  # also on Ctrl-C: each node runs in a session of its own, so nothing else would stop it
        for process in running:
            _stop(process)
    codes = [process.wait() for process in running]
    return next((code for code in codes if code != 0), 0)


def _session_groups(session: int) -> set[int]:
    """The process groups of the live (not zombie) processes in ``session``, read from ``/proc``.

    A node's script may make groups of its own (coreutils ``timeout`` runs its command in a new one), so signalling
    the session leader's group alone would leave the node's work running. Without ``/proc`` (not Linux) the
    session's own group stands in."""
    if not Path("/proc/self/stat").exists():
        return {session}
    groups = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group, member_of = stat.read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):  # gone since the listing
            continue
        if int(member_of) == session and state != "Z":
            groups.add(int(group))
    return groups


def _signal_session(session: int, sig: signal.Signals) -> None:
    for group in _session_groups(session):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:  # exited since the listing
            pass


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to every process group of the node's session, SIGKILL to what outlives the grace.

    The node's script leads a session of its own (``start_new_session``), so whatever it started, in any group,
    is found by session; a node that already exited may have left work behind, and that is stopped too."""
    _signal_session(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + NODE_GRACE_S
    while (process.poll() is None or _session_groups(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_session(process.pid, signal.SIGKILL)


def _workdir(spec: TaskSpec) -> Path:
    workdir = spec.task.workdir
    return Path(workdir) if isinstance(workdir, str) and workdir else Path.cwd()


def run_local(
    spec: TaskSpec,
    *,
    out: Path | None = None,
    cuda: bool,
    skip_setup: bool = False,
    venv: Path | None = None,
    echo: Callable[[str], None] = print,
) -> int:
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
        nodes = node_envs(env, spec.num_nodes, cuda=cuda) if label == "run" else [env]
        if len(nodes) > 1:
            echo(f"rtv gpu local: {len(nodes)} nodes on 127.0.0.1 (SKYPILOT_NODE_RANK 0..{len(nodes) - 1})")
        code = _run_nodes(script, workdir, nodes)
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
