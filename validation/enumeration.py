"""Exact expectations over every sequence of a tiny autoregressive policy.

A *policy* here is ``logits_fn(prefix) -> (V,)``: the next-token logits given the
1-D int64 prefix generated so far (empty at the first position). A sequence's
probability is the product of its token probabilities. With ``V**L`` sequences
(4**2 = 16, say) every expectation is a finite sum, exact up to rounding: an
oracle for policy-gradient estimators with no sampling noise. Everything is
differentiable, so ``grad E_theta[R]`` is one ``torch.autograd.grad`` away. Use
FP64 logits for oracle work.

A trainer-level test can wrap a model as a policy, e.g.
``lambda prefix: model(torch.cat([prompt, prefix])[None])[0, -1]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

__all__ = [
    "LogitsFn",
    "enumerate_sequences",
    "sequence_token_logprobs",
    "sequence_logprob",
    "sequence_logprobs",
    "exact_expectation",
    "table_policy",
    "level_weights",
    "per_token_objective",
]

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def enumerate_sequences(vocab: int, length: int) -> torch.Tensor:
    """Every sequence of ``length`` tokens from ``range(vocab)``: int64 ``(vocab**length, length)``.

    Lexicographic order: row ``i`` is ``i`` written in base ``vocab``.
    """
    if vocab < 1 or length < 1:
        raise ValueError(f"expected vocab >= 1 and length >= 1, found {vocab} and {length}")
    return torch.tensor(list(itertools.product(range(vocab), repeat=length)), dtype=torch.long)


def sequence_token_logprobs(logits_fn: LogitsFn, seq: torch.Tensor) -> torch.Tensor:
    """``(L,)``: ``log pi(seq[t] | seq[:t])`` for each position ``t`` of a 1-D ``seq``."""
    return torch.stack([torch.log_softmax(logits_fn(seq[:t]), dim=-1)[seq[t]] for t in range(seq.shape[0])])


def sequence_logprob(logits_fn: LogitsFn, seq: torch.Tensor) -> torch.Tensor:
    """0-d: ``log pi(seq) = sum_t log pi(seq[t] | seq[:t])``."""
    return sequence_token_logprobs(logits_fn, seq).sum()


def sequence_logprobs(logits_fn: LogitsFn, sequences: torch.Tensor) -> torch.Tensor:
    """``(N,)``: :func:`sequence_logprob` of each row of an ``(N, L)`` tensor."""
    return torch.stack([sequence_logprob(logits_fn, seq) for seq in sequences])


def exact_expectation(
    logits_fn: LogitsFn,
    values: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    *,
    vocab: int,
    length: int,
) -> torch.Tensor:
    """0-d: ``E_{y ~ pi}[v(y)] = sum_y pi(y) v(y)`` over every sequence, exactly.

    ``values`` is an ``(vocab**length,)`` tensor in :func:`enumerate_sequences`
    order, or a callable ``v(seq) -> scalar``. The result is differentiable
    through both ``pi`` (the logits) and ``values``.
    """
    sequences = enumerate_sequences(vocab, length)
    if callable(values):
        values = torch.stack([torch.as_tensor(values(seq)) for seq in sequences])
    if tuple(values.shape) != (sequences.shape[0],):
        raise ValueError(
            f"expected values of shape {(sequences.shape[0],)} (one per sequence), found {tuple(values.shape)}"
        )
    return (sequence_logprobs(logits_fn, sequences).exp() * values).sum()


def table_policy(theta: torch.Tensor) -> LogitsFn:
    """A tabular policy over sequences of length ``L``: ``theta`` is ``(L, V + 1, V)``.

    The logits at position ``t`` after previous token ``p`` are ``theta[t, p]``;
    row ``V`` is the start state (``t = 0``). Every sequence distribution in
    which a token depends on its position and predecessor is reachable.
    """
    _, states, vocab = theta.shape
    if states != vocab + 1:
        raise ValueError(f"expected theta of shape (L, V + 1, V), found {tuple(theta.shape)}")

    def logits_fn(prefix: torch.Tensor) -> torch.Tensor:
        t = prefix.shape[0]
        return theta[t, int(prefix[-1]) if t else vocab]

    return logits_fn


def level_weights(ratios: torch.Tensor, level: str, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(N, L)``: each token's importance weight at ``level`` from the token ratios ``(N, L)``, unclipped.

    Formed from the ratios themselves, not their logarithms (the oracle's own
    reading of docs/semantics.md#importance-correction), over each row's
    ``mask``-ed tokens (``None``: all): ``token`` each ratio; ``sequence`` the
    row's product, ``geometric`` its ``n``-th root (``n`` tokens),
    ``average`` the row's mean, on every token of the row. Tokens outside
    the mask weigh 0.
    """
    mask = torch.ones_like(ratios, dtype=torch.bool) if mask is None else mask
    kept = torch.where(mask, ratios, 1.0)
    count = mask.sum(-1).to(ratios.dtype)
    unit = {
        "token": ratios,
        "sequence": kept.prod(-1, keepdim=True),
        "geometric": kept.prod(-1, keepdim=True) ** (1.0 / count[:, None]),
        "average": torch.where(mask, ratios, 0.0).sum(-1, keepdim=True) / count[:, None],
    }[level]
    return torch.where(mask, unit.expand_as(ratios), 0.0)


def per_token_objective(theta: torch.Tensor, theta_old: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """0-d: ``sum_t E[R(y)]`` with ``y_t ~ pi_theta(. | y_<t)`` and every other token from ``pi_old``.

    The objective the token-level correction is unbiased for: its gradient at
    ``theta`` is ``E_{y ~ pi_old}[R(y) sum_t rho_t grad log pi_theta(y_t | y_<t)]``
    (``rho_t`` the token ratio). Tables as in :func:`table_policy`.
    """
    length, _, vocab = theta.shape
    sequences = enumerate_sequences(vocab, length)
    new, old = table_policy(theta), table_policy(theta_old)
    token_new = torch.stack([sequence_token_logprobs(new, y) for y in sequences])  # (N, L)
    token_old = torch.stack([sequence_token_logprobs(old, y) for y in sequences])
    swapped = token_old.sum(-1, keepdim=True) - token_old + token_new  # log of pi_old with token t from pi_theta
    return (rewards[:, None] * swapped.exp()).sum()
