"""Where logical ranks live and the one order their sums take: pure arithmetic, no processes.

Which physical rank hosts which logical ranks (NOTE [Logical ranks] Rule 1, in
``ranks/__init__.py``), how a list of inputs is spread over logical ranks (Rule 7), and
the left-to-right sum over logical ranks that makes the bits independent of
the number of processes (Rule 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError, int_at_least

__all__ = ["LogicalLayout", "ordered_sum", "spread"]


@dataclass(frozen=True)
class LogicalLayout:
    """Which logical ranks physical rank ``rank`` of ``world_size`` hosts (Rule 1)."""

    logical_dp: int
    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("logical_dp", "world_size"):
            value = getattr(self, name)
            if not int_at_least(value, 1):
                raise ConfigError(name, value, "an int >= 1")
        if self.logical_dp % self.world_size:
            raise ConfigError(
                "logical_dp",
                self.logical_dp,
                f"a multiple of the number of processes ({self.world_size})",
                hint="each process hosts logical_dp / world_size logical ranks",
            )
        if not 0 <= self.rank < self.world_size:
            raise ConfigError("rank", self.rank, f"an int in [0, {self.world_size})")

    @property
    def per_process(self) -> int:
        return self.logical_dp // self.world_size

    @property
    def hosted(self) -> range:
        return range(self.rank * self.per_process, (self.rank + 1) * self.per_process)

    def owner(self, logical_rank: int) -> int:
        return logical_rank // self.per_process


def spread(count: int, parts: int) -> list[range]:
    """Contiguous chunks of ``range(count)`` for ``parts`` logical ranks; the first ``count % parts`` get one more."""
    base, extra = divmod(count, parts)
    chunks, start = [], 0
    for part in range(parts):
        stop = start + base + (part < extra)
        chunks.append(range(start, stop))
        start = stop
    return chunks


def ordered_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``((p0 + p1) + p2) + ...``: the one association order (Rule 4)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total
