"""Saving a trainer and resuming it (NOTE [Resume] in reference_trainer/resume.py; docs/semantics.md#saves-and-resume).

The oracle is the same job run without stopping: a job saved, loaded into a
fresh trainer and continued must end bitwise where the uninterrupted job ends.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

import reference_trainer as rt
from reference_trainer.saves import read_folder, write_folder
from tests.support import (
    advantages,
    assert_model_unchanged,
    assert_nested_equal,
    grad_snapshot,
    model_snapshot,
    sequence,
)
from validation.trainers import trainer_with_policy

STEPS = 3


def _build(kind: str, *, dtype: torch.dtype = torch.float32, dropout: float = 0.1) -> rt.Trainer:
    model = rt.DecoderLM(rt.ModelConfig.tiny(dropout=dropout, dtype=dtype), seed=0)
    trainer = rt.Trainer(model, options=rt.ForwardOptions(max_gradient_staleness=1, corrections=()))
    if kind in ("lora", "both"):
        trainer.add_checkpoint("policy", lora=rt.LoRAConfig(rank=4), optimizer=rt.AdamWConfig(lr=5e-2), seed=1)
    if kind in ("full", "both"):
        trainer.add_checkpoint("critic", full=True, optimizer=rt.AdamWConfig(lr=1e-2))
    return trainer


def _model(dtype: torch.dtype = torch.float32, dropout: float = 0.1) -> rt.DecoderLM:
    return rt.DecoderLM(rt.ModelConfig.tiny(dropout=dropout, dtype=dtype), seed=0)


def _step(trainer: rt.Trainer, index: int) -> None:
    """Per checkpoint: two forwards; the first steps, the second is backpropagated one revision old and stays committed."""
    for name in trainer.checkpoints:
        out_a, out_b = (
            trainer.forward(rt.ForwardInput(*sequence(10 * index + k + len(name))), checkpoint=name) for k in (0, 1)
        )
        trainer.backward(-(out_a.target_logprobs * advantages(index)).sum())
        trainer.optim_step(max_grad_norm=1.0, checkpoints=[name])
        trainer.zero_grad(checkpoints=[name])
        trainer.backward(-(out_b.target_logprobs * advantages(index + 1)).sum())  # age 1, bound 1


def _state(trainer: rt.Trainer) -> dict[str, object]:
    return {name: (c.revision, c.generation, c.state_dict()) for name, c in trainer.checkpoints.items()}


def _run(kind: str, dtype: torch.dtype, save_at: int | None, path, *, forget_rng: bool = False) -> rt.Trainer:
    torch.manual_seed(7)
    trainer = _build(kind, dtype=dtype)
    for index in range(STEPS):
        if index == save_at:
            trainer.save(path)
            del trainer
            torch.manual_seed(1234)  # the restarted process's own RNG: the load must replace it
            trainer = rt.Trainer.load(path, _model(dtype))
            if forget_rng:
                torch.manual_seed(7)
        _step(trainer, index)
    return trainer


@pytest.mark.parametrize(("kind", "dtype", "save_at"), [("both", torch.float32, 1), ("lora", torch.bfloat16, 2)])
def test_a_saved_and_loaded_job_finishes_bitwise_as_the_uninterrupted_one(tmp_path, kind, dtype, save_at):
    """Saved with a one-revision-old gradient committed (``_step``), loaded by a process whose RNG moved on."""
    expected = _state(_run(kind, dtype, None, tmp_path))
    assert_nested_equal(_state(_run(kind, dtype, save_at, tmp_path / "save")), expected)


def test_the_oracle_sees_a_resume_that_forgot_the_rng(tmp_path):
    """Negative control: with dropout, a resume on another RNG state ends elsewhere."""
    expected = _state(_run("lora", torch.float32, None, tmp_path))
    found = _state(_run("lora", torch.float32, 2, tmp_path / "s", forget_rng=True))
    with pytest.raises(AssertionError):
        assert_nested_equal(found, expected)


def test_committed_gradients_and_options_survive_the_save(tmp_path):
    torch.manual_seed(3)
    trainer = _build("lora")
    ids, tgt = sequence(5)
    out = trainer.forward(rt.ForwardInput(ids, tgt))
    trainer.backward(-(out.target_logprobs * advantages(5)).sum())
    trainer.save(tmp_path)
    loaded = rt.Trainer.load(tmp_path, _model())
    assert loaded.options == trainer.options
    assert loaded.checkpoint("policy").origins == trainer.checkpoint("policy").origins
    assert loaded.checkpoint("policy").lora_config == trainer.checkpoint("policy").lora_config
    for (name, p), (_, q) in zip(
        trainer.checkpoint("policy").named_parameters(), loaded.checkpoint("policy").named_parameters()
    ):
        assert torch.equal(p.grad, q.grad), name
    assert_nested_equal(loaded.optim_step()["policy"].grad_norm, trainer.optim_step()["policy"].grad_norm)
    assert_nested_equal(_state(loaded), _state(trainer))


def _commit_old_gradient(trainer: rt.Trainer) -> None:
    """A forward at revision 0 (bound 1), backpropagated at revision 1: committed one revision old."""
    old, fresh = (trainer.forward(rt.ForwardInput(*sequence(seed))) for seed in (1, 2))
    trainer.backward(-(fresh.target_logprobs * advantages(2)).sum())
    trainer.optim_step()
    trainer.zero_grad()
    trainer.backward(-(old.target_logprobs * advantages(1)).sum())


def test_staleness_counts_in_revisions_across_the_resume(tmp_path):
    """Committed at age 1 before the save: stepped after the load (age 1 <= 1), refused one step later (age 2)."""
    outcomes = []
    for resume in (False, True):
        torch.manual_seed(0)
        trainer = _build("lora")
        _commit_old_gradient(trainer)
        if resume:
            trainer.save(tmp_path)
            trainer = rt.Trainer.load(tmp_path, _model())
        within = trainer.optim_step()["policy"]
        with pytest.raises(rt.StaleGradientError) as beyond:
            trainer.optim_step()  # .grad stays: its origin is now two revisions old
        outcomes.append(
            (
                within.stepped,
                within.revision,
                beyond.value.staleness,
                beyond.value.bound,
                trainer.checkpoint("policy").revision,
            )
        )
    assert outcomes[0] == outcomes[1] == (True, 2, 2, 1, 2)


def _refused_as_replaced(trainer: rt.Trainer, out: rt.ForwardOutput) -> rt.CheckpointReplacedError:
    """``trainer.backward`` of ``out``'s loss raises ``CheckpointReplacedError`` and changes nothing of ``trainer``."""
    before = (_state(trainer), grad_snapshot(trainer), trainer.live_records())
    with pytest.raises(rt.CheckpointReplacedError) as info:
        trainer.backward(out.target_logprobs.sum())
    assert_nested_equal((_state(trainer), grad_snapshot(trainer), trainer.live_records()), before)
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())
    return info.value


