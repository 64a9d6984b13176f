"""Per-token behaviour versions in the trainer: exact lags on known schedules, stale tokens masked, the behaviour ratio."""

from __future__ import annotations

import math

import pytest
import torch

import reference_trainer as rt
from validation.trainers import trainer_with_policy

TOKENS = torch.tensor([3, 8, 1, 9, 4, 4, 7, 2])
PROMPT = 3  # targets of the first PROMPT - 1 positions are masked, as a Sample's are


def _trainer() -> rt.Trainer:
    trainer = trainer_with_policy(lora=rt.LoRAConfig(rank=4), optimizer=rt.AdamWConfig(lr=0.05))
    return trainer


def _steps(trainer: rt.Trainer, count: int) -> None:
    for _ in range(count):
        output = trainer.forward(rt.ForwardInput(input_tokens=TOKENS), checkpoint="policy")
        trainer.backward(-output.target_logprobs.sum())
        trainer.optim_step()
        trainer.zero_grad()


def _targets(masked: tuple[int, ...] = ()) -> torch.Tensor:
    targets = torch.cat((TOKENS[1:], torch.tensor([5])))
    targets[: PROMPT - 1] = -1
    targets[list(masked)] = -1
    return targets


def _input(
    revisions: list[int] | None = None, logprobs: torch.Tensor | None = None, **options: object
) -> rt.ForwardInput:
    aligned = None if revisions is None else torch.tensor([-1] * (PROMPT - 1) + revisions)
    return rt.ForwardInput(
        input_tokens=TOKENS,
        target_tokens=_targets(),
        behaviour_revisions=aligned,
        behaviour_logprobs=logprobs,
        options=rt.ForwardOptions(**options) if options else None,
    )


def _gradients(trainer: rt.Trainer) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in trainer.checkpoint("policy").named_parameters()}
    trainer.zero_grad()
    return grads


def test_the_behaviour_lag_of_a_known_schedule_is_exact() -> None:
    trainer = _trainer()
    _steps(trainer, 3)  # the forward runs at revision 3
    output = trainer.forward(_input([3, 3, 2, 1, 0, 3]), checkpoint="policy")
    (record,) = trainer.backward(-output.target_logprobs.sum()).records
    behaviour = record.behaviour
    assert record.staleness == 0
    assert (behaviour.tokens, behaviour.lag_min, behaviour.lag_median, behaviour.lag_max) == (6, 0, 0, 3)
    assert behaviour.lag_histogram == {0: 3, 1: 1, 2: 1, 3: 1}
    assert behaviour.stale_tokens == 0 and behaviour.max_behaviour_staleness is None
    assert behaviour.ratio is None and behaviour.correction is None


def test_a_record_without_behaviour_data_reports_none() -> None:
    trainer = _trainer()
    output = trainer.forward(rt.ForwardInput(input_tokens=TOKENS), checkpoint="policy")
    assert trainer.backward(-output.target_logprobs.sum()).records[0].behaviour is None


@pytest.mark.parametrize("bound, stale", [(0, (5, 6, 7)), (1, (6, 7)), (3, ())])
def test_tokens_older_than_the_bound_are_masked_counted_and_get_no_gradient(bound: int, stale: tuple[int, ...]) -> None:
    trainer = _trainer()
    _steps(trainer, 3)
    output = trainer.forward(_input([3, 3, 3, 2, 1, 0], max_behaviour_staleness=bound), checkpoint="policy")
    (record,) = trainer.backward(-(output.target_logprobs * torch.arange(1.0, 9.0)).sum()).records
    assert record.behaviour.stale_tokens == len(stale)
    assert record.behaviour.tokens == 6 and record.behaviour.lag_max == 3  # masked tokens are still in the distribution
    masked = _gradients(trainer)
    # The oracle: the same loss over a forward whose stale targets are masked by the caller.
    oracle = trainer.forward(rt.ForwardInput(input_tokens=TOKENS, target_tokens=_targets(stale)), checkpoint="policy")
    trainer.backward(-(oracle.target_logprobs * torch.arange(1.0, 9.0)).sum())
    expected = _gradients(trainer)
    assert all(torch.equal(masked[n], expected[n]) for n in masked)


