"""Evidence frames in a job's log (``ci.frames``): what was emitted is what comes back, byte for byte, or a refusal."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from ci.frames import FrameError, collect, emit
from validation.evidence import evidence_path, make_record, verify, write_once

ENV = {"RTV_RUN_ID": "rtv-x-1-1-abcd", "RTV_COMMIT": "c0ffee", "RTV_SOURCE_DIGEST": "d1", "RTV_EXPECT": "smoke memory"}


def framed(folder: Path) -> str:
    log = io.StringIO()
    log.write("(task, pid=7) starting\n")
    emit(folder, stream=log, env=ENV)
    return log.getvalue()


@pytest.fixture
def records(tmp_path: Path) -> Path:
    folder = tmp_path / "out" / "run-cpu-1"
    folder.mkdir(parents=True)
    for kind in ("smoke", "memory-cpu"):
        write_once(evidence_path(folder, kind), make_record(kind, config={}, checks={"ok": True}, measurements={}))
    (folder / "report.md").write_text("stays on the cluster")
    return tmp_path / "out"


def test_what_was_emitted_comes_back_with_its_manifest(records: Path, tmp_path: Path) -> None:
    log = framed(records)
    prefixed = "".join(f"(rtv-gate, pid=4242) {line}\n" for line in log.splitlines())  # what SkyPilot may add
    made = collect(prefixed, tmp_path / "back")
    back = sorted((tmp_path / "back" / "records").rglob("*.json"))
    sent = sorted(records.rglob("*.json"))
    assert [p.read_bytes() for p in back] == [p.read_bytes() for p in sent] and all(verify(p) for p in back)
    assert made["run_id"] == ENV["RTV_RUN_ID"] and made["expect"] == ["smoke", "memory"]
    assert sorted(r["digest"] for r in made["records"]) == sorted(json.loads(p.read_text())["digest"] for p in sent)
    assert not list((tmp_path / "back").rglob("report.md"))


def test_the_records_come_back_in_folders_the_report_still_collects(records: Path, tmp_path: Path) -> None:
    """The report reads only folders the harness marked (``reports.records``): the marks travel with the records."""
    from reports.records import load_records

    collect(framed(records), tmp_path / "back")
    assert (
        sorted(r.name for r in load_records(tmp_path / "back" / "records"))
        == sorted(r.name for r in load_records(records))
        and len(load_records(records)) == 2
    )


@pytest.mark.parametrize("damage", ["truncated", "a line lost", "a line repeated", "a byte changed"])
def test_a_damaged_frame_is_refused(records: Path, tmp_path: Path, damage: str) -> None:
    lines = framed(records).splitlines()
    body = [i for i, line in enumerate(lines) if line.startswith("RTV-EVIDENCE ")]
    if damage == "truncated":
        lines = lines[:-1]
    elif damage == "a line lost":
        del lines[body[0]]
    elif damage == "a line repeated":
        lines.insert(body[0], lines[body[0]])
    else:
        lines[body[0]] = lines[body[0]][:-2] + ("A" if lines[body[0]][-2] != "A" else "B") + lines[body[0]][-1]
    with pytest.raises(FrameError, match="frame"):
        collect("\n".join(lines), tmp_path / "back")


def test_the_last_whole_frame_counts_and_no_frame_is_refused(records: Path, tmp_path: Path) -> None:
    first = framed(records)
    (records / "run-cpu-1" / "extra.json").write_text("{}")
    second = framed(records)
    made = collect(first + second.rsplit("\n", 2)[0] + "\n", tmp_path / "a")  # the second is cut short
    assert len(made["records"]) == 2
    assert len(collect(first + second, tmp_path / "b")["records"]) == 3
    with pytest.raises(FrameError, match="no RTV-EVIDENCE frame"):
        collect("the job printed nothing of the kind\n", tmp_path / "c")


def test_a_missing_folder_is_framed_as_no_records(tmp_path: Path) -> None:
    made = collect(framed(tmp_path / "never-written"), tmp_path / "back")
    assert made["records"] == [] and made["expect"] == ["smoke", "memory"]


def test_the_job_side_command_writes_only_stdout_frame_first(records: Path, tmp_path: Path, capfd) -> None:
    from ci.frames import main

    assert main(["emit", str(records), "--status", "0"]) == 0
    out, err = capfd.readouterr()
    assert err == "", "a stderr line can land inside a frame line when SkyPilot merges the streams"
    assert collect(out, tmp_path / "back")["status"] == 0 and out.splitlines()[-1].startswith("rtv evidence frame")


def _framed_tar(monkeypatch, tmp_path: Path, add) -> str:
    """A frame, made by the real ``emit``, whose tar payload ``add(tar)`` filled."""
    import tarfile

    import ci.frames

    def payload(folder, env, status):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            add(tar)
        return buffer.getvalue()

    monkeypatch.setattr(ci.frames, "_payload", payload)
    log = io.StringIO()
    emit(tmp_path, stream=log, env=ENV)
    return log.getvalue()


@pytest.mark.parametrize("member", ["a link", "an absolute path", "a path leaving the folder"])
def test_a_frame_member_that_is_not_a_plain_file_inside_is_refused(monkeypatch, tmp_path: Path, member: str) -> None:
    import tarfile

    def add(tar):
        info = tarfile.TarInfo(
            {
                "a link": "records/x.json",
                "an absolute path": "/tmp/rtv-escape.json",
                "a path leaving the folder": "../escape.json",
            }[member]
        )
        if member == "a link":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        else:
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))

    log = _framed_tar(monkeypatch, tmp_path, add)
    with pytest.raises(FrameError, match="not a plain file or folder"):
        collect(log, tmp_path / "back" / "inner")
    assert not (tmp_path / "back" / "escape.json").exists() and not list((tmp_path / "back").rglob("*.json"))


def test_frames_come_back_on_a_python_whose_tarfile_has_no_data_filter(records, monkeypatch, tmp_path: Path) -> None:
    """Debian 12's python3.11 is 3.11.2: ``extractall`` takes no ``filter`` (added in 3.11.4); seen as a new user."""
    import tarfile

    original = tarfile.TarFile.extractall

    def extractall_3_11_2(self, path=".", members=None, *, numeric_owner=False):
        return original(self, path, members, numeric_owner=numeric_owner)

    monkeypatch.delattr(tarfile, "data_filter", raising=False)  # absent already on 3.11.2 itself
    monkeypatch.setattr(tarfile.TarFile, "extractall", extractall_3_11_2)
    made = collect(framed(records), tmp_path / "back")
    assert made["expect"] == ["smoke", "memory"] and len(list((tmp_path / "back").rglob("*.json"))) == 3
