"""Offload copies, replay, the saved-state ledger and quantized-state refusal.

See docs/semantics.md#placements-and-memory-admission.
"""

from __future__ import annotations

import pytest
import torch

import reference_trainer as rt
from reference_trainer.host_arena import HostArena, host_block_bytes
from reference_trainer.ledger import FLOAT8_DTYPES, SavedStateLedger
from reference_trainer.planner import Placement
from tests.support import NO_CORRECTION, advantages, assert_grads_unchanged, grad_snapshot, make_trainer, sequence
from validation.allocations import AllocationPeak
from validation.lifetime import TensorCensus
from validation.trainers import trainer_with_policy


def _options(placement: str) -> rt.ForwardOptions:
    return rt.ForwardOptions(backward_state=placement, corrections=())


def _stash_activation(trainer: rt.Trainer) -> list[torch.Tensor]:
    """Keep the first MLP up-projection output, which SwiGLU's product saves for backward."""
    stash: list[torch.Tensor] = []
    trainer.model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: stash.append(o))
    return stash


def _gradient(placement: str, tamper: bool) -> dict[str, torch.Tensor]:
    trainer = make_trainer("full", dropout=0.0)
    stash = _stash_activation(trainer)
    out = trainer.forward(rt.ForwardInput(*sequence(1)), options=_options(placement))
    if tamper:
        with torch.no_grad():
            stash[0].mul_(3.0)
    trainer.backward(-(out.target_logprobs * advantages(1)).sum())
    return {n: p.grad for n, p in trainer.checkpoint("policy").named_parameters()}


def test_offload_copies_so_in_place_changes_to_originals_do_not_change_the_gradient() -> None:
    clean = _gradient("retain", tamper=False)
    for placement in ("offload", "replay"):
        tampered = _gradient(placement, tamper=True)
        for name, grad in clean.items():
            assert torch.equal(tampered[name], grad), f"{placement}: {name}"


def test_ledger_refuses_a_retained_tensor_modified_in_place() -> None:
    with pytest.raises(rt.GradientCommitError, match="modified in place after the forward"):
        _gradient("retain", tamper=True)


def test_ledger_catches_a_tampered_offloaded_copy_and_commits_nothing() -> None:
    trainer = make_trainer("full", dropout=0.0)
    out = trainer.forward(rt.ForwardInput(*sequence(2)), options=_options("offload"))
    ledger = trainer.records.get(out.record_id).ledger
    assert ledger.host_bytes > 0 and ledger.device_bytes == 0
    copy = ledger.host_copies[0]
    copy.add_(1)
    with pytest.raises(rt.GradientCommitError, match="modified in place"):
        trainer.backward(out.target_logprobs.sum())
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())


def test_offload_copies_each_shared_storage_once() -> None:
    ledger = SavedStateLedger(Placement.OFFLOAD, weight_storages=set())
    base = torch.randn(8, 4)
    with ledger.hooks():
        x = base.clone().requires_grad_(True)
        y = (x[:4] * x[4:]).sum()  # both views of one storage are saved
    ledger.end_forward()
    assert len(ledger.host_copies) == 1 and ledger.host_bytes == x.untyped_storage().nbytes()
    (grad,) = torch.autograd.grad(y, x)
    assert torch.equal(grad, torch.cat([base[4:], base[:4]]))


def test_replay_runs_the_forward_exactly_once_more_and_leaves_the_callers_rng_alone() -> None:
    trainer = make_trainer("lora", dropout=0.2)
    calls = []
    trainer.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    out = trainer.forward(rt.ForwardInput(*sequence(3)), options=_options("replay"))
    assert out.placement == "replay" and len(calls) == 1
    torch.manual_seed(42)
    rng_before = torch.get_rng_state()
    trainer.backward(out.target_logprobs.sum())
    assert len(calls) == 2, "replay re-runs the forward exactly once"
    assert torch.equal(torch.get_rng_state(), rng_before), "the caller's RNG state is untouched"


@pytest.mark.parametrize("caller_grad", [True, False])
def test_a_replay_placed_forward_runs_in_its_replays_grad_mode(caller_grad: bool) -> None:
    """On CUDA attention kernels choose by grad mode: the forward and its replay must run in the same one."""
    trainer = make_trainer("lora", dropout=0.0)
    modes: list[bool] = []
    trainer.model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a: modes.append(torch.is_grad_enabled())
    )
    with torch.set_grad_enabled(caller_grad):
        out = trainer.forward(rt.ForwardInput(*sequence(3)), options=_options("replay"))
    assert out.target_logprobs.grad_fn is None and trainer.records.get(out.record_id).root is None
    trainer.backward(out.target_logprobs.sum())
    assert modes == [True, True], "the replay-placed forward and its replay ran in different grad modes"