def test_pending_forwards_are_not_saved_and_a_backward_of_one_through_the_loaded_trainer_is_replaced(tmp_path):
    """The forward's generation against the loaded checkpoint's; the saving trainer still owns its graph."""
    trainer = _build("lora")
    out = trainer.forward(rt.ForwardInput(*sequence(1)))
    trainer.save(tmp_path)
    loaded = rt.Trainer.load(tmp_path, _model())
    assert loaded.live_records() == 0 and trainer.live_records() == 1
    loaded.load_checkpoint("policy", loaded.checkpoint("policy").state_dict())  # a generation the forward never saw
    error = _refused_as_replaced(loaded, out)
    assert (error.checkpoint, error.forward_generation, error.current_generation) == (
        "policy",
        out.version.generation,
        loaded.checkpoint("policy").generation,
    )
    assert error.forward_generation != error.current_generation
    trainer.backward(out.target_logprobs.sum())  # the saving trainer still owns it
    assert trainer.live_records() == 0


def test_a_trainer_loaded_from_a_loaded_trainers_save_also_refuses_the_first_ones_forwards(tmp_path):
    first = _build("lora")
    out = first.forward(rt.ForwardInput(*sequence(1)))
    first.save(tmp_path / "a")
    second = rt.Trainer.load(tmp_path / "a", _model())
    second_out = second.forward(rt.ForwardInput(*sequence(2)))
    second.save(tmp_path / "b")
    third = rt.Trainer.load(tmp_path / "b", _model())
    for forward in (out, second_out):
        assert _refused_as_replaced(third, forward).forward_generation == forward.version.generation
    first.backward(out.target_logprobs.sum())
    second.backward(second_out.target_logprobs.sum())


