"""Pause costs (NOTE [Pause costs] in ``canaries/benchmark/pauses.py``): their statistics, bytes and report.

The statistics are checked on hand-built blocks against ``scipy.stats.quantile_test``
and medians taken by hand; the bytes against the save's own manifest, and a
publication's against the checkpoint's own tensors; one real block on the tiny
shape (``compare`` stood in by one ``run_block``) checks that every arm runs and
each publication reaches the one engine at a newer version; one run on the tiny
shape with a counting clock checks the plumbing (every arm timed in the same
blocks as the step).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import scipy.stats as sps

import reference_trainer as rt
from canaries.benchmark import pauses
from canaries.benchmark.pauses import PAUSE_ARMS, measure_pauses, saved_bytes
from reports.benchmark import _pauses_table, pause_line
from tests.benchmark_fakes import TINY, FakeProbe
from validation import stats
from validation.abba import Comparison, run_block
from validation.trainers import trainer_with_policy


def comparison(arm: list[float], step: list[float], loaded: tuple[int, ...], name: str = "save") -> Comparison:
    ratios = tuple(a / s for a, s in zip(arm, step))
    kept = [r for i, r in enumerate(ratios) if i not in loaded]
    return Comparison(
        arm=name,
        baseline="step",
        gate=0.05,
        blocks=len(kept),
        ratio=float(np.median(kept)) if kept else float("nan"),
        ci95=(0.5, 2.0),
        confidence=0.95,
        drift=stats.Drift(0.0, 1.0, False),
        loaded=loaded,
        verdict="regression",
        looks=(len(kept),),
        ratios=ratios,
        arm_seconds=tuple(arm),
        baseline_seconds=tuple(step),
    )


def test_a_pause_is_its_median_seconds_with_the_order_statistic_interval_of_the_unloaded_blocks() -> None:
    rng = np.random.default_rng(3)
    arm, step = list(rng.uniform(2.0, 3.0, 12)), list(rng.uniform(0.9, 1.1, 12))
    arm[4] = 50.0  # a loaded block: left out
    found = pauses._summary(comparison(arm, step, loaded=(4,)))
    kept = [a for i, a in enumerate(arm) if i != 4]
    extra = [a - s for i, (a, s) in enumerate(zip(arm, step)) if i != 4]
    assert found["seconds"] == pytest.approx(sorted(kept)[5])  # 11 values: the 6th
    oracle = sps.quantile_test(kept, q=1.0, p=0.5).confidence_interval(0.95)
    assert found["seconds_ci"] == [pytest.approx(oracle.low), pytest.approx(oracle.high)]
    oracle = sps.quantile_test(extra, q=0.0, p=0.5).confidence_interval(0.95)
    assert found["extra_seconds_ci"] == [pytest.approx(oracle.low), pytest.approx(oracle.high)]
    assert found["ratio_ci"] == [0.5, 2.0] and found["blocks"] == 11
    assert found["reading"] == "measured", "a pause has no verdict (Rule 2)"


def test_a_run_whose_blocks_were_all_loaded_has_no_number_and_says_why() -> None:
    result = comparison([2.0, 2.0], [1.0, 1.0], loaded=(0, 1))
    result = Comparison(**{**result.__dict__, "verdict": "inconclusive", "load": "2 of 2 blocks loaded"})
    found = pauses._summary(result)
    assert np.isnan(found["seconds"]) and found["reading"].startswith("inconclusive (loaded: 2 of 2")


def test_the_bytes_of_a_save_are_its_manifests_files_and_the_manifest(tmp_path: Path) -> None:
    trainer = trainer_with_policy(lora=rt.LoRAConfig(rank=2))
    for _ in range(2):  # the second save replaces the first: only the one in force counts
        trainer.save(tmp_path / "save")
    (folder,) = (tmp_path / "save").glob("save-*")
    (tmp_path / "save" / "save-000000").mkdir()  # what a writer killed before its LATEST left: not in force
    (tmp_path / "save" / "save-000000" / "weights.bin").write_bytes(b"x" * 1000)
    manifest = json.loads((folder / "manifest.json").read_text())
    listed = sum(entry["bytes"] for entry in manifest["files"].values())
    assert saved_bytes(tmp_path / "save") == listed + (folder / "manifest.json").stat().st_size


def one_block(arms: dict, *, baseline: str, clock, **_) -> list[Comparison]:
    """``compare`` stood in by block 0 alone (A B B A: the last arm, ``publish``, runs twice in a row)."""
    times = run_block(arms, 0, clock)
    return [comparison([times[name]], [times[baseline]], loaded=(), name=name) for name in arms if name != baseline]


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_every_publication_reaches_the_one_engine_newer_and_sends_the_checkpoints_tensors(
    monkeypatch: pytest.MonkeyPatch, lora: bool
) -> None:
    published: list[tuple[rt.Trainer, rt.PublicationReport]] = []
    publish = rt.Trainer.publish

    def spy(self: rt.Trainer, engine: rt.RolloutEngine, **options) -> rt.PublicationReport:
        published.append((self, publish(self, engine, **options)))
        return published[-1][1]

    monkeypatch.setattr(rt.Trainer, "publish", spy)
    monkeypatch.setattr(pauses, "compare", one_block)
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # the saves' durability is not this test's: no disk waits
    workload = dataclasses.replace(TINY, lora=lora)
    ticks = itertools.count()
    found = measure_pauses(workload, "quick", clock=lambda: float(next(ticks)), load_probe=FakeProbe())
    assert [a["arm"] for a in found["arms"]] == list(PAUSE_ARMS) and "publish" in PAUSE_ARMS
    assert len(published) == 3, "one publication before the blocks, then the publish arm's two runs in block 0"
    reports = [report for _, report in published]
    assert all(r.switched and r.mode == "drain" for r in reports), "an idle engine switches at once"
    assert [r.previous for r in reports] == [None] + [r.version for r in reports[:-1]], "one engine, built once"
    revisions = [r.version.revision for r in reports]
    assert revisions == sorted(set(revisions)), "each publication is a newer revision"
    checkpoint = published[0][0].checkpoint("policy")
    sent = sum(p.numel() * p.element_size() for p in checkpoint.parameters())
    assert found["published_bytes"] == sent and sent > 0
    if lora:  # an adapter sends its factors only
        assert sent < sum(p.numel() * p.element_size() for p in published[0][0].model.parameters())


@pytest.mark.slow  # 32 real steps, saves (fsynced) and loads of the tiny shape: seconds on a busy disk
def test_every_pause_is_timed_in_the_same_blocks_as_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that counts its readings: every run lasts one tick, so every pause is exactly one step."""
    ticks = itertools.count()
    monkeypatch.setitem(pauses.PAUSE_BLOCKS, "quick", (2, 1e9))  # a budget the ticks never spend
    found = measure_pauses(TINY, "quick", clock=lambda: float(next(ticks)), load_probe=FakeProbe())
    assert [a["arm"] for a in found["arms"]] == list(PAUSE_ARMS) and found["workload"] == TINY.label
    for arm in found["arms"]:
        assert (arm["blocks"], arm["ratio"], arm["seconds"], arm["extra_seconds"]) == (2, 1.0, 1.0, 0.0), arm
    assert found["bytes"] > 0 and found["published_bytes"] > 0 and found["step_seconds"] == 1.0


