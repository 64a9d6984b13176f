"""Checkpoints: versions, state dicts, loading, BASE and copy on write (NOTE [Weight captures]).

See docs/api.md#checkpoints.
"""

from __future__ import annotations

import copy

import pytest
import torch

import reference_trainer as rt
from tests.support import (
    NO_CORRECTION,
    advantages,
    assert_grads_unchanged,
    assert_nested_equal,
    grad_snapshot,
    make_trainer,
    sequence,
    train_step,
)
from validation.oracle import plain_gradients, snapshot_weights
from validation.trainers import trainer_with_policy


def _forward(trainer: rt.Trainer, seed: int, checkpoint: str | None = None) -> rt.ForwardOutput:
    ids, tgt = sequence(seed)
    return trainer.forward(rt.ForwardInput(ids, tgt), checkpoint=checkpoint, options=NO_CORRECTION)


def _loss(out: rt.ForwardOutput, seed: int) -> torch.Tensor:
    return -(out.target_logprobs * advantages(seed)).sum()


def _commit(trainer: rt.Trainer, seed: int, checkpoint: str | None = None) -> None:
    trainer.backward(_loss(_forward(trainer, seed, checkpoint), seed))


def _params(trainer: rt.Trainer, name: str = "policy") -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.checkpoint(name).named_parameters()}


def _assert_params_equal(trainer: rt.Trainer, expected: dict[str, torch.Tensor], name: str = "policy") -> None:
    for n, p in trainer.checkpoint(name).named_parameters():
        assert torch.equal(p, expected[n]), f"{name}.{n}: parameter differs"


def _unchanged(trainer: rt.Trainer, name: str = "policy") -> tuple[dict, rt.CheckpointVersion, dict]:
    """What a refused load must not touch: parameters, version, optimizer state."""
    checkpoint = trainer.checkpoint(name)
    return _params(trainer, name), checkpoint.version, checkpoint.state_dict()["optimizer"]


def _assert_unchanged(
    trainer: rt.Trainer, before: tuple[dict, rt.CheckpointVersion, dict], name: str = "policy"
) -> None:
    params, version, optimizer = before
    _assert_params_equal(trainer, params, name)
    assert trainer.checkpoint(name).version == version
    assert_nested_equal(trainer.checkpoint(name).state_dict()["optimizer"], optimizer, "optimizer")


# --- loading ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_load_restores_parameters_and_optimizer_state_exactly(kind: str) -> None:
    source = make_trainer(kind, dropout=0.0)
    train_step(source, seed=1)
    train_step(source, seed=2)
    saved = source.checkpoint("policy").state_dict()
    _commit(source, seed=3)
    source.optim_step()
    source.zero_grad()
    expected = _params(source)  # the step the saved state takes next

    target = make_trainer(kind, dropout=0.0)
    checkpoint = target.checkpoint("policy")
    old_generation = checkpoint.generation
    assert any(not torch.equal(p, saved["parameters"][n]) for n, p in checkpoint.named_parameters())
    target.load_checkpoint("policy", saved)
    assert checkpoint.generation != old_generation
    assert checkpoint.revision == 2
    assert checkpoint.version == rt.CheckpointVersion("policy", checkpoint.generation, 2)
    _assert_params_equal(target, saved["parameters"])
    assert_nested_equal(checkpoint.state_dict()["optimizer"], saved["optimizer"], "optimizer")
    pristine = copy.deepcopy(saved)
    for value in saved["parameters"].values():
        value.add_(1.0)  # the load copied: the caller's dict stays the caller's
    _commit(target, seed=3)
    target.optim_step()
    _assert_params_equal(target, expected)

    # Loading over the same checkpoint rewinds it the same way, under a new generation.
    generation = source.checkpoint("policy").generation
    source.load_checkpoint("policy", pristine)
    assert source.checkpoint("policy").generation != generation
    assert source.checkpoint("policy").revision == 2
    _commit(source, seed=3)
    source.optim_step()
    _assert_params_equal(source, expected)


def test_bf16_load_restores_master_copies() -> None:
    trainer = trainer_with_policy(rt.ModelConfig.tiny(dtype=torch.bfloat16), optimizer=rt.AdamWConfig(lr=1e-3))
    train_step(trainer, seed=1)
    saved = trainer.checkpoint("policy").state_dict()
    train_step(trainer, seed=2)
    trainer.load_checkpoint("policy", saved)
    assert_nested_equal(trainer.checkpoint("policy").state_dict(), saved, "state")


