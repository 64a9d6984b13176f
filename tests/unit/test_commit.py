"""Transactional commit (NOTE [Gradient commit]): faults, mixed batches, accumulation, lifetime, the finiteness check,
and ``GradientTransaction``'s own checks driven directly."""

from __future__ import annotations

import gc

import pytest
import torch

import reference_trainer as rt
from reference_trainer.commit import GradientTransaction
from reference_trainer.sinks import LiveGradSink
from reference_trainer.testing import inject_fault
from tests.support import (
    NO_CORRECTION,
    advantages,
    assert_grads_unchanged,
    grad_snapshot,
    make_trainer,
    sequence,
    train_step,
)
from validation.lifetime import TensorCensus, live_tensors_like
from validation.oracle import plain_gradients, snapshot_weights
from validation.trainers import trainer_with_policy


def _forward(trainer: rt.Trainer, seed: int) -> rt.ForwardOutput:
    ids, tgt = sequence(seed)
    return trainer.forward(rt.ForwardInput(ids, tgt), options=NO_CORRECTION)


def _loss(out: rt.ForwardOutput, seed: int) -> torch.Tensor:
    return -(out.target_logprobs * advantages(seed)).sum()


def _with_existing_grads(kind: str = "full") -> rt.Trainer:
    trainer = make_trainer(kind, dropout=0.0)
    trainer.backward(_loss(_forward(trainer, 1), 1))
    return trainer


N_PARAMS = len(list(make_trainer("full").checkpoint("policy").parameters()))
FAULTS = [
    ("user_autograd", None),
    ("model_backward", None),
    ("validate", None),
    ("publish", 0),
    ("publish", N_PARAMS // 2),
    ("publish", N_PARAMS - 1),
]


@pytest.mark.parametrize("stage,index", FAULTS)
def test_fault_at_any_stage_commits_nothing_and_frees_staging(stage: str, index: int | None) -> None:
    trainer = _with_existing_grads()
    embed_shape = tuple(trainer.model.model.embed_tokens.weight.shape)
    out = _forward(trainer, 2)
    loss = _loss(out, 2)
    before = grad_snapshot(trainer)
    witnesses = live_tensors_like(embed_shape)
    with inject_fault(stage, index=index), pytest.raises(rt.GradientCommitError) as info:
        trainer.backward(loss, retain_graph=False)
    assert_grads_unchanged(trainer, before)
    # Staging is freed even though the exception (and its traceback) is still held.
    assert live_tensors_like(embed_shape) <= witnesses
    del info
    if stage == "user_autograd":
        assert trainer.live_records() == 1
        trainer.backward(loss)  # the same record, the same loss
    else:
        assert trainer.live_records() == 0
        with pytest.raises(rt.GradientCommitError, match="already backpropagated or released"):
            trainer.backward(_loss(out, 2))
        trainer.backward(_loss(_forward(trainer, 2), 2))  # a fresh forward succeeds
    assert all(p.grad is not before[n][0] for n, p in trainer.checkpoint("policy").named_parameters())


def test_publish_fault_rolls_back_the_assignments_already_made() -> None:
    trainer = _with_existing_grads()
    before = grad_snapshot(trainer)
    with inject_fault("publish", index=N_PARAMS - 1), pytest.raises(rt.GradientCommitError):
        trainer.backward(_loss(_forward(trainer, 3), 3))
    assert_grads_unchanged(trainer, before)


@pytest.mark.parametrize("stale_first", [True, False])
def test_batch_mixing_good_and_stale_records_commits_nothing(stale_first: bool) -> None:
    trainer = make_trainer("full", dropout=0.0)
    options = rt.ForwardOptions(max_gradient_staleness=0, corrections=())
    ids, tgt = sequence(4)
    stale = trainer.forward(rt.ForwardInput(ids, tgt), options=options)
    trainer.backward(_loss(_forward(trainer, 5), 5))
    trainer.optim_step()
    trainer.zero_grad()
    good = _forward(trainer, 6)
    parts = [stale.target_logprobs.sum(), good.target_logprobs.sum()]
    loss = parts[0] + parts[1] if stale_first else parts[1] + parts[0]
    with pytest.raises(rt.StaleGradientError):
        trainer.backward(loss)
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())
    trainer.backward(good.target_logprobs.sum())  # its model backward never ran: retryable