def test_an_unrelated_trainers_output_is_still_a_config_error_after_a_load(tmp_path):
    """The control: only trainers whose state was resumed get ``CheckpointReplacedError``."""
    saving, unrelated = _build("lora"), _build("lora")
    out = unrelated.forward(rt.ForwardInput(*sequence(1)))
    saving.save(tmp_path)
    loaded = rt.Trainer.load(tmp_path, _model())
    for trainer in (loaded, saving):
        with pytest.raises(rt.ConfigError, match="another trainer's output"):
            trainer.backward(out.target_logprobs.sum())
    with pytest.raises(rt.ConfigError, match="another trainer's output"):  # no lineage runs backwards
        saving.backward(loaded.forward(rt.ForwardInput(*sequence(3))).target_logprobs.sum())
    saving.add_checkpoint(
        "critic", full=True
    )  # after the save: the loaded trainer has no "critic" it could have replaced
    with pytest.raises(rt.ConfigError, match="another trainer's output"):
        loaded.backward(saving.forward(rt.ForwardInput(*sequence(4)), checkpoint="critic").target_logprobs.sum())


def test_a_save_written_without_a_lineage_loads_with_an_empty_one(tmp_path):
    """A save of the same format version from before the lineage was kept: the saver's outputs are just another trainer's."""
    saving = _build("lora")
    out = saving.forward(rt.ForwardInput(*sequence(1)))
    saving.save(tmp_path / "new")
    files = read_folder(tmp_path / "new")
    meta = json.loads(files["trainer.json"])
    assert {meta.pop("identity"), *meta.pop("lineage")} == {saving.records.identity}
    write_folder(tmp_path / "old", {**files, "trainer.json": json.dumps(meta).encode()})
    loaded = rt.Trainer.load(tmp_path / "old", _model())
    assert loaded.records.lineage == frozenset()
    with pytest.raises(rt.ConfigError, match="another trainer's output"):
        loaded.backward(out.target_logprobs.sum())


def _logical_step(trainer: rt.Trainer, step: int) -> None:
    def body(view):
        out = view.forward(rt.ForwardInput(*sequence(10 * step + view.logical_rank)))
        view.backward(-(out.target_logprobs * advantages(step)).sum())

    rt.run_logical(body, trainer, logical_dp=2)


def test_pending_logical_buffers_or_a_save_inside_fn_are_refused_and_nothing_is_written(tmp_path):
    trainer = _build("lora")
    _logical_step(trainer, 0)
    with pytest.raises(rt.ConfigError, match="optim_step"):
        trainer.save(tmp_path / "pending")
    assert not (tmp_path / "pending").exists()
    trainer.optim_step()
    trainer.zero_grad()
    with pytest.raises(rt.ConfigError, match="inside run_logical"):
        rt.run_logical(lambda view: trainer.save(tmp_path / "inside"), trainer, logical_dp=2)
    assert not (tmp_path / "inside").exists()


def test_logical_ranks_continue_their_own_rng_streams_after_a_resume(tmp_path):
    """Dropout draws from each logical rank's stream: a resumed run (saved between steps) ends bitwise equal."""
    results = []
    for save_at in (None, 2, 1):
        torch.manual_seed(5)
        trainer = _build("lora")
        for step in range(3):
            if step == save_at:
                trainer.save(tmp_path / f"s{save_at}")
                torch.manual_seed(99)
                trainer = rt.Trainer.load(tmp_path / f"s{save_at}", _model())
            _logical_step(trainer, step)
            trainer.optim_step()
            trainer.zero_grad()
        results.append(_state(trainer))
    assert_nested_equal(results[1], results[0])
    assert_nested_equal(results[2], results[0])


# --- refusals, the generation counter, the model digest (NOTE [Resume] Rule 6) ------------------------------------


def _shrunk_state(source, target, key: str):
    """``source``'s save written again under ``target`` with one tensor of checkpoint 0's ``key`` cut to one row."""
    files = read_folder(source)
    state = torch.load(io.BytesIO(files["checkpoint-0.pt"]), weights_only=True)
    name = next(iter(state[key]))
    state[key][name] = state[key][name][:1]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_folder(target, {**files, "checkpoint-0.pt": buffer.getvalue()})
    return target


