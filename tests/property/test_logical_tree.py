"""The fixed tree of NOTE [Logical ranks] Rule 4, exhaustively over small layouts: the bits never depend on ``W``.

Each layout folds its chunks the way processes do (``TreeFold`` from the chunk's
first rank, leaves in logical order), then finishes the tree from every
chunk's partial sums the way a shard's owner does. The oracle is the rule
written again as a recursion, in plain torch; random FP32 leaves make
association visible (the negative control proves it is).
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch

from reference_trainer.ranks.tree import TreeFold


def oracle(leaves: list[torch.Tensor | None]) -> torch.Tensor | None:
    """``tree(lo, hi) = tree(lo, m) + tree(m, hi)``, ``m - lo`` the largest power of two below ``hi - lo``; None skipped."""
    if len(leaves) == 1:
        return leaves[0]
    half = 1 << ((len(leaves) - 1).bit_length() - 1)
    left, right = oracle(leaves[:half]), oracle(leaves[half:])
    return right if left is None else left if right is None else left + right


def folded(leaves: list[torch.Tensor | None], world: int) -> tuple[torch.Tensor | None, int]:
    """The sum as ``world`` processes compute it, and the most partial sums one process held at once."""
    logical_dp, per = len(leaves), len(leaves) // world
    shipped, held = [], 0
    for process in range(world):
        fold = TreeFold(logical_dp, process * per)
        for rank in range(process * per, (process + 1) * per):
            if leaves[rank] is not None:
                fold.push((rank, rank + 1), leaves[rank])
                held = max(held, len(fold.entries))
        fold.close((process + 1) * per)
        shipped += fold.entries
    owner = TreeFold(logical_dp)
    for node, value in shipped:
        owner.push(node, value)
    return owner.total(), held


def _leaves(logical_dp: int, seed: int, missing: frozenset[int] = frozenset()) -> list[torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.randint(-4, 5, (logical_dp,), generator=generator)
    return [None if r in missing else torch.randn(64, generator=generator) * scales[r] for r in range(logical_dp)]


@pytest.mark.parametrize("logical_dp", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 64])
def test_every_process_count_gives_the_oracles_bits(logical_dp: int) -> None:
    leaves = _leaves(logical_dp, logical_dp)
    expected = oracle(leaves)
    for world in (w for w in range(1, logical_dp + 1) if logical_dp % w == 0):
        found, held = folded(leaves, world)
        assert torch.equal(found.view(torch.int32), expected.view(torch.int32)), f"L={logical_dp}, W={world}"
        per = logical_dp // world
        if per & (per - 1) == 0:  # a chunk that is one subtree: a binary counter's partial sums
            assert held <= max(per - 1, 0).bit_length() + 1, f"L={logical_dp}, W={world}: {held} partial sums"


@pytest.mark.parametrize(
    ("logical_dp", "missing"), [(4, {1}), (8, {0, 5, 6, 7}), (16, set(range(8))), (6, {5}), (3, {0, 1, 2})]
)
def test_a_rank_without_the_tensor_is_skipped_not_added(logical_dp: int, missing: set[int]) -> None:
    leaves = _leaves(logical_dp, 7, frozenset(missing))
    expected = oracle(leaves)
    for world in (w for w in range(1, logical_dp + 1) if logical_dp % w == 0):
        found = folded(leaves, world)[0]
        assert (found is None) == (expected is None)
        if expected is not None:
            assert torch.equal(found.view(torch.int32), expected.view(torch.int32)), f"L={logical_dp}, W={world}"


def test_negative_zero_survives_a_skipped_sibling() -> None:
    leaves = [torch.tensor([-0.0]), None, None, None]
    assert torch.signbit(folded(leaves, 2)[0]).item()


def test_negative_control_the_tree_is_not_the_left_to_right_sum() -> None:
    leaves = _leaves(16, 16)
    assert not torch.equal(oracle(leaves), functools.reduce(operator.add, leaves)), (
        "the oracle cannot tell the orders apart"
    )
