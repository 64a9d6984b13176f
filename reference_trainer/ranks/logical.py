"""The entry points of logical data parallelism: ``run_logical``, the rank-mode view, ``logical_gradients``.

The rules are NOTE [Logical ranks] in ``ranks/__init__.py``; Rules 2
(fibers), 3 (rounds) and 5 (gradients) are what this module wires up: the
trainer's logical-rank state lives on the trainer itself
(``trainer.rank_gradients``), so there is no registry of trainers here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, PeerError
from ..peers import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_TIMEOUT_S, Comm, TrafficCount, timeout_seconds
from ..trainer import BackwardReport, Trainer
from .fibers import Fiber, FiberCoordinator, Request, current_fiber
from .layout import LogicalLayout
from .rounds import drive
from .state import LogicalState
from .zero import ZeroSession

__all__ = ["LogicalRank", "logical_gradients", "logical_traffic", "run_logical"]


def _state_for(trainer: Trainer, logical_dp: int, timeout_s: float, idle_timeout_s: float) -> LogicalState:
    """The trainer's logical-rank state for this layout: kept between calls, replaced only when nothing is pending."""
    world = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    layout = LogicalLayout(logical_dp, *world)
    sink = trainer.rank_gradients
    current = sink.host
    if isinstance(current, LogicalState) and current.layout == layout:
        current.comm.timeout_s, current.comm.idle_timeout_s = timeout_s, idle_timeout_s
        return current
    if isinstance(current, LogicalState) and (current.holds_outputs() or sink.pending()):
        raise ConfigError(
            "logical_dp",
            logical_dp,
            f"{current.layout.logical_dp}, the layout of this trainer's pending logical gradients or outputs",
            hint="call optim_step or zero_grad and drop zero-mode outputs before changing it",
        )
    comm = Comm(timeout_s, idle_timeout_s, trainer.device)
    seed = comm.exchange(torch.initial_seed(), "run_logical: layout")[0]
    state = LogicalState(layout, comm, seed, trainer.device)
    sink.attach(state)
    return state


def logical_gradients(trainer: Trainer) -> dict[tuple[str, str], torch.Tensor]:
    """Copies of this process's shards of the logical-rank sums pending since the last ``optim_step``.

    Keys are ``(checkpoint, parameter)``; each value is 1-D, shard ``p`` of
    ``W`` of the flattened sum over every logical rank (``torch.tensor_split``
    of it; the whole sum on one process), NOTE [Logical ranks] Rule 4. Empty
    when nothing is pending or the trainer never ran logical ranks. For
    inspection and tests; ``optim_step`` consumes them.
    """
    host = trainer.rank_gradients.host
    if not isinstance(host, LogicalState):
        return {}
    return {key: total.detach().clone() for key, total in host.sums.totals.items()}


def logical_traffic(trainer: Trainer) -> dict[str, TrafficCount]:
    """What this process's logical ranks sent and received so far, by collective (copies; control included).

    Bytes are logical (each peer's payload, whatever the backend's algorithm);
    ``"control"`` counts the pickled control messages. Empty on one process.
    """
    host = trainer.rank_gradients.host
    if not isinstance(host, LogicalState):
        return {}
    return {kind: dataclasses.replace(count) for kind, count in host.comm.traffic.items()}


# --- rank mode -------------------------------------------------------------------------


