"""The memory-lifetime canary and the censuses it stands on (validation.memory).

What they check: docs/semantics.md#transactions, docs/semantics.md#placements-and-memory-admission and
docs/semantics.md#logical-ranks.

Negative controls: a record the trainer forgets to let go must be flagged at
every release point, and the "offload that aliases instead of copies"
mutation (``canaries.mutations.catalogue``) must fail the canary for the right reasons.
The censuses themselves are tested in ``tests/validation/test_memory.py``.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

from canaries.memory import canary as memory
from canaries.memory.intersections import SCENARIOS
from canaries.memory.lifecycle import POINTS
from canaries.memory.scale import SCALE_CHECKS
from canaries.mutations.catalogue import mutation
from canaries.presets import PLACEMENTS
from canaries.registry import canary
from canaries.request import canary_run
from reference_trainer.records import RecordTable
from validation.errors import SetupError
from validation.evidence import verify

OFFLOAD_CHECKS = {
    "offload: census device bytes within the trainer's own accounting",
    "offload: no activation outlives the forward",
    "offload: device bytes after forward fall to replay's floor",
    "offload: host copies hold what retain keeps on the device",
}


def _run(tmp: Path, preset: str = "cpu") -> tuple[dict, str, Path]:
    lines: list[str] = []
    path = canary("memory").run(canary_run(preset, "quick", echo=lines.append), tmp)
    return verify(path), "\n".join(lines), path


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    """One unmutated run of the CPU preset, shared by the tests that read it."""
    return _run(tmp_path_factory.mktemp("memory"))


# --- the canary -------------------------------------------------------------------------


def test_canary_passes_on_the_reference_trainer_and_writes_verified_evidence(clean) -> None:
    record, stdout, path = clean
    assert record["kind"] == memory.KIND and record["passed"] is True, stdout
    checks = record["checks"]
    for p in PLACEMENTS:
        for name in (
            "census sees the pending graph after forward",
            "nothing outlives backward",
            "nothing outlives a dropped output",
            "nothing outlives a failed commit once the error is dropped",
            "previous logical batch freed before the next pull",
        ):
            assert checks[f"{p}: {name}"] is True
    assert OFFLOAD_CHECKS <= set(checks)
    assert {name for name in checks if name.startswith("admission:")} and not any(n.startswith("cuda") for n in checks)
    # NOTE [Admission intersections] Rules 1 and 2: held <= admitted, after every forward and per scenario.
    assert checks["admission: held <= admitted after every forward"] is True
    for name in SCENARIOS:
        assert checks[f"admission: {name}: held <= admitted"] is True
    # One line per check, in order of making, and the record path last.
    lines = stdout.splitlines()
    assert sum(line.startswith(("PASS  ", "FAIL  ")) for line in lines) == len(checks)
    assert lines[-1] == f"wrote {path}"
    assert record["config"]["profile"] == "quick" and record["config"]["points"] == list(POINTS)


def test_bytes_are_held_while_pending_and_gone_at_every_release_point(clean) -> None:
    record, _, _ = clean
    held = record["measurements"]["lifecycle_bytes"]
    assert set(held) == set(PLACEMENTS) and all(set(held[p]) == set(POINTS) for p in held)
    retain, offload, replay = (held[p]["after_forward"] for p in PLACEMENTS)
    assert retain["device"] > 10 * replay["device"] > 0
    assert (
        offload["device"] == replay["device"]
        and offload["host"] - replay["host"] == retain["device"] - replay["device"]
    )
    for p in PLACEMENTS:
        for point in ("after_backward", "after_drop", "after_failed_commit", "before_next_logical_batch"):
            assert held[p][point] == {"device": 0, "host": 0}, (p, point)
        assert record["measurements"]["lifecycle_values"][p]["held_with_error_after_failed_commit"]["device"] == 0


def test_admission_stays_within_a_limit_that_binds(clean) -> None:
    record, _, _ = clean
    admission = record["measurements"]["admission"]
    limit = admission["limit_bytes"]
    assert set(admission["placements"]) - {"retain"}, "the limit must force offload or replay"
    assert max(admission["predicted_bytes"]) <= limit
    assert 0 < admission["census_peak_device"] <= limit
    assert admission["census_peak_host"] <= admission["host_limit_bytes"]


def test_cuda_checks_are_reported_as_skipped_on_cpu(clean) -> None:
    record, stdout, _ = clean
    skipped = record["skips"]
    assert set(skipped) == set(memory.CUDA_CHECKS) | set(SCALE_CHECKS)
    assert all("runs on cpu" in skipped[name] for name in memory.CUDA_CHECKS)
    assert all("--profile default runs it" in skipped[name] for name in SCALE_CHECKS), "quick leaves it, and says so"
    assert all(f"SKIP  {name}" in stdout for name in memory.CUDA_CHECKS)


def test_offload_that_aliases_instead_of_copying_is_caught(tmp_path: Path) -> None:
    with mutation("offload_alias").apply():
        record, _, _ = _run(tmp_path / "mutated")
    failed = {name for name, ok in record["checks"].items() if not ok}
    assert record["passed"] is False and failed == OFFLOAD_CHECKS, failed
    details = record["details"]
    assert "still allocated" in details["offload: no activation outlives the forward"]
    # The bug lived only inside its block: the same canary passes again afterwards.
    assert _run(tmp_path / "after")[0]["passed"] is True


def test_a_trainer_that_keeps_released_records_fails_every_release_point(tmp_path: Path) -> None:
    """Negative control for the lifecycle censuses: records kept after release must be flagged."""
    kept: list[object] = []
    release = RecordTable.release

    def keeping_release(self: RecordTable, record: object) -> None:
        kept.append((record, record.root, record.ledger, record.batch))  # what release would drop
        release(self, record)

    with mock.patch.object(RecordTable, "release", keeping_release):
        record, _, _ = _run(tmp_path)
    failed = {name for name, ok in record["checks"].items() if not ok}
    for p in PLACEMENTS:
        assert {
            f"{p}: nothing outlives backward",
            f"{p}: nothing outlives a dropped output",
            f"{p}: nothing outlives a failed commit once the error is dropped",
            f"{p}: previous logical batch freed before the next pull",
        } <= failed, failed


def test_unknown_preset_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(SetupError, match="unknown preset 'tpu'") as info:
        canary("memory").run(canary_run("tpu", "quick"), tmp_path)
    assert "cpu" in info.value.fix
    assert list(tmp_path.iterdir()) == []
