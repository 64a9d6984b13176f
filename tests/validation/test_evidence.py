"""Write-once evidence (validation.evidence): schema, tamper detection, idempotence, atomic writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest

from tests.support import checkless_passed_record
from validation import evidence
from validation.evidence import SCHEMA_VERSION, Checks, EvidenceError, make_record, verify, write_once


def _record(**measurements) -> dict:
    return make_record(
        "test-kind",
        config={"preset": "cpu", "seed": 0},
        checks={"bytes freed": True, "peak within limit": True},
        measurements={"peak_bytes": 1234, "series": [1, 2, 3], **measurements},
    )


def _rewrite(path: Path, change) -> None:
    """Edit a written record the way a careless hand would (the digest is left as it was)."""
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def test_a_written_record_verifies_against_its_schema(tmp_path: Path) -> None:
    path = write_once(tmp_path / "r.json", _record())
    record = verify(path)
    assert record["schema_version"] == SCHEMA_VERSION and record["kind"] == "test-kind"
    assert record["passed"] is True and record["measurements"]["peak_bytes"] == 1234
    assert {"sha256", "git_commit"} <= set(record["source"]) and record["environment"]["torch"]


def test_passed_needs_at_least_one_check_and_all_of_them() -> None:
    assert make_record("k", config={}, checks={}, measurements={})["passed"] is False
    assert make_record("k", config={}, checks={"a": True, "b": False}, measurements={})["passed"] is False


def test_a_record_without_checks_that_says_passed_does_not_verify(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    with pytest.raises(EvidenceError, match="'passed' disagrees with its checks"):
        write_once(path, checkless_passed_record())
    assert not path.exists()
    path.write_text(json.dumps(checkless_passed_record()))
    with pytest.raises(EvidenceError, match="'passed' disagrees with its checks"):
        verify(path)


@pytest.mark.parametrize(
    "what,change",
    [
        ("a measured value", lambda r: r["measurements"].__setitem__("peak_bytes", 1)),
        ("a check's verdict", lambda r: r["checks"].__setitem__("bytes freed", False)),
        ("the verdict alone", lambda r: r.__setitem__("passed", False)),
        ("a config value", lambda r: r["config"].__setitem__("seed", 1)),
        ("a dropped measurement", lambda r: r["measurements"].pop("series")),
        ("an added field", lambda r: r.__setitem__("note", "looks fine")),
    ],
)
def test_tampering_is_detected(tmp_path: Path, what: str, change) -> None:
    path = write_once(tmp_path / "r.json", _record())
    _rewrite(path, change)
    with pytest.raises(EvidenceError, match=r"digest|disagrees"):
        verify(path)


@pytest.mark.parametrize("field", ["checks", "digest", "source", "schema_version"])
def test_a_dropped_field_is_detected_and_named(tmp_path: Path, field: str) -> None:
    path = write_once(tmp_path / "r.json", _record())
    _rewrite(path, lambda r: r.pop(field))
    with pytest.raises(EvidenceError, match=f"missing \\['{field}'\\]"):
        verify(path)


@pytest.mark.parametrize(
    "field,value", [("checks", [["bytes freed", True]]), ("passed", "yes"), ("schema_version", True), ("config", None)]
)
def test_a_field_of_the_wrong_type_is_a_typed_error(tmp_path: Path, field: str, value) -> None:
    path = write_once(tmp_path / "r.json", _record())
    _rewrite(path, lambda r: r.__setitem__(field, value))
    with pytest.raises(EvidenceError, match=f"wrong type.*{field}"):
        verify(path)


def test_a_file_that_is_not_json_is_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"kind": "half a rec')
    with pytest.raises(EvidenceError, match="not a readable JSON record"):
        verify(path)


def test_same_content_again_is_a_no_op(tmp_path: Path) -> None:
    record = _record()
    path = write_once(tmp_path / "r.json", record)
    before = path.stat()
    assert write_once(tmp_path / "r.json", record) == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_different_content_over_an_existing_record_is_refused(tmp_path: Path) -> None:
    path = write_once(tmp_path / "r.json", _record())
    original = path.read_text()
    with pytest.raises(EvidenceError, match="already exists"):
        write_once(path, _record(peak_bytes=99))
    assert path.read_text() == original


def test_a_record_that_would_not_verify_is_never_written(tmp_path: Path) -> None:
    edited = {**_record(), "passed": False}  # digest no longer matches
    with pytest.raises(EvidenceError, match="digest"):
        write_once(tmp_path / "r.json", edited)
    with pytest.raises(EvidenceError, match="missing"):
        write_once(tmp_path / "s.json", {"kind": "x"})
    assert list(tmp_path.iterdir()) == []


def test_a_record_that_cannot_be_serialised_leaves_nothing_behind(tmp_path: Path) -> None:
    record = _record()
    record["measurements"]["handle"] = object()
    record["digest"] = evidence.content_digest(record)  # a digest that matches: only serialisation can fail
    with pytest.raises(EvidenceError, match="not plain JSON"):
        write_once(tmp_path / "r.json", record)
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_halfway_leaves_no_partial_file(tmp_path: Path) -> None:
    with mock.patch.object(evidence.os, "fsync", side_effect=OSError("disk full")), pytest.raises(OSError):
        write_once(tmp_path / "r.json", _record())
    assert list(tmp_path.iterdir()) == [], "neither the record nor its temporary file may remain"
    write_once(tmp_path / "r.json", _record())  # and the name is still free


def test_a_concurrent_writer_that_wins_with_other_content_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    mine, theirs = _record(), _record(peak_bytes=7)
    real_link = os.link

    def racing_link(src, dst):  # the other writer lands its record between our check and our link
        Path(dst).write_text(json.dumps(theirs, indent=2, sort_keys=True) + "\n")
        return real_link(src, dst)

    with mock.patch.object(evidence.os, "link", racing_link), pytest.raises(EvidenceError, match="concurrently"):
        write_once(path, mine)
    assert verify(path)["measurements"]["peak_bytes"] == 7
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"], "the other writer's record, nothing of ours"


def test_the_schema_changelog_names_every_version_up_to_the_one_written() -> None:
    assert sorted(evidence.SCHEMA_CHANGELOG) == list(range(1, SCHEMA_VERSION + 1)) and SCHEMA_VERSION == 2
    assert all(evidence.SCHEMA_CHANGELOG[v] and f"- {v}: " in evidence.__doc__ for v in evidence.SCHEMA_CHANGELOG)


def _collected() -> evidence.Checks:
    checks = evidence.Checks()
    checks.check("bytes freed", True, "0 B left")
    checks.check("peak within limit", False, "peak 2048 B, limit 1024 B")
    checks.skip("cuda: allocator back", "no CUDA device")
    return checks


def test_a_schema_2_record_round_trips_checks_details_and_skips(tmp_path: Path) -> None:
    record = verify(write_once(tmp_path / "r.json", make_record("k", config={}, checks=_collected(), measurements={})))
    assert record["schema_version"] == 2 and record["passed"] is False
    assert record["checks"] == {"bytes freed": True, "peak within limit": False}
    assert record["details"] == {"bytes freed": "0 B left", "peak within limit": "peak 2048 B, limit 1024 B"}
    assert record["skips"] == {"cuda: allocator back": "no CUDA device"}
    assert evidence.checks_of(record) == [
        evidence.Check("bytes freed", True, "0 B left"),
        evidence.Check("peak within limit", False, "peak 2048 B, limit 1024 B"),
        evidence.Check("cuda: allocator back", True, "no CUDA device", skipped=True),
    ]
    assert [c.name for c in evidence.checks_of(record) if c.failed] == ["peak within limit"]


def test_skips_alone_do_not_pass_a_record_and_a_name_is_recorded_once() -> None:
    checks = evidence.Checks()
    checks.skip("cuda: allocator back", "no CUDA device")
    assert make_record("k", config={}, checks=checks, measurements={})["passed"] is False
    with pytest.raises(ValueError, match="recorded twice"):
        checks.check("cuda: allocator back", True)


def _resealed(record: dict, change) -> dict:
    """``record`` changed by ``change`` with its digest recomputed: well formed, but inconsistent."""
    change(record)
    record["digest"] = evidence.content_digest(record)
    return record


@pytest.mark.parametrize(
    "what,change,message",
    [
        ("passed disagrees", lambda r: r.__setitem__("passed", True), "'passed' disagrees with its checks"),
        ("a detail without its check", lambda r: r["details"].__setitem__("ghost", "?"), "a detail for exactly"),
        ("a check without its detail", lambda r: r["details"].pop("bytes freed"), "a detail for exactly"),
        ("run and skipped", lambda r: r["skips"].__setitem__("bytes freed", "?"), "either run or skipped"),
        ("a reason that is not text", lambda r: r["details"].__setitem__("bytes freed", 1), "must be text"),
        ("no skips field", lambda r: r.pop("skips"), r"missing \['skips'\]"),
        ("an unknown version", lambda r: r.__setitem__("schema_version", 3), "schema_version one of \\[1, 2\\]"),
    ],
)
def test_verify_refuses_an_inconsistent_schema_2_record(tmp_path: Path, what: str, change, message: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_resealed(make_record("k", config={}, checks=_collected(), measurements={}), change)))
    with pytest.raises(EvidenceError, match=message):
        verify(path)


FIXTURES = Path(__file__).parents[1] / "fixtures" / "evidence"


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.json")))
def test_the_committed_schema_1_records_still_verify_and_read(name: str) -> None:
    record = verify(FIXTURES / name)
    assert record["schema_version"] == 1
    read = evidence.checks_of(record)
    ran = [c for c in read if not c.skipped]
    assert {c.name: c.ok for c in ran} == record["checks"]
    skipped = record["measurements"].get("skipped_checks", {})
    assert {c.name: c.detail for c in read if c.skipped} == skipped
    details = record["measurements"].get("details", {})
    assert all(c.detail == details[c.name] for c in ran if c.name in details)


def test_a_schema_1_reason_is_read_from_failures_before_details() -> None:
    record = {
        "schema_version": 1,
        "checks": {"a": False, "b": True},
        "measurements": {"failures": {"a": "why a failed"}, "details": {"a": "shadowed", "b": "b held"}},
    }
    assert evidence.checks_of(record) == [
        evidence.Check("a", False, "why a failed"),
        evidence.Check("b", True, "b held"),
    ]


def test_checks_show_each_verdict_as_it_is_recorded_in_the_one_format() -> None:
    lines: list[str] = []
    checks = Checks(echo=lines.append)
    checks.check("holds", True, "1 == 1")
    assert lines == ["PASS  holds: 1 == 1"], "shown when recorded, not at the end"
    checks.check("breaks", False, "expected 1, found 2")
    checks.skip("cuda only", "no CUDA device")
    checks.check("bare", True)
    assert lines == [
        "PASS  holds: 1 == 1",
        "FAIL  breaks: expected 1, found 2",
        "SKIP  cuda only: no CUDA device",
        "PASS  bare",
    ]
    with pytest.raises(ValueError):
        checks.check("holds", True)
    assert len(lines) == 4, "a refused duplicate is not shown"
    assert [c.line for c in checks] == lines
    assert Checks.of({"holds": True}) == Checks.of({"holds": True}) and Checks().echo is None
