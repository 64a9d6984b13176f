"""Save folders on disk: atomic writes and verified reads (NOTE [Durable saves] in reference_trainer/saves.py).

Every damaged folder is refused by ``rt.Trainer.load`` with a ``CorruptSaveError``
naming the file, and the refusal changes nothing: not the model passed, not the RNG.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib
import json
import multiprocessing
import os
import queue
import re
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch

import reference_trainer as rt
import reference_trainer.saves as saves
from tests.support import make_trainer, train_step
from tests.unit import saves_workers as workers


def _model() -> rt.DecoderLM:
    return rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.1), seed=0)


def _saved(tmp_path: Path, steps: int = 1) -> rt.Trainer:
    torch.manual_seed(0)
    trainer = make_trainer("lora")
    for seed in range(steps):
        train_step(trainer, seed)
    trainer.save(tmp_path)
    return trainer


def _save_folder(root: Path) -> Path:
    return root / (root / "LATEST").read_text().split()[0]


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in _save_folder(root).iterdir() if p.name != "manifest.json")


DAMAGES = {"changed": _flip_byte, "missing": os.remove, "truncated": _truncate}


@pytest.mark.parametrize("problem", sorted(DAMAGES))
def test_a_damaged_file_is_refused_naming_it_and_nothing_changes(tmp_path, problem):
    _saved(tmp_path)
    for file in _files(tmp_path) + ["manifest.json"]:
        intact = shutil.copytree(_save_folder(tmp_path), tmp_path.parent / f"intact-{problem}-{file}")
        DAMAGES[problem](_save_folder(tmp_path) / file)
        model = _model()
        before = {n: (p.clone(), p.requires_grad) for n, p in model.named_parameters()}
        rng = torch.get_rng_state()
        with pytest.raises(rt.CorruptSaveError) as refused:
            rt.Trainer.load(tmp_path, model)
        assert refused.value.file == f"save-000001/{file}"
        expected = "changed" if file == "manifest.json" and problem != "missing" else problem
        assert refused.value.problem == expected and file in str(refused.value)
        assert torch.equal(torch.get_rng_state(), rng)
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n][0]) and p.requires_grad == before[n][1], n
        shutil.rmtree(_save_folder(tmp_path))
        shutil.move(intact, _save_folder(tmp_path))
        rt.Trainer.load(tmp_path, _model())  # the restored copy loads again: the refusal was the damage


def test_an_edited_pointer_or_another_base_model_is_refused(tmp_path):
    _saved(tmp_path)
    with pytest.raises(rt.ConfigError, match="base model"):
        rt.Trainer.load(tmp_path, rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.1), seed=1))
    (tmp_path / "LATEST").write_text("save-000001 " + "0" * 64 + "\n")
    with pytest.raises(rt.CorruptSaveError, match=r"manifest\.json"):
        rt.Trainer.load(tmp_path, _model())
    with pytest.raises(rt.ConfigError, match=r"trainer\.save"):
        rt.Trainer.load(tmp_path / "nowhere", _model())


def test_a_crash_mid_save_leaves_the_previous_save_in_force(tmp_path, monkeypatch):
    first = _saved(tmp_path)
    expected = {n: p.detach().clone() for n, p in first.checkpoint("policy").named_parameters()}
    train_step(first, 5)

    def crash(*args):
        raise OSError("killed before LATEST moved")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        first.save(tmp_path)
    monkeypatch.undo()
    loaded = rt.Trainer.load(tmp_path, _model())
    for n, p in loaded.checkpoint("policy").named_parameters():
        assert torch.equal(p, expected[n]), n
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "save-000001"]  # nothing of it is left
    first.save(tmp_path)  # the next save replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "save-000002"]
    assert json.loads((tmp_path / "save-000002" / "manifest.json").read_text())["files"]
    loaded = rt.Trainer.load(tmp_path, _model())
    assert loaded.checkpoint("policy").revision == first.checkpoint("policy").revision == 2


def test_any_one_byte_change_to_latest_is_named_as_latest(tmp_path):
    """Exhaustive over LATEST's bytes and two flips each (a low bit; the high bit, which is not ASCII)."""
    _saved(tmp_path)
    pointer, model = tmp_path / "LATEST", _model()
    intact = pointer.read_bytes()
    for i in range(len(intact) - 1):  # the last byte is the newline, which splitting ignores
        for flip in (0x01, 0x80):
            damaged = bytearray(intact)
            damaged[i] ^= flip
            pointer.write_bytes(bytes(damaged))
            with pytest.raises(rt.CorruptSaveError) as caught:
                rt.Trainer.load(tmp_path, model)
            assert caught.value.file == "LATEST", (i, flip, caught.value)
    pointer.write_bytes(intact)
    rt.Trainer.load(tmp_path, model)  # the refusals were the damage


