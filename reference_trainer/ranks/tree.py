"""The one pairwise tree over logical ranks that gradient sums follow: pure arithmetic, no processes.

NOTE [Logical ranks] Rule 4 (``ranks/__init__.py``) fixes the order:
``tree(lo, hi)`` over logical ranks ``lo .. hi-1`` is the leaf itself for one
rank, else ``tree(lo, m) + tree(m, hi)`` with ``m - lo`` the largest power of
two below ``hi - lo``. A rank with no gradient for a tensor is *skipped*, not
added as zero: a node with one present child is that child, bit for bit
(``-0.0`` stays ``-0.0``), and a node with none is absent. The tree depends
on ``L`` only, never on ``W``.

:class:`TreeFold` folds one tensor's contributions as they arrive in
ascending order, like a binary counter: it merges two siblings as soon as both
are complete and promotes a lone child once its sibling's ranks have all gone
by, so a run of ``k`` consecutive leaves is held as at most
``ceil(log2 k) + 1`` partial sums. Pushing whole subtrees (the partial sums
another process shipped) gives the same bits as pushing their leaves, because
every node is computed by the same rule. No library folds a stream of tensors
by a given tree with skipped leaves, hence this module.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["Node", "TreeFold", "tree_parents"]

Node = tuple[int, int]  # [lo, hi): the logical ranks of one subtree


def _split(lo: int, hi: int) -> int:
    """Where ``tree(lo, hi)`` splits: ``lo`` plus the largest power of two below ``hi - lo`` (``hi - lo >= 2``)."""
    return lo + (1 << ((hi - lo - 1).bit_length() - 1))


@functools.cache
def tree_parents(logical_dp: int) -> dict[Node, Node]:
    """Every non-root node of the tree over ``logical_dp`` logical ranks, mapped to its parent."""
    parents: dict[Node, Node] = {}
    stack = [(0, logical_dp)]
    while stack:
        lo, hi = stack.pop()
        if hi - lo > 1:
            mid = _split(lo, hi)
            parents[(lo, mid)] = parents[(mid, hi)] = (lo, hi)
            stack += [(lo, mid), (mid, hi)]
    return parents


class TreeFold:
    """One tensor's partial sums over logical ranks, folded in tree order as contributions arrive.

    ``entries`` are disjoint nodes in ascending order with their sums. Push
    nodes in ascending order (a leaf is ``(r, r + 1)``), none below ``start``
    (a process folds only the ranks it hosts: what lies below ``start`` is
    another's); :meth:`close` once every rank in ``[start, upto)`` has arrived.
    """

    def __init__(self, logical_dp: int, start: int = 0) -> None:
        self.logical_dp = logical_dp
        self.start = start
        self.parents = tree_parents(logical_dp)
        self.entries: list[tuple[Node, torch.Tensor]] = []

    def push(self, node: Node, value: torch.Tensor) -> None:
        """Add the sum of subtree ``node`` (a node of the tree, after every node already pushed)."""
        self.close(node[0])
        self.entries.append((node, value))
        self.close(node[1])

    def close(self, upto: int) -> None:
        """Every logical rank in ``[start, upto)`` has arrived: merge or promote every node now complete here."""
        while self.entries:
            node, value = self.entries[-1]
            parent = self.parents.get(node)
            if parent is None or parent[0] < self.start or parent[1] > upto:
                return
            below = self.entries[-2] if len(self.entries) > 1 else None
            if node[0] > parent[0] and below is not None and below[0] == (parent[0], node[0]):
                del self.entries[-2:]
                self.entries.append((parent, below[1] + value))  # both children: left + right
            else:
                self.entries[-1] = (parent, value)  # the sibling's ranks went by with nothing: skipped

    def total(self) -> torch.Tensor | None:
        """The root's sum once every logical rank has arrived (``None``: no rank contributed; ``start`` 0 only)."""
        self.close(self.logical_dp)
        assert len(self.entries) <= 1, f"an unfinished tree: {[n for n, _ in self.entries]}"
        return self.entries[0][1] if self.entries else None
