"""The trainer owns its logical ranks' gradient buffers: load, zero_grad, optim_step and the busy check see them.

One-process cases run here (W = 1, no process group); the two-process case
comes from the spawned suite (``two_process`` fixture, scenario
``pending-then-load``).
"""

from __future__ import annotations

from typing import Any

import dist_scenarios as ds
import numpy as np
import pytest
import torch

import reference_trainer as rt
from reference_trainer.ranks import logical_gradients, run_logical


def _backward_on_every_rank(trainer: rt.Trainer, logical_dp: int = 2) -> None:
    def body(view: Any) -> None:
        items, advantages = ds.micro_batch(0, view.logical_rank)
        view.backward(ds.rank_loss(view.forward(items), advantages, 10))

    run_logical(body, trainer, logical_dp=logical_dp)


def test_load_refuses_pending_logical_gradients_and_discard_drops_them() -> None:
    trainer = ds.make_trainer()
    saved = trainer.checkpoint(ds.POLICY).state_dict()
    _backward_on_every_rank(trainer)
    before = logical_gradients(trainer)
    assert before and not trainer.checkpoint(ds.POLICY).has_gradients()
    with pytest.raises(rt.CheckpointBusyError) as info:
        trainer.load_checkpoint(ds.POLICY, saved)
    assert info.value.pending_gradients > 0
    after = logical_gradients(trainer)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), "a refused load changed a sum"
    trainer.load_checkpoint(ds.POLICY, saved, discard_graphs=True)
    assert logical_gradients(trainer) == {}
    step = trainer.optim_step()[ds.POLICY]
    assert (step.stepped, step.reason, step.revision) == (False, "no gradients", 0)
    _backward_on_every_rank(trainer)  # training goes on
    step = trainer.optim_step()[ds.POLICY]
    assert (step.stepped, step.revision) == (True, 1)


def test_zero_grad_clears_logical_buffers() -> None:
    trainer = ds.make_trainer()
    _backward_on_every_rank(trainer)
    trainer.zero_grad()
    assert logical_gradients(trainer) == {}
    assert trainer.optim_step()[ds.POLICY].reason == "no gradients"
    trainer.load_checkpoint(ds.POLICY, trainer.checkpoint(ds.POLICY).state_dict())  # nothing pending: allowed


def test_a_repeated_checkpoint_name_steps_once_and_adds_the_buffers_once() -> None:
    trainer = ds.make_trainer()
    _backward_on_every_rank(trainer, logical_dp=4)
    sums = logical_gradients(trainer)
    report = trainer.optim_step(checkpoints=[ds.POLICY, ds.POLICY])
    assert report[ds.POLICY].revision == 1 and trainer.checkpoint(ds.POLICY).revision == 1
    expected = ds.tree_oracle([ds.rank_gradients(rank) for rank in range(4)])
    for name, param in trainer.checkpoint(ds.POLICY).named_parameters():
        assert expected[name].abs().sum() > 0
        assert torch.equal(param.grad, expected[name]) and torch.equal(sums[(ds.POLICY, name)], expected[name].reshape(-1)), name


def test_changing_the_layout_over_pending_buffers_is_refused() -> None:
    trainer = ds.make_trainer()
    _backward_on_every_rank(trainer, logical_dp=2)
    with pytest.raises(rt.ConfigError, match="pending logical gradients"):
        run_logical(lambda view: None, trainer, logical_dp=4)
    trainer.zero_grad()
    run_logical(lambda view: None, trainer, logical_dp=4)


def test_no_registry_of_trainers_remains() -> None:
    """The logical-rank state lives on the trainer: dropping the trainer drops it."""
    import gc
    import weakref

    trainer = ds.make_trainer()
    _backward_on_every_rank(trainer)
    ref = weakref.ref(trainer.rank_gradients.host)
    del trainer
    gc.collect()
    assert ref() is None


@pytest.mark.dist
def test_two_processes_refuse_a_load_over_pending_buffers_and_go_on_after_a_discard(two_process: dict) -> None:
    single = ds.pending_then_load(0)  # W = 1 reference, same job
    for rank in (0, 1):
        entry = two_process["ranks"][rank]["pending-then-load"]
        assert "crash" not in entry, entry.get("crash")
        facts = entry["value"]
        assert facts["pending"] == single["pending"] > 0
        assert facts["busy"]["type"] == "CheckpointBusyError"
        assert facts["after_discard"] == 0
        assert facts["discarded_step"] == (False, "no gradients", 0)
        assert facts["next_step"] == (True, None, 1)
        for name, value in single["params"].items():
            assert np.array_equal(facts["params"][name], value.numpy()), f"rank {rank}: {name} differs from W=1"


def test_optim_step_validates_every_buffered_origin_before_any_grad_changes() -> None:
    """NOTE [Staleness] Rule 4 for buffers: an invalid buffered origin fails the step with .grad untouched.

    Through the API an origin cannot go bad while buffered (load refuses, every
    step flushes first), so an origin of another generation is written into a
    buffer by hand.
    """
    trainer = ds.make_trainer()
    _backward_on_every_rank(trainer)
    checkpoint = trainer.checkpoint(ds.POLICY)
    replaced = rt.CheckpointVersion(ds.POLICY, checkpoint.generation + 1, checkpoint.revision)
    trainer.rank_gradients.buffers[1].record_origins(checkpoint, {(replaced, 2)})
    sums = logical_gradients(trainer)
    with pytest.raises(rt.CheckpointReplacedError):
        trainer.optim_step()
    assert not checkpoint.has_gradients() and checkpoint.revision == 0, "a refused step changed the checkpoint"
    after = logical_gradients(trainer)
    assert sums and sums.keys() == after.keys() and all(torch.equal(sums[k], after[k]) for k in sums), "a refused step changed a sum"