def test_a_pointer_written_before_the_check_still_loads(tmp_path):
    _saved(tmp_path)
    name, digest, _ = (tmp_path / "LATEST").read_text().split()
    (tmp_path / "LATEST").write_text(f"{name} {digest}\n")
    assert rt.Trainer.load(tmp_path, _model()).checkpoint("policy").revision >= 0


def test_a_save_that_fails_to_write_leaves_the_path_as_it_was(tmp_path, monkeypatch):
    trainer = _saved(tmp_path / "kept")
    before = sorted(p.name for p in (tmp_path / "kept").iterdir())
    real, written = saves._write_synced, []

    def disk_full(path, data):
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        real(path, data)

    monkeypatch.setattr(saves, "_write_synced", disk_full)
    for target in (tmp_path / "kept", tmp_path / "new" / "saves"):
        written.clear()
        with pytest.raises(OSError, match="No space"):
            trainer.save(target)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == before
    assert not (tmp_path / "new" / "saves").exists()


def test_files_given_as_makers_are_made_one_at_a_time_as_written(tmp_path, monkeypatch):
    events, real = [], saves._write_synced
    monkeypatch.setattr(
        saves, "_write_synced", lambda path, data: (events.append(f"write {path.name}"), real(path, data))
    )

    def maker(name):
        return lambda: (events.append(f"make {name}"), name.encode() * 3)[1]

    saves.write_folder(tmp_path, {"a": maker("a"), "b": maker("b"), "c": b"ccc"})
    assert events[:5] == ["make a", "write a", "make b", "write b", "write c"]
    assert saves.read_folder(tmp_path) == {"a": b"aaa", "b": b"bbb", "c": b"ccc"}


# --- concurrency: a lock per folder, unique staging names (NOTE [Durable saves] Rule 6) -------------------------


def _concurrent_jobs(root: Path, writers: int, count: int, readers: int, reads: int, barrier) -> list[tuple]:
    """The workers' jobs on ``root``, which first gets a save in force (what readers start from)."""
    workers.write_folder(root, workers.save_files("seed", 0))
    jobs = [(workers.writer, str(root), f"w{i}", count, barrier) for i in range(writers)]
    return jobs + [(workers.reader, str(root), reads, barrier)] * readers


def _check_concurrent_outcomes(root: Path, results: list, count: int) -> None:
    """No worker failed; every save completed in its own folder, one writer's in its order; LATEST names the
    last save made, the only one left; every read was one whole save."""
    assert [error for _, error in results if error] == []
    written = dict(result for result, _ in results if result[0] != "reader")
    folders = [folder for made in written.values() for folder in made]
    assert len(set(folders)) == len(folders) == len(written) * count
    assert all(made == sorted(made) for made in written.values())
    last = max(folders)
    assert (root / "LATEST").read_text().split()[0] == last
    assert sorted(p.name for p in root.iterdir()) == [".lock", "LATEST", last]
    writer = workers.whose(workers.read_folder(root))
    assert writer == (writer[0], count - 1) and last in written[writer[0]]
    reads = [who for result, _ in results if result[0] == "reader" for who in result[1]]
    assert reads and all(who[0] in {"seed", *written} for who in reads)


