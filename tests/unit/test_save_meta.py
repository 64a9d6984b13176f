"""``trainer.json``'s fields, checked at load (``reference_trainer/save_meta.py``; NOTE [Resume] Rule 6).

A save whose ``trainer.json`` holds a field no ``save`` writes (rewritten
with a fresh manifest, so only the field is wrong) is a ``CorruptSaveError``
naming the field, what it must be and what was found, and the model passed
keeps its ``requires_grad``, weights, buffers and mode, the process RNG its
state. The control: the save rewritten unchanged loads.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import reference_trainer as rt
from reference_trainer.saves import read_folder, write_folder
from tests.support import advantages, assert_model_unchanged, model_snapshot, sequence
from validation.trainers import trainer_with_policy


def _model(dtype: torch.dtype = torch.float32, **changes: Any) -> rt.DecoderLM:
    return rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.0, dtype=dtype, **changes), seed=0)


def _saved(folder: Path) -> rt.Trainer:
    """A trainer at revision 2 with a committed gradient from revision 1 and a checkpoint loaded over (generation 2)."""
    trainer = trainer_with_policy(
        _model(), lora=rt.LoRAConfig(rank=2), options=rt.ForwardOptions(max_gradient_staleness=2, corrections=())
    )
    trainer.add_checkpoint("critic", full=True)
    trainer.load_checkpoint("critic", trainer.checkpoint("critic").state_dict())
    for step in range(2):
        out = trainer.forward(rt.ForwardInput(*sequence(step, 5)), checkpoint="policy")
        trainer.backward(-(out.target_logprobs * advantages(step, 5)).sum())
        trainer.optim_step(checkpoints=["policy"])
    trainer.save(folder)
    return trainer


def _rewritten(
    source: Path,
    target: Path,
    change: Callable[[dict[str, Any]], None] | None = None,
    file: str = "trainer.json",
    state: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """``source``'s save written again under ``target`` with ``trainer.json`` or a checkpoint file changed."""
    files = read_folder(source)
    if change is not None:
        meta = json.loads(files["trainer.json"])
        change(meta)
        files["trainer.json"] = json.dumps(meta).encode()
    if state is not None:
        loaded = torch.load(io.BytesIO(files[file]), weights_only=True)
        state(loaded)
        buffer = io.BytesIO()
        torch.save(loaded, buffer)
        files[file] = buffer.getvalue()
    write_folder(target, files)
    return target


def _policy(meta: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in meta["checkpoints"] if c["name"] == "policy")


