"""Failover alternatives in a task file (SkyPilot's any_of / ordered): labelled, autodown-capable, and on the receipt.

Task files are the gate's with its one resources entry replaced; SkyPilot
parses them (``sky.Task.from_yaml``) and answers the autodown question
(``check_features_are_supported``) itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

AUTOSTOP = {"idle_minutes": 10, "down": True}


def _alternative(infra: str, gpus: int, label: str | None) -> dict:
    entry = {"infra": infra, "accelerators": f"H200:{gpus}"}
    if label is not None:
        entry["labels"] = {"rtv-alternative": label}
    return entry


def _task(repo_root: Path, tmp_path: Path, entries: list[dict], how: str = "any_of") -> Path:
    config = yaml.safe_load((repo_root / "ci" / "gate.sky.yaml").read_text())
    config["resources"] = {"autostop": AUTOSTOP, how: entries}
    path = tmp_path / "failover.sky.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


RUNPOD, NEBIUS = _alternative("runpod", 2, "runpod-h200x2"), _alternative("nebius", 8, "nebius-h200x8")


@pytest.mark.parametrize("how", ["any_of", "ordered"])
def test_labelled_alternatives_load_and_the_job_needs_the_smallest(sky_sandbox, repo_root, tmp_path, how):
    from ci.tasks import load_task

    spec = load_task(_task(repo_root, tmp_path, [NEBIUS, RUNPOD], how))
    assert spec.alternatives() == ["nebius-h200x8", "runpod-h200x2"]
    assert spec.accelerators == {"H200": 2} and spec.requested()["alternatives"] == spec.alternatives()
    assert all(res.autostop_config.down for res in spec.task.resources), "the top-level autostop holds for each"


@pytest.mark.parametrize(
    ("entries", "names"),
    [
        ([RUNPOD, _alternative("nebius", 8, None)], "unique `labels: {rtv-alternative: NAME}`"),
        ([RUNPOD, _alternative("nebius", 8, "runpod-h200x2")], "unique `labels: {rtv-alternative: NAME}`"),
        ([RUNPOD, _alternative("hyperbolic", 2, "hyperbolic-h200x2")], "cannot autodown"),
    ],
)
def test_an_unlabelled_duplicate_or_autodownless_alternative_is_refused(
    sky_sandbox, repo_root, tmp_path, entries, names
):
    from ci.tasks import TaskFileError, load_task

    with pytest.raises(TaskFileError) as info:
        load_task(_task(repo_root, tmp_path, entries))
    assert names in info.value.cause and info.value.fix
    if "autodown" in names:
        assert "hyperbolic-h200x2" in info.value.cause and "Auto-down not supported" in info.value.cause


def test_the_receipt_says_which_alternative_ran_and_every_one_carries_the_cluster_label(
    sky_fake, sky_sandbox, repo_root, tmp_path
):
    from ci.launcher import LABEL
    from ci.tasks import load_task

    from .test_launcher import launch, receipt_of

    fake = sky_fake.FakeSky()
    spec = load_task(_task(repo_root, tmp_path, [NEBIUS, RUNPOD], "ordered"))
    outcome = launch(fake, spec, tmp_path / "out")
    measurements = receipt_of(outcome)["measurements"]
    assert measurements["alternative"] == "nebius-h200x8", "an ordered list's first is what SkyPilot tries first"
    assert measurements["requested"]["alternatives"] == ["nebius-h200x8", "runpod-h200x2"]
    (sent,) = fake.server.tasks
    assert isinstance(sent.resources, list) and len(sent.resources) == 2
    (cluster,) = {res.labels[LABEL] for res in sent.resources}  # the census finds it whichever alternative ran
    assert cluster == measurements["cluster"]
    assert {res.labels["rtv-alternative"] for res in sent.resources} == {"nebius-h200x8", "runpod-h200x2"}


def test_one_entry_records_no_alternative(sky_fake, gate, tmp_path):
    from .test_launcher import launch, receipt_of

    assert receipt_of(launch(sky_fake.FakeSky(), gate, tmp_path))["measurements"]["alternative"] is None
