"""What a trainer keeps for its logical ranks between ``run_logical`` calls.

:class:`LogicalState` is the trainer's ``RankHost`` (``sinks.py``): it lives
on the trainer (``trainer.rank_gradients.host``), not in any registry here,
and holds the layout, the transport, each hosted logical rank's RNG stream
and which of them runs now (NOTE [Logical ranks] Rule 2, in
``ranks/__init__.py``: :meth:`LogicalState.as_rank`) and the zero-mode
outputs (Rule 7). The gradient buffers themselves live in the trainer's
``RankGradients`` sink, which hands every commit to :attr:`LogicalState.sums`
(``reduction.py``) to be folded in the tree order of Rule 4;
:meth:`LogicalState.sum_buffers` gives ``optim_step`` the sums (Rule 5).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..checkpoints import Checkpoint
from ..errors import ConfigError
from ..peers import Comm
from ..rng import RngState, rng_state, seeded_rng_state, set_rng_state, stream_seed
from ..sinks import BufferGradSink, SummedGradients
from .fibers import current_fiber
from .layout import LogicalLayout
from .reduction import LogicalSums

__all__ = ["LogicalState"]


# What fn calls instead of a trainer method that must not run on one logical rank's behalf.
_INSIDE_FN = {"backward": "view.backward(loss), which commits into this logical rank's buffer"}


class LogicalState:
    """A trainer's logical layout, transport, RNG streams and zero-mode outputs."""

    def __init__(self, layout: LogicalLayout, comm: Comm, seed: int, device: torch.device) -> None:
        self.layout = layout
        self.comm = comm
        self.device = device
        self.sums = LogicalSums(layout, comm, device)  # Rule 4: what every logical rank committed, folded
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

    def exchange(self, obj: Any, label: str) -> list[Any]:
        """Every process's ``obj``, by physical rank, on every process (a save's kept versions, NOTE [Resume] Rule 5)."""
        return self.comm.exchange(obj, label)

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
            raise ConfigError(
                call, f"trainer.{call}() inside a zero-mode fn", f"zero.{call}(), which runs it on every process"
            )

    def agree(self, error: Exception | None, label: str) -> None:
        """Every process raises the lowest failing process's error, or none does (Rule 6)."""
        self.comm.agree(error, label)

    def sum_buffers(self, buffers: dict[int, BufferGradSink], checkpoints: list[Checkpoint]) -> SummedGradients:
        """The running logical-rank sums of ``checkpoints`` and every logical rank's origins, on every process (Rules 4-5)."""
        names = [c.name for c in checkpoints]
        local = {rank: {name: set(buffer.origins.get(name, ())) for name in names} for rank, buffer in buffers.items()}
        meta: dict[int, dict[str, set[Any]]] = {}
        for part in self.comm.exchange(local, "optim_step: logical origins"):
            meta.update(part)
        origins = {name: set().union(*(meta[rank][name] for rank in range(self.layout.logical_dp))) for name in names}
        keys = [(c.name, pname) for c in checkpoints for pname, _ in c.named_parameters()]
        totals = [(name, pname, total) for (name, pname), total in self.sums.finish(keys, "optim_step")]
        return SummedGradients(totals=totals, origins={n: o for n, o in origins.items() if o})