def _set(where: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda meta: where(meta).__setitem__(key, value)


def _top(meta: dict[str, Any]) -> dict[str, Any]:
    return meta


FIELD_CORRUPTIONS = {  # name -> (change, the field the error names)
    "negative generation": (_set(_policy, "generation", -1), "checkpoints[0].generation"),
    "generation not below next_generation": (_set(_policy, "generation", 3), "checkpoints[0].generation"),
    "generation of the wrong type": (_set(_policy, "generation", "0"), "checkpoints[0].generation"),
    "origin at a future revision": (_set(_policy, "origins", [[0, 5, 2]]), "checkpoints[0].origins"),
    "origin of another generation": (_set(_policy, "origins", [[1, 1, 2]]), "checkpoints[0].origins"),
    "origin not a triple": (_set(_policy, "origins", [[0, 1]]), "checkpoints[0].origins"),
    "next_generation negative": (_set(_top, "next_generation", -1), "next_generation"),
    "next_generation a bool": (_set(_top, "next_generation", True), "next_generation"),
    "checkpoints not a list": (_set(_top, "checkpoints", {"policy": 1}), "checkpoints"),
    "empty checkpoint name": (_set(_policy, "name", ""), "checkpoints[0].name"),
    "file outside the save": (_set(_policy, "file", "../checkpoint-0.pt"), "checkpoints[0].file"),
    "unknown LoRA field": (_set(_policy, "lora", {"rank": 2, "shape": 1}), "checkpoints[0].lora"),
    "bad AdamW value": (_set(_policy, "optimizer", {"lr": -1.0}), "checkpoints[0].optimizer"),
    "unknown option": (_set(_top, "options", {"max_gradient_staleness": 2, "speed": "fast"}), "options"),
    "logical_dp zero": (_set(_top, "logical_dp", 0), "logical_dp"),
    "lineage not strings": (_set(_top, "lineage", [1]), "lineage"),
    "lineage a string": (_set(_top, "lineage", "ab"), "lineage"),
    "kept version at the current revision": (_set(_policy, "kept", [[2, 2]]), "checkpoints[0].kept"),
    "missing next_generation": (lambda meta: meta.pop("next_generation"), "next_generation"),
}


@pytest.fixture(scope="module")
def save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("resume") / "save"
    _saved(folder)
    return folder


def test_the_unchanged_rewrite_loads(save, tmp_path):
    """The control: rewriting alone is no corruption."""
    rt.Trainer.load(_rewritten(save, tmp_path / "same", lambda meta: None), _model())


@pytest.mark.parametrize("name", list(FIELD_CORRUPTIONS))
def test_a_bad_trainer_json_field_is_a_corrupt_save_naming_it_and_changes_nothing(save, tmp_path, name):
    change, field = FIELD_CORRUPTIONS[name]
    model = _model()
    before = model_snapshot(model)
    with pytest.raises(rt.CorruptSaveError) as info:
        rt.Trainer.load(_rewritten(save, tmp_path / "bad", change), model)
    assert (info.value.file, info.value.problem) == ("trainer.json", "invalid")
    assert f"field {field}" in str(info.value) and "expected" in str(info.value) and "found" in str(info.value)
    assert_model_unchanged(model, before)


@pytest.mark.parametrize("file", ["trainer.json", "rng.pt"])
def test_a_manifest_without_a_file_every_save_writes_is_a_corrupt_save_naming_it(save, tmp_path, file):
    files = read_folder(save)
    del files[file]
    write_folder(tmp_path / "bad", files)
    with pytest.raises(rt.CorruptSaveError) as info:
        rt.Trainer.load(tmp_path / "bad", _model())
    assert (info.value.file, info.value.problem) == (file, "missing")


def _rng_set(key: str, value: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    return lambda rng: rng.__setitem__(key, value(rng))


RNG_CORRUPTIONS = {  # name -> (trainer.json change or None, rng.pt change)
    "no streams": (None, lambda rng: rng.pop("streams")),
    "streams without logical ranks": (None, _rng_set("streams", lambda rng: {0: rng["process"]})),
    "no stream of a saved logical rank": (_set(_top, "logical_dp", 2), lambda rng: None),
    "process state not a pair": (None, _rng_set("process", lambda rng: rng["process"][0])),
    "process CPU state cut short": (None, _rng_set("process", lambda rng: (rng["process"][0][:8], None))),
    "process CPU state not bytes": (None, _rng_set("process", lambda rng: (rng["process"][0].float(), None))),
    "not a dict": (None, None),
}


@pytest.mark.parametrize("name", list(RNG_CORRUPTIONS))
def test_a_bad_rng_file_is_a_corrupt_save_naming_it_and_changes_nothing(save, tmp_path, name):
    change, rng_change = RNG_CORRUPTIONS[name]
    files = read_folder(_rewritten(save, tmp_path / "meta", change))
    rng = torch.load(io.BytesIO(files["rng.pt"]), weights_only=True)
    if rng_change is None:
        rng = [rng]
    else:
        rng_change(rng)
    buffer = io.BytesIO()
    torch.save(rng, buffer)
    write_folder(tmp_path / "bad", {**files, "rng.pt": buffer.getvalue()})
    model = _model()
    before, cpu_rng = model_snapshot(model), torch.get_rng_state()
    with pytest.raises(rt.CorruptSaveError) as info:
        rt.Trainer.load(tmp_path / "bad", model)
    assert (info.value.file, info.value.problem) == ("rng.pt", "invalid")
    assert "expected" in str(info.value) and "found" in str(info.value)
    assert_model_unchanged(model, before)
    assert torch.equal(torch.get_rng_state(), cpu_rng), "the process RNG changed"


def test_a_refused_cuda_rng_state_leaves_the_cpu_generator_as_it_was(monkeypatch):
    """``set_rng_state`` sets the CUDA generator first: if it refuses, the CPU one has not moved."""
    from reference_trainer.rng import set_rng_state

    def refuse(state: torch.Tensor, device: torch.device) -> None:
        raise RuntimeError("a CUDA generator state of another size")

    monkeypatch.setattr(torch.cuda, "set_rng_state", refuse)
    before = torch.get_rng_state()
    other = torch.Generator().manual_seed(5).get_state()
    with pytest.raises(RuntimeError, match="CUDA generator"):
        set_rng_state((other, torch.zeros(16, dtype=torch.uint8)), torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)


def test_trainer_options_with_behaviour_fields_are_saved_and_loaded_as_they_were(tmp_path: Path) -> None:
    options = rt.ForwardOptions(
        max_behaviour_staleness=1, behaviour_corrections=(rt.ImportanceCorrection(level="sequence", clip_high=3.0),)
    )
    trainer = trainer_with_policy(_model(), lora=rt.LoRAConfig(rank=2), options=options)
    trainer.save(tmp_path / "save")
    assert rt.Trainer.load(tmp_path / "save", _model()).options == options
