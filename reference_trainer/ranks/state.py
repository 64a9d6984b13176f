"""What a trainer keeps for its logical ranks between ``run_logical`` calls.

:class:`LogicalState` is the trainer's ``RankHost`` (``sinks.py``): it lives
on the trainer (``trainer.rank_gradients.host``), not in any registry here,
and holds the layout, the transport, each hosted logical rank's RNG stream
and which of them runs now (NOTE [Logical ranks] Rule 2, in
``ranks/__init__.py``: :meth:`LogicalState.as_rank`) and the zero-mode
outputs (Rule 7). The gradient buffers themselves live in the trainer's
``RankGradients`` sink; :meth:`LogicalState.sum_buffers` sums them over
every process in logical order (Rules 4-5).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..checkpoints import Checkpoint
from ..errors import ConfigError
from ..rng import RngState, rng_state, seeded_rng_state, set_rng_state, stream_seed
from ..sinks import BufferGradSink, SummedGradients
from .fibers import current_fiber
from .layout import LogicalLayout, ordered_sum
from .peers import Comm

__all__ = ["BUCKET_NUMEL", "LogicalState"]

BUCKET_NUMEL = 1 << 24  # elements per gradient gather: bounds the L/W-fold staging copy


# What fn calls instead of a trainer method that must not run on one logical rank's behalf.
_INSIDE_FN = {"backward": "view.backward(loss), which commits into this logical rank's buffer"}


class LogicalState:
    """A trainer's logical layout, transport, RNG streams and zero-mode outputs."""

    def __init__(self, layout: LogicalLayout, comm: Comm, seed: int, device: torch.device) -> None:
        self.layout = layout
        self.comm = comm
        self.device = device
        self.rng: dict[int, RngState] = {r: seeded_rng_state(stream_seed(seed, r), device) for r in layout.hosted}
        self.running: int | None = None  # the hosted logical rank whose code runs now (``as_rank``)
        self.commands = 0
        self.leading = False  # rank 0 is inside a zero-mode fn
        # Zero mode: the outputs hosted here by handle; on rank 0 also the caller's copies,
        # their logical ranks and the handles of copies the caller dropped (sent with the next command).
        self.outputs: dict[int, tuple[int, torch.Tensor]] = {}
        self.proxies: dict[int, weakref.ref[torch.Tensor]] = {}
        self.owners: dict[int, int] = {}
        self.dropped: list[int] = []
        self.next_handle = 0

    @property
    def hosted(self) -> range:
        return self.layout.hosted

    @property
    def logical_dp(self) -> int:
        return self.layout.logical_dp

    @property
    def leader(self) -> bool:
        return self.comm.rank == 0

    def all_streams(self, label: str) -> dict[int, RngState]:
        """Every logical rank's RNG stream, gathered from the processes that host them, on every process."""
        streams: dict[int, RngState] = {}
        for part in self.comm.exchange(dict(self.rng), label):
            streams.update(part)
        return streams

    def take_streams(self, streams: dict[int, RngState]) -> None:
        """The hosted logical ranks continue from their streams in ``streams`` (NOTE [Resume] Rule 5)."""
        self.rng = {rank: streams[rank] for rank in self.layout.hosted}

    @contextmanager
    def as_rank(self, logical_rank: int) -> Iterator[None]:
        """Run the block as ``logical_rank``: on its own RNG stream (Rule 2), its forwards owned by it.

        The stream advances only if the block returns; the caller restores its own RNG.
        """
        set_rng_state(self.rng[logical_rank], self.device)
        self.running = logical_rank
        try:
            yield
            self.rng[logical_rank] = rng_state(self.device)
        finally:
            self.running = None

    def holds_outputs(self) -> bool:
        return bool(self.outputs or self.proxies)

    def label(self, command: str) -> str:
        self.commands += 1
        return f"{command} (#{self.commands})"

    def check_caller(self, call: str) -> None:
        """``trainer.<call>()`` runs on every process, from its own code: not in ``fn``, not in a zero-mode ``fn``."""
        if current_fiber() is not None:
            allowed = _INSIDE_FN.get(call, "a call after run_logical returns, once per process")
            raise ConfigError(call, "a call inside run_logical's fn", allowed)
        if self.leading:
            raise ConfigError(call, f"trainer.{call}() inside a zero-mode fn", f"zero.{call}(), which runs it on every process")

    def agree(self, error: Exception | None, label: str) -> None:
        """Every process raises the lowest failing process's error, or none does (Rule 6)."""
        self.comm.agree(error, label)

    def sum_buffers(self, buffers: dict[int, BufferGradSink], checkpoints: list[Checkpoint]) -> SummedGradients:
        """Every logical rank's buffers of ``checkpoints``, summed in logical order on every process (Rules 4-5)."""
        names = [c.name for c in checkpoints]
        local = {
            rank: {name: ({k[1] for k in buffer.grads if k[0] == name}, set(buffer.origins.get(name, ()))) for name in names}
            for rank, buffer in buffers.items()
        }
        meta: dict[int, dict] = {}
        for part in self.comm.exchange(local, "optim_step: logical gradients"):
            meta.update(part)
        every = range(self.layout.logical_dp)
        origins = {name: set().union(*(meta[rank][name][1] for rank in every)) for name in names}
        entries = [
            (checkpoint.name, pname, param, present)
            for checkpoint in checkpoints
            for pname, param in checkpoint.named_parameters()
            if (present := [rank for rank in every if pname in meta[rank][checkpoint.name][0]])
        ]
        totals = []
        for bucket in _buckets(entries):
            rows = []
            for rank in self.layout.hosted:
                grads = buffers[rank].grads
                rows.append(torch.cat([_or_zeros(grads.get((c, n)), p).reshape(-1) for c, n, p, _ in bucket]))
            mine = torch.stack(rows)  # (L/W, bucket numel)
            everyone = self.comm.all_gather(mine, f"optim_step: logical gradients of {len(bucket)} parameters")  # (L, numel)
            offset = 0
            for name, pname, param, present in bucket:
                parts = [everyone[rank, offset : offset + param.numel()].view_as(param) for rank in present]
                totals.append((name, pname, ordered_sum(parts).to(param.device)))
                offset += param.numel()
        return SummedGradients(totals=totals, origins={n: o for n, o in origins.items() if o})


def _buckets(entries: list[tuple]) -> list[list[tuple]]:
    """Consecutive parameters of one dtype, up to ``BUCKET_NUMEL`` elements each: one collective per bucket."""
    buckets: list[list[tuple]] = []
    numel = 0
    for entry in entries:
        param = entry[2]
        if not buckets or buckets[-1][0][2].dtype != param.dtype or numel + param.numel() > BUCKET_NUMEL:
            buckets.append([])
            numel = 0
        buckets[-1].append(entry)
        numel += param.numel()
    return [b for b in buckets if b]


def _or_zeros(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor:
    """``grad``, or zeros shaped like ``param`` where this logical rank holds none (made only then)."""
    return grad if grad is not None else torch.zeros_like(param)
