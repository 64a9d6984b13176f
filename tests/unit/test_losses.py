"""Policy-gradient objectives against gradients derived by hand.

Every expected value below is worked out on paper from the formulas in the
module docstrings (the arithmetic is spelled out next to it), never produced by
the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from reference_trainer.errors import ConfigError
from reference_trainer.losses import group_advantages, pad_sequences, ppo_clip_loss, reinforce_loss

F64 = torch.float64

# Two sequences of 3 tokens; the second has only its middle token unmasked.
LOGPROBS = [[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.5]]
ADVANTAGES = [[1.0, -2.0, 0.5], [3.0, 1.0, -1.0]]
MASK = [[True, True, True], [False, True, False]]
# Unmasked A*logp: 1*-1 = -1, -2*-2 = 4, 0.5*-0.5 = -0.25 (row 0: 2.75); 1*-4 = -4 (row 1).
# N = 4 tokens; n_0 = 3, n_1 = 1; B = 2.


def _leaf(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=True)


@pytest.mark.parametrize(
    ("reduction", "loss", "grad"),
    [
        # -sum(A*logp)/N = -(2.75 - 4)/4; d/dlogp = -A/N.
        ("token_mean", 1.25 / 4, [[-1 / 4, 2 / 4, -0.5 / 4], [0.0, -1 / 4, 0.0]]),
        # -sum(A*logp); d/dlogp = -A.
        ("sum", 1.25, [[-1.0, 2.0, -0.5], [0.0, -1.0, 0.0]]),
        # mean over rows of -row_sum/n_b = (-2.75/3 + 4/1)/2; d/dlogp = -A/(B n_b).
        ("sequence_mean", (-2.75 / 3 + 4.0) / 2, [[-1 / 6, 2 / 6, -0.5 / 6], [0.0, -1 / 2, 0.0]]),
    ],
)
def test_reinforce_value_and_gradient_match_hand_derivation(reduction, loss, grad):
    logprobs = _leaf(LOGPROBS)
    value = reinforce_loss(logprobs, torch.tensor(ADVANTAGES, dtype=F64), torch.tensor(MASK), reduction=reduction)
    value.backward()
    assert value.dim() == 0
    assert value.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(logprobs.grad, torch.tensor(grad, dtype=F64), rtol=1e-12, atol=0)


def test_reinforce_per_sequence_advantages_spread_over_tokens():
    logprobs = _leaf(LOGPROBS)
    reinforce_loss(logprobs, torch.tensor([2.0, -1.0])).backward()
    # No mask: N = 6 tokens, d/dlogp = -A_b / 6.
    expected = torch.tensor([[-2 / 6] * 3, [1 / 6] * 3], dtype=F64)
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-12, atol=0)


def test_reinforce_accepts_ragged_lists_like_target_logprobs():
    first, second = _leaf([-1.0, -2.0, -0.5]), _leaf([-0.7])
    loss = reinforce_loss([first, second], [2.0, -1.0])
    loss.backward()
    # N = 4: loss = -(2*(-3.5) + -1*(-0.7))/4; d/dlogp = -A_b/4.
    assert loss.item() == pytest.approx(-(2 * -3.5 + 0.7) / 4, rel=1e-12)
    torch.testing.assert_close(first.grad, torch.full((3,), -0.5, dtype=F64))
    torch.testing.assert_close(second.grad, torch.full((1,), 0.25, dtype=F64))

    # Per-token advantages and masks given as lists too.
    first.grad = second.grad = None
    advantages = [torch.tensor([1.0, 1.0, 4.0]), torch.tensor([-8.0])]
    masks = [torch.tensor([True, False, True]), torch.tensor([True])]
    reinforce_loss([first, second], advantages, masks, reduction="sum").backward()
    torch.testing.assert_close(first.grad, torch.tensor([-1.0, 0.0, -4.0], dtype=F64))
    torch.testing.assert_close(second.grad, torch.tensor([8.0], dtype=F64))


def test_reinforce_single_sequence_with_scalar_advantage():
    logprobs = _leaf([-1.0, -3.0])
    loss = reinforce_loss(logprobs, 0.5)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 * -4.0) / 2)
    torch.testing.assert_close(logprobs.grad, torch.full((2,), -0.25, dtype=F64))


def test_masked_positions_give_zero_value_and_gradient_even_at_minus_inf():
    logprobs = _leaf([float("-inf"), -1.0])
    advantages = torch.tensor([float("nan"), 2.0])
    mask = torch.tensor([False, True])
    for loss in (
        reinforce_loss(logprobs, advantages, mask),
        ppo_clip_loss(logprobs, torch.tensor([0.0, -1.0]), advantages, mask),
    ):
        logprobs.grad = None
        loss.backward()
        # One unmasked token with ratio 1: loss = -2*(-1) for REINFORCE, -1*2 for PPO.
        assert math.isfinite(loss.item())
        assert logprobs.grad[0].item() == 0.0
        assert logprobs.grad[1].item() == pytest.approx(-2.0)


def test_all_masked_input_gives_zero_loss_not_nan():
    logprobs = _leaf([[-1.0, -2.0]])
    for reduction in ("token_mean", "sum", "sequence_mean"):
        nothing = torch.zeros(1, 2, dtype=torch.bool)
        loss = reinforce_loss(logprobs, torch.ones(1), nothing, reduction=reduction)
        assert loss.item() == 0.0


def test_advantages_and_behaviour_are_constants():
    logprobs = _leaf([-1.0, -2.0])
    advantages = torch.tensor([1.0, 2.0], requires_grad=True)
    behaviour = torch.tensor([-1.5, -1.5], dtype=F64, requires_grad=True)
    loss = reinforce_loss(logprobs, advantages) + ppo_clip_loss(logprobs, behaviour, advantages)
    loss.backward()
    assert advantages.grad is None
    assert behaviour.grad is None
    assert logprobs.grad is not None


# PPO with clip_low = clip_high = 0.2 (ratio range [0.8, 1.2]); behaviour logp 0,
# so ratio r = exp(logp). Per token: l = -min(r A, clip(r) A), dl/dlogp = -r A when
# the unclipped term is the min, else 0.
PPO_CASES = [
    # each: ratio r, advantage A, loss l, then dl/dlogp
    (1.1, 2.0, -2.2, -2.2),  # inside the range
    (1.5, 2.0, -2.4, 0.0),  # A > 0, above: min is 1.2*2 = 2.4 (clipped, flat)
    (0.5, 2.0, -1.0, -1.0),  # A > 0, below: min is 0.5*2 = 1.0 < 1.6 (unclipped)
    (0.5, -2.0, 1.6, 0.0),  # A < 0, below: min is 0.8*-2 = -1.6 (clipped, flat)
    (1.5, -2.0, 3.0, 3.0),  # A < 0, above: min is 1.5*-2 = -3.0 (unclipped)
    (0.9, -1.0, 0.9, 0.9),  # inside the range, A < 0
]


def test_ppo_clip_matches_hand_derived_regions():
    ratios = torch.tensor([c[0] for c in PPO_CASES], dtype=F64)
    logprobs = ratios.log().requires_grad_()
    behaviour = torch.zeros(len(PPO_CASES), dtype=F64)
    advantages = torch.tensor([c[1] for c in PPO_CASES], dtype=F64)
    loss = ppo_clip_loss(logprobs, behaviour, advantages)
    loss.backward()
    n = len(PPO_CASES)
    assert loss.item() == pytest.approx(sum(c[2] for c in PPO_CASES) / n, rel=1e-12)
    expected = torch.tensor([c[3] / n for c in PPO_CASES], dtype=F64)
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-12, atol=1e-15)


def test_ppo_asymmetric_clip_high():
    # r = 1.25, A = 1: inside [0.8, 1.28] (gradient -r A = -1.25), outside [0.8, 1.2] (0).
    def grad(clip_high: float) -> float:
        logprobs = torch.tensor([math.log(1.25)], dtype=F64, requires_grad=True)
        advantages, behaviour = torch.ones(1, dtype=F64), torch.zeros(1, dtype=F64)
        ppo_clip_loss(logprobs, behaviour, advantages, clip_high=clip_high).backward()
        return logprobs.grad.item()

    assert grad(0.28) == pytest.approx(-1.25)
    assert grad(0.2) == 0.0


def test_ppo_on_policy_gradient_is_reinforce_gradient():
    values = [[-0.2, -1.7, -3.0], [-0.9, -0.1, -2.2]]
    logprobs = _leaf(values)
    advantages = torch.tensor(ADVANTAGES, dtype=F64)
    ppo_clip_loss(logprobs, torch.tensor(values, dtype=F64), advantages).backward()
    # r = 1 everywhere: dl/dlogp = -A / N with N = 6.
    torch.testing.assert_close(logprobs.grad, -advantages / 6, rtol=1e-12, atol=0)


def test_group_advantages_hand_example_uses_population_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 3.0, 5.0, 5.0], dtype=F64)
    eps = 1e-6
    # Group 0: mean 0.5, population std sqrt((4 * 0.25) / 4) = 0.5 (sample std would be
    # sqrt(1/3) = 0.577). Group 1: mean 3.75, deviations -1.75, -0.75, 1.25, 1.25,
    # squares sum 6.75, population variance 6.75 / 4 = 27/16.
    std1 = math.sqrt(27 / 16)
    expected = [d / (0.5 + eps) for d in (0.5, -0.5, -0.5, 0.5)]
    expected += [d / (std1 + eps) for d in (-1.75, -0.75, 1.25, 1.25)]
    got = group_advantages(rewards, 4, eps=eps)
    assert got.dtype == F64
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)
    assert got[0].item() == pytest.approx(1.0, rel=1e-5)  # not 0.5/0.577 = 0.866

    # The same groups given as interleaved ids, and unscaled (Dr. GRPO) advantages.
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    ids = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    torch.testing.assert_close(group_advantages(rewards[order], groups=ids), got[order])
    unscaled = [0.5, -0.5, -0.5, 0.5, -1.75, -0.75, 1.25, 1.25]
    torch.testing.assert_close(group_advantages(rewards, 4, scale=False), torch.tensor(unscaled, dtype=F64))


def test_group_advantages_degenerate_groups_are_zero():
    got = group_advantages(torch.tensor([3.0, 3.0, 3.0, 7.0]), 2)
    # Group [3, 3]: std 0, advantage 0. Group [3, 7]: mean 5, std 2 -> -1, +1.
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -2 / (2 + 1e-6), 2 / (2 + 1e-6)]))
    assert group_advantages(torch.tensor([4.0, 1.0]), 1).abs().max().item() == 0.0
    # No groups given: the whole batch is one group ([1, 3] -> mean 2, std 1).
    torch.testing.assert_close(group_advantages([1.0, 3.0], eps=0.0), torch.tensor([-1.0, 1.0]))


def test_pad_sequences_pads_with_the_value_asked_for():
    padded, real = pad_sequences([torch.tensor([1, 2]), torch.tensor([3])], padding_value=-100)
    assert padded.tolist() == [[1, 2], [3, -100]] and real.tolist() == [[True, True], [True, False]]


def test_pad_sequences_pads_and_marks_real_positions():
    padded, real = pad_sequences([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    torch.testing.assert_close(padded, torch.tensor([[1.0, 2.0], [3.0, 0.0]]))
    assert real.tolist() == [[True, True], [True, False]]


LP = torch.zeros(2, 3)
BAD_INPUTS = [
    ("advantages", lambda: reinforce_loss(LP, torch.zeros(3))),
    ("advantages", lambda: reinforce_loss(LP, torch.zeros(3, 2))),
    ("advantages", lambda: reinforce_loss([torch.zeros(2)], [torch.zeros(3)])),
    ("mask", lambda: reinforce_loss(LP, torch.zeros(2), torch.ones(2, 3, dtype=torch.long))),
    ("mask", lambda: reinforce_loss(LP, torch.zeros(2), torch.ones(3, 2, dtype=torch.bool))),
    ("reduction", lambda: reinforce_loss(LP, torch.zeros(2), reduction="mean")),
    ("logprobs", lambda: reinforce_loss(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2))),
    ("logprobs", lambda: reinforce_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2))),
    ("behaviour_logprobs", lambda: ppo_clip_loss(LP, torch.zeros(2, 2), torch.zeros(2))),
    ("behaviour_logprobs", lambda: ppo_clip_loss([torch.zeros(2)], [torch.zeros(3)], [1.0])),
    ("clip_low", lambda: ppo_clip_loss(LP, LP, torch.zeros(2), clip_low=1.5)),
    ("clip_low", lambda: ppo_clip_loss(LP, LP, torch.zeros(2), clip_low=True)),
    ("clip_high", lambda: ppo_clip_loss(LP, LP, torch.zeros(2), clip_high=-0.1)),
    ("clip_high", lambda: ppo_clip_loss(LP, LP, torch.zeros(2), clip_high=float("nan"))),
    ("group_size", lambda: group_advantages(torch.zeros(8), 3)),
    ("group_size", lambda: group_advantages(torch.zeros(4), 2, groups=torch.zeros(4).long())),
    ("groups", lambda: group_advantages(torch.zeros(4), groups=torch.zeros(4))),
    ("groups", lambda: group_advantages(torch.zeros(4), groups=torch.zeros(3).long())),
    ("rewards", lambda: group_advantages(torch.zeros(2, 4), 4)),
    ("rewards", lambda: group_advantages(torch.tensor([1.0, float("nan")]))),
    ("eps", lambda: group_advantages(torch.zeros(4), eps=-1.0)),
    ("sequences", lambda: pad_sequences([])),
]


@pytest.mark.parametrize(("field", "call"), BAD_INPUTS)
def test_invalid_inputs_raise_config_error_naming_the_field(field, call):
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.field == field
    assert info.value.allowed
