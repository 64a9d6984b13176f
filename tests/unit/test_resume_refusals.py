"""What ``Trainer.load`` refuses, and that a refusal changes nothing (NOTE [Resume] Rule 6, ``save_meta.py``).

A save whose ``trainer.json`` holds a field no ``save`` writes (rewritten
with a fresh manifest, so only the field is wrong) is a ``CorruptSaveError``
naming the field; a checkpoint state that does not fit is a ``ConfigError``;
either way the model passed keeps its ``requires_grad``, weights, buffers and
mode, and the process RNG its state. Paths that are not paths are
``ConfigError`` at save and load. The generation counter comes back.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import reference_trainer as rt
from reference_trainer.resume import _model_identity
from reference_trainer.saves import read_folder, write_folder
from tests.support import advantages, sequence


def _model(dtype: torch.dtype = torch.float32, **changes: Any) -> rt.DecoderLM:
    return rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.0, dtype=dtype, **changes), seed=0)


def _saved(folder: Path) -> rt.Trainer:
    """A trainer at revision 2 with a committed gradient from revision 1 and a checkpoint loaded over (generation 2)."""
    trainer = rt.Trainer(_model(), options=rt.ForwardOptions(max_gradient_staleness=2, corrections=()))
    trainer.add_checkpoint("policy", lora=rt.LoRAConfig(rank=2), seed=1)
    trainer.add_checkpoint("critic", full=True)
    trainer.load_checkpoint("critic", trainer.checkpoint("critic").state_dict())
    for step in range(2):
        out = trainer.forward(rt.ForwardInput(*sequence(step, 5)), checkpoint="policy")
        trainer.backward(-(out.target_logprobs * advantages(step, 5)).sum())
        trainer.optim_step(checkpoints=["policy"])
    trainer.save(folder)
    return trainer


def _rewritten(source: Path, target: Path, change: Callable[[dict[str, Any]], None] | None = None,
               file: str = "trainer.json", state: Callable[[dict[str, Any]], None] | None = None) -> Path:
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
    "kept version at the current revision": (_set(_policy, "kept", [[2, 2]]), "checkpoints[0].kept"),
    "missing next_generation": (lambda meta: meta.pop("next_generation"), "next_generation"),
}


def _snapshot(model: rt.DecoderLM) -> tuple:
    return ([(n, p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()],
            [(n, b.clone()) for n, b in model.named_buffers()], model.training, torch.get_rng_state())


def _assert_unchanged(model: rt.DecoderLM, before: tuple) -> None:
    params, buffers, training, rng = _snapshot(model)
    assert [(n, g) for n, g, _ in params] == [(n, g) for n, g, _ in before[0]], "requires_grad changed"
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(params, before[0])), "weights changed"
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(buffers, before[1])), "buffers changed"
    assert training == before[2] and torch.equal(rng, before[3]), "mode or RNG changed"


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
    before = _snapshot(model)
    with pytest.raises(rt.CorruptSaveError) as info:
        rt.Trainer.load(_rewritten(save, tmp_path / "bad", change), model)
    assert (info.value.file, info.value.problem) == ("trainer.json", "invalid")
    assert f"field {field}" in str(info.value) and "expected" in str(info.value) and "found" in str(info.value)
    _assert_unchanged(model, before)


def _shrunk(key: str) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        name = next(iter(state[key]))
        state[key][name] = state[key][name][:1]
    return change


@pytest.mark.parametrize("key", ["parameters", "grads"])
def test_a_refused_checkpoint_state_leaves_the_model_as_it_was(save, tmp_path, key):
    """The state is checked after the trainer is built (it needs the checkpoints): the model is unfrozen again."""
    model = _model()
    model.eval()
    before = _snapshot(model)
    assert all(g for _, g, _ in before[0]), "a fresh model's parameters require grad"
    with pytest.raises(rt.ConfigError):
        rt.Trainer.load(_rewritten(save, tmp_path / "bad", file="checkpoint-0.pt", state=_shrunk(key)), model)
    _assert_unchanged(model, before)


def test_the_generation_counter_continues_after_a_load(tmp_path):
    """Checkpoints added or loaded over after a resume take the generations the uninterrupted trainer gives."""
    trainer = _saved(tmp_path / "save")
    loaded = rt.Trainer.load(tmp_path / "save", _model())
    assert loaded.next_generation == trainer.next_generation == 3
    for each in (trainer, loaded):
        each.load_checkpoint("policy", each.checkpoint("policy").state_dict(), discard_graphs=True)
    assert loaded.checkpoint("policy").generation == trainer.checkpoint("policy").generation == 3
    assert loaded.add_checkpoint("value", full=True).generation == trainer.add_checkpoint("value", full=True).generation
    generations = [c.generation for c in loaded.checkpoints.values()]
    assert len(set(generations)) == len(generations), f"a generation repeats: {generations}"


@pytest.mark.parametrize("path", [123, None, 1.5, b"bytes-path", ["a"]])
def test_a_path_that_is_not_a_path_is_a_config_error_at_save_and_load(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    trainer = rt.Trainer(_model())
    trainer.add_checkpoint("policy", lora=rt.LoRAConfig(rank=2), seed=1)
    with pytest.raises(rt.ConfigError, match="path"):
        trainer.save(path)
    model = _model()
    before = _snapshot(model)
    with pytest.raises(rt.ConfigError, match="path"):
        rt.Trainer.load(path, model)
    _assert_unchanged(model, before)
    assert list(tmp_path.iterdir()) == [], "nothing written"


def _numpy_digest(model: rt.DecoderLM) -> str:
    """The identity digest as numpy computes it (the oracle, and what earlier saves hold)."""
    digest = hashlib.sha256()
    for name, param in model.state_dict().items():
        tensor = param.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize(("dtype", "tied"), [(torch.float32, False), (torch.bfloat16, False), (torch.float16, True)])
def test_the_model_digest_is_the_raw_bytes_digest_earlier_saves_hold(dtype, tied):
    """Hashed without numpy, bitwise what numpy's bytes give: BF16 included, tied (shared-storage) weights too."""
    model = _model(dtype, tie_word_embeddings=tied)
    assert _model_identity(model)["digest"] == _numpy_digest(model)
    other = _model(dtype, tie_word_embeddings=tied)
    with torch.no_grad():
        next(other.parameters()).view(-1)[0] += 1
    assert _model_identity(other)["digest"] != _model_identity(model)["digest"]