def test_replay_without_rng_restore_would_differ() -> None:
    """Non-vacuous dropout: a forward with another RNG state gives other log-probs."""
    trainer = make_trainer("lora", dropout=0.2)
    ids, tgt = sequence(4)
    torch.manual_seed(1)
    a = trainer.forward(rt.ForwardInput(ids, tgt), options=_options("replay")).target_logprobs
    torch.manual_seed(2)
    b = trainer.forward(rt.ForwardInput(ids, tgt), options=_options("replay")).target_logprobs
    assert not torch.equal(a, b)


def test_a_replay_whose_outputs_differ_raises_and_commits_nothing() -> None:
    trainer = make_trainer("full", dropout=0.0)
    first = trainer.forward(rt.ForwardInput(*sequence(5)), options=NO_CORRECTION)
    trainer.backward(first.target_logprobs.sum())
    before = grad_snapshot(trainer)
    out = trainer.forward(rt.ForwardInput(*sequence(6)), options=_options("replay"))
    trainer.model.lm_head.register_forward_hook(lambda m, i, o: o * 1.01)  # the model changes behind our back
    with pytest.raises(rt.GradientCommitError, match="did not reproduce"):
        trainer.backward(out.target_logprobs.sum())
    assert_grads_unchanged(trainer, before)
    assert trainer.live_records() == 0


@pytest.mark.parametrize("placement", ["retain", "offload"])
def test_quantized_saved_state_is_refused_before_backward_and_released(placement: str) -> None:
    trainer = make_trainer("lora", dropout=0.0)
    rt.mark_quantized_saved_state(trainer.model.model.layers[0].mlp)
    with TensorCensus() as census:
        out = trainer.forward(rt.ForwardInput(*sequence(7)), options=_options(placement))
    calls = []
    trainer.model.register_full_backward_hook(lambda *a: calls.append(1))
    with pytest.raises(rt.UnsupportedSavedStateError, match="mark_quantized_saved_state"):
        trainer.backward(out.target_logprobs.sum())
    assert calls == []
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())
    assert census.alive(ignore=[out.target_logprobs]) == [], "the graph is gone"


def test_quantized_module_under_auto_is_replayed_exactly() -> None:
    trainer = make_trainer("lora", dropout=0.0)
    rt.mark_quantized_saved_state(trainer.model.model.layers[0].mlp)
    out = trainer.forward(rt.ForwardInput(*sequence(8)), options=NO_CORRECTION)
    assert out.placement == "replay"
    trainer.backward(out.target_logprobs.sum())
    assert all(p.grad is not None for p in trainer.checkpoint("policy").parameters())


@pytest.mark.parametrize("dtype", sorted(FLOAT8_DTYPES, key=str))
def test_float8_saved_tensors_are_noted_as_unsupported(dtype: torch.dtype) -> None:
    ledger = SavedStateLedger(Placement.RETAIN, weight_storages=set())
    ledger.hooks().pack_hook(torch.zeros(4).to(dtype))  # what autograd calls when it saves the tensor
    assert ledger.unsupported is not None and str(dtype) in ledger.unsupported


def test_a_retained_backward_of_a_replay_record_keeps_no_graph_and_replays_again() -> None:
    trainer = make_trainer("full", dropout=0.1)
    calls = []
    trainer.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    out = trainer.forward(rt.ForwardInput(*sequence(9)), options=_options("replay"))
    trainer.backward(out.target_logprobs.sum(), retain_graph=True)
    first = {n: p.grad.clone() for n, p in trainer.checkpoint("policy").named_parameters()}
    assert trainer.records.get(out.record_id).root is None, "a replay record holds no graph between backwards"
    trainer.zero_grad()
    trainer.backward(out.target_logprobs.sum())
    assert len(calls) == 3, "the forward, then one replay per backward"
    for name, param in trainer.checkpoint("policy").named_parameters():
        assert torch.equal(param.grad, first[name]), name


def test_base_forwards_are_deterministic_reference_log_probs() -> None:
    trainer = make_trainer("lora", dropout=0.5)
    ids, tgt = sequence(10)
    rng = torch.get_rng_state()
    a = trainer.forward(rt.ForwardInput(ids, tgt), checkpoint=rt.BASE).target_logprobs
    b = trainer.forward(rt.ForwardInput(ids, tgt), checkpoint=rt.BASE).target_logprobs
    assert torch.equal(a, b) and torch.equal(torch.get_rng_state(), rng)
    assert trainer.model.training, "the model's mode is restored"


