"""The exact unbiasedness oracle for importance-corrected policy gradients (pure math).

For a tiny tabular policy every sequence is enumerated, so expectations are exact
sums. With ``w(y) = pi_cur(y) / pi_old(y)`` (detached) and no clipping:

    E_{y ~ pi_old}[ w(y) R(y) grad log pi_cur(y) ] == grad_theta E_{y ~ pi_cur}[ R(y) ]

in FP64 to 1e-10 relative, for arbitrary old and current parameters and rewards.
Without the weight the two differ (negative control). For length-1 sequences the
token-level correction (reweighting the cotangent of each token log-prob, as the
trainer does) is that same identity; for longer sequences per-token ratios are not
the sequence ratio, and the identity fails. This is the first half of the oracle;
a trainer-level test reuses :mod:`validation.enumeration`.
"""

from __future__ import annotations

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from validation.enumeration import (
    enumerate_sequences,
    exact_expectation,
    sequence_logprobs,
    sequence_token_logprobs,
    table_policy,
)

F64 = torch.float64
TOLERANCE = 1e-10


def _floats(n: int, bound: float):
    return st.lists(st.floats(-bound, bound, allow_nan=False, allow_infinity=False), min_size=n, max_size=n)


@st.composite
def _problems(draw, length: int):
    """``(theta_old, theta_cur, rewards)``: FP64 tables ``(L, V + 1, V)`` and ``(V**L,)``."""
    vocab = draw(st.integers(3, 4))
    shape = (length, vocab + 1, vocab)
    size = length * (vocab + 1) * vocab
    theta_old = torch.tensor(draw(_floats(size, 3.0)), dtype=F64).reshape(shape)
    theta_cur = torch.tensor(draw(_floats(size, 3.0)), dtype=F64).reshape(shape)
    rewards = torch.tensor(draw(_floats(vocab**length, 2.0)), dtype=F64)
    return theta_old, theta_cur, rewards


def _random_problem(seed: int, vocab: int, length: int):
    g = torch.Generator().manual_seed(seed)
    shape = (length, vocab + 1, vocab)
    theta_old = torch.randn(shape, generator=g, dtype=F64)
    theta_cur = torch.randn(shape, generator=g, dtype=F64)
    return theta_old, theta_cur, torch.randn(vocab**length, generator=g, dtype=F64)


def _true_gradient(theta_cur, rewards):
    """``grad_theta E_{y ~ pi_theta}[R(y)]`` at ``theta_cur``: autograd of the exact sum."""
    theta = theta_cur.clone().requires_grad_()
    length, _, vocab = theta.shape
    value = exact_expectation(table_policy(theta), rewards, vocab=vocab, length=length)
    return torch.autograd.grad(value, theta)[0]


def _sequence_weighted_gradient(theta_old, theta_cur, rewards, *, weighted=True):
    """``E_{y ~ pi_old}[w(y) R(y) grad log pi_cur(y)]``, ``w`` the detached sequence ratio."""
    theta = theta_cur.clone().requires_grad_()
    length, _, vocab = theta.shape
    sequences = enumerate_sequences(vocab, length)
    logp_cur = sequence_logprobs(table_policy(theta), sequences)  # (N,)
    logp_old = sequence_logprobs(table_policy(theta_old), sequences)
    w = (logp_cur - logp_old).exp().detach() if weighted else torch.ones_like(logp_old)
    surrogate = exact_expectation(table_policy(theta_old), w * rewards * logp_cur, vocab=vocab, length=length)
    return torch.autograd.grad(surrogate, theta)[0]


def _token_corrected_gradient(theta_old, theta_cur, rewards):
    """What the trainer does: REINFORCE cotangents on token log-probs, each reweighted.

    Loss ``-sum_y pi_old(y) R(y) sum_t logp_t(y)`` (the expectation over samples
    from pi_old); its cotangent on each token log-prob is multiplied by the
    detached token ratio ``w_t = exp(logp_cur_t - logp_old_t)`` and pulled back
    through the current policy's log-probs. Returns minus that (an ascent direction).
    """
    theta = theta_cur.clone().requires_grad_()
    length, _, vocab = theta.shape
    sequences = enumerate_sequences(vocab, length)
    old, cur = table_policy(theta_old), table_policy(theta)
    token_cur = torch.stack([sequence_token_logprobs(cur, y) for y in sequences])  # (N, L)
    token_old = torch.stack([sequence_token_logprobs(old, y) for y in sequences])
    p_old = sequence_logprobs(old, sequences).exp()  # (N,)
    leaf = token_cur.detach().requires_grad_()  # like the trainer's target_logprobs
    loss = -(p_old[:, None] * rewards[:, None] * leaf).sum()
    cotangent = torch.autograd.grad(loss, leaf)[0]
    weights = (token_cur - token_old).exp().detach()
    return -torch.autograd.grad(token_cur, theta, grad_outputs=weights * cotangent)[0]