def test_concurrent_writers_and_readers_in_threads_lose_no_save(tmp_path):
    """Two writer threads and two reader threads on one folder (the fast sibling of the processes' test)."""
    count, barrier, outcomes = 12, threading.Barrier(4), queue.Queue()
    jobs = _concurrent_jobs(tmp_path / "saves", 2, count, 2, 12, barrier)
    threads = [threading.Thread(target=workers.report, args=(outcomes, *job), daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    results = [outcomes.get(timeout=60) for _ in threads]
    _check_concurrent_outcomes(tmp_path / "saves", results, count)


@pytest.mark.slow
def test_concurrent_saving_and_loading_processes_lose_no_save(tmp_path):
    """Two writer processes and a reader process (spawned) on one folder."""
    count, context = 10, multiprocessing.get_context("spawn")
    barrier, outcomes = context.Barrier(3), context.Queue()
    jobs = _concurrent_jobs(tmp_path / "saves", 2, count, 1, 20, barrier)
    processes = [context.Process(target=workers.report, args=(outcomes, *job)) for job in jobs]
    for process in processes:
        process.start()
    try:
        results = [outcomes.get(timeout=120) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    _check_concurrent_outcomes(tmp_path / "saves", results, count)


def test_clean_up_removes_a_dead_writers_staging_and_keeps_a_live_ones(tmp_path):
    """A staging folder is a live writer's while its lock file's lock is held (NOTE [Save locks] Rule 3); a dead
    writer's lock is free, or its lock file missing."""
    saves.write_folder(tmp_path, {"a": b"1"})
    for name in (".tmp-dead", ".tmp-live", ".tmp-no-lock-file"):
        (tmp_path / name).mkdir()
    for name in (".tmp-dead.lock", ".tmp-live.lock", ".tmp-LATEST-dead"):
        (tmp_path / name).write_text("")
    held = os.open(tmp_path / ".tmp-live.lock", os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        saves.write_folder(tmp_path, {"a": b"2"})
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            ".lock",
            ".tmp-live",
            ".tmp-live.lock",
            "LATEST",
            "save-000002",
        ]
    finally:
        os.close(held)
    saves.write_folder(tmp_path, {"a": b"3"})  # its writer gone, the next save removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "save-000003"]


def test_a_reader_during_a_save_reads_the_previous_save_whole(tmp_path):
    saves.write_folder(tmp_path, {"a": b"old", "b": b"old"})
    seen = []
    saves.write_folder(tmp_path, {"a": b"new", "b": lambda: (seen.append(saves.read_folder(tmp_path)), b"new")[1]})
    assert seen == [{"a": b"old", "b": b"old"}]
    assert saves.read_folder(tmp_path) == {"a": b"new", "b": b"new"}


# --- failures: what was written is removed, and the error says whether the new save is in force (Rule 5) -------


def _fail_at(monkeypatch, target, name: str, when=lambda *args: True) -> list:
    """Make ``target.name`` raise ``OSError(EIO)`` on its first call for which ``when(*args)`` holds."""
    real, fired = getattr(target, name), []

    def failing(*args, **kwargs):
        if not fired and when(*args):
            fired.append(args)
            raise OSError(5, f"injected failure of {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)
    return fired


BEFORE_LATEST_MOVES = {
    "staging": ("reference_trainer.saves", "_write_synced", lambda path, data: path.name == "b"),
    "rename": ("os", "rename", lambda src, dst: True),
    "fsync after the rename": ("reference_trainer.saves", "_fsync_dir", lambda path: path.name.startswith("saves")),
    "LATEST's temporary file": ("reference_trainer.saves", "_write_synced", lambda path, data: "LATEST" in path.name),
    "the replace of LATEST": ("os", "replace", lambda src, dst: True),
}


@pytest.mark.parametrize("where", sorted(BEFORE_LATEST_MOVES))
def test_a_save_failing_before_latest_moves_removes_all_it_wrote(tmp_path, monkeypatch, where):
    """Into a folder of saves and into new nested folders: the path is as it was, the previous save in force."""
    kept, new = tmp_path / "saves", tmp_path / "new" / "a" / "saves"
    saves.write_folder(kept, {"a": b"old", "b": b"old"})
    before = sorted(p.name for p in kept.iterdir())
    module, name, when = BEFORE_LATEST_MOVES[where]
    for target in (kept, new):
        monkeypatch.undo()
        fired = _fail_at(monkeypatch, importlib.import_module(module), name, when)
        with pytest.raises(OSError, match="injected") as raised:
            saves.write_folder(target, {"a": b"new", "b": b"new"})
        assert fired and not isinstance(raised.value, rt.SaveInForceError)
    monkeypatch.undo()
    assert sorted(p.name for p in kept.iterdir()) == before
    assert saves.read_folder(kept) == {"a": b"old", "b": b"old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saves"]


AFTER_LATEST_MOVED = {
    "fsync": (
        "reference_trainer.saves",
        "_fsync_dir",
        lambda path: (path / "LATEST").is_file() and (path / "LATEST").read_text().startswith("save-000002"),
    ),
    "clean-up": ("shutil", "rmtree", lambda path, *rest: True),
}


@pytest.mark.parametrize("where", sorted(AFTER_LATEST_MOVED))
def test_a_save_failing_after_latest_moved_says_the_new_save_is_in_force(tmp_path, monkeypatch, where):
    saves.write_folder(tmp_path, {"a": b"old"})
    module, name, when = AFTER_LATEST_MOVED[where]
    fired = _fail_at(monkeypatch, importlib.import_module(module), name, when)
    with pytest.raises(rt.SaveInForceError) as raised:
        saves.write_folder(tmp_path, {"a": b"new"})
    monkeypatch.undo()
    assert fired and isinstance(raised.value.__cause__, OSError)
    assert raised.value.save == "save-000002" == (tmp_path / "LATEST").read_text().split()[0]
    assert raised.value.path == str(tmp_path) and "in force" in str(raised.value)
    assert saves.read_folder(tmp_path) == {"a": b"new"}


# --- durability: every new folder's entry, and the save's after its rename, fsynced (Rule 2) --------------------


def _record_directory_fsyncs(monkeypatch) -> list[tuple[str, str]]:
    """Record ``("fsync", folder)`` for every fsync of a folder's descriptor, ``("rename"|"replace", target)``."""
    events, names = [], {}
    real_open, real_close, real_fsync = os.open, os.close, os.fsync
    real_rename, real_replace = os.rename, os.replace

    def opened(path, flags, *args, **kwargs):
        handle = real_open(path, flags, *args, **kwargs)
        names[handle] = os.fspath(path) if "dir_fd" not in kwargs else None
        return handle

    def closed(handle):
        names.pop(handle, None)
        real_close(handle)

    def fsync(handle):
        if names.get(handle) and os.path.isdir(names[handle]):
            events.append(("fsync", names[handle]))
        real_fsync(handle)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "close", closed)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(
        os, "rename", lambda src, dst: (events.append(("rename", os.fspath(dst))), real_rename(src, dst))[1]
    )
    monkeypatch.setattr(
        os, "replace", lambda src, dst: (events.append(("replace", os.fspath(dst))), real_replace(src, dst))[1]
    )
    return events


def test_every_new_folder_is_fsynced_into_its_parent(tmp_path, monkeypatch):
    root = tmp_path / "a" / "b" / "saves"
    created = [tmp_path / "a", tmp_path / "a" / "b", root]  # the oracle: what does not exist yet
    assert not any(folder.exists() for folder in created)
    events = _record_directory_fsyncs(monkeypatch)
    saves.write_folder(root, {"x": b"1"})
    synced = [path for kind, path in events if kind == "fsync"]
    for folder in created:
        assert str(folder.parent) in synced, (folder, synced)
    assert synced.index(str(tmp_path)) < synced.index(str(tmp_path / "a")) < synced.index(str(tmp_path / "a" / "b"))


def test_the_save_folders_entry_is_fsynced_before_latest_names_it(tmp_path, monkeypatch):
    saves.write_folder(tmp_path, {"x": b"1"})
    events = _record_directory_fsyncs(monkeypatch)
    saves.write_folder(tmp_path, {"x": b"2"})
    renamed = events.index(("rename", str(tmp_path / "save-000002")))
    replaced = events.index(("replace", str(tmp_path / "LATEST")))
    assert ("fsync", str(tmp_path)) in events[renamed:replaced], events
    assert ("fsync", str(tmp_path)) in events[replaced:], events  # and LATEST's own entry after it


# --- reading: manifest entries are plain names of regular files in the save folder (Rule 3) ---------------------


def _forge_manifest(root: Path, files: dict) -> None:
    """Replace the manifest with ``files`` (name -> bytes) and LATEST with a pointer that matches it (the format of
    NOTE [Durable saves] Rule 1, computed here): a save that only its names make unsafe."""

    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    manifest = json.dumps({"files": {n: {"bytes": len(d), "sha256": sha(d)} for n, d in files.items()}}).encode()
    (root / "save-000001" / "manifest.json").write_bytes(manifest)
    head = f"save-000001 {sha(manifest)}"
    (root / "LATEST").write_text(f"{head} {sha(head.encode())[:16]}\n")


@pytest.mark.parametrize("name", ["../outside", "ABSOLUTE", "sub/inner", ".", ".."])
def test_a_manifest_entry_that_is_not_a_plain_name_is_refused_naming_it(tmp_path, name):
    root, secret = tmp_path / "saves", b"a file outside the save"
    saves.write_folder(root, {"a": b"1"})
    (tmp_path / "outside").write_bytes(secret)
    (root / "save-000001" / "sub").mkdir()
    (root / "save-000001" / "sub" / "inner").write_bytes(secret)
    entry = str(tmp_path / "outside") if name == "ABSOLUTE" else name
    _forge_manifest(root, {"a": b"1", entry: secret})
    with pytest.raises(rt.CorruptSaveError) as refused:
        saves.read_folder(root)
    assert refused.value.file == "save-000001/manifest.json" and repr(entry) in str(refused.value)
    assert hashlib.sha256(secret).hexdigest() not in str(refused.value)


def test_a_symbolic_link_in_a_save_is_refused_naming_it(tmp_path):
    root = tmp_path / "saves"
    saves.write_folder(root, {"a": b"1", "b": b"2"})
    (tmp_path / "outside").write_bytes(b"2")  # the same bytes: only the link is wrong
    (root / "save-000001" / "b").unlink()
    (root / "save-000001" / "b").symlink_to(tmp_path / "outside")
    with pytest.raises(rt.CorruptSaveError) as refused:
        saves.read_folder(root)
    assert (refused.value.file, refused.value.problem) == ("save-000001/b", "changed")
    assert "symbolic link" in str(refused.value)


@pytest.mark.parametrize("file", ["b", "LATEST"])
def test_a_fifo_in_a_save_is_refused_without_waiting(tmp_path, file):
    """Read in a thread: a load that waited on the FIFO is unblocked by opening its other end, and fails."""
    root = tmp_path / "saves"
    saves.write_folder(root, {"a": b"1", "b": b"2"})
    fifo = root / ("save-000001" if file == "b" else "") / file
    fifo.unlink()
    os.mkfifo(fifo)
    outcome = []
    reading = threading.Thread(target=lambda: outcome.append(_raised(saves.read_folder, root)), daemon=True)
    reading.start()
    reading.join(timeout=10)
    if reading.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the reader sees an end of file and returns
        reading.join(timeout=10)
        pytest.fail("the load waited on a FIFO")
    assert isinstance(outcome[0], rt.CorruptSaveError), outcome
    assert outcome[0].file == ("save-000001/b" if file == "b" else "LATEST") and "FIFO" in str(outcome[0])


def _raised(function, *args) -> BaseException | None:
    try:
        function(*args)
    except BaseException as exc:  # noqa: BLE001 - the caller judges it
        return exc
    return None


# --- a missing LATEST, bad paths (Rules 3, 5) -----------------------------------------------------------------


def test_a_missing_latest_beside_a_save_is_corrupt_and_a_folder_without_saves_is_a_config_error(tmp_path):
    saves.write_folder(tmp_path / "saves", {"a": b"1"})
    (tmp_path / "saves" / "LATEST").unlink()
    with pytest.raises(rt.CorruptSaveError) as refused:
        rt.Trainer.load(tmp_path / "saves", _model())
    assert (refused.value.file, refused.value.problem) == ("LATEST", "missing")
    (tmp_path / "empty" / ".tmp-dead").mkdir(parents=True)  # a first save's staging, its writer killed
    with pytest.raises(rt.ConfigError, match="holds no save"):
        rt.Trainer.load(tmp_path / "empty", _model())


def test_every_bad_save_path_is_a_config_error_that_writes_nothing(tmp_path, monkeypatch):
    trainer = make_trainer("lora")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    for path in ("", 123, b"bytes", None, tmp_path / "file", tmp_path / "file" / "under"):
        with pytest.raises(rt.ConfigError, match="path"):
            trainer.save(path)
        with pytest.raises(rt.ConfigError, match="path"):
            rt.Trainer.load(path, _model())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]

    def unwritable(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    (tmp_path / "existing").mkdir()
    real_open = os.open

    def open_unwritable(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and not os.path.exists(path):
            unwritable(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", unwritable)  # the tests run as root, whom no permission stops
    monkeypatch.setattr(os, "open", open_unwritable)
    for path in (tmp_path / "new" / "saves", tmp_path / "existing"):  # an unwritable parent, an unwritable folder
        with pytest.raises(rt.ConfigError, match="Permission denied"):
            trainer.save(path)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["existing", "file"]


@pytest.mark.parametrize("name", ["../outside", "sub/inner", ".", "..", "", "manifest.json"])
def test_a_file_name_that_is_not_plain_is_refused_at_write_and_writes_nothing(tmp_path, name):
    with pytest.raises(rt.ConfigError, match="file name"):
        saves.write_folder(tmp_path / "saves", {"a": b"1", name: b"2"})
    assert list(tmp_path.iterdir()) == []


# --- the lock and staging protocol (NOTE [Save locks] in reference_trainer/save_locks.py) -----------------------


def _nfs_flock(monkeypatch) -> None:
    """``fcntl.flock`` as NFS emulates it (fcntl byte-range locks): an exclusive lock needs a descriptor open for
    writing, else ``EBADF`` (a folder's descriptor never is)."""
    real = fcntl.flock

    def flock(handle, operation):
        writable = fcntl.fcntl(handle, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
        if operation & fcntl.LOCK_EX and not writable:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(handle, operation)

    monkeypatch.setattr(fcntl, "flock", flock)


def test_saves_and_loads_work_where_an_exclusive_lock_needs_a_descriptor_open_for_writing(tmp_path, monkeypatch):
    _nfs_flock(monkeypatch)
    for data in (b"1", b"2"):
        saves.write_folder(tmp_path / "saves", {"a": data})
        assert saves.read_folder(tmp_path / "saves") == {"a": data}
    assert sorted(p.name for p in (tmp_path / "saves").iterdir()) == [".lock", "LATEST", "save-000002"]


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF])
def test_a_filesystem_without_lock_support_is_a_config_error_naming_it(tmp_path, monkeypatch, code):
    saves.write_folder(tmp_path, {"a": b"1"})
    before = sorted(p.name for p in tmp_path.iterdir())

    def flock(handle, operation):
        if operation & (fcntl.LOCK_EX | fcntl.LOCK_SH):
            raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", flock)
    for attempt in (lambda: saves.write_folder(tmp_path, {"a": b"2"}), lambda: saves.read_folder(tmp_path)):
        with pytest.raises(rt.ConfigError, match="does not support file locks"):
            attempt()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert saves.read_folder(tmp_path) == {"a": b"1"}


def test_a_lock_is_let_go_even_when_a_forked_child_inherited_it(tmp_path, monkeypatch):
    """A reader that forks while it holds the lock (another thread's ``fork``): once it returns, a writer may lock."""
    saves.write_folder(tmp_path, {"a": b"1"})
    real_open, children, gate = os.open, [], os.pipe()

    def open_forking(path, flags, *args, **kwargs):
        if "dir_fd" in kwargs and path == "a" and not children:
            children.append(os.fork())
            if children[0] == 0:  # the child waits until the parent's check is done, holding what it inherited
                os.read(gate[0], 1)
                os._exit(0)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_forking)
    try:
        assert saves.read_folder(tmp_path) == {"a": b"1"}
        monkeypatch.undo()
        probe = os.open(tmp_path / ".lock", os.O_RDWR)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while the child holds it
        finally:
            os.close(probe)
    finally:
        os.write(gate[1], b"x")
        if children:
            os.waitpid(children[0], 0)
        os.close(gate[0])
        os.close(gate[1])


def test_clean_up_keeps_a_staging_whose_lock_it_cannot_test(tmp_path, monkeypatch):
    """Too many open files while testing a live writer's staging: it is kept, and that writer completes."""
    saves.write_folder(tmp_path, {"a": b"1"})
    real_open = os.open

    def open_failing(path, flags, *args, **kwargs):
        if os.path.basename(os.fspath(path)).startswith(".tmp-") and flags & os.O_NONBLOCK:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args, **kwargs)

    def another_save() -> bytes:
        with monkeypatch.context() as patch:
            patch.setattr(os, "open", open_failing)
            saves.write_folder(tmp_path, {"a": b"other"})
        assert any(p.is_dir() and p.name.startswith(".tmp-") for p in tmp_path.iterdir())  # this save's staging
        return b"mine"

    saves.write_folder(tmp_path, {"a": another_save, "b": b"mine"})
    assert saves.read_folder(tmp_path) == {"a": b"mine", "b": b"mine"}


def _bounded_lock_opens(monkeypatch, limit: int = 200) -> None:
    """Make the ``limit``-th open of a ``.lock`` raise: a loop on it fails instead of running forever."""
    real_open, opens = os.open, []

    def counting(path, flags, *args, **kwargs):
        if os.path.basename(os.fspath(path)) == ".lock":
            opens.append(path)
            if len(opens) >= limit:
                raise RuntimeError("looped on .lock")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)


LOCK_DAMAGES = {
    "a dangling symbolic link": lambda lock: lock.symlink_to("/nonexistent-folder/x"),
    "a symbolic link to a file": lambda lock: (
        lock.with_name("elsewhere").write_text(""),
        lock.symlink_to("elsewhere"),
    ),
    "a folder": lambda lock: lock.mkdir(),
}


@pytest.mark.parametrize("damage", sorted(LOCK_DAMAGES))
def test_a_lock_file_that_is_not_a_regular_file_is_a_config_error_at_once(tmp_path, monkeypatch, damage):
    saves.write_folder(tmp_path, {"a": b"1"})
    (tmp_path / ".lock").unlink()
    LOCK_DAMAGES[damage](tmp_path / ".lock")
    before = sorted(p.name for p in tmp_path.iterdir())
    _bounded_lock_opens(monkeypatch)
    for attempt in (lambda: saves.write_folder(tmp_path, {"a": b"2"}), lambda: saves.read_folder(tmp_path)):
        with pytest.raises(rt.ConfigError, match=r"\.lock"):
            attempt()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("name", ["x" * 300, "nul\0byte"])
def test_a_path_the_system_refuses_is_a_config_error_that_leaves_no_folder(tmp_path, name):
    for attempt in (saves.write_folder, lambda path, files: saves.read_folder(path)):
        with pytest.raises(rt.ConfigError, match="path"):
            attempt(tmp_path / "new" / "deeper" / name, {"a": b"1"})
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_while_making_folders_removes_the_ones_made(tmp_path, monkeypatch):
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)) == "deeper":
            raise KeyboardInterrupt
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(KeyboardInterrupt):
        saves.write_folder(tmp_path / "new" / "deeper" / "saves", {"a": b"1"})
    assert list(tmp_path.iterdir()) == []


