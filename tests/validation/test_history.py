"""The benchmark history store and its change points (synthetic records, no timing)."""

from __future__ import annotations

import copy
import functools
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from validation import history
from validation.evidence import make_record

NOISE = 0.01  # per-commit relative noise of the synthetic series


@functools.cache
def _made() -> dict:
    """One real record (environment and source fingerprints), made once: the synthetic ones copy it."""
    return make_record("benchmark", config={}, checks={"ran": True}, measurements={})


def _record(commit: str, seconds: float, rng: np.random.Generator, cores: int | None = None) -> dict:
    blocks = list(seconds * rng.lognormal(0.0, NOISE / 4, 8))  # the blocks of one run scatter less than runs do
    group = {
        "label": "small 4x64 full",
        "comparisons": [{"arm": "retain@s0", "arm_seconds": blocks, "baseline_seconds": [1.0] * 8, "confidence": 0.95}],
    }
    record = copy.deepcopy(_made())
    record["measurements"] = {"groups": [group]}
    record["source"] = {"git_commit": commit, "sha256": f"digest-{commit}"}
    if cores is not None:
        record["environment"]["cpu_count"] = cores
    return record


def _store(
    path: Path,
    seed: int,
    step_at: int | None,
    cores: int | None = None,
    size: float = 0.05,
    back_at: int | None = None,
    commits: int = 12,
) -> None:
    rng = np.random.default_rng(seed)
    for n in range(1, commits + 1):
        level = 1.0 + (size if step_at is not None and n >= step_at and (back_at is None or n < back_at) else 0.0)
        history.append(path, _record(f"c{n:02d}", level * rng.lognormal(0.0, NOISE), rng, cores))


def _retain(path: Path) -> list[history.Series]:
    return [s for s in history.series(history.load(path)) if s.arm == "retain@s0"]


@pytest.mark.parametrize("seed", range(4))
def test_a_five_percent_step_at_commit_8_is_a_regression_named_at_commit_8(tmp_path: Path, seed: int) -> None:
    _store(tmp_path / "h.sqlite", seed, step_at=8)
    (found,) = _retain(tmp_path / "h.sqlite")
    assert found.verdict == "regression" and [c.commit for c in found.changes] == ["c08"], found.changes
    assert found.changes[0].change == pytest.approx(0.05, abs=0.02)


@pytest.mark.parametrize("seed", range(4))
def test_a_flat_series_with_the_same_noise_has_no_change(tmp_path: Path, seed: int) -> None:
    _store(tmp_path / "h.sqlite", seed, step_at=None)
    (found,) = _retain(tmp_path / "h.sqlite")
    assert found.changes == () and found.verdict == "no change"


def _simulated(seed: int, step_at: int | None) -> np.ndarray:
    """One series as the store holds it: per-commit noise, times the median of 8 blocks' own scatter."""
    rng = np.random.default_rng(seed)
    return np.array(
        [
            (1.05 if step_at is not None and n >= step_at else 1.0)
            * rng.lognormal(0, NOISE)
            * np.median(rng.lognormal(0, NOISE / 4, 8))
            for n in range(1, 13)
        ]
    )


@pytest.mark.slow  # a Monte Carlo property over many series (about 0.7 s)
def test_over_many_series_a_flat_one_is_never_a_regression_and_a_step_nearly_always_is() -> None:
    """The rates NOTE [Benchmark history] Rule 4 states, on 200 simulated series of each kind."""
    flat = [history.detect(_simulated(seed, None)) for seed in range(1000, 1200)]
    stepped = [history.detect(_simulated(seed, 8)) for seed in range(1000, 1200)]
    assert not any(c[3] == "regression" for found in flat for c in found)
    assert sum(bool(found) for found in flat) <= 0.12 * len(flat)
    assert sum([(c[0], c[3]) for c in found] == [(7, "regression")] for found in stepped) >= 0.9 * len(stepped)


def test_a_faster_step_is_an_improvement_and_a_short_series_is_insufficient_data(tmp_path: Path) -> None:
    _store(tmp_path / "h.sqlite", 0, step_at=8, size=-0.05)
    assert _retain(tmp_path / "h.sqlite")[0].verdict == "improvement"
    rng = np.random.default_rng(0)
    for n in range(3):
        history.append(tmp_path / "short.sqlite", _record(f"c{n}", 1.0, rng))
    assert _retain(tmp_path / "short.sqlite")[0].verdict == "insufficient data"


