"""The exact enumeration oracle for each importance-correction level (NOTE [Importance correction] Rule 9).

A tiny tabular policy (``validation.enumeration``), every sequence enumerated,
FP64, clipping off (``clip_high=1e300``, ``max_log_ratio=700``). The trainer's
own ``correct_cotangent`` reweights the REINFORCE cotangents
``pi_old(y) R(y)`` of every token log-prob, which are then pulled back through
the CURRENT policy's token log-probs: the corrected gradient's exact
expectation under the forward's policy ``pi_old``. It must equal, to 1e-10
relative:

1. its exact expectation written from the ratios themselves
   (``validation.enumeration.level_weights``: products and means of
   ``pi_cur / pi_old``, no log space), at every level;
2. the current policy's gradient of the objective the level is unbiased for:
   ``sequence``: the sequence objective ``E_{pi_cur}[R]``; ``token``: the
   per-token objective (``per_token_objective``: one token from ``pi_cur``,
   the others from ``pi_old``).

``geometric`` and ``average`` are unbiased for neither: their bias against the
sequence objective is computed exactly (the relative error of 1.) and shown,
never asserted away; it vanishes for one-token sequences, where every level is
the sequence ratio, and when the policies agree (controls that the bias is the
level's, not the oracle's).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import reference_trainer as rt
from reference_trainer.importance import correct_cotangent
from validation.enumeration import (
    enumerate_sequences,
    exact_expectation,
    level_weights,
    per_token_objective,
    sequence_token_logprobs,
    table_policy,
)

F64 = torch.float64
EXACT = 1e-10
LEVELS = ("token", "sequence", "geometric", "average")
BIASED = ("geometric", "average")


def _problem(seed: int, vocab: int = 3, length: int = 2, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    shape = (length, vocab + 1, vocab)
    theta_old = scale * torch.randn(shape, generator=g, dtype=F64)
    theta_cur = theta_old + 0.5 * torch.randn(shape, generator=g, dtype=F64)
    return theta_old, theta_cur, torch.randn(vocab**length, generator=g, dtype=F64)


def _tokens(theta, sequences):
    policy = table_policy(theta)
    return torch.stack([sequence_token_logprobs(policy, y) for y in sequences])  # (N, L)


def _corrected_gradient(theta_old, theta_cur, rewards, level: str) -> torch.Tensor:
    """The trainer's correction at ``level``, in exact expectation under ``pi_old``, pulled back at ``theta_cur``."""
    theta = theta_cur.clone().requires_grad_()
    length, _, vocab = theta.shape
    sequences = enumerate_sequences(vocab, length)
    token_cur, token_old = _tokens(theta, sequences), _tokens(theta_old, sequences)
    p_old = token_old.sum(-1).exp()
    cotangent = (p_old * rewards)[:, None].expand(-1, length).contiguous()  # d/d lp_t of E_old[R sum_t lp_t]
    correction = rt.ImportanceCorrection(clip_low=0.0, clip_high=1e300, max_log_ratio=700.0, level=level)
    corrected, _ = correct_cotangent(cotangent, token_cur.detach(), token_old, correction, staleness=1)
    return torch.autograd.grad(token_cur, theta, grad_outputs=corrected)[0]


def _expected_gradient(theta_old, theta_cur, rewards, level: str) -> torch.Tensor:
    """``E_{y ~ pi_old}[R(y) sum_t W_t(y) grad log pi_cur(y_t | y_<t)]``, ``W`` from the ratios themselves."""
    theta = theta_cur.clone().requires_grad_()
    length, _, vocab = theta.shape
    sequences = enumerate_sequences(vocab, length)
    token_cur, token_old = _tokens(theta, sequences), _tokens(theta_old, sequences)
    ratios = token_cur.detach().exp() / token_old.exp()
    surrogate = (level_weights(ratios, level) * token_cur).sum(-1)
    value = exact_expectation(table_policy(theta_old), rewards * surrogate, vocab=vocab, length=length)
    return torch.autograd.grad(value, theta)[0]


def _sequence_objective_gradient(theta_cur, rewards) -> torch.Tensor:
    theta = theta_cur.clone().requires_grad_()
    length, _, vocab = theta.shape
    return torch.autograd.grad(exact_expectation(table_policy(theta), rewards, vocab=vocab, length=length), theta)[0]