def test_a_refused_load_writes_nothing(tmp_path):
    (tmp_path / "home" / ".tmp-dead").mkdir(parents=True)  # a folder of no saves (a first save's killed staging)
    with pytest.raises(rt.ConfigError, match="holds no save"):
        saves.read_folder(tmp_path / "home")
    assert [p.name for p in (tmp_path / "home").iterdir()] == [".tmp-dead"]


@pytest.mark.parametrize("interrupt", [OSError(errno.EIO, "injected"), KeyboardInterrupt()], ids=repr)
def test_a_failure_just_after_latest_moved_keeps_the_new_save_in_force(tmp_path, monkeypatch, interrupt):
    saves.write_folder(tmp_path, {"a": b"old"})
    real_replace = os.replace

    def replace_then_fail(src, dst):
        real_replace(src, dst)
        raise interrupt

    monkeypatch.setattr(os, "replace", replace_then_fail)
    with pytest.raises(rt.SaveInForceError if isinstance(interrupt, OSError) else KeyboardInterrupt):
        saves.write_folder(tmp_path, {"a": b"new"})
    monkeypatch.undo()
    assert saves.read_folder(tmp_path) == {"a": b"new"}


def test_a_failed_save_whose_folder_was_removed_raises_its_own_error(tmp_path):
    def remove_then_fail() -> bytes:
        shutil.rmtree(tmp_path / "saves")
        raise RuntimeError("the maker's own error")

    with pytest.raises(RuntimeError, match="the maker's own error"):
        saves.write_folder(tmp_path / "saves", {"a": remove_then_fail})
    assert list(tmp_path.iterdir()) == []