def test_load_is_refused_while_a_graph_is_live_and_nothing_changes() -> None:
    trainer = make_trainer("full", dropout=0.0)
    saved = trainer.checkpoint("policy").state_dict()
    train_step(trainer, seed=1)
    out = _forward(trainer, seed=2)
    before = _unchanged(trainer)
    with pytest.raises(rt.CheckpointBusyError) as info:
        trainer.load_checkpoint("policy", saved)
    error = info.value
    assert isinstance(error, rt.TrainerError)
    assert (error.checkpoint, error.live_graphs, error.pending_gradients) == ("policy", 1, 0)
    assert "discard_graphs=True" in str(error)
    _assert_unchanged(trainer, before)
    trainer.backward(_loss(out, 2))  # the record is still good


def test_load_is_refused_while_gradients_are_pending_and_nothing_changes() -> None:
    trainer = make_trainer("lora", dropout=0.0)
    saved = trainer.checkpoint("policy").state_dict()
    train_step(trainer, seed=1)
    _commit(trainer, seed=2)
    grads = grad_snapshot(trainer)
    pending = sum(1 for p in trainer.checkpoint("policy").parameters() if p.grad is not None)
    before = _unchanged(trainer)
    with pytest.raises(rt.CheckpointBusyError) as info:
        trainer.load_checkpoint("policy", saved)
    assert (info.value.live_graphs, info.value.pending_gradients) == (0, pending) and pending > 0
    _assert_unchanged(trainer, before)
    assert_grads_unchanged(trainer, grads)
    trainer.zero_grad()
    trainer.load_checkpoint("policy", saved)  # idle now: allowed
    assert trainer.checkpoint("policy").revision == 0


def test_the_busy_check_counts_only_the_loaded_checkpoint() -> None:
    """A live graph and committed gradients on "policy" do not make loading "ref" busy, nor touch "policy"."""
    trainer = make_trainer("full", dropout=0.0)
    trainer.add_checkpoint("ref", lora=rt.LoRAConfig(rank=4), seed=3)
    saved = trainer.checkpoint("ref").state_dict()
    _commit(trainer, seed=1, checkpoint="ref")
    trainer.optim_step(checkpoints=["ref"])
    trainer.zero_grad(checkpoints=["ref"])
    _commit(trainer, seed=2, checkpoint="policy")
    out = _forward(trainer, seed=3, checkpoint="policy")
    grads, before = grad_snapshot(trainer), _unchanged(trainer)
    trainer.load_checkpoint("ref", saved)
    assert trainer.checkpoint("ref").revision == 0
    _assert_params_equal(trainer, saved["parameters"], "ref")
    _assert_unchanged(trainer, before)
    assert_grads_unchanged(trainer, grads)
    trainer.backward(_loss(out, 3))  # policy's record is still good


def test_discard_graphs_drops_gradients_and_older_graphs_raise_replaced() -> None:
    trainer = make_trainer("full", dropout=0.0)
    saved = trainer.checkpoint("policy").state_dict()
    train_step(trainer, seed=1)
    out = _forward(trainer, seed=2)
    _commit(trainer, seed=3)
    old_generation = trainer.checkpoint("policy").generation

    trainer.load_checkpoint("policy", saved, discard_graphs=True)

    checkpoint = trainer.checkpoint("policy")
    new_generation = checkpoint.generation
    assert new_generation != old_generation and checkpoint.revision == 0
    _assert_params_equal(trainer, saved["parameters"])
    assert all(p.grad is None for p in checkpoint.parameters())
    # The dropped gradients' origins are gone too: the step does not trip over them.
    assert trainer.optim_step()["policy"].reason == "no gradients"
    loaded = _params(trainer)
    with pytest.raises(rt.CheckpointReplacedError) as info:
        trainer.backward(_loss(out, 2))
    error = info.value
    assert isinstance(error, rt.GradientCommitError)
    assert (error.checkpoint, error.forward_generation, error.current_generation) == (
        "policy",
        old_generation,
        new_generation,
    )
    assert trainer.live_records() == 0, "the replaced record is released"
    assert all(p.grad is None for p in checkpoint.parameters())
    _assert_params_equal(trainer, loaded)
    _commit(trainer, seed=2)  # a forward on the loaded checkpoint works
    assert trainer.optim_step()["policy"].stepped


# --- creating and selecting ------------------------------------------------------------


def test_add_checkpoint_refuses_an_existing_name() -> None:
    trainer = make_trainer("full", dropout=0.0)
    original = trainer.checkpoint("policy")
    params = _params(trainer)
    with pytest.raises(rt.ConfigError) as info:
        trainer.add_checkpoint("policy", lora=rt.LoRAConfig(rank=2))
    assert info.value.field == "name" and info.value.value == "policy"
    assert trainer.checkpoint("policy") is original
    assert list(trainer.checkpoints) == ["policy"]
    _assert_params_equal(trainer, params)