PAUSES = {
    "workload": "small 4x64 full",
    "bytes": 3 * 2**20,
    "step_seconds": 0.25,
    "arms": [
        {
            "arm": "save",
            "blocks": 8,
            "ratio": 0.8,
            "ratio_ci": [0.7, 0.9],
            "seconds": 0.2,
            "seconds_ci": [0.18, 0.22],
            "extra_seconds": -0.05,
            "extra_seconds_ci": [-0.07, -0.03],
            "reading": "measured",
        },
        {
            "arm": "load",
            "blocks": 8,
            "ratio": 0.4,
            "ratio_ci": [0.35, 0.45],
            "seconds": 0.1,
            "seconds_ci": [0.09, 0.11],
            "extra_seconds": -0.15,
            "extra_seconds_ci": [-0.16, -0.14],
            "reading": "measured",
        },
        {
            "arm": "offload",
            "blocks": 8,
            "ratio": 1.2,
            "ratio_ci": [1.1, 1.3],
            "seconds": 0.3,
            "seconds_ci": [0.28, 0.32],
            "extra_seconds": 0.05,
            "extra_seconds_ci": [0.04, 0.06],
            "reading": "measured",
        },
        {
            "arm": "publish",
            "blocks": 8,
            "ratio": 1.1,
            "ratio_ci": [1.05, 1.15],
            "seconds": 0.27,
            "seconds_ci": [0.26, 0.28],
            "extra_seconds": 0.02,
            "extra_seconds_ci": [0.01, 0.03],
            "reading": "measured",
        },
    ],
    "published_bytes": 3 * 2**19,
}


def test_the_report_shows_each_pause_with_its_intervals_and_the_bytes_of_a_save_and_a_publication() -> None:
    line = pause_line(PAUSES)
    assert "a save 0.80 [0.70..0.90] of a step, writing 3.00 MiB" in line
    assert "a load 0.40 [0.35..0.45]" in line and "demoted to offload +0.05 s [0.04..0.06]" in line
    assert "a weight publication +0.02 s [0.01..0.03], sending 1.50 MiB" in line
    table = _pauses_table(PAUSES)
    assert list(table["pause"]) == [
        "trainer.save",
        "Trainer.load",
        "a forward demoted to offload",
        "trainer.publish (after its step)",
    ]
    assert list(table["bytes written"]) == [3 * 2**20, "n/a", "n/a", "n/a"]
    assert list(table["bytes sent"]) == ["n/a", "n/a", "n/a", 3 * 2**19]
    assert table.loc[0, "seconds CI"] == "[0.18, 0.22]" and table.loc[2, "× step CI"] == "[1.100, 1.300]"
    assert table.loc[3, "extra s CI"] == "[0.01, 0.03]"
    assert _pauses_table(None).empty, "a record without pauses shows an empty table"


def test_a_record_from_before_the_publish_arm_reads_without_it() -> None:
    older = {key: value for key, value in PAUSES.items() if key != "published_bytes"}
    older["arms"] = [a for a in PAUSES["arms"] if a["arm"] != "publish"]
    assert "publication" not in pause_line(older) and len(_pauses_table(older)) == 3