def test_the_behaviour_ratio_statistics_and_its_correction_at_token_and_sequence_level() -> None:
    trainer = _trainer()
    _steps(trainer, 1)
    plain = trainer.forward(_input(), checkpoint="policy")
    forward = plain.target_logprobs.detach()
    trainer.backward(-plain.target_logprobs.sum())
    reference = _gradients(trainer)
    shift = torch.tensor([0.0] * (PROMPT - 1) + [math.log(2.0)] * 3 + [math.log(0.5)] * 3)
    correction = rt.ImportanceCorrection(clip_low=0.0, clip_high=10.0)
    output = trainer.forward(_input([1] * 6, forward - shift, behaviour_corrections=(correction,)), checkpoint="policy")
    (record,) = trainer.backward(-output.target_logprobs.sum()).records
    ratio = record.behaviour.ratio  # exp(forward - behaviour): 2 on three tokens, 1/2 on three
    assert (ratio.min, ratio.max) == pytest.approx((0.5, 2.0), rel=1e-6)
    assert ratio.mean == pytest.approx(1.25, rel=1e-6)
    assert record.behaviour.correction.tokens == 6 and record.behaviour.correction.level == "token"
    weighted = _gradients(trainer)
    # Token level: the cotangent of each token times its ratio; the oracle is that loss, weighted by hand.
    oracle = trainer.forward(_input(), checkpoint="policy")
    trainer.backward(-(oracle.target_logprobs * shift.exp()).sum())
    expected = _gradients(trainer)
    assert all(torch.allclose(weighted[n], expected[n], rtol=1e-5, atol=1e-8) for n in weighted)
    assert not all(torch.allclose(weighted[n], reference[n]) for n in weighted)
    # Sequence level: every token gets the product of the ratios, 2**3 * 0.5**3 = 1.
    sequence = rt.ImportanceCorrection(clip_low=0.0, clip_high=10.0, level="sequence")
    output = trainer.forward(_input([1] * 6, forward - shift, behaviour_corrections=sequence), checkpoint="policy")
    (record,) = trainer.backward(-output.target_logprobs.sum()).records
    assert record.behaviour.correction.raw.max == pytest.approx(1.0, rel=1e-5)
    assert all(torch.allclose(g, reference[n], rtol=1e-4, atol=1e-7) for n, g in _gradients(trainer).items())


def test_on_policy_behaviour_logprobs_give_a_ratio_of_one() -> None:
    trainer = _trainer()
    first = trainer.forward(_input(), checkpoint="policy")
    behaviour = first.target_logprobs.detach()
    output = trainer.forward(_input([0] * 6, behaviour), checkpoint="policy")
    (_, record) = trainer.backward(-(first.target_logprobs.sum() + output.target_logprobs.sum())).records
    assert (record.behaviour.ratio.min, record.behaviour.ratio.max) == (1.0, 1.0)


def test_bad_behaviour_inputs_and_options_are_refused() -> None:
    with pytest.raises(rt.ConfigError, match="behaviour_logprobs"):
        rt.ForwardInput(input_tokens=TOKENS, behaviour_logprobs=torch.zeros(3))
    with pytest.raises(rt.ConfigError, match="behaviour_revisions"):
        rt.ForwardInput(input_tokens=TOKENS, behaviour_revisions=torch.zeros(8))
    with pytest.raises(rt.ConfigError, match="behaviour_logprobs"):
        rt.ForwardInput(input_tokens=TOKENS, behaviour_logprobs=torch.zeros(8, dtype=torch.long))
    with pytest.raises(rt.ConfigError, match="max_behaviour_staleness"):
        rt.ForwardOptions(max_behaviour_staleness=-1)
    with pytest.raises(rt.ConfigError, match="max_behaviour_staleness"):
        rt.ForwardOptions(max_behaviour_staleness=True)
    with pytest.raises(rt.ConfigError, match="behaviour_corrections"):
        rt.ForwardOptions(behaviour_corrections=(rt.ImportanceCorrection(), rt.ImportanceCorrection()))


