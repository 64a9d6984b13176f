"""A job saved on one process resumes on two and back (L=4), bitwise (NOTE [Resume] Rule 5).

The oracle is the job run on one process without stopping, saving on the way
(saving changes nothing it computes): the saves made at W=1 and at W=2 at the
same step must be byte-identical (the same digests in their manifests), and
the resumed job must end bitwise where the uninterrupted one ends. The one
exception is the saving trainer's identity and lineage in ``trainer.json``
(NOTE [Resume] Rule 2): unique per trainer by design, so they are compared
apart: every other byte of ``trainer.json`` must match.
"""

from __future__ import annotations

import json
from pathlib import Path

import dist_scenarios as ds
import numpy as np
import pytest
import resume_job as job

from tests.support import assert_nested_equal
from validation.spawn import spawn_ranks

pytestmark = pytest.mark.dist


def _folder(root: Path) -> Path:
    return root / (root / "LATEST").read_text().split()[0]


def _lineage(root: Path) -> tuple[str, set[str]]:
    """The saving trainer's identity and lineage."""
    meta = json.loads((_folder(root) / "trainer.json").read_text())
    return meta["identity"], set(meta["lineage"])


def _digests(root: Path) -> dict[str, object]:
    """Every file's digest, but ``trainer.json``'s content less the identity and lineage (the docstring)."""
    folder = _folder(root)
    digests: dict[str, object] = {
        name: entry["sha256"] for name, entry in json.loads((folder / "manifest.json").read_text())["files"].items()
    }
    meta = json.loads((folder / "trainer.json").read_text())
    digests["trainer.json"] = {k: v for k, v in meta.items() if k not in ("identity", "lineage")}
    return digests


@pytest.mark.slow  # spawns one and two processes in turn; saves with pending work across W=2 are in the two-process suite
def test_saved_on_one_process_restored_on_two_and_back_is_byte_identical_and_bitwise_equal(tmp_path, one_thread):
    straight = {2: tmp_path / "straight-2", 4: tmp_path / "straight-4"}
    expected = job.segment(None, None, 0, 6, {k: str(v) for k, v in straight.items()})
    first = job.segment(None, str(tmp_path / "w1"), 0, 2)
    # The W=2 job saves once right after the load, before any run_logical (no logical layout yet), and at the end.
    two = spawn_ranks(job.segment, 2, str(tmp_path / "w1"), str(tmp_path / "w2"), 2, 4, {2: str(tmp_path / "w2-at-load")},
                      str(tmp_path / "w1" / "LATEST"), timeout_s=120.0)
    # Rank 0 alone writes; its refusal (a file where a folder must be) is raised on every process, as the same
    # typed error, under logical ranks and before any (a plain process group).
    assert [r["refused"] for r in two] == ["path", "path"]
    assert [r["refused_before_logical"] for r in two] == ["path", "path"]
    back = job.segment(str(tmp_path / "w2"), None, 4, 6)
    assert _digests(tmp_path / "w1") == _digests(straight[2]), "W=1 save differs from the uninterrupted run's"
    assert _digests(tmp_path / "w2") == _digests(straight[4]), "the W=2 save is not byte-identical to the W=1 one"
    assert _digests(tmp_path / "w2-at-load") == _digests(straight[2]), "a W=2 save before run_logical differs"
    assert sorted(p.name for p in (tmp_path / "w2-at-load").iterdir()) == [".lock", "LATEST", "save-000001"], "more than one writer"
    # Each load adds the saver to the lineage, across processes too (NOTE [Resume] Rule 2).
    w1, w2 = _lineage(tmp_path / "w1"), _lineage(tmp_path / "w2")
    assert w1[1] == set() and w2[1] == {w1[0]} and w2[0] != w1[0]
    for rank, result in enumerate(two):
        assert_nested_equal(result["loaded"], first["final"], f"rank {rank} after the load")
        assert_nested_equal(result["final"], two[0]["final"], f"rank {rank} at the end")
    assert_nested_equal(back["loaded"], two[0]["final"], "W=1 after loading the W=2 save")
    assert_nested_equal(back["final"], expected["final"], "resumed vs uninterrupted")
    assert any(a.tobytes() != b.tobytes() for a, b in zip(
        first["final"]["state"]["parameters"].values(), back["final"]["state"]["parameters"].values())), "training changed nothing"


@pytest.mark.parametrize("mode", ["rank", "zero", "plain"])
def test_a_save_keeps_the_version_a_forward_pending_on_another_process_used(two_process, mode, one_thread):
    """A forward pending on physical rank 1 (NOTE [Logical ranks] Rule 2) has its version kept, at its bound, as at
    W=1, and (rank mode) the current log-probs its correction would use: the W=2 save is byte-identical and the
    forward made again after the load runs on exactly its weights."""
    single = ds.stale_pending_save(0, mode)
    assert single["kept"] == [[[0, 2]]] and len(single["remade"]) == (0 if mode == "zero" else 2)
    assert single["logprob_rows"] == (2 if mode == "rank" else 0), "rank mode: logical rank 1's rows for its correction"
    for rank in (0, 1):
        entry = two_process["ranks"][rank][f"stale-pending-save/{mode}"]
        assert "crash" not in entry, entry.get("crash")
        facts = entry["value"]
        assert facts["kept"] == single["kept"], f"rank {rank}: the save left out a version rank 1's forward used"
        assert facts["digests"] == single["digests"], f"rank {rank}: the W=2 save differs from the W=1 one"
    remade = two_process["ranks"][1][f"stale-pending-save/{mode}"]["value"]["remade"]
    assert isinstance(remade, list) and len(remade) == len(single["remade"]), remade
    for made, again in remade:
        assert np.array_equal(made, again), "the forward made again did not run on its saved weights"
