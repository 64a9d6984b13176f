"""``rtv gpu local`` runs the gate task's own setup and run commands on CPU and judges their evidence.

The fast cases run the task's commands through ``rtv gpu local`` with the
heavy steps stubbed at the edge: a stub venv whose ``python`` and ``rtv``
record their arguments (``rtv run`` writes one real evidence record),
and a ``make`` on PATH that records its arguments (the real one would
reinstall the shared venv). The ``slow`` case runs everything but
``make`` for real: the GPU tests (skipped without CUDA) and ``rtv run
--preset cpu --nproc 2`` (about 20 s).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import pytest

from canaries.cli import main

WRITE_EVIDENCE = """
import sys
from pathlib import Path
from validation.evidence import evidence_path, make_record, write_once
write_once(evidence_path(Path(sys.argv[1]) / "run-stub", "canary-stub"),
           make_record("canary-stub", config={}, checks={"stub": True}, measurements={}))
"""


def _script(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.fixture
def stubs(tmp_path: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch):
    """A stub venv and a stub ``make``; returns (venv, calls log, set verdict)."""
    venv, bin_dir, calls = tmp_path / "venv", tmp_path / "venv" / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(parents=True)
    (tmp_path / "writer.py").write_text(WRITE_EVIDENCE)
    _script(
        bin_dir / "python",
        f'echo "python $*" >> {calls}\n'  # node 0 of a torchrun world writes, as rank 0
        f'case "$*" in *torch.distributed.run*"--node-rank 0"*) '
        f'exec {sys.executable} {tmp_path / "writer.py"} "$RTV_OUT";; esac\n'
        f'[ "${{STUB_NODE_FAILS:-x}}" != "$SKYPILOT_NODE_RANK" ] || exit 1\n'
        f'[ "${{STUB_NODE_SLEEP:-0}}" = 0 ] || {{ echo $$ >> {tmp_path / "sleepers"}; exec sleep "$STUB_NODE_SLEEP"; }}\n',
    )
    _script(
        bin_dir / "rtv",
        f'echo "rtv $*" >> {calls}\n'
        f'[ "${{STUB_SLEEP:-0}}" = 0 ] || sleep "$STUB_SLEEP"\n'
        f'[ "${{STUB_RTV_EXIT:-0}}" = 0 ] || exit "$STUB_RTV_EXIT"\n'
        f'[ "${{STUB_NO_EVIDENCE:-0}}" = 0 ] || exit 0\n'
        f'exec {sys.executable} {tmp_path / "writer.py"} "$RTV_OUT"\n',
    )
    make_dir = tmp_path / "path"
    make_dir.mkdir()
    _script(make_dir / "make", f'echo "make $*" >> {calls}\n')
    monkeypatch.setenv("PATH", f"{make_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(repo_root))
    return venv, calls


@pytest.fixture
def gate(sky_sandbox, repo_root: Path, monkeypatch: pytest.MonkeyPatch):
    from ci.tasks import load_task

    monkeypatch.chdir(repo_root)  # the task's workdir is "."
    return load_task(repo_root / "ci" / "gate.sky.yaml")


@pytest.mark.slow  # runs the gate task's commands in subprocesses (about 3 s); the failing and timeout paths stay in the default run
def test_local_runs_the_gate_tasks_own_commands_on_cpu(gate, stubs, tmp_path: Path, monkeypatch):
    venv, calls = stubs
    out = tmp_path / "out"
    monkeypatch.chdir(gate.path.parent.parent)
    code = main(["gpu", "local", str(gate.path), "--out", str(out), "--venv", str(venv)])
    assert code == 0
    lines = calls.read_text().splitlines()
    assert (
        lines
        == [
            "python - none",  # ci/node_install.sh keeps rtv's own venv and checks it (no CUDA here: RTV_CUDA=none)
            "python -m pytest tests/gpu -q",
            f"rtv run --preset cpu --nproc 2 --hang-timeout 300 --out {out.resolve()}",
            f"python -m ci.frames emit {out.resolve()} --status 0",  # the evidence frame the launcher would read from the log
        ]
    )
    assert len(list(out.rglob("canary-stub-*.json"))) == 1


def test_local_fails_when_the_run_fails_or_leaves_no_evidence(gate, stubs, tmp_path, monkeypatch):
    from ci.local import run_local

    venv, _ = stubs
    monkeypatch.setenv("STUB_RTV_EXIT", "1")
    assert run_local(gate, out=tmp_path / "a", cuda=False, venv=venv, echo=lambda line: None) == 3
    monkeypatch.setenv("STUB_RTV_EXIT", "0")
    monkeypatch.setenv("STUB_NO_EVIDENCE", "1")
    assert run_local(gate, out=tmp_path / "b", cuda=False, venv=venv, echo=lambda line: None) == 3


@pytest.mark.slow  # waits for a real timeout (about 1.2 s); the failing run's exit is checked in the default run
def test_local_maps_the_runs_own_timeout_to_exit_5(gate, stubs, tmp_path, monkeypatch):
    from ci.local import run_local

    venv, calls = stubs
    monkeypatch.setenv("STUB_SLEEP", "5")
    short = dataclasses.replace(gate, envs={**gate.envs, "RTV_TIME_LIMIT": "1s"})
    assert run_local(short, out=tmp_path / "out", cuda=False, venv=venv, skip_setup=True, echo=lambda line: None) == 5
    assert "make" not in calls.read_text()


def test_gpu_presets_stay_when_cuda_is_there(gate, tmp_path):
    from ci.local import local_env

    assert local_env(gate, out=tmp_path, cuda=True)["RTV_PRESET"] == "gpu"
    assert local_env(gate, out=tmp_path, cuda=False)["RTV_PRESET"] == "cpu"


@pytest.fixture
def two_nodes(sky_sandbox, repo_root: Path, monkeypatch: pytest.MonkeyPatch):
    from ci.tasks import load_task

    monkeypatch.chdir(repo_root)
    return load_task(repo_root / "ci" / "canaries-2node.sky.yaml")


def test_each_local_node_gets_skypilots_node_variables_and_a_free_master_port(two_nodes, tmp_path):
    from ci.local import local_env, node_envs

    env = local_env(two_nodes, out=tmp_path, cuda=False)
    nodes = node_envs(env, 2, cuda=False)
    assert [n["SKYPILOT_NODE_RANK"] for n in nodes] == ["0", "1"]
    for node in nodes:
        assert node["SKYPILOT_NUM_NODES"] == "2" and node["SKYPILOT_NUM_GPUS_PER_NODE"] == "1"
        assert node["SKYPILOT_NODE_IPS"].splitlines() == ["127.0.0.1", "127.0.0.1"]
        assert node["RTV_PRESET"] == "cpu" and "CUDA_VISIBLE_DEVICES" not in node
    assert nodes[0]["RTV_MASTER_PORT"] == nodes[1]["RTV_MASTER_PORT"] != two_nodes.envs["RTV_MASTER_PORT"]


@pytest.mark.slow  # two node processes (about 3 s); the failing and timeout paths stay in the default run
def test_local_runs_both_nodes_commands_and_judges_node_zeros_evidence(two_nodes, stubs, tmp_path, monkeypatch):
    venv, calls = stubs
    out = tmp_path / "out"
    assert main(["gpu", "local", str(two_nodes.path), "--out", str(out), "--venv", str(venv)]) == 0
    runs = sorted(line for line in calls.read_text().splitlines() if "torch.distributed.run" in line)
    assert len(runs) == 2, runs
    for node_rank, line in enumerate(runs):
        assert f"--nnodes 2 --node-rank {node_rank} --master-addr 127.0.0.1" in line
        assert line.endswith(
            f"--nproc-per-node 1 -m canaries.entry run --preset cpu --hang-timeout 300 --out {out.resolve()}"
        )
    assert len(list(out.rglob("canary-stub-*.json"))) == 1


def test_a_failed_node_takes_the_waiting_one_down(two_nodes, stubs, tmp_path, monkeypatch):
    from ci.local import run_local

    venv, _ = stubs
    monkeypatch.setenv("STUB_NODE_FAILS", "1")
    monkeypatch.setenv("STUB_NODE_SLEEP", "300")  # node 0 would wait for its peer until the run's limit
    started = time.monotonic()
    node_zero_waits = dataclasses.replace(two_nodes, run=two_nodes.run.replace("--node-rank", "--node-rank-x"))
    assert (
        run_local(node_zero_waits, out=tmp_path / "out", cuda=False, venv=venv, skip_setup=True, echo=lambda line: None)
        == 3
    )
    assert time.monotonic() - started < 60
    # The waiting node's work ran inside the run's `timeout`, in a process group of its own: it is stopped too.
    sleepers = [int(pid) for pid in (tmp_path / "sleepers").read_text().split()]
    assert sleepers and not [pid for pid in sleepers if _alive(pid)], sleepers


def test_a_stopped_node_leaves_nothing_running_in_any_process_group(tmp_path: Path) -> None:
    """The task scripts run their work under coreutils ``timeout``, which makes a process group of its own: stopping
    the node's leading group alone left that work running until the run's limit. No SkyPilot needed here."""
    from ci.local import _run_nodes

    script = (
        'if [ "$NODE" = 1 ]; then sleep 0.3; exit 4; fi\n'
        "timeout 300 sh -c 'echo $$ > sleeper; exec sleep 300'\n"
        "exit $?\n"  # as in the task files: a command after it, so bash does not exec `timeout` as the session leader
    )
    nodes = [{**os.environ, "NODE": str(rank)} for rank in (0, 1)]
    assert _run_nodes(script, tmp_path, nodes) != 0  # node 1 failed, node 0 was stopped
    sleeper = int((tmp_path / "sleeper").read_text())
    assert not _alive(sleeper), f"pid {sleeper} (the waiting node's sleep) still runs"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_local_runs_the_two_node_task_for_real_on_cpu(two_nodes, tmp_path: Path):
    """Both nodes' torchrun on 127.0.0.1, ``rtv run --preset cpu`` in one world of two: one set of evidence."""
    from ci.local import run_local
    from validation.evidence import verify

    out = tmp_path / "out"
    assert run_local(two_nodes, out=out, cuda=False, skip_setup=True, echo=print) == 0
    records = [verify(path) for path in out.rglob("*.json") if "report" not in path.parts]
    assert records and all(r["passed"] for r in records)
    derivative = [r for r in records if r["kind"] == "derivative-canary"]
    assert len(derivative) == 1, "rank 0 alone writes, once"
    assert [f["node_rank"] for f in derivative[0]["environment"]["world"]] == [0, 1]
    assert derivative[0]["config"]["preset"]["processes"] == 2


@pytest.mark.slow
def test_local_runs_the_gate_for_real_on_cpu(gate, stubs, tmp_path: Path):
    from ci.local import run_local

    out = tmp_path / "out"
    assert run_local(gate, out=out, cuda=False, echo=print) == 0  # RTV_VENV: the venv running this test
    assert len(list(out.rglob("*.json"))) >= 3 and list(out.rglob("report/index.md"))