# --- live .grad beside logical-rank buffers ----------------------------------------------------

STRICT = rt.ForwardOptions(corrections=(), max_gradient_staleness=0)


def _plain_gradient(trainer: rt.Trainer, batches: list[tuple[list, list]], count: int) -> dict[str, torch.Tensor]:
    """Oracle: plain autograd of ``sum_b rank_loss(batch b)`` on a deep copy of the model at the live weights."""
    import copy

    model = copy.deepcopy(trainer.model)
    weights = {n: p.detach().clone().requires_grad_(True) for n, p in trainer.checkpoint(ds.POLICY).named_parameters()}
    total = 0.0
    for items, advantages in batches:
        for item, advantage in zip(items, advantages):
            logits = torch.func.functional_call(model, weights, (item.input_tokens[None],))[0]  # (T, V)
            targets = item.targets()
            picked = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[:, None])[:, 0]
            logprobs = torch.where(targets >= 0, picked, torch.zeros_like(picked))  # a masked target: log-prob 0
            total = total - (logprobs * advantage).sum() / count
    return dict(zip(weights, torch.autograd.grad(total, list(weights.values()))))


def test_flush_adds_the_logical_sum_to_a_gradient_already_committed_to_grad() -> None:
    """A plain backward committed to ``.grad``, then logical ranks' buffers: the step sees both (oracle: autograd)."""
    trainer = ds.make_trainer()
    live = ds.micro_batch(7, 0)
    trainer.backward(ds.rank_loss(trainer.forward(live[0]), live[1], 10))
    _backward_on_every_rank(trainer)
    expected = _plain_gradient(trainer, [live, ds.micro_batch(0, 0), ds.micro_batch(0, 1)], 10)
    trainer.optim_step(lr=0.0)
    for name, param in trainer.checkpoint(ds.POLICY).named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_step_refused_for_a_stale_live_origin_leaves_grad_buffers_and_revision_unchanged() -> None:
    """NOTE [Staleness] Rule 4: every origin, buffered and live, is checked before the buffers are flushed."""
    trainer = ds.make_trainer()
    checkpoint = trainer.checkpoint(ds.POLICY)
    items, advantages = ds.micro_batch(7, 0)
    trainer.backward(ds.rank_loss(trainer.forward(items, options=STRICT), advantages, 10))
    trainer.optim_step()  # revision 1: the live origin (revision 0, bound 0) is now 1 stale

    def body(view: Any) -> None:
        items, advantages = ds.micro_batch(0, view.logical_rank)
        view.backward(ds.rank_loss(view.forward(items, options=STRICT), advantages, 10))

    run_logical(body, trainer, logical_dp=2)
    grads = {n: (p.grad, p.grad.clone()) for n, p in checkpoint.named_parameters()}
    params, sums = ds.params(trainer), logical_gradients(trainer)
    with pytest.raises(rt.StaleGradientError) as info:
        trainer.optim_step()
    assert (info.value.staleness, info.value.bound, info.value.forward_revision) == (1, 0, 0)
    for name, param in checkpoint.named_parameters():
        assert param.grad is grads[name][0] and torch.equal(param.grad, grads[name][1]), f"{name}: .grad changed"
        assert torch.equal(param, params[name]), f"{name}: parameter changed"
    after = logical_gradients(trainer)
    assert sums and after.keys() == sums.keys()
    assert all(torch.equal(sums[k], after[k]) for k in sums), "a refused step changed a sum"
    assert checkpoint.revision == 1
    trainer.zero_grad()  # the way out: drop the stale gradients, then train on
    _backward_on_every_rank(trainer)
    assert trainer.optim_step()[ds.POLICY].stepped


def test_zero_grad_of_one_checkpoint_leaves_the_other_checkpoints_logical_sums() -> None:
    """``zero_grad(checkpoints=[...])`` clears the named checkpoint's sums only; the other's stay, bit for bit."""
    trainer = ds.make_trainer()
    trainer.add_checkpoint("other", lora=rt.LoRAConfig(rank=2), seed=3)

    def body(view: Any) -> None:
        items, advantages = ds.micro_batch(0, view.logical_rank)
        loss = ds.rank_loss(view.forward(items, checkpoint=ds.POLICY), advantages, 10)
        view.backward(loss + ds.rank_loss(view.forward(items, checkpoint="other"), advantages, 10))

    run_logical(body, trainer, logical_dp=2)
    before = logical_gradients(trainer)
    assert {k[0] for k in before} == {ds.POLICY, "other"}, "non-vacuous: both checkpoints have pending sums"
    trainer.zero_grad(checkpoints=[ds.POLICY])
    after = logical_gradients(trainer)
    kept = {k: v for k, v in before.items() if k[0] == "other"}
    assert after.keys() == kept.keys() and all(torch.equal(after[k], kept[k]) for k in kept)


def test_a_round_failed_on_two_logical_ranks_raises_the_lowest_ranks_own_error() -> None:
    """Rank 0's backward is refused (a non-scalar loss), rank 1's fails its commit (NaN): every rank's backward
    fails with rank 0's error as the common one, and ``run_logical`` raises it, not rank 1's."""
    trainer = ds.make_trainer()

    def body(view: Any) -> None:
        items, advantages = ds.micro_batch(0, view.logical_rank)
        outputs = view.forward(items)
        if view.logical_rank == 0:
            view.backward(outputs[0].target_logprobs)
        else:
            view.backward(ds.rank_loss(outputs, advantages, 10) * float("nan"))

    with pytest.raises(rt.ConfigError, match="expected a one-element tensor"):
        run_logical(body, trainer, logical_dp=2)
    assert logical_gradients(trainer) == {}, "a failed round committed something"