def test_stale_tokens_take_part_in_no_ratio_and_no_correction() -> None:
    trainer = _trainer()
    _steps(trainer, 2)
    first = trainer.forward(_input(), checkpoint="policy")
    forward = first.target_logprobs.detach()
    trainer.backward(-first.target_logprobs.sum())
    trainer.zero_grad()
    # The last two tokens are stale (lag 2 > 1) and their behaviour log-probs would give ratios of 100.
    shift = torch.tensor([0.0] * (PROMPT - 1) + [math.log(2.0)] * 4 + [math.log(100.0)] * 2)
    correction = rt.ImportanceCorrection(clip_low=0.0, clip_high=1000.0)
    output = trainer.forward(
        _input([2, 2, 2, 2, 0, 0], forward - shift, max_behaviour_staleness=1, behaviour_corrections=correction),
        checkpoint="policy",
    )
    (record,) = trainer.backward(-output.target_logprobs.sum()).records
    assert record.behaviour.stale_tokens == 2
    assert record.behaviour.ratio.max == pytest.approx(2.0, rel=1e-5)
    assert record.behaviour.correction.tokens == 4 and record.behaviour.correction.max == pytest.approx(2.0, rel=1e-5)


def test_a_stale_masked_token_is_a_masked_target_under_the_sequence_level_staleness_correction() -> None:
    """Rule 3: a stale token takes part in no ratio, so the staleness correction's sequence ratio leaves it out."""

    def run(stale_by_target: bool) -> tuple[float, dict[str, torch.Tensor]]:
        trainer = _trainer()
        _steps(trainer, 2)  # the forward runs at revision 2; tokens of revision 0 are stale under bound 1
        correction = rt.ImportanceCorrection(level="sequence", policy="always", clip_low=0.0, clip_high=1e6)
        options = rt.ForwardOptions(max_gradient_staleness=1, max_behaviour_staleness=1, corrections=(correction,))
        targets = _targets((2, 3, 4) if stale_by_target else ())
        revisions = torch.tensor([-1] * (PROMPT - 1) + [0, 0, 0, 2, 2, 2])
        output = trainer.forward(
            rt.ForwardInput(TOKENS, targets, options=options, behaviour_revisions=revisions), checkpoint="policy"
        )
        _steps(trainer, 1)  # the record is now one revision stale: the staleness correction runs at backward
        (record,) = trainer.backward(-(output.target_logprobs * torch.arange(1.0, 9.0)).sum()).records
        assert record.behaviour.stale_tokens == (0 if stale_by_target else 3)
        assert record.correction.tokens == 3
        return record.correction.raw.mean, _gradients(trainer)

    (masked_ratio, masked), (oracle_ratio, oracle) = run(False), run(True)
    assert masked_ratio == oracle_ratio and masked_ratio != 1.0
    assert all(torch.equal(masked[n], oracle[n]) for n in masked)


@pytest.mark.parametrize("bound", [None, 5])
def test_tokens_of_another_generation_are_stale_whatever_the_bound_and_have_no_lag(bound: int | None) -> None:
    trainer = _trainer()
    _steps(trainer, 1)
    saved = trainer.checkpoint("policy").state_dict()  # revision 1
    _steps(trainer, 2)  # revision 3 of generation 0: the weights that drew the tokens below
    drawn = trainer.checkpoint("policy").version
    trainer.load_checkpoint("policy", saved)  # back to revision 1, under a new generation
    assert trainer.checkpoint("policy").version.generation != drawn.generation
    # Two tokens drawn at revision 3 of the old generation (a lag of -2 if revisions alone counted), four at this one.
    generations = torch.tensor(
        [-1] * (PROMPT - 1) + [drawn.generation] * 2 + [trainer.checkpoint("policy").generation] * 4
    )
    revisions = torch.tensor([-1] * (PROMPT - 1) + [3, 3, 1, 1, 0, 0])
    options = rt.ForwardOptions(max_behaviour_staleness=bound)
    output = trainer.forward(
        rt.ForwardInput(
            TOKENS, _targets(), options=options, behaviour_revisions=revisions, behaviour_generations=generations
        ),
        checkpoint="policy",
    )
    (record,) = trainer.backward(-(output.target_logprobs * torch.arange(1.0, 9.0)).sum()).records
    behaviour = record.behaviour
    assert (behaviour.tokens, behaviour.stale_tokens) == (6, 2)
    assert behaviour.lag_histogram == {0: 2, 1: 2} and behaviour.lag_min == 0  # no negative lag
    masked = _gradients(trainer)
    oracle = trainer.forward(rt.ForwardInput(input_tokens=TOKENS, target_tokens=_targets((2, 3))), checkpoint="policy")
    trainer.backward(-(oracle.target_logprobs * torch.arange(1.0, 9.0)).sum())
    expected = _gradients(trainer)
    assert all(torch.equal(masked[n], expected[n]) for n in masked)
