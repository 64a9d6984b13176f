"""What the concurrent-save tests run in spawned processes (kept apart from the tests: a child imports only this)."""

from __future__ import annotations

from pathlib import Path

from reference_trainer.saves import read_folder, write_folder

FILES = ("a", "b", "c")


def save_files(writer: str, index: int) -> dict[str, bytes]:
    """The files of save ``index`` of ``writer``: each names both, so a read shows which save it came from."""
    return {name: f"{writer}:{index}:{name}".encode() * 64 for name in FILES}


def whose(files: dict[str, bytes]) -> tuple[str, int]:
    """The writer and index of a whole save (every file from the same one), else ``AssertionError``."""
    assert sorted(files) == list(FILES), sorted(files)
    owners = {files[name].decode()[: files[name].decode().index(f":{name}")] for name in FILES}
    assert len(owners) == 1, owners
    writer, index = owners.pop().split(":")
    return writer, int(index)


def writer(root: str, name: str, saves: int, barrier) -> tuple[str, list[str]]:
    """Write ``saves`` saves into ``root`` once every worker is ready; ``name`` and the folders returned, in order."""
    barrier.wait()
    return name, [write_folder(root, save_files(name, i)).name for i in range(saves)]


def reader(root: str, reads: int, barrier) -> tuple[str, list[tuple[str, int]]]:
    """Read ``root`` ``reads`` times once every worker is ready; whose save each read was."""
    barrier.wait()
    return "reader", [whose(read_folder(Path(root))) for _ in range(reads)]


def report(queue, function, *args) -> None:
    """Run ``function(*args)`` and put ``(result, None)`` or ``(None, the error's repr)`` on ``queue``."""
    try:
        queue.put((function(*args), None))
    except BaseException as exc:  # noqa: BLE001 - the parent judges every outcome
        queue.put((None, repr(exc)))