@pytest.mark.parametrize("kwargs", [{}, {"lora": rt.LoRAConfig(rank=2), "full": True}], ids=["neither", "both"])
def test_add_checkpoint_needs_exactly_one_of_lora_and_full(kwargs: dict) -> None:
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(), seed=0))
    with pytest.raises(rt.ConfigError) as info:
        trainer.add_checkpoint("policy", **kwargs)
    assert "lora" in info.value.field and "full" in info.value.field
    assert not trainer.checkpoints


def _two_checkpoints() -> rt.Trainer:
    trainer = make_trainer("full", dropout=0.0)
    trainer.add_checkpoint("adapter", lora=rt.LoRAConfig(rank=2), seed=3)
    return trainer


def test_forward_without_a_name_is_ambiguous_with_two_checkpoints() -> None:
    trainer = _two_checkpoints()
    with pytest.raises(rt.ConfigError) as info:
        _forward(trainer, seed=1)
    assert info.value.field == "checkpoint"
    assert trainer.live_records() == 0
    with pytest.raises(rt.ConfigError):
        _forward(rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(), seed=0)), seed=1)  # none at all
    with pytest.raises(rt.ConfigError):
        _forward(trainer, seed=1, checkpoint="missing")


def test_base_runs_the_frozen_model_without_grad() -> None:
    trainer = _two_checkpoints()
    _commit(trainer, seed=1, checkpoint="policy")
    trainer.optim_step()
    trainer.zero_grad()
    ids, tgt = sequence(2)
    out = trainer.forward(rt.ForwardInput(ids, tgt), checkpoint=rt.BASE)
    assert not out.target_logprobs.requires_grad and out.target_logprobs.grad_fn is None
    assert out.version is None
    assert trainer.live_records() == 0
    with torch.no_grad():
        expected = rt.token_logprobs(trainer.model(ids[None]), tgt[None])[0]
    assert torch.equal(out.target_logprobs, expected)
    moved = trainer.forward(rt.ForwardInput(ids, tgt), checkpoint="policy").target_logprobs
    assert not torch.allclose(moved, expected), "non-vacuous: the stepped checkpoint differs from the base"


# --- state dicts -------------------------------------------------------------------------


