"""NOTE [Host syncs]: how often forward, backward and commit read device values on the host (each a GPU stall).

Counted with ``testing.observe_host_reads``, which sees every read the
trainer makes through ``host_reads.read_on_host``.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import reference_trainer as rt
from reference_trainer.testing import observe_host_reads
from validation.trainers import trainer_with_policy


def _inputs(lengths: list[int], vocab: int) -> list[rt.ForwardInput]:
    generator = torch.Generator().manual_seed(0)
    return [rt.ForwardInput(torch.randint(0, vocab, (n,), generator=generator)) for n in lengths]


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_padded_forward_reads_nothing_and_a_backward_reads_once(kind: str) -> None:
    trainer = trainer_with_policy(
        lora=None if kind == "full" else rt.LoRAConfig(rank=2), options=rt.ForwardOptions(corrections=())
    )
    inputs = _inputs([5, 9, 7], trainer.model.config.vocab_size)  # unequal lengths: a padded batch with a mask
    with observe_host_reads() as reads:
        outputs = trainer.forward(inputs)
    assert reads == [], "the forward read device values on the host (its padding or token checks)"
    loss = sum(out.target_logprobs.sum() for out in outputs)
    with observe_host_reads() as reads:
        trainer.backward(loss)
    assert [why for why, _ in reads] == ["finite gradients"]


def test_a_backward_into_two_checkpoints_reads_the_host_once() -> None:
    """One loss over a LoRA and a full checkpoint's outputs: both checkpoints' norms come from one read, not one each."""
    trainer = trainer_with_policy(lora=rt.LoRAConfig(rank=2), options=rt.ForwardOptions(corrections=()))
    trainer.add_checkpoint("ref", full=True)
    vocab = trainer.model.config.vocab_size
    policy = trainer.forward(_inputs([5, 7], vocab), checkpoint="policy")
    ref = trainer.forward(_inputs([6], vocab), checkpoint="ref")
    loss = sum(out.target_logprobs.sum() for out in policy + ref)
    with observe_host_reads() as reads:
        trainer.backward(loss)
    assert [why for why, _ in reads] == ["finite gradients"]
    for name in ("policy", "ref"):  # both were committed by that backward
        assert all(p.grad is not None for p in trainer.checkpoint(name).parameters()), name


def test_the_public_model_still_checks_padding_of_masks_it_did_not_build() -> None:
    model = rt.DecoderLM(rt.ModelConfig.tiny(), seed=0)
    ids = torch.zeros(2, 4, dtype=torch.long)
    with observe_host_reads() as reads, pytest.raises(rt.ConfigError, match="right padding"):
        model(ids, torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))
    assert [why for why, _ in reads] == ["right padding"]


def test_out_of_range_tokens_are_refused_naming_the_extremes() -> None:
    trainer = trainer_with_policy()
    vocab = trainer.model.config.vocab_size
    good = _inputs([4], vocab)[0]
    with pytest.raises(rt.ConfigError) as info:
        trainer.forward([good, rt.ForwardInput(torch.tensor([1, vocab + 2, 3]))])
    assert info.value.value == (1, vocab + 2, vocab + 2)


@pytest.mark.parametrize("policy, reads_expected", [("when_available", ["token keys"]), ("always", []), (None, [])])
def test_a_forward_behind_a_pending_older_version_reads_its_token_keys_once(policy, reads_expected) -> None:
    """``when_available`` corrections key log-probs by tokens: one read per forward, not one per row; and none
    when no pending older record asks for that policy (``always`` recomputes, no correction needs nothing)."""
    corrections = () if policy is None else (rt.ImportanceCorrection(policy=policy),)
    trainer = trainer_with_policy(
        lora=rt.LoRAConfig(rank=2),
        optimizer=rt.AdamWConfig(lr=1e-2),
        options=rt.ForwardOptions(corrections=corrections),
    )
    vocab = trainer.model.config.vocab_size
    old = trainer.forward(_inputs([6], vocab))  # pending across the step below
    fresh = trainer.forward(_inputs([5], vocab))
    trainer.backward(fresh[0].target_logprobs.sum())
    trainer.optim_step()
    with observe_host_reads() as reads:
        trainer.forward(_inputs([5, 9, 7], vocab))
    assert [why for why, _ in reads] == reads_expected
    trainer.backward(old[0].target_logprobs.sum())


class _HostConversions(TorchFunctionMode):
    """Counts every tensor-to-host conversion (``bool``, ``float``, ``item``, ``tolist``), read_on_host or not."""

    CONVERSIONS = (torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.item, torch.Tensor.tolist)

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.CONVERSIONS
        return func(*args, **(kwargs or {}))


def test_an_accumulating_backward_reads_the_host_once() -> None:
    """The sums a second backward publishes are proven finite by its one read (no read per parameter)."""
    trainer = trainer_with_policy(options=rt.ForwardOptions(corrections=()))
    vocab = trainer.model.config.vocab_size
    trainer.backward(trainer.forward(_inputs([6], vocab))[0].target_logprobs.sum())
    loss = trainer.forward(_inputs([5], vocab))[0].target_logprobs.sum()
    with observe_host_reads() as reads, _HostConversions() as conversions:
        trainer.backward(loss)
    assert [why for why, _ in reads] == ["finite gradients"] and conversions.count == 1