@pytest.mark.parametrize("key", ["parameters", "grads"])
def test_a_refused_checkpoint_state_leaves_the_model_as_it_was(tmp_path, key):
    """The state is checked once the trainer (which freezes the model) is built: a refusal unfreezes it again."""
    trainer = _build("lora")
    out = trainer.forward(rt.ForwardInput(*sequence(1)))
    trainer.backward(out.target_logprobs.sum())
    trainer.save(tmp_path / "save")
    model = _model()
    model.eval()
    before = model_snapshot(model)
    assert all(g for _, g, _ in before[0]), "a fresh model's parameters require grad"
    with pytest.raises(rt.ConfigError):
        rt.Trainer.load(_shrunk_state(tmp_path / "save", tmp_path / "bad", key), model)
    assert_model_unchanged(model, before)


def test_the_generation_counter_continues_after_a_load(tmp_path):
    """Checkpoints added or loaded over after a resume take the generations the uninterrupted trainer gives."""
    trainer = _build("both")
    trainer.load_checkpoint("critic", trainer.checkpoint("critic").state_dict())
    trainer.save(tmp_path)
    loaded = rt.Trainer.load(tmp_path, _model())
    assert loaded.next_generation == trainer.next_generation == 3
    for each in (trainer, loaded):
        each.load_checkpoint("policy", each.checkpoint("policy").state_dict())
    assert loaded.checkpoint("policy").generation == trainer.checkpoint("policy").generation == 3
    assert loaded.add_checkpoint("value", full=True).generation == trainer.add_checkpoint("value", full=True).generation
    generations = [c.generation for c in loaded.checkpoints.values()]
    assert len(set(generations)) == len(generations), f"a generation repeats: {generations}"


