"""Logical batches: physical micro-batches grouped per optimizer step, released before the next pull.

NOTE [Logical-batch lifetime]
  1. ``logical_batches(source, size)`` pulls ``size`` physical micro-batches
     from ``source`` and yields them as one :class:`LogicalBatch`.
  2. Before it pulls the next physical micro-batch it releases the previous
     logical batch: every attribute the caller set on it (outputs, losses,
     anything holding graphs) is dropped, and the generator keeps no
     reference to it (no local variable, no list, no exception frame). A
     forward's graph is released when its outputs are dropped (NOTE [Forward
     records] Rule 4), so the previous batch's inputs, outputs and graphs are
     gone before the next micro-batch is produced: memory the next forward
     needs is never held by the last one. In zero mode the servers drop their
     outputs at rank 0's next command, before it runs.
  3. The generator can only drop what it owns. Keep per-batch state on the
     batch (``batch.outputs = ...``), not in loop-local variables, or ``del``
     those before the loop advances; read a released batch and you get a
     ``ConfigError`` saying so.
  4. The last logical batch may be short (``drop_last=False``); closing the
     generator early releases the batch it last yielded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import ConfigError, int_at_least
from .layout import spread

__all__ = ["LogicalBatch", "logical_batches"]


class LogicalBatch:
    """One logical batch: ``index``, its physical ``micro_batches``, and whatever the caller attaches.

    Set any attribute (``batch.outputs = trainer.forward(...)``); all of them
    are dropped when the generator advances (NOTE [Logical-batch lifetime]).
    """

    def __init__(self, index: int, micro_batches: list[Any]) -> None:
        self.index = index
        self.micro_batches = micro_batches
        self.released = False

    def shard(self, logical_rank: int, logical_world_size: int) -> list[Any]:
        """The contiguous run of micro-batches logical rank ``logical_rank`` of ``logical_world_size`` takes."""
        if not 0 <= logical_rank < logical_world_size:
            raise ConfigError("logical_rank", logical_rank, f"an int in [0, {logical_world_size})")
        return [self.micro_batches[i] for i in spread(len(self.micro_batches), logical_world_size)[logical_rank]]

    def release(self) -> None:
        """Drop the micro-batches and everything attached (Rule 2)."""
        index = self.index
        vars(self).clear()
        self.index, self.released = index, True

    def __getattr__(self, name: str) -> Any:
        if vars(self).get("released"):
            raise ConfigError(
                f"LogicalBatch.{name}",
                f"logical batch {self.index} (released)",
                "a batch that is still current",
                hint="logical_batches releases a batch before pulling the next; keep what must outlive it elsewhere",
            )
        raise AttributeError(f"'LogicalBatch' object has no attribute {name!r}")

    def __repr__(self) -> str:
        state = "released" if self.released else f"{len(self.micro_batches)} micro-batches"
        return f"LogicalBatch({self.index}, {state})"


def logical_batches(source: Iterable[Any], size: int = 1, *, drop_last: bool = False) -> Iterator[LogicalBatch]:
    """Group ``size`` physical micro-batches of ``source`` into each yielded :class:`LogicalBatch`.

    The previous batch is released before the next micro-batch is pulled
    (NOTE [Logical-batch lifetime]).
    """
    if not int_at_least(size, 1):
        raise ConfigError("size", size, "an int >= 1 (physical micro-batches per logical batch)")
    return _generate(iter(source), size, drop_last)


def _generate(source: Iterator[Any], size: int, drop_last: bool) -> Iterator[LogicalBatch]:
    index = 0
    while True:
        micro_batches = _pull(source, size)
        if not micro_batches or (drop_last and len(micro_batches) < size):
            return
        batch = LogicalBatch(index, micro_batches)
        del micro_batches
        try:
            yield batch
        finally:
            batch.release()
            del batch  # no reference may survive into the next pull (Rule 2)
        index += 1


def _pull(source: Iterator[Any], size: int) -> list[Any]:
    pulled: list[Any] = []
    for _ in range(size):
        try:
            pulled.append(next(source))
        except StopIteration:
            break
    return pulled
