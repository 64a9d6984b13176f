"""The gradient sum over logical ranks is the fixed tree of NOTE [Logical ranks] Rule 4, with exact oracles.

One process here (W = 1); the W = 2 and W = 4 bits come from the spawned
suites (``test_logical_invariance.py`` and the ``slow`` cases below). The
oracle: each logical rank's gradient from a plain trainer (no logical
ranks), summed by the tree written again in ``dist_scenarios.tree_oracle``.
"""

from __future__ import annotations

import functools
from typing import Any

import dist_scenarios as ds
import numpy as np
import pytest
import torch

import reference_trainer as rt
from reference_trainer.ranks import run_logical
from validation.spawn import spawn_ranks, to_plain

pytestmark = pytest.mark.dist


def _grads(trainer: rt.Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in trainer.checkpoint(ds.POLICY).named_parameters() if p.grad is not None}


def _assert_bits(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert found.keys() == expected.keys(), what
    differ = [n for n in expected if not torch.equal(found[n].view(torch.int32), expected[n].view(torch.int32))]
    assert not differ, f"{what}: {len(differ)} of {len(expected)} gradients differ (first {differ[0] if differ else ''})"


def test_one_step_sums_every_logical_ranks_gradient_in_the_fixed_tree(one_thread: None) -> None:
    """L=16, one backward per logical rank: .grad is bitwise the tree over the per-rank gradients."""
    trainer = ds.make_trainer()

    def body(view: Any) -> None:
        items, advantages = ds.micro_batch(0, view.logical_rank)
        view.backward(ds.rank_loss(view.forward(items), advantages, 10))

    run_logical(body, trainer, logical_dp=16)
    trainer.optim_step()
    assert rt.logical_gradients(trainer) == {}, "the step left its sums pending"
    per_rank = [ds.rank_gradients(rank) for rank in range(16)]
    expected = ds.tree_oracle(per_rank)
    _assert_bits(_grads(trainer), expected, "L=16 vs the tree oracle")
    left_to_right = {n: functools.reduce(torch.add, [g[n] for g in per_rank]) for n in expected}
    assert any(not torch.equal(left_to_right[n], expected[n]) for n in expected), "negative control: orders agree"


def test_several_rounds_before_one_step_add_their_trees_in_round_order(one_thread: None) -> None:
    """Rule 4's leaves are (round, logical rank): two run_logical calls, or two backwards in one fn, both give
    ``tree(round 0) + tree(round 1)``, bit for bit; a second call adds to the pending sum, not to the leaves."""
    def backward_step(view: Any, step: int) -> None:
        items, advantages = ds.micro_batch(step, view.logical_rank)
        view.backward(ds.rank_loss(view.forward(items), advantages, 10))

    two_calls, one_call = ds.make_trainer(), ds.make_trainer()
    for step in (0, 1):
        run_logical(lambda view, step=step: backward_step(view, step), two_calls, logical_dp=4)
    run_logical(lambda view: [backward_step(view, step) for step in (0, 1)], one_call, logical_dp=4)
    rounds = [ds.tree_oracle([ds.rank_gradients(rank, step) for rank in range(4)]) for step in (0, 1)]
    expected = {n: rounds[0][n] + rounds[1][n] for n in rounds[0]}
    for trainer, what in ((two_calls, "two run_logical calls"), (one_call, "two backwards in one fn")):
        trainer.optim_step()
        _assert_bits(_grads(trainer), expected, what)
    rank_major = ds.tree_oracle([{n: a[n] + b[n] for n in a} for a, b in
                                 ([ds.rank_gradients(r, 0), ds.rank_gradients(r, 1)] for r in range(4))])
    assert any(not torch.equal(rank_major[n], expected[n]) for n in expected), "negative control: orders agree"


# --- W = 1, 2, 4 at L = 16 and 64 (slow: a four-process spawn) ---------------------------------

WIDE = [(16, "full"), (16, "lora"), (64, "full"), (64, "lora")]


@functools.cache
def _wide(world: int) -> list[dict[str, Any]]:
    if world == 1:
        return [to_plain(ds.wide_cases(WIDE))]
    return spawn_ranks(ds.wide_cases, world, WIDE, timeout_s=600.0)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("logical_dp", "kind"), WIDE)
def test_wide_layouts_give_the_one_process_bits(logical_dp: int, kind: str, world: int, one_thread: None) -> None:
    one = _wide(1)[0][f"L{logical_dp}-{kind}"]
    for rank, result in enumerate(_wide(world)):
        found = result[f"L{logical_dp}-{kind}"]
        for name, value in one.items():
            assert np.array_equal(found[name].view(np.uint32), value.view(np.uint32)), f"W={world} rank {rank}: {name}"