@pytest.mark.parametrize("path", [123, None, 1.5, b"bytes-path", ["a"]])
def test_a_path_that_is_not_a_path_is_a_config_error_at_save_and_load(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    trainer = _build("lora")
    with pytest.raises(rt.ConfigError, match="path"):
        trainer.save(path)
    model = _model()
    before = model_snapshot(model)
    with pytest.raises(rt.ConfigError, match="path"):
        rt.Trainer.load(path, model)
    assert_model_unchanged(model, before)
    assert list(tmp_path.iterdir()) == [], "nothing written"


# --- current log-probs of pending forwards ("when_available", NOTE [Resume] Rule 2) --------------------------------


def _stale_pair(folder):
    """A job saved under ``folder`` with forward A pending at revision 0 and forward C of A's tokens pending at
    revision 1; returns the trainer, A and C."""
    torch.manual_seed(0)
    trainer = trainer_with_policy(
        _model(dropout=0.0),
        lora=rt.LoRAConfig(rank=2),
        optimizer=rt.AdamWConfig(lr=5e-2),
        options=rt.ForwardOptions(max_gradient_staleness=2),
    )  # when_available
    a = trainer.forward(rt.ForwardInput(*sequence(1)))
    b = trainer.forward(rt.ForwardInput(*sequence(2)))
    trainer.backward(-b.target_logprobs.sum())
    trainer.optim_step()
    trainer.zero_grad()
    c = trainer.forward(rt.ForwardInput(*sequence(1)))
    trainer.save(folder)
    return trainer, a, c


@pytest.mark.parametrize("order", ["a-then-c", "c-then-a"])
def test_a_forward_made_again_at_a_kept_version_keeps_the_current_log_probs_of_its_tokens(tmp_path, order):
    """Made again in either order, stale A is corrected by C's log-probs as in the job that never stopped: a forward
    at a kept (older) version neither keeps nor prunes current log-probs (NOTE [Importance correction] Rule 7)."""
    trainer, a, c = _stale_pair(tmp_path / "save")
    report = trainer.backward(-a.target_logprobs.sum())
    assert len(report.corrected) == 1, "the uninterrupted job corrects A with C's log-probs"
    trainer.backward(-c.target_logprobs.sum())
    trainer.optim_step()
    loaded = rt.Trainer.load(tmp_path / "save", _model(dropout=0.0))
    remade = {}
    for name in order.split("-then-"):
        remade[name] = loaded.forward(rt.ForwardInput(*sequence(1)), checkpoint={"a": a, "c": c}[name].version)
    assert len(loaded.backward(-remade["a"].target_logprobs.sum()).corrected) == 1
    loaded.backward(-remade["c"].target_logprobs.sum())
    loaded.optim_step()
    assert_nested_equal(_state(loaded), _state(trainer))


def test_saved_log_probs_keep_their_autocast_state_and_correct_only_forwards_made_under_it(tmp_path):
    """A and C under CPU autocast (BF16): C's saved row names that state, and after the load it corrects A made again
    under it as in the job that never stopped; A made again without autocast finds no row of its state."""
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    torch.manual_seed(0)
    trainer = trainer_with_policy(
        _model(dropout=0.0),
        lora=rt.LoRAConfig(rank=2),
        optimizer=rt.AdamWConfig(lr=5e-2),
        options=rt.ForwardOptions(max_gradient_staleness=2),
    )
    with bf16():
        a = trainer.forward(rt.ForwardInput(*sequence(1)))
    b = trainer.forward(rt.ForwardInput(*sequence(2)))
    trainer.backward(-b.target_logprobs.sum())
    trainer.optim_step()
    with bf16():  # C: the forward whose log-probs are the saved row
        trainer.forward(rt.ForwardInput(*sequence(1)))
    trainer.save(tmp_path / "save")
    (row,) = torch.load(io.BytesIO(read_folder(tmp_path / "save")["checkpoint-0.pt"]), weights_only=True)["logprobs"]
    assert row["autocast"] == ["cpu", "bfloat16"]
    assert len(trainer.backward(-a.target_logprobs.sum()).corrected) == 1, "C's row corrects A: one autocast state"
    for under_autocast, corrected in ((True, 1), (False, 0)):
        loaded = rt.Trainer.load(tmp_path / "save", _model(dropout=0.0))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
            again = loaded.forward(rt.ForwardInput(*sequence(1)), checkpoint=a.version)
        assert len(loaded.backward(-again.target_logprobs.sum()).corrected) == corrected, under_autocast


def _rewritten_logprobs(source, target, change):
    """``source``'s save written again under ``target`` with ``change`` applied to checkpoint 0's log-prob rows."""
    files = read_folder(source)
    state = torch.load(io.BytesIO(files["checkpoint-0.pt"]), weights_only=True)
    state["logprobs"] = change(state["logprobs"])
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_folder(target, {**files, "checkpoint-0.pt": buffer.getvalue()})
    return target


BAD_ROWS = {
    "not a list": lambda rows: {"rows": rows},
    "a row twice": lambda rows: rows + rows,
    "a missing key": lambda rows: [{k: v for k, v in rows[0].items() if k != "owner"}],
    "a negative owner": lambda rows: [{**rows[0], "owner": -1}],
    "float token ids": lambda rows: [{**rows[0], "inputs": rows[0]["inputs"].float()}],
    "lengths that differ": lambda rows: [{**rows[0], "logprobs": rows[0]["logprobs"][:-1]}],
    "integer log-probs": lambda rows: [{**rows[0], "logprobs": rows[0]["logprobs"].long()}],
    "an autocast dtype torch lacks": lambda rows: [{**rows[0], "autocast": ["cpu", "float7"]}],
    "no autocast state": lambda rows: [{k: v for k, v in rows[0].items() if k != "autocast"}],
}


@pytest.mark.parametrize("bad", sorted(BAD_ROWS))
def test_bad_saved_log_probs_are_refused_and_leave_the_model_as_it_was(tmp_path, bad):
    _stale_pair(tmp_path / "save")
    rows = torch.load(io.BytesIO(read_folder(tmp_path / "save")["checkpoint-0.pt"]), weights_only=True)["logprobs"]
    assert len(rows) == 1 and rows[0]["owner"] is None, "C's row, kept for A"
    model = _model(dropout=0.0)
    before = model_snapshot(model)
    with pytest.raises(rt.ConfigError, match="saved current log-probs of 'policy'"):
        rt.Trainer.load(_rewritten_logprobs(tmp_path / "save", tmp_path / "bad", BAD_ROWS[bad]), model)
    assert_model_unchanged(model, before)