def test_state_dict_structure_and_independence() -> None:
    trainer = make_trainer("lora", dropout=0.0, lr=2e-2)
    train_step(trainer, seed=1)
    checkpoint = trainer.checkpoint("policy")
    state = checkpoint.state_dict()
    assert set(state) == {"parameters", "optimizer", "revision"}
    assert state["revision"] == 1 and isinstance(state["revision"], int)
    assert list(state["parameters"]) == [n for n, _ in checkpoint.named_parameters()]
    for name, param in checkpoint.named_parameters():
        assert torch.equal(state["parameters"][name], param)
        assert state["parameters"][name].untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
    assert set(state["optimizer"]) == {"state", "param_groups"}
    group = state["optimizer"]["param_groups"][0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == (2e-2, (0.9, 0.999), 1e-8, 1e-2)
    assert len(state["optimizer"]["state"]) == len(state["parameters"])


def _drop(key: str):
    return lambda s: s.pop(key)


def _set(path: tuple, value: object):
    def mutate(state: dict) -> None:
        where = state
        for key in path[:-1]:
            where = where[key]
        where[path[-1]] = value(where[path[-1]]) if callable(value) else value

    return mutate


FIRST = "model.embed_tokens.weight"
MALFORMED = {
    "missing parameters": _drop("parameters"),
    "missing optimizer": _drop("optimizer"),
    "missing revision": _drop("revision"),
    "unknown parameter name": _set(("parameters", "model.nope.weight"), torch.zeros(1)),
    "missing parameter name": lambda s: s["parameters"].pop(FIRST),
    "wrong shape": _set(("parameters", FIRST), lambda t: t[:-1].clone()),
    "not a tensor": _set(("parameters", FIRST), lambda t: t.tolist()),
    "negative revision": _set(("revision",), -1),
    "bool revision": _set(("revision",), True),
    "optimizer without groups": _set(("optimizer", "param_groups"), []),
    "optimizer slot of wrong shape": _set(("optimizer", "state", 0, "exp_avg"), torch.zeros(3)),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_state_dict_is_a_config_error_and_changes_nothing(case: str) -> None:
    trainer = make_trainer("full", dropout=0.0)
    train_step(trainer, seed=1)
    saved = trainer.checkpoint("policy").state_dict()
    train_step(trainer, seed=2)
    before = _unchanged(trainer)
    bad = copy.deepcopy(saved)
    MALFORMED[case](bad)
    with pytest.raises(rt.ConfigError) as info:
        trainer.load_checkpoint("policy", bad)
    assert info.value.field.startswith("state_dict"), info.value.field
    _assert_unchanged(trainer, before)
    trainer.load_checkpoint("policy", saved)  # positive control: the intact state loads
    assert trainer.checkpoint("policy").revision == 1


@pytest.mark.parametrize(
    "mutate",
    [
        _set(("master_parameters", "model.nope.weight"), torch.zeros(1)),
        _set(("master_parameters", FIRST), lambda t: t[:, :-1].clone()),
        _set(("master_parameters",), [1, 2]),
        lambda s: s.update(parameters=s),  # not a name -> tensor mapping
    ],
    ids=["unknown master name", "master of wrong shape", "masters not a mapping", "parameters not a mapping"],
)
def test_malformed_bf16_state_dict_is_a_config_error_and_changes_nothing(mutate) -> None:
    trainer = trainer_with_policy(rt.ModelConfig.tiny(dtype=torch.bfloat16))
    saved = trainer.checkpoint("policy").state_dict()
    train_step(trainer, seed=1)
    before, masters = _unchanged(trainer), trainer.checkpoint("policy").state_dict()["master_parameters"]
    bad = copy.deepcopy(saved)
    mutate(bad)
    with pytest.raises(rt.ConfigError):
        trainer.load_checkpoint("policy", bad)
    _assert_unchanged(trainer, before)
    assert_nested_equal(trainer.checkpoint("policy").state_dict()["master_parameters"], masters, "masters")


# --- versions and copy on write --------------------------------------------------------------


def test_outputs_carry_the_version_they_were_computed_at() -> None:
    trainer = _two_checkpoints()
    policy = trainer.checkpoint("policy")
    first = trainer.forward([rt.ForwardInput(*sequence(1)), rt.ForwardInput(*sequence(2))], checkpoint="policy")
    assert [o.version for o in first] == [rt.CheckpointVersion("policy", policy.generation, 0)] * 2
    assert first[0].version == policy.version
    adapter = _forward(trainer, seed=3, checkpoint="adapter")
    assert adapter.version == rt.CheckpointVersion("adapter", trainer.checkpoint("adapter").generation, 0)

    _commit(trainer, seed=4, checkpoint="policy")
    trainer.optim_step()
    trainer.zero_grad()
    second = _forward(trainer, seed=1, checkpoint="policy")
    assert second.version == rt.CheckpointVersion("policy", policy.generation, 1)
    assert first[0].version.revision == 0, "an output's version never changes"

    old_generation = policy.generation
    trainer.load_checkpoint("policy", policy.state_dict(), discard_graphs=True)
    third = _forward(trainer, seed=1, checkpoint="policy")
    assert third.version == rt.CheckpointVersion("policy", policy.generation, 1)
    assert policy.generation != old_generation


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_pending_forward_keeps_its_weights_across_a_step(kind: str) -> None:
    trainer = make_trainer(kind, dropout=0.0)
    train_step(trainer, seed=1)  # LoRA: moves B off zero, so every gradient is non-trivial
    weights = snapshot_weights(trainer, "policy")
    storage = {n: p.untyped_storage().data_ptr() for n, p in trainer.checkpoint("policy").named_parameters()}
    ids, tgt = sequence(2)
    rng_state = torch.get_rng_state()
    out = trainer.forward(rt.ForwardInput(ids, tgt), options=NO_CORRECTION)
    train_step(trainer, seed=3)
    for n, p in trainer.checkpoint("policy").named_parameters():
        assert p.untyped_storage().data_ptr() != storage[n], f"{n}: a live capture forces a copy"
    trainer.backward(_loss(out, 2))
    expected = plain_gradients(
        trainer.model.config, weights, [(ids, tgt)], lambda o: -(o[0] * advantages(2)).sum(), rng_state
    )
    for n, p in trainer.checkpoint("policy").named_parameters():
        assert torch.equal(p.grad, expected[n]), f"{n}: not the gradient of the forward's weights"


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_step_without_pending_graph_does_not_copy_weights(kind: str) -> None:
    trainer = make_trainer(kind, dropout=0.0)
    _commit(trainer, seed=1)
    assert trainer.live_records() == 0
    before = _params(trainer)
    storage = {n: p.untyped_storage().data_ptr() for n, p in trainer.checkpoint("policy").named_parameters()}
    trainer.optim_step()
    for n, p in trainer.checkpoint("policy").named_parameters():
        assert p.untyped_storage().data_ptr() == storage[n], f"{n}: copied although no graph needs the old weights"
    assert any(not torch.equal(p, before[n]) for n, p in trainer.checkpoint("policy").named_parameters())