@pytest.mark.parametrize("seed", range(2))
def test_each_change_is_judged_on_its_own_segments(tmp_path: Path, seed: int) -> None:
    """Up 5% at commit 7 and back at 13: a regression named at c07, an improvement at c13 (segments of 6)."""
    _store(tmp_path / "h.sqlite", seed, step_at=7, back_at=13, commits=18)
    (found,) = _retain(tmp_path / "h.sqlite")
    assert [(c.commit, c.verdict) for c in found.changes] == [("c07", "regression"), ("c13", "improvement")]
    assert found.verdict == "regression"


@pytest.mark.parametrize("seed", range(2))
def test_a_step_at_the_last_two_commits_is_only_suspicious(tmp_path: Path, seed: int) -> None:
    """Two commits after a change cannot reach p < 0.01 (Mann-Whitney, 2 against 10): suspicious, not a regression."""
    _store(tmp_path / "h.sqlite", seed, step_at=11)
    (found,) = _retain(tmp_path / "h.sqlite")
    assert [(c.commit, c.verdict) for c in found.changes] == [("c11", "suspicious")] and found.verdict == "suspicious"


def test_two_machine_identities_never_mix(tmp_path: Path) -> None:
    """The first 6 commits on one machine, the other 6 on a machine 5% slower: no change on either, two series."""
    path, rng = tmp_path / "h.sqlite", np.random.default_rng(1)
    for n in range(1, 13):
        fast = n <= 6
        history.append(
            path, _record(f"c{n:02d}", (1.0 if fast else 1.05) * rng.lognormal(0, NOISE), rng, cores=2 if fast else 64)
        )
    found = _retain(path)
    assert len(found) == 2 and len({s.machine_id for s in found}) == 2
    assert [len(s.commits) for s in found] == [6, 6] and all(s.verdict == "no change" for s in found)
    merged = history.load(path).assign(machine_id="one")  # negative control: one machine, the step shows
    assert [s.verdict for s in history.series(merged) if s.arm == "retain@s0"] == ["regression"]


def test_a_store_of_the_older_schema_still_loads_and_takes_new_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:  # schema 1, as it was written: no interval columns
        db.execute(f"CREATE TABLE results ({', '.join(history.V1_COLUMNS)})")
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
        db.execute("INSERT INTO meta VALUES ('schema', '1')")
        db.execute(
            f"INSERT INTO results VALUES ({', '.join('?' * len(history.V1_COLUMNS))})",
            ("2026-01-01", "old.json", "c00", "d", "retain@s0", "small 4x64 full", "m", "{}", 1.0),
        )
    history.append(path, _record("c01", 1.0, np.random.default_rng(0)))
    table = history.load(path, arm="retain@s0")
    assert list(table["commit_id"]) == ["c00", "c01"] and np.isnan(table["ci_low"][0]) and table["ci_low"][1] > 0


def test_commits_keep_their_history_order_not_their_hash_order(tmp_path: Path) -> None:
    """Real commit ids do not sort in history order: the series and its change point follow the order recorded."""
    import hashlib

    rng = np.random.default_rng(0)
    commits = [hashlib.sha1(str(n).encode()).hexdigest() for n in range(1, 13)]
    assert commits != sorted(commits), "the ids must not already be in hash order"
    for n, commit in enumerate(commits, start=1):
        history.append(
            tmp_path / "h.sqlite", _record(commit, (1.05 if n >= 8 else 1.0) * rng.lognormal(0.0, NOISE), rng)
        )
    (found,) = _retain(tmp_path / "h.sqlite")
    assert found.commits == tuple(commits)
    assert found.verdict == "regression" and [c.commit for c in found.changes] == [commits[7]], found.changes


def test_the_history_page_colours_a_verdict_from_the_fixed_vocabulary_never_from_its_text(tmp_path: Path) -> None:
    from reports.classes import CLASSES
    from reports.history import render_history

    _store(tmp_path / "h.sqlite", 0, step_at=8)
    (found,) = _retain(tmp_path / "h.sqlite")
    assert found.verdict == "regression"  # a shown verdict: the page must not paint it as a failure
    page = render_history([found], "history", tmp_path / "out" / "history.md").html.read_text()
    used = set(re.findall(r"class='([^']*)'", page))
    assert used and used <= set(CLASSES), used
    assert "class='shown'>regression<" in page