def test_a_reader_whose_folder_is_removed_while_it_waits_gets_a_config_error(tmp_path, monkeypatch):
    saves.write_folder(tmp_path / "saves", {"a": b"1"})
    real_flock = fcntl.flock

    def flock_after_removal(handle, operation):
        if operation & fcntl.LOCK_SH and (tmp_path / "saves").exists():
            shutil.rmtree(tmp_path / "saves")  # a failed first save removing what it made, while this waited
        return real_flock(handle, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_removal)
    with pytest.raises(rt.ConfigError, match="no such folder"):
        saves.read_folder(tmp_path / "saves")


def test_a_folder_another_writer_just_made_is_fsynced_into_its_parent(tmp_path, monkeypatch):
    root = tmp_path / "a" / "saves"
    real_mkdir = os.mkdir

    def made_by_another(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        if os.path.basename(os.fspath(path)) in ("a", "saves"):  # the other writer's, its parent not fsynced yet
            raise FileExistsError(errno.EEXIST, "File exists", os.fspath(path))

    events = _record_directory_fsyncs(monkeypatch)
    monkeypatch.setattr(os, "mkdir", made_by_another)
    saves.write_folder(root, {"x": b"1"})
    synced = [path for kind, path in events if kind == "fsync"]
    assert str(tmp_path) in synced and str(tmp_path / "a") in synced, synced


# --- a saver killed by SIGKILL (a real kill of a forked child) -------------------------------------------------

KILL_POINTS = {  # where the child dies: (module, function), the debris (NOTE [Save locks] Rule 3), the save in
    # force after it, the next save's folder
    "after staging, before the rename": (
        "reference_trainer.saves",
        "_stage",
        [".tmp-X", ".tmp-X.lock"],
        "old",
        "save-000002",
    ),
    "after the rename, before LATEST": (
        "os",
        "replace",
        [".tmp-LATEST-X", ".tmp-X.lock", "save-000002"],
        "old",
        "save-000003",
    ),
    "after LATEST moved, before the clean-up": (
        "reference_trainer.saves",
        "_clean",
        [".tmp-X.lock", "save-000002"],
        "new",
        "save-000003",
    ),
}


def _kinds(root: Path) -> list[str]:
    """The names in ``root``, each writer's random part as ``X``."""
    return sorted(re.sub(r"^\.tmp-(LATEST-)?\d+-[0-9a-f]{32}", r".tmp-\1X", p.name) for p in root.iterdir())


@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_a_killed_saver_leaves_debris_the_next_save_removes(tmp_path, point):
    saves.write_folder(tmp_path, {"a": b"old"})
    module, name, debris, in_force, following = KILL_POINTS[point]
    child = os.fork()
    if child == 0:  # pragma: no cover - the child dies by SIGKILL or exits
        try:
            real = getattr(importlib.import_module(module), name)

            def killed(*args, **kwargs):
                if name == "_stage":
                    real(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)

            setattr(importlib.import_module(module), name, killed)
            saves.write_folder(tmp_path, {"a": b"new"})
        finally:
            os._exit(1)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert _kinds(tmp_path) == sorted([".lock", "LATEST", "save-000001", *debris])
    assert saves.read_folder(tmp_path) == {"a": in_force.encode()}
    saves.write_folder(tmp_path, {"a": b"next"})
    assert saves.read_folder(tmp_path) == {"a": b"next"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", following]
