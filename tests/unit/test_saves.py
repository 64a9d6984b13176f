"""Save folders on disk: atomic writes and verified reads (NOTE [Durable saves] in reference_trainer/saves.py).

Every damaged folder is refused by ``rt.Trainer.load`` with a ``CorruptSaveError``
naming the file, and the refusal changes nothing: not the model passed, not the RNG.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import reference_trainer as rt
from tests.support import make_trainer, train_step


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
    with pytest.raises(rt.CorruptSaveError, match="manifest.json"):
        rt.Trainer.load(tmp_path, _model())
    with pytest.raises(rt.ConfigError, match="trainer.save"):
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
    first.save(tmp_path)  # the next save replaces it and sweeps the debris of the crashed one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "save-000003"]
    assert json.loads((tmp_path / "save-000003" / "manifest.json").read_text())["files"]
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
    import reference_trainer.saves as saves

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
    import reference_trainer.saves as saves

    events, real = [], saves._write_synced
    monkeypatch.setattr(saves, "_write_synced", lambda path, data: (events.append(f"write {path.name}"),
                                                                    real(path, data)))

    def maker(name):
        return lambda: (events.append(f"make {name}"), name.encode() * 3)[1]

    saves.write_folder(tmp_path, {"a": maker("a"), "b": maker("b"), "c": b"ccc"})
    assert events[:5] == ["make a", "write a", "make b", "write b", "write c"]
    assert saves.read_folder(tmp_path) == {"a": b"aaa", "b": b"bbb", "c": b"ccc"}
