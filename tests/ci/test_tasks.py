"""The CI task files load through SkyPilot, validate offline against the seeded catalog, and keep the contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

TASKS = {"gate.sky.yaml": ("H200", 2, "rtv-out/ci/gate"), "canaries.sky.yaml": ("H200", 8, "rtv-out/ci/canaries")}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_files_load_and_validate_offline(sky_sandbox, repo_root: Path, name: str):
    from ci.tasks import load_task, parse_duration

    accelerator, count, out = TASKS[name]
    spec = load_task(repo_root / "ci" / name, validate=True)
    (resources,) = spec.task.resources
    assert isinstance(resources, sky_sandbox.Resources)
    assert resources.accelerators == {accelerator: count} and spec.gpus == count and spec.num_nodes == 1
    assert resources.autostop_config.enabled and resources.autostop_config.down
    assert spec.evidence_dir == out
    assert spec.time_limit_s == parse_duration(spec.envs["RTV_TIME_LIMIT"]) > 0
    assert spec.job_deadline_s > spec.time_limit_s
    assert 'bash ci/node_install.sh "$RTV_VENV"' in spec.setup, "the node installs from the committed lock"
    assert spec.envs["RTV_TORCH_INDEX"].endswith("/cu" + spec.envs["RTV_CUDA"].replace(".", ""))
    assert '--nproc "$RTV_NPROC"' in spec.run and spec.envs["RTV_NPROC"] == str(count)
    assert "pytest tests/gpu" in spec.run and '--preset "$RTV_PRESET"' in spec.run
    if count == 8:
        assert '--preset "$RTV_BENCH_PRESET"' in spec.run and spec.envs["RTV_BENCH_PRESET"] == "gpu-8b"


@pytest.mark.parametrize("name", ["gate.sky.yaml", "canaries.sky.yaml", "canaries-2node.sky.yaml"])
def test_every_gpu_task_passes_the_hang_deadline_and_turns_on_the_nccl_flight_recorder(
    sky_sandbox, repo_root: Path, name: str
):
    """A hung GPU job ends by the watchdog (exit 7, its dumps framed home) well before the task's own limit."""
    from ci.tasks import load_task

    spec = load_task(repo_root / "ci" / name)
    runs = [line for line in spec.run.splitlines() if " run --preset" in line]
    assert runs and all('--hang-timeout "$RTV_HANG_TIMEOUT"' in line for line in runs), runs
    assert 0 < float(spec.envs["RTV_HANG_TIMEOUT"]) * 4 <= spec.time_limit_s
    assert spec.envs["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(spec.envs["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0


def _mutated(repo_root: Path, tmp_path: Path, change) -> Path:
    config = yaml.safe_load((repo_root / "ci" / "gate.sky.yaml").read_text())
    change(config)
    path = tmp_path / "task.sky.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


MALFORMED = {
    "misspelt field": (
        lambda c: c["resources"].update(acclerators=c["resources"].pop("accelerators")),
        "SkyPilot refused",
    ),
    "bad accelerator count": (lambda c: c["resources"].update(accelerators="H200:abc"), "SkyPilot refused"),
    "no autodown": (lambda c: c["resources"].pop("autostop"), "autostop"),
    "autostop without down": (lambda c: c["resources"]["autostop"].update(down=False), "autostop"),
    "no time limit": (lambda c: c.update(run="rtv run --preset gpu"), "timeout"),
    "no evidence folder": (lambda c: c["envs"].pop("RTV_OUT"), "RTV_OUT"),
    "bad time limit": (lambda c: c["envs"].update(RTV_TIME_LIMIT="forty minutes"), "RTV_TIME_LIMIT"),
    "no setup": (lambda c: c.pop("setup"), "setup"),
    "setup without its deadline": (lambda c: c.update(setup="make install"), "RTV_SETUP_LIMIT"),
    "no setup limit": (lambda c: c["envs"].pop("RTV_SETUP_LIMIT"), "RTV_SETUP_LIMIT"),
    "no expected records": (lambda c: c["envs"].pop("RTV_EXPECT"), "RTV_EXPECT"),
    "run keeps earlier records": (lambda c: c.update(run=c["run"].replace('rm -rf "$RTV_OUT"\n', "")), "rm -rf"),
    "run sends no evidence home": (lambda c: c.update(run=c["run"].rsplit("\n", 2)[0]), "ci.frames emit"),
    "nothing requested": (lambda c: c["resources"].pop("accelerators"), "accelerators"),
    "rtv run without the hang deadline": (
        lambda c: c.update(run=c["run"].replace(' --hang-timeout "$RTV_HANG_TIMEOUT"', "")),
        "--hang-timeout",
    ),
    "no hang deadline declared": (lambda c: c["envs"].pop("RTV_HANG_TIMEOUT"), "RTV_HANG_TIMEOUT"),
    "hang deadline past the time limit": (lambda c: c["envs"].update(RTV_HANG_TIMEOUT="2400"), "RTV_HANG_TIMEOUT"),
    "hang deadline not in seconds": (lambda c: c["envs"].update(RTV_HANG_TIMEOUT="5m"), "RTV_HANG_TIMEOUT"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_task_gives_a_clear_error(sky_sandbox, repo_root: Path, tmp_path: Path, case: str):
    from ci.tasks import TaskFileError, load_task
    from validation.errors import HarnessError

    change, names = MALFORMED[case]
    path = _mutated(repo_root, tmp_path, change)
    with pytest.raises(TaskFileError) as info:
        load_task(path)
    error = info.value
    assert isinstance(error, HarnessError) and error.exit_code == 2
    assert str(path) in error.cause and names in error.cause and error.fix


def test_the_unchanged_copy_loads(sky_sandbox, repo_root: Path, tmp_path: Path):
    """The mutation cases fail because of their mutation, not the copying."""
    from ci.tasks import load_task

    assert load_task(_mutated(repo_root, tmp_path, lambda c: None)).accelerators == {"H200": 2}


def test_a_missing_task_file_says_which_exist(tmp_path: Path):
    from ci.tasks import TaskFileError, load_task

    with pytest.raises(TaskFileError, match=r"ci/gate\.sky\.yaml"):
        load_task(tmp_path / "nope.sky.yaml")


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("30s", 30), ("40m", 2400), ("2h", 7200), ("1d", 86400)])
def test_durations_follow_timeouts_syntax(text: str, seconds: float):
    from ci.tasks import parse_duration

    assert parse_duration(text) == seconds


def test_the_two_node_task_runs_one_torchrun_world_across_its_nodes(sky_sandbox, repo_root: Path):
    from ci.tasks import load_task

    spec = load_task(repo_root / "ci" / "canaries-2node.sky.yaml", validate=True)
    (resources,) = spec.task.resources
    assert spec.num_nodes == 2 and resources.accelerators == {"H200": 8} and spec.gpus == 16
    assert resources.network_tier.value == "best"
    assert resources.autostop_config.enabled and resources.autostop_config.down
    for flag in (
        '--nnodes "$SKYPILOT_NUM_NODES"',
        '--node-rank "$SKYPILOT_NODE_RANK"',
        '--master-addr "$RTV_HEAD_IP"',
        '--nproc-per-node "$SKYPILOT_NUM_GPUS_PER_NODE"',
        '--master-port "$RTV_MASTER_PORT"',
    ):
        assert flag in spec.run, flag
    assert '"$SKYPILOT_NODE_IPS" | head -n 1' in spec.run, "the master is the first of the node IPs (the head)"
    assert "--nproc" not in spec.run.replace("--nproc-per-node", ""), "the world's size is the process count"


def test_a_cpu_variant_on_slurm_loads_too(sky_sandbox, repo_root: Path, tmp_path: Path):
    """The loopback-Slurm CI launches a CPU copy of the gate through the same contract."""
    from ci.tasks import load_task

    def to_slurm(config: dict) -> None:
        config["resources"] = {"infra": "slurm", "cpus": 1, "autostop": {"idle_minutes": 5, "down": True}}

    spec = load_task(_mutated(repo_root, tmp_path, to_slurm))
    assert spec.infra == "slurm" and spec.accelerators == {} and spec.gpus == 0


def test_envs_given_at_launch_override_the_file_before_the_checks(sky_sandbox, repo_root: Path):
    """``rtv gpu launch --env``: the override reaches the task and what the launcher fetches (RTV_OUT)."""
    from ci.tasks import TaskFileError, load_task

    plain = load_task(repo_root / "ci" / "gate.sky.yaml")
    spec = load_task(repo_root / "ci" / "gate.sky.yaml", envs={"RTV_OUT": "rtv-out/elsewhere", "EXTRA": "1"})
    assert plain.evidence_dir != "rtv-out/elsewhere"
    assert spec.evidence_dir == "rtv-out/elsewhere" and spec.task.envs["EXTRA"] == "1"
    with pytest.raises(TaskFileError, match="RTV_TIME_LIMIT"):  # an override is checked like the file
        load_task(repo_root / "ci" / "gate.sky.yaml", envs={"RTV_TIME_LIMIT": "soon"})


def test_the_tasks_expect_what_rtv_run_writes(sky_sandbox, repo_root: Path):
    """RTV_EXPECT lists the smoke and every registered canary (the 8-GPU task also ``rtv bench``'s two records:
    the benchmark and, on its default profile, the cost-growth sweep, NOTE [Cost growth])."""
    from canaries.registry import CANARIES
    from ci.tasks import load_task

    assert load_task(repo_root / "ci" / "gate.sky.yaml").expect == ("smoke", *CANARIES)
    assert load_task(repo_root / "ci" / "canaries-2node.sky.yaml").expect == ("smoke", *CANARIES)
    assert load_task(repo_root / "ci" / "canaries.sky.yaml").expect == ("smoke", *CANARIES, "benchmark", "benchmark")