def _relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return ((got - reference).norm() / reference.norm()).item()


# --- the oracle machinery itself ----------------------------------------------------


def test_enumeration_covers_every_sequence_once_and_probabilities_sum_to_one():
    sequences = enumerate_sequences(3, 2)
    assert sequences.tolist() == [[a, b] for a in range(3) for b in range(3)]
    theta = _random_problem(0, vocab=3, length=2)[0]
    probs = sequence_logprobs(table_policy(theta), sequences).exp()
    # By hand: pi(a, b) = softmax(theta[0, start])[a] * softmax(theta[1, a])[b], start = 3.
    first = torch.softmax(theta[0, 3], -1)
    expected = torch.stack([first[a] * torch.softmax(theta[1, a], -1)[b] for a, b in sequences])
    torch.testing.assert_close(probs, expected, rtol=1e-14, atol=0)
    assert abs(probs.sum().item() - 1.0) < 1e-14


def test_true_gradient_matches_the_closed_form_for_one_token():
    # L = 1: d/d theta_j sum_y p_y R_y = p_j (R_j - sum_y p_y R_y), p = softmax(theta[0, V]).
    theta, _, rewards = _random_problem(1, vocab=4, length=1)
    p = torch.softmax(theta[0, 4], -1)
    closed_form = torch.zeros_like(theta)
    closed_form[0, 4] = p * (rewards - (p * rewards).sum())
    torch.testing.assert_close(_true_gradient(theta, rewards), closed_form, rtol=1e-13, atol=1e-16)


# --- the identity ----------------------------------------------------------------------


@given(_problems(length=2))
def test_sequence_ratio_weighted_gradient_is_exactly_the_current_policy_gradient(problem):
    theta_old, theta_cur, rewards = problem
    truth = _true_gradient(theta_cur, rewards)
    assume(truth.norm().item() > 1e-6)  # constant rewards have no gradient to compare
    got = _sequence_weighted_gradient(theta_old, theta_cur, rewards)
    assert _relative_error(got, truth) <= TOLERANCE


@given(_problems(length=1))
def test_token_level_correction_is_exact_for_one_token_sequences(problem):
    theta_old, theta_cur, rewards = problem
    truth = _true_gradient(theta_cur, rewards)
    assume(truth.norm().item() > 1e-6)
    got = _token_corrected_gradient(theta_old, theta_cur, rewards)
    assert _relative_error(got, truth) <= TOLERANCE


# --- negative controls: the oracle can fire ----------------------------------------


def test_without_the_weight_the_gradient_is_wrong():
    for seed in range(5):
        theta_old, theta_cur, rewards = _random_problem(seed, vocab=4, length=2)
        truth = _true_gradient(theta_cur, rewards)
        unweighted = _sequence_weighted_gradient(theta_old, theta_cur, rewards, weighted=False)
        assert _relative_error(unweighted, truth) > 0.05
        # Same inputs, weighted: exact. So the gap above is the weight's doing.
        weighted = _sequence_weighted_gradient(theta_old, theta_cur, rewards)
        assert _relative_error(weighted, truth) <= TOLERANCE


def test_token_level_ratios_are_not_the_sequence_ratio_beyond_one_token():
    for seed in range(5):
        theta_old, theta_cur, rewards = _random_problem(seed, vocab=3, length=2)
        truth = _true_gradient(theta_cur, rewards)
        token_level = _token_corrected_gradient(theta_old, theta_cur, rewards)
        assert _relative_error(token_level, truth) > 1e-2


def test_identical_policies_need_no_weight():
    # Sanity of the control: with theta_old == theta_cur every weight is 1.
    theta, _, rewards = _random_problem(7, vocab=3, length=2)
    truth = _true_gradient(theta, rewards)
    unweighted = _sequence_weighted_gradient(theta, theta, rewards, weighted=False)
    assert _relative_error(unweighted, truth) <= TOLERANCE
    assert _relative_error(_token_corrected_gradient(theta, theta, rewards), truth) <= TOLERANCE
