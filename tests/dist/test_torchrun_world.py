"""A torchrun world of two "nodes" on 127.0.0.1, joined by the harness (NOTE [Joined worlds] in validation.world).

The oracle of the bitwise checks is the same schedule on one process, run
here, with no process group at all.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_nodes(module_args: list[str], *, out_dir: Path, timeout_s: float) -> list[subprocess.CompletedProcess]:
    """``torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 1`` on 127.0.0.1, as two shells would start it."""
    port = _free_port()
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                        "OMP_NUM_THREADS": "1"}
    nodes = []
    for node_rank in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
                   "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), *module_args]
        log = (out_dir / f"node{node_rank}.log").open("w")
        nodes.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True),
                      log))
    done = []
    for process, log in nodes:
        code = process.wait(timeout=timeout_s)
        log.close()
        done.append(subprocess.CompletedProcess(process.args, code, Path(log.name).read_text(), ""))
    return done


@pytest.mark.slow  # four processes importing torch (two torchrun agents, two ranks): seconds of the suite's budget
def test_two_torchrun_nodes_give_the_one_process_bits_and_survive_a_failed_call(tmp_path: Path, one_thread: None):
    from canaries.derivative.intersections import logical_run
    from canaries.presets import preset

    node0, node1 = two_nodes([str(ROOT / "tests" / "dist" / "torchrun_world_job.py")], out_dir=tmp_path,
                             timeout_s=240)
    assert node0.returncode == 0 and node1.returncode == 0, node0.stdout + node1.stdout
    assert "RESULT" not in node1.stdout, "only rank 0 reports"
    (line,) = [line for line in node0.stdout.splitlines() if line.startswith("RESULT ")]
    found = json.loads(line.removeprefix("RESULT "))
    one = logical_run(preset("cpu", 2), 2)  # the oracle: one process, both logical ranks
    assert any(s > 0 for records in one["default"]["flags"].values() for s, _ in records), "no stale backward"
    for label in ("control", "default"):
        assert [part[label]["digest"] for part in found["first"]] == [one[label]["digest"]] * 2, label
        merged = {k: [tuple(r) for r in v] for part in found["first"] for k, v in part[label]["flags"].items()}
        assert merged == one[label]["flags"], label
    assert found["failure"] == [[0, True, []], [1, False, ["ValueError: rank 1 fails on purpose"]]]
    assert found["again"] == [[0, 2], [1, 2]], "a call after a failed one gets a group of its own"
    assert [(f["rank"], f["node_rank"], f["local_rank"]) for f in found["facts"]] == [(0, 0, 0), (1, 1, 0)]


@pytest.mark.slow
def test_the_derivative_canary_under_two_torchrun_nodes_writes_one_passed_record(tmp_path: Path):
    """Its logical-rank checks run across the world (W=1 on rank 0 against W=2 across both nodes)."""
    from validation.evidence import verify

    out = tmp_path / "evidence"
    node0, node1 = two_nodes(["-m", "canaries.entry", "canary", "derivative", "--preset", "cpu", "--profile",
                              "quick", "--out", str(out)], out_dir=tmp_path, timeout_s=600)
    assert node0.returncode == 0 and node1.returncode == 0, node0.stdout[-4000:] + node1.stdout[-4000:]
    (path,) = out.glob("derivative-*.json")
    record = verify(path)
    assert record["passed"] and record["config"]["preset"]["processes"] == 2
    assert [(f["rank"], f["node_rank"]) for f in record["environment"]["world"]] == [(0, 0), (1, 1)]
    logical = [name for name in record["checks"] if "logical" in name]
    assert len(logical) >= 2 and all(record["checks"][name] for name in logical), logical


@pytest.mark.slow  # two torchrun nodes and a 2 s deadline waited out
def test_a_hang_in_a_torchrun_world_is_named_and_leaves_no_process(tmp_path: Path):
    """Rank 1 of the world lags past the deadline: rank 0 names it, exits 7, and every rank's process ends."""
    out = tmp_path / "evidence"
    node0, node1 = two_nodes([str(ROOT / "tests" / "dist" / "torchrun_hang_job.py"), str(out)], out_dir=tmp_path,
                             timeout_s=240)
    (line,) = [line for line in node0.stdout.splitlines() if line.startswith("RESULT ")]
    diagnosis = json.loads(line.removeprefix("RESULT "))
    assert diagnosis["odd_ranks"] == [1] and diagnosis["by_rank"]["1"] is None, diagnosis
    assert diagnosis["call"].startswith("run_logical(mode='rank')")
    assert node0.returncode != 0 and "exitcode  : 7" in node0.stdout, f"rank 0 exits 7: {node0.stdout[-3000:]}"
    assert node1.returncode == 0, node1.stdout[-3000:]
    dumps = sorted(p.name for p in Path(diagnosis["folder"]).glob("rank-*.json"))
    assert {"rank-0-failed.json", "rank-1-asked.json"} <= set(dumps), dumps
    pids = [int(p.read_text()) for p in (out / "pids").iterdir()]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