@pytest.mark.parametrize("placement", ["replay", "offload"])
def test_a_backward_after_the_model_went_to_eval_differentiates_the_forwards_train_mode(placement: str) -> None:
    """The mode is part of the forward's state: replay restores it, and the caller's mode is left alone."""
    grads = {}
    for label, options in (("retain, mode kept", _options("retain")), (placement, _options(placement))):
        trainer = make_trainer("full", dropout=0.2)
        torch.manual_seed(3)
        out = trainer.forward(rt.ForwardInput(*sequence(4)), options=options)
        trainer.model.eval()
        trainer.backward(-(out.target_logprobs * advantages(4)).sum())
        assert not trainer.model.training, f"{label}: the backward changed the caller's mode"
        grads[label] = {n: p.grad for n, p in trainer.checkpoint("policy").named_parameters()}
    for name, expected in grads["retain, mode kept"].items():
        assert expected.abs().sum() > 0 and torch.equal(grads[placement][name], expected), name


@pytest.mark.parametrize(
    ("nbytes", "pinned", "held"),
    [(1000, True, 1024), (1024, True, 1024), (1025, True, 2048), (1025, False, 1025), (0, True, 0)],
)
def test_the_host_budget_counts_the_pinned_block_a_copy_really_holds(nbytes: int, pinned: bool, held: int) -> None:
    assert host_block_bytes(nbytes, pinned) == held


def _offloaded_square(arena: HostArena | None) -> tuple[SavedStateLedger, torch.Tensor, torch.Tensor]:
    x = torch.randn(300, requires_grad=True, generator=torch.Generator().manual_seed(0))
    ledger = SavedStateLedger(Placement.OFFLOAD, weight_storages=set(), arena=arena)
    with ledger.hooks():
        y = (x.exp() * x.sin()).sum()  # saves x, exp(x) and sin(x): three storages
    ledger.end_forward()
    (grad,) = torch.autograd.grad(y, x)
    return ledger, grad, x


def test_an_arena_holds_every_copy_of_a_record_in_one_buffer_and_the_gradient_is_unchanged() -> None:
    arena = HostArena(4096, pinned=False)
    ledger, grad, x = _offloaded_square(arena)
    expected = (x.exp() * x.sin() + x.exp() * x.cos()).detach()  # closed form of d/dx exp(x) sin(x)
    torch.testing.assert_close(grad, expected)
    base = arena.buffer.untyped_storage().data_ptr()
    assert len(ledger.host_copies) == 3
    assert all(c.untyped_storage().data_ptr() == base for c in ledger.host_copies), "a copy outside the arena"
    assert ledger.copied_bytes == 3 * 300 * 4 and ledger.host_bytes == 0  # the arena's block is counted by its owner


def test_what_does_not_fit_the_arena_gets_a_copy_of_its_own_and_is_counted() -> None:
    arena = HostArena(1300, pinned=False)  # room for one 1200-byte storage, not two
    ledger, grad, x = _offloaded_square(arena)
    torch.testing.assert_close(grad, (x.exp() * (x.sin() + x.cos())).detach())
    inside = sum(
        c.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr() for c in ledger.host_copies
    )
    assert inside == 1 and ledger.host_bytes == 2 * 1200


def test_a_retained_backward_frees_saved_activations_as_it_goes_like_plain_autograd() -> None:
    """The ledger holds retained tensors weakly: autograd frees each once its node has run, so a
    retained forward + backward peaks where plain PyTorch's does (holding them to the end: +11% here)."""
    config = rt.ModelConfig.tiny()
    tokens = torch.randint(0, config.vocab_size, (4, 65), generator=torch.Generator().manual_seed(0))
    model = rt.DecoderLM(config, seed=0)
    with AllocationPeak() as plain:
        rt.token_logprobs(model(tokens[:, :-1]), tokens[:, 1:]).sum().backward()
    trainer = trainer_with_policy(config)
    inputs = [rt.ForwardInput(tokens[row, :-1], tokens[row, 1:]) for row in range(4)]
    with AllocationPeak() as versioned:
        outputs = trainer.forward(inputs, options=rt.ForwardOptions(backward_state="retain", corrections=()))
        trainer.backward(torch.stack([o.target_logprobs for o in outputs]).sum())
    assert plain.peak > 0
    assert versioned.peak <= 1.03 * plain.peak, f"versioned peak {versioned.peak} B vs plain {plain.peak} B"


def test_a_deep_copy_of_a_marked_model_is_still_refused_for_offload() -> None:
    """The mark travels with the module (an attribute): a copy of a marked model is as unrestorable."""
    import copy

    original = rt.DecoderLM(rt.ModelConfig.tiny(), seed=0)
    rt.mark_quantized_saved_state(original.model.layers[0].mlp)
    trainer = trainer_with_policy(copy.deepcopy(original))
    del original
    out = trainer.forward(rt.ForwardInput(*sequence(0)), options=rt.ForwardOptions(backward_state="offload"))
    with pytest.raises(rt.UnsupportedSavedStateError, match="mark_quantized_saved_state"):
        trainer.backward(out.target_logprobs.sum())
