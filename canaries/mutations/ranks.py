"""Injected bugs in the logical ranks: normalisation and the fixed reduction tree (``canaries.mutations.catalogue``).

Each puts back a bug of the loss normalisation across logical ranks or of
the tree that sums their gradients, within a process and across processes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reference_trainer.ranks import LogicalRank
from reference_trainer.ranks.reduction import LogicalSums
from reference_trainer.ranks.tree import TreeFold

from .injection import Mutation, patched

__all__ = ["RANK_MUTATIONS"]

_SCALE_BITS = "logical-rank scale: parameters equal for every W, .grad equal to the tree oracle on one process"


def _local_count(self: LogicalRank, mask: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """``global_token_count`` returning the logical rank's own count: per-rank instead of global normalisation."""
    masks = [mask] if isinstance(mask, torch.Tensor) else list(mask)
    return sum(int(torch.count_nonzero(m)) for m in masks)


def _arrival_push(self: TreeFold, node: tuple[int, int], value: torch.Tensor) -> None:
    """``TreeFold.push`` folding left to right as contributions arrive: ``((g0 + g1) + g2) + ...`` per process."""
    if not self.entries:
        self.entries.append((node, value))
        return
    (lo, _), total = self.entries[0]
    self.entries[0] = ((lo, node[1]), total + value)


def _local_pieces(self: LogicalSums, bucket: list, local: dict, nodes: list, specs: dict, label: str) -> dict:
    """``LogicalSums._exchange`` without the exchange: each shard's owner finishes the tree from its own partial sums."""
    world, rank = self.comm.world_size, self.comm.rank
    return {
        key: [(node, torch.tensor_split(v.reshape(-1), world)[rank]) for node, v in local.get(key, [])]
        for key in bucket
    }


RANK_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "per_rank_normalisation",
        "each logical rank normalises its loss by its own token count",
        "derivative",
        patched(LogicalRank, "global_token_count", _local_count),
        "logical_global_normalisation",
    ),
    Mutation(
        "fold_in_arrival_order",
        "logical ranks' gradients are folded left to right as they arrive, not in the fixed tree",
        "memory",
        patched(TreeFold, "push", _arrival_push),
        _SCALE_BITS,
    ),
    Mutation(
        "no_cross_process_reduction",
        "each process finishes the logical-rank sum from its own partial sums only",
        "memory",
        patched(LogicalSums, "_exchange", _local_pieces),
        _SCALE_BITS,
    ),
)