@pytest.mark.parametrize("bad_first", [True, False])
def test_batch_mixing_good_and_non_finite_records_commits_nothing(bad_first: bool) -> None:
    trainer = _with_existing_grads()
    first, second = _forward(trainer, 7), _forward(trainer, 8)
    bad, good = (first, second) if bad_first else (second, first)
    before = grad_snapshot(trainer)
    loss = good.target_logprobs.sum() + bad.target_logprobs.sum() * float("nan")
    with pytest.raises(rt.GradientCommitError, match="non-finite"):
        trainer.backward(loss)
    assert_grads_unchanged(trainer, before)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_first_backward_with_a_nan_loss_is_refused_at_validation_and_leaves_every_grad_none(kind: str) -> None:
    trainer = make_trainer(kind, dropout=0.0)
    out = _forward(trainer, 3)
    with pytest.raises(rt.GradientCommitError, match="expected a finite gradient"):
        trainer.backward(_loss(out, 3) * float("nan"))
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())
    assert trainer.optim_step()["policy"].reason == "no gradients"


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_an_accumulating_backward_with_non_finite_gradients_is_refused_at_validation(value: float) -> None:
    trainer = _with_existing_grads()
    before = grad_snapshot(trainer)
    with pytest.raises(rt.GradientCommitError, match="expected a finite gradient"):
        trainer.backward(_loss(_forward(trainer, 4), 4) * value)
    assert_grads_unchanged(trainer, before)


def test_gradients_of_several_backwards_accumulate_bitwise_in_order() -> None:
    trainer = make_trainer("lora", dropout=0.1)
    config = trainer.model.config
    weights = snapshot_weights(trainer, "policy")
    expected = None
    for seed in (11, 12, 13):
        ids, tgt = sequence(seed)
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        out = trainer.forward(rt.ForwardInput(ids, tgt), options=NO_CORRECTION)
        trainer.backward(_loss(out, seed))
        grads = plain_gradients(config, weights, [(ids, tgt)], lambda o, s=seed: -(o[0] * advantages(s)).sum(), state)
        expected = grads if expected is None else {n: expected[n] + grads[n] for n in grads}
    for name, param in trainer.checkpoint("policy").named_parameters():
        assert torch.equal(param.grad, expected[name]), name


def test_a_record_consumes_all_its_outputs_and_unused_ones_get_zero_cotangent() -> None:
    trainer = make_trainer("full", dropout=0.0)
    a, b = sequence(20), sequence(21, length=6)
    weights = snapshot_weights(trainer, "policy")
    state = torch.get_rng_state()
    outs = trainer.forward([rt.ForwardInput(*a), rt.ForwardInput(*b)], options=NO_CORRECTION)
    trainer.backward(outs[1].target_logprobs.sum())
    assert trainer.live_records() == 0
    with pytest.raises(rt.GradientCommitError):
        trainer.backward(outs[0].target_logprobs.sum())
    ref = plain_gradients(trainer.model.config, weights, [a, b], lambda o: o[1].sum(), state)
    for name, param in trainer.checkpoint("policy").named_parameters():
        assert torch.equal(param.grad, ref[name]), name


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_no_graph_or_saved_tensor_outlives_backward(kind: str) -> None:
    trainer = make_trainer(kind, dropout=0.1)
    with TensorCensus() as census:
        out = _forward(trainer, 30)
    mine = [out.target_logprobs]
    assert census.alive(ignore=mine), "the census must see the graph while it is pending"
    trainer.backward(_loss(out, 30))
    assert census.alive(ignore=mine) == []


def test_no_graph_outlives_a_dropped_output() -> None:
    trainer = make_trainer("full", dropout=0.1)
    with TensorCensus() as census:
        out = _forward(trainer, 31)
    del out
    gc.collect()
    assert census.alive() == []
    assert trainer.live_records() == 0


def test_census_flags_a_kept_graph() -> None:
    """Negative control: a retained graph is reported alive."""
    trainer = make_trainer("full", dropout=0.1)
    with TensorCensus() as census:
        out = _forward(trainer, 32)
    mine = [out.target_logprobs]
    trainer.backward(_loss(out, 32), retain_graph=True)
    assert census.alive(ignore=mine), "retain_graph=True keeps the graph; the census must say so"
    trainer.backward(_loss(out, 32))  # a retained output may be backpropagated again
    assert census.alive(ignore=mine) == []


def test_second_backward_through_same_output_raises_unless_retained() -> None:
    trainer = make_trainer("lora", dropout=0.0)
    out = _forward(trainer, 33)
    trainer.backward(out.target_logprobs.sum())
    with pytest.raises(rt.GradientCommitError, match="retain_graph=True"):
        trainer.backward(out.target_logprobs.sum())


