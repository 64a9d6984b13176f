"""The sum over logical ranks of every gradient committed since the last ``optim_step``, folded as it arrives.

By Rules 4-5 of NOTE [Logical ranks] (``ranks/__init__.py``), the leaves of
the gradient sum are ``g[b][r]``: what logical rank ``r`` committed in the
``b``-th agreed backward round since the last step (every logical rank takes
part in every round, Rule 3). :class:`LogicalSums` is this process's part of
``sum_b tree_r g[b][r]``:

- In a round, each hosted logical rank's commit is folded at once, in
  logical order, into one :class:`TreeFold` per tensor (its ``BufferGradSink``
  hands it over, NOTE [Gradient commit] Rule 5); a failed round is dropped
  whole (:meth:`LogicalSums.discard`), nothing before it changes.
- Once every process agreed the round (:meth:`LogicalSums.complete`), the
  processes exchange what names their partial sums (a control message), then
  one ``all_to_all`` per bucket sends shard ``q`` of every partial sum to
  physical rank ``q``, which finishes the tree for its shard and adds it to
  its running total, round after round (left to right).
- ``optim_step`` all-gathers the shards (:meth:`LogicalSums.finish`).

Costs per process, with ``G`` the gradient bytes and ``k = L/W``: held, at
most ``ceil(log2 k) + 1`` partial sums while a round folds plus ``G/W`` of
totals; received, ``(W-1)/W * G`` per round and again per step when each
process's chunk is one subtree (``k`` a power of two). Otherwise a chunk is
shipped as the few subtrees that cover it (two or three), each costing as
much.
"""

from __future__ import annotations

import torch

from ..peers import Comm
from .layout import LogicalLayout
from .tree import Node, TreeFold

__all__ = ["BUCKET_NUMEL", "LogicalSums"]

BUCKET_NUMEL = 1 << 24  # elements per bucket of partial sums: bounds each collective's staging copy

Key = tuple[str, str]  # (checkpoint name, parameter name)
Spec = tuple[torch.Size, torch.dtype]  # a gradient's shape and dtype