def _per_token_objective_gradient(theta_old, theta_cur, rewards) -> torch.Tensor:
    theta = theta_cur.clone().requires_grad_()
    return torch.autograd.grad(per_token_objective(theta, theta_old, rewards), theta)[0]


def _relative(got: torch.Tensor, reference: torch.Tensor) -> float:
    return ((got - reference).norm() / reference.norm()).item()


@st.composite
def _problems(draw):
    return _problem(
        draw(st.integers(0, 2**31 - 1)),
        vocab=draw(st.integers(2, 3)),
        length=draw(st.integers(1, 3)),
        scale=draw(st.sampled_from([0.5, 1.0, 2.0])),
    )


@pytest.mark.parametrize("level", LEVELS)
@given(problem=_problems())
def test_each_level_matches_its_exact_expectation(level, problem):
    theta_old, theta_cur, rewards = problem
    expected = _expected_gradient(theta_old, theta_cur, rewards, level)
    assume(expected.norm().item() > 1e-8)
    assert _relative(_corrected_gradient(theta_old, theta_cur, rewards, level), expected) <= EXACT


@given(problem=_problems())
def test_sequence_level_is_exactly_the_sequence_objectives_gradient(problem):
    theta_old, theta_cur, rewards = problem
    truth = _sequence_objective_gradient(theta_cur, rewards)
    assume(truth.norm().item() > 1e-8)
    assert _relative(_corrected_gradient(theta_old, theta_cur, rewards, "sequence"), truth) <= EXACT


@given(problem=_problems())
def test_token_level_is_exactly_the_per_token_objectives_gradient(problem):
    theta_old, theta_cur, rewards = problem
    truth = _per_token_objective_gradient(theta_old, theta_cur, rewards)
    assume(truth.norm().item() > 1e-8)
    assert _relative(_corrected_gradient(theta_old, theta_cur, rewards, "token"), truth) <= EXACT


def test_the_biased_levels_bias_is_computed_exactly_and_vanishes_only_where_it_must(tmp_path):
    rows = []
    for seed in range(4):
        theta_old, theta_cur, rewards = _problem(seed, vocab=3, length=3)
        truth = _sequence_objective_gradient(theta_cur, rewards)
        row = {"seed": seed}
        for level in LEVELS:
            got = _corrected_gradient(theta_old, theta_cur, rewards, level)
            row[level] = _relative(got, truth)  # the exact bias against the sequence objective
        rows.append(row)
        assert row["sequence"] <= EXACT
        for level in ("token",) + BIASED:
            assert row[level] > 1e-3, row  # a real bias, far beyond FP64 noise
        # One token: every level is the sequence ratio, so none is biased.
        one = _problem(seed, vocab=3, length=1)
        one_truth = _sequence_objective_gradient(one[1], one[2])
        for level in LEVELS:
            assert _relative(_corrected_gradient(*one, level), one_truth) <= EXACT, level
        # Same policies: every weight is 1 and nothing is biased.
        for level in LEVELS:
            same = _corrected_gradient(theta_cur, theta_cur, rewards, level)
            assert _relative(same, truth) <= EXACT, level
    (tmp_path / "level_bias.json").write_text(json.dumps(rows, indent=1))
    print("\nexact bias of each level against the sequence objective's gradient (relative L2):")
    for row in rows:
        print("  seed {seed}: ".format(**row) + ", ".join(f"{level} {row[level]:.3e}" for level in LEVELS))


def test_negative_control_the_sequence_weight_applied_per_token_is_the_token_levels_gradient():
    # The sequence level's weight on each token is the row's product: replacing it by the token's own ratio
    # (the bug the mutation suite injects) gives the token level's gradient, which misses the sequence objective.
    theta_old, theta_cur, rewards = _problem(5, vocab=3, length=2)
    truth = _sequence_objective_gradient(theta_cur, rewards)
    per_token = _expected_gradient(theta_old, theta_cur, rewards, "token")
    assert _relative(per_token, truth) > 1e-2
    assert _relative(_expected_gradient(theta_old, theta_cur, rewards, "sequence"), truth) <= EXACT