class LogicalRank:
    """What ``fn`` gets in rank mode: one logical rank's forward, backward and reductions."""

    def __init__(self, state: LogicalState, trainer: Trainer, logical_rank: int) -> None:
        self._state = state
        self.trainer = trainer
        self.logical_rank = logical_rank
        self.logical_world_size = state.layout.logical_dp

    def _fiber(self, call: str) -> Fiber:
        fiber = current_fiber()
        if fiber is None or fiber.logical_rank != self.logical_rank:
            raise ConfigError(
                call,
                "a call outside this logical rank's fn",
                f"a call from fn(view) of logical rank {self.logical_rank}",
            )
        return fiber

    def forward(self, inputs: Any, *, checkpoint: Any = None, options: Any = None) -> Any:
        """``Trainer.forward`` on this logical rank (its own RNG stream)."""
        self._fiber("forward")
        return self.trainer.forward(inputs, checkpoint=checkpoint, options=options)

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> BackwardReport:
        """``Trainer.backward`` into this logical rank's buffer; every logical rank commits or none (Rule 5)."""
        self._fiber("backward")
        sink = self.trainer.rank_gradients.buffers[self.logical_rank]
        return self.trainer.backward(loss, retain_graph=retain_graph, sink=sink, coordinator=FiberCoordinator())

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of ``tensor`` over every logical rank, in logical order (Rule 4); not differentiable."""
        fiber = self._fiber("reduce")
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError("reduce", type(tensor).__name__, "a tensor")
        if tensor.dtype == torch.bool:
            tensor = tensor.long()
        total: torch.Tensor = fiber.pause(Request("reduce", tensor=tensor))
        return total

    def global_token_count(self, mask: torch.Tensor | Sequence[torch.Tensor]) -> int:
        """Non-zero entries of ``mask`` summed over every logical rank: normalise losses by this, never per process."""
        masks = [mask] if isinstance(mask, torch.Tensor) else list(mask)
        local = sum(int(torch.count_nonzero(m)) for m in masks)
        return int(self.reduce(torch.tensor(local, dtype=torch.int64)))


def run_logical(
    fn: Callable[[Any], Any],
    trainer: Trainer,
    *,
    mode: str = "rank",
    logical_dp: int,
    timeout_s: float | None = None,
    idle_timeout_s: float | None = None,
) -> Any:
    """Run ``fn`` over ``logical_dp`` logical ranks; call it on every process (NOTE [Logical ranks]).

    ``mode="rank"``: ``fn(view)`` runs once per hosted logical rank (a
    :class:`LogicalRank`); returns their results, in logical order.
    ``mode="zero"``: ``fn(zero)`` runs once, on global rank 0 (a
    :class:`RankZero`), and returns its result there; other processes serve
    its commands and return ``None``. Afterwards call ``trainer.optim_step()``
    on every process. ``timeout_s`` bounds each collective step
    (``RT_DIST_TIMEOUT_S``, default 300); ``idle_timeout_s`` bounds how long a
    zero-mode server waits for rank 0's next command (``RT_DIST_IDLE_TIMEOUT_S``,
    default 3600).
    """
    if current_fiber() is not None or ZeroSession.leading_here():
        raise ConfigError("run_logical", "a call inside run_logical's fn", "a call from the process's own code")
    if mode not in ("rank", "zero"):
        raise ConfigError("mode", mode, "'rank' or 'zero'")
    if not callable(fn):
        raise ConfigError("fn", type(fn).__name__, "a callable taking the logical view")
    if not isinstance(trainer, Trainer):
        raise ConfigError("trainer", type(trainer).__name__, "a Trainer")
    timeout = timeout_seconds(timeout_s, "RT_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)
    idle = timeout_seconds(idle_timeout_s, "RT_DIST_IDLE_TIMEOUT_S", DEFAULT_IDLE_TIMEOUT_S)
    state = _state_for(trainer, logical_dp, timeout, idle)
    label = state.label(f"run_logical(mode={mode!r})")
    calls = state.comm.exchange((mode, logical_dp), label)
    if len(set(calls)) > 1:
        raise PeerError(f"{label}: processes called run_logical differently: {calls} by physical rank", command=label)
    if mode == "rank":
        bodies = {rank: (lambda rank=rank: fn(LogicalRank(state, trainer, rank))) for rank in state.layout.hosted}
        return drive(state, label, bodies)
    session = ZeroSession(state, trainer)
    if state.comm.rank != 0:
        return session.serve(label)
    return session.lead(fn)