def test_loss_that_reaches_no_output_is_a_config_error() -> None:
    trainer = make_trainer("lora", dropout=0.0)
    with pytest.raises(rt.ConfigError):
        trainer.backward(torch.ones(2, requires_grad=True).sum())


# --- the finiteness check: one fused norm, then an exact per-tensor check; refuses NaN, keeps huge finite values


def _trainer_and_output() -> tuple[rt.Trainer, rt.ForwardOutput]:
    trainer = trainer_with_policy()
    tokens = torch.randint(0, trainer.model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    return trainer, trainer.forward(rt.ForwardInput(tokens[:-1], tokens[1:]))


def test_a_first_backward_with_a_nan_loss_commits_nothing() -> None:
    trainer, out = _trainer_and_output()
    with pytest.raises(rt.GradientCommitError, match="expected a finite gradient"):
        trainer.backward(out.target_logprobs.sum() * float("nan"))
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())


def test_finite_gradients_whose_squares_overflow_still_commit() -> None:
    trainer, out = _trainer_and_output()
    trainer.backward(out.target_logprobs.sum() * 1e25)
    grads = [p.grad for p in trainer.checkpoint("policy").parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    assert max(float(g.abs().max()) for g in grads) > 1e20  # the fused norm overflowed: the exact path decided


# --- GradientTransaction driven directly (NOTE [Gradient commit] Rule 2)
# Through the trainer most of these are also caught earlier (ages are checked
# before any model backward runs) or cannot arise (a backward's gradients have
# the capture's shapes); the transaction still validates everything it
# publishes, so each check is exercised here on purpose-built staging.


def _transaction(trainer: rt.Trainer, lookup=None) -> GradientTransaction:
    released: list = []
    return GradientTransaction(LiveGradSink(), lookup or trainer.checkpoint, released.append)


def _grads(capture, transform=lambda g: g) -> dict[str, torch.Tensor]:
    return {n: transform(torch.ones_like(t)) for n, t in capture.tensors.items()}


def _assert_nothing_published(trainer: rt.Trainer) -> None:
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())


def test_validate_refuses_an_origin_that_grew_too_old_after_staging() -> None:
    trainer = make_trainer("full", dropout=0.0)
    capture = trainer.checkpoint("policy").capture()
    transaction = _transaction(trainer)
    transaction.stage(capture, _grads(capture), 0)
    train_step(trainer, seed=5)  # revision 0 -> 1: the staged origin is now stale beyond bound 0
    with pytest.raises(rt.StaleGradientError):
        transaction.commit()
    _assert_nothing_published(trainer)


def test_validate_refuses_a_replaced_checkpoint_object() -> None:
    trainer = make_trainer("full", dropout=0.0)
    other = make_trainer("full", dropout=0.0)
    capture = trainer.checkpoint("policy").capture()
    lookup = {"policy": trainer.checkpoint("policy")}
    transaction = _transaction(trainer, lookup.__getitem__)
    transaction.stage(capture, _grads(capture), 2)
    lookup["policy"] = other.checkpoint("policy")  # the name now resolves to another checkpoint
    with pytest.raises(rt.GradientCommitError, match="gradient target was replaced"):
        transaction.commit()
    _assert_nothing_published(trainer)


@pytest.mark.parametrize(
    ("what", "transform"),
    [
        ("shape", lambda g: g.reshape(-1)[:-1] if g.numel() > 1 else g.reshape(2, -1)),
        ("dtype", lambda g: g.double()),
        ("device", lambda g: g.to("meta")),
    ],
)
def test_validate_refuses_a_gradient_of_the_wrong_shape_dtype_or_device(what: str, transform) -> None:
    trainer = make_trainer("full", dropout=0.0)
    capture = trainer.checkpoint("policy").capture()
    transaction = _transaction(trainer)
    transaction.stage(capture, _grads(capture, transform), 2)
    with pytest.raises(rt.GradientCommitError, match=f"gradient {what} expected"):
        transaction.commit()
    _assert_nothing_published(trainer)


def test_validate_refuses_a_non_finite_first_gradient() -> None:
    trainer = make_trainer("full", dropout=0.0)
    capture = trainer.checkpoint("policy").capture()
    transaction = _transaction(trainer)
    transaction.stage(capture, _grads(capture, lambda g: g * float("nan")), 2)
    with pytest.raises(rt.GradientCommitError, match="expected a finite gradient"):
        transaction.commit()
    _assert_nothing_published(trainer)