class LogicalSums:
    """This process's folds of the current round and its shards of the running totals (by ``Key``)."""

    def __init__(self, layout: LogicalLayout, comm: Comm, device: torch.device) -> None:
        self.layout = layout
        self.comm = comm
        self.device = device  # the trainer's: where partial sums and totals live
        self.round: dict[Key, TreeFold] = {}
        self.totals: dict[Key, torch.Tensor] = {}  # 1-D: this process's shard of each running sum
        self.specs: dict[Key, Spec] = {}

    # the round (one agreed backward of every logical rank) ------------------------------

    def add(self, logical_rank: int, key: Key, value: torch.Tensor) -> None:
        """Fold ``logical_rank``'s committed gradient ``value`` of ``key`` (hosted ranks arrive in logical order)."""
        fold = self.round.get(key)
        if fold is None:
            fold = self.round[key] = TreeFold(self.layout.logical_dp, self.layout.hosted.start)
        fold.push((logical_rank, logical_rank + 1), value)

    def discard(self) -> None:
        """The round failed somewhere: drop everything it folded (the totals are untouched)."""
        self.round.clear()

    def complete(self, label: str) -> None:
        """Every process agreed the round: finish each tensor's tree for this process's shard, add it to the totals.

        Runs on every process; the totals change only once every collective succeeded.
        """
        hosted = self.layout.hosted
        local: dict[Key, list[tuple[Node, torch.Tensor]]] = {}
        for key, fold in self.round.items():
            fold.close(hosted.stop)
            local[key] = fold.entries
        described = {
            key: ([node for node, _ in entries], (e.shape, e.dtype))
            for key, entries in local.items()
            for e in [entries[0][1]]
        }
        every = self.comm.exchange(described, f"{label}: logical-rank partial sums")
        self.round = {}
        specs = {key: spec for part in reversed(every) for key, (_, spec) in part.items()}
        nodes = [{key: listed for key, (listed, _) in part.items()} for part in every]
        updated: dict[Key, torch.Tensor] = {}
        world = self.comm.world_size
        for bucket in _buckets(sorted(specs), specs):
            pieces = self._exchange(bucket, local, nodes, specs, label)
            for key in bucket:
                fold = TreeFold(self.layout.logical_dp)
                for node, piece in pieces[key]:
                    fold.push(node, piece)
                total = fold.total()
                assert total is not None, f"{key}: every key of a bucket has a piece"
                if len(pieces[key]) == 1 and world > 1:  # a view of the whole received bucket: keep only its shard
                    total = total.clone()
                old = self.totals.get(key)
                updated[key] = total if old is None else old + total
        self.totals.update(updated)
        self.specs.update(specs)

    def _exchange(
        self,
        bucket: list[Key],
        local: dict[Key, list[tuple[Node, torch.Tensor]]],
        nodes: list[dict[Key, list[Node]]],
        specs: dict[Key, Spec],
        label: str,
    ) -> dict[Key, list[tuple[Node, torch.Tensor]]]:
        """Every process's partial sums of ``bucket``, cut to this process's shard, in logical order.

        ``nodes[q]``: the subtrees physical rank ``q`` holds, by key. Shard ``q``
        of a flat tensor is ``torch.tensor_split(flat, W)[q]``.
        """
        world, me = self.comm.world_size, self.comm.rank
        if world == 1:
            return {key: [(node, value.reshape(-1)) for node, value in local.get(key, [])] for key in bucket}
        dtype = specs[bucket[0]][1]
        sends = []
        for peer in range(world):
            cut = [torch.tensor_split(v.reshape(-1), world)[peer] for key in bucket for _, v in local.get(key, [])]
            sends.append(torch.cat(cut) if cut else torch.zeros(0, dtype=dtype, device=self.device))
        widths = {key: _shard_size(specs[key][0].numel(), me, world) for key in bucket}
        sizes = [sum(widths[key] * len(part.get(key, ())) for key in bucket) for part in nodes]
        received = self.comm.all_to_all(sends, sizes, f"{label}: {len(bucket)} logical-rank partial sums")
        del sends
        pieces: dict[Key, list[tuple[Node, torch.Tensor]]] = {key: [] for key in bucket}
        for part, arrived in zip(nodes, received):
            flat = arrived.to(self.device)
            offset = 0
            for key in bucket:
                for node in part.get(key, ()):
                    pieces[key].append((node, flat[offset : offset + widths[key]]))
                    offset += widths[key]
        return pieces

    # the step ----------------------------------------------------------------------------

    def finish(self, keys: list[Key], label: str) -> list[tuple[Key, torch.Tensor]]:
        """Each of ``keys`` that has a total, whole and shaped, on every process; the totals stay until cleared.

        ``optim_step`` clears them only once every origin passed: a refused step keeps them.
        """
        present = [key for key in keys if key in self.totals]
        world = self.comm.world_size
        out = []
        for bucket in _buckets(present, self.specs):
            if world == 1:  # a copy: the total may be a committed tensor itself, and .grad must own its storage
                out += [(key, self.totals[key].clone().view(self.specs[key][0])) for key in bucket]
                continue
            mine = torch.cat([self.totals[key] for key in bucket])
            width = max(sum(_shard_size(self.specs[k][0].numel(), q, world) for k in bucket) for q in range(world))
            padded = torch.zeros(width, dtype=mine.dtype, device=mine.device)
            padded[: mine.numel()] = mine
            gathered = self.comm.all_gather(padded[None], f"{label}: {len(bucket)} logical-rank sums").to(self.device)
            offsets = [0] * world  # (W, width): row q holds shard q of each key of the bucket, in order
            for key in bucket:
                shape = self.specs[key][0]
                parts = []
                for q in range(world):
                    n = _shard_size(shape.numel(), q, world)
                    parts.append(gathered[q, offsets[q] : offsets[q] + n])
                    offsets[q] += n
                out.append((key, torch.cat(parts).view(shape)))
        return out

    def pending(self, checkpoint: str | None = None) -> int:
        """Tensors with a running total or a fold in progress, of one checkpoint or of all."""
        return sum(1 for key in {*self.totals, *self.round} if checkpoint in (None, key[0]))

    def clear(self, checkpoint: str) -> None:
        """Drop the totals of ``checkpoint`` (``zero_grad``, ``load_checkpoint(discard_graphs=True)``)."""
        for key in [k for k in self.totals if k[0] == checkpoint]:
            del self.totals[key]


def _shard_size(numel: int, shard: int, world: int) -> int:
    """Elements of shard ``shard`` of ``world`` of a flat tensor of ``numel`` (``torch.tensor_split``'s cut)."""
    base, extra = divmod(numel, world)
    return base + (shard < extra)


def _buckets(keys: list[Key], specs: dict[Key, Spec]) -> list[list[Key]]:
    """Consecutive keys of one dtype, up to ``BUCKET_NUMEL`` elements each (at least one key): one collective each."""
    buckets: list[list[Key]] = []
    numel = 0
    for key in keys:
        size = specs[key][0].numel()
        if not buckets or specs[buckets[-1][0]][1] != specs[key][1] or numel + size > BUCKET_NUMEL:
            buckets.append([])
            numel = 0
        buckets[-1].append(key)
        numel += size
    return buckets
