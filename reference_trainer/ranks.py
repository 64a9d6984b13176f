"""Logical data parallelism: L logical ranks over W processes, in rank mode and zero mode.

This module holds the entry points (``run_logical``, the rank-mode view
:class:`LogicalRank`, ``logical_gradients``) and the optimizer hooks that sum
the logical ranks' gradient buffers; each rule below names the module that
holds the rest.

NOTE [Logical ranks]
  1. Layout (``layout.py``): ``logical_dp = L`` logical ranks over the ``W``
     processes of the default process group (none: ``W = 1``),
     ``L % W == 0``. Physical rank ``p`` hosts the consecutive logical ranks
     ``p*L/W ... (p+1)*L/W - 1``.
  2. Fibers (``fibers.py``): each hosted logical rank's code runs on its own
     thread, but only while it holds the process's baton, so hosted ranks
     run one at a time in logical order between collective points. Each
     draws from its own RNG stream (seeded by rank 0's seed and the logical
     rank), so what a logical rank computes does not depend on which process
     hosts it. A view's outputs belong to its logical rank: backpropagate
     them through the view of that logical rank (in a later ``run_logical``
     call if need be).
  3. Rounds (``fibers.py``): at a collective point (``reduce``, a backward's
     agreement, the end of ``fn``) every process runs its fibers to their
     next point, then all processes exchange what each logical rank asked
     for and act together. Different requests in one round (one logical rank
     reduces while another returned) fail every logical rank.
  4. Fixed order (``layout.ordered_sum``): a sum over logical ranks gathers
     every logical rank's contribution to every process and adds them left
     to right in logical-rank order, ``((x0 + x1) + x2) + ...``, so the bits
     do not depend on ``W``. What is bitwise equal, then: the same job for
     every ``W`` dividing ``L``; and zero mode, rank mode (per-rank losses
     summing to the global one) and a plain ``Trainer`` that makes one
     forward call per logical rank's chunk, in logical order, and one
     backward of the global loss per optimizer step. With k backwards per
     step the plain trainer associates ``sum_b (sum_r g[b][r])`` and logical
     ranks ``sum_r (sum_b g[b][r])``: equal in exact arithmetic only.
  5. Gradients (here): in a logical mode a backward commits into its logical
     rank's own buffer (NOTE [Gradient commit] Rule 5) and agrees with every
     other logical rank (Rule 6): all commit or none. ``optim_step``, called
     on every process, validates every buffered origin, then sums the
     buffers into ``.grad`` by Rule 4 (added to an existing ``.grad``) and
     steps, the same everywhere; ``zero_grad`` clears the buffers.
  6. Errors (``peers.py`` carries them; ``fibers.py`` and ``zero.py`` pick
     the common one): the lowest logical rank's own error (not one it
     received from a peer) is the common error; every process raises it: the
     original object where it happened, elsewhere the same type rebuilt from
     its args and attributes. A process that dies, hangs past ``timeout_s``
     or diverges makes the others raise ``PeerError`` naming it and the
     command; the job cannot go on after that.
  7. Zero mode (``zero.py``): global rank 0 runs ``fn(zero)``; the other
     processes serve its commands. ``forward`` spreads inputs over logical
     ranks in contiguous chunks, in source order; rank 0 gets leaf copies of
     every output. ``backward`` computes every output's cotangent on rank 0
     and each logical rank backpropagates ``sum((leaf * cotangent).sum())``
     over its outputs, whose cotangents are then exactly the sent ones: the
     gradient is bitwise that of the direct path. A copy rank 0 drops frees
     the hosted output (and its graph) at the next command, before it runs.
     A command's error is raised on every process; rank 0's ``fn`` may catch
     it and go on, and the servers follow.
  8. Transport (``peers.py``): control messages go through rank 0 (a star),
     so a silent peer is named; tensors travel by collectives (gloo on CPU,
     NCCL on GPU). A data collective starts only when every process has
     received the command that needs it or has reported success in a
     control exchange, so a local failure never leaves a peer waiting in a
     collective.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .commit import LiveGradSink
from .errors import ConfigError, PeerError
from .fibers import _current_fiber, _drive, _Fiber, _FiberCoordinator, _LogicalState, _Request
from .layout import LogicalLayout, ordered_sum, spread
from .peers import _DEFAULT_IDLE_TIMEOUT_S, _DEFAULT_TIMEOUT_S, _Comm, _timeout, init_distributed
from .peers import _Failure as _Failure  # re-exported: the tests rebuild errors through it
from .staleness import check_age
from .trainer import BackwardReport, Trainer
from .zero import RankZero, _ZeroSession

__all__ = [
    "LogicalLayout",
    "LogicalRank",
    "PeerError",
    "RankZero",
    "init_distributed",
    "logical_gradients",
    "ordered_sum",
    "run_logical",
    "spread",
]

_BUCKET_NUMEL = 1 << 24  # elements per gradient gather: bounds the L/W-fold staging copy


# --- per-trainer state ---------------------------------------------------------------

_STATES: weakref.WeakKeyDictionary[Trainer, _LogicalState] = weakref.WeakKeyDictionary()


def _state_for(trainer: Trainer, logical_dp: int, timeout_s: float, idle_timeout_s: float) -> _LogicalState:
    world = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    layout = LogicalLayout(logical_dp, *world)
    state = _STATES.get(trainer)
    if state is not None and state.layout == layout:
        state.comm.timeout_s, state.comm.idle_timeout_s = timeout_s, idle_timeout_s
        return state
    if state is not None and state.busy():
        raise ConfigError(
            "logical_dp",
            logical_dp,
            f"{state.layout.logical_dp}, the layout of this trainer's pending logical gradients or outputs",
            hint="call optim_step or zero_grad and drop zero-mode outputs before changing it",
        )
    comm = _Comm(timeout_s, idle_timeout_s)
    seed = comm.exchange(torch.initial_seed(), "run_logical: layout")[0]
    state = _LogicalState(layout, comm, seed, trainer.device)
    _STATES[trainer] = state
    if _flush_buffers not in trainer.before_step_hooks:
        trainer.before_step_hooks.append(_flush_buffers)
        trainer.zero_grad_hooks.append(_clear_buffers)
    return state


def logical_gradients(trainer: Trainer) -> dict[int, dict[tuple[str, str], torch.Tensor]]:
    """Copies of the uncommitted gradient buffers of the logical ranks hosted here, by logical rank.

    Keys are ``(checkpoint, parameter)``. Empty when the trainer never ran
    logical ranks. For inspection and tests; ``optim_step`` consumes them.
    """
    state = _STATES.get(trainer)
    if state is None:
        return {}
    return {lr: {k: v.detach().clone() for k, v in sink.grads.items()} for lr, sink in state.buffers.items()}


# --- optimizer hooks (Rule 5) --------------------------------------------------------


def _outside_fibers(state: _LogicalState, call: str) -> None:
    if _current_fiber() is not None:
        raise ConfigError(call, "a call inside run_logical's fn", "a call after run_logical returns, once per process")
    if state.leading:
        raise ConfigError(call, f"trainer.{call}() inside a zero-mode fn", f"zero.{call}(), which runs it on every process")


def _flush_buffers(trainer: Trainer, names: list[str]) -> None:
    """Sum every logical rank's buffer into ``.grad`` in logical order, after validating every origin."""
    state = _STATES.get(trainer)
    if state is None:
        return
    _outside_fibers(state, "optim_step")
    layout, comm = state.layout, state.comm
    local = {
        lr: {name: ({k[1] for k in sink.grads if k[0] == name}, set(sink.origins.get(name, ()))) for name in names}
        for lr, sink in state.buffers.items()
    }
    meta: dict[int, dict] = {}
    for part in comm.exchange(local, "optim_step: logical gradients"):
        meta.update(part)
    origins = {name: set().union(*(meta[lr][name][1] for lr in range(layout.logical_dp))) for name in names}
    for name in names:  # the same check optim_step makes next, but before .grad changes
        for version, bound in sorted(origins[name], key=lambda o: o[0].revision):
            check_age(trainer.checkpoint(name), version, bound)
    entries = [
        (trainer.checkpoint(name), pname, param, present)
        for name in names
        for pname, param in trainer.checkpoint(name).named_parameters()
        if (present := [lr for lr in range(layout.logical_dp) if pname in meta[lr][name][0]])
    ]
    totals = []
    for bucket in _buckets(entries):
        rows = []
        for lr in layout.hosted:
            grads = state.buffers[lr].grads
            rows.append(torch.cat([grads.get((c.name, n), torch.zeros_like(p)).reshape(-1) for c, n, p, _ in bucket]))
        mine = torch.stack(rows)  # (L/W, bucket numel)
        everyone = comm.all_gather(mine, f"optim_step: logical gradients of {len(bucket)} parameters")  # (L, numel)
        offset = 0
        for checkpoint, pname, param, present in bucket:
            parts = [everyone[lr, offset : offset + param.numel()].view_as(param) for lr in present]
            totals.append((checkpoint, pname, ordered_sum(parts).to(param.device)))
            offset += param.numel()
    live = LiveGradSink()
    for checkpoint, pname, total in totals:
        old = live.current(checkpoint, pname)
        live.assign(checkpoint, pname, total if old is None else old + total)
    for name in names:
        live.record_origins(trainer.checkpoint(name), origins[name])
    for sink in state.buffers.values():
        for name in names:
            sink.clear(name)


def _buckets(entries: list[tuple]) -> list[list[tuple]]:
    """Consecutive parameters of one dtype, up to ``_BUCKET_NUMEL`` elements each: one collective per bucket."""
    buckets: list[list[tuple]] = []
    numel = 0
    for entry in entries:
        param = entry[2]
        if not buckets or buckets[-1][0][2].dtype != param.dtype or numel + param.numel() > _BUCKET_NUMEL:
            buckets.append([])
            numel = 0
        buckets[-1].append(entry)
        numel += param.numel()
    return [b for b in buckets if b]


def _clear_buffers(trainer: Trainer, names: list[str]) -> None:
    state = _STATES.get(trainer)
    if state is None:
        return
    _outside_fibers(state, "zero_grad")
    for sink in state.buffers.values():
        for name in names:
            sink.clear(name)


# --- rank mode -------------------------------------------------------------------------


class LogicalRank:
    """What ``fn`` gets in rank mode: one logical rank's forward, backward and reductions."""

    def __init__(self, state: _LogicalState, trainer: Trainer, logical_rank: int) -> None:
        self._state = state
        self.trainer = trainer
        self.logical_rank = logical_rank
        self.logical_world_size = state.layout.logical_dp

    def _fiber(self, call: str) -> _Fiber:
        fiber = _current_fiber()
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
        sink = self._state.buffers[self.logical_rank]
        return self.trainer.backward(loss, retain_graph=retain_graph, sink=sink, coordinator=_FiberCoordinator())

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of ``tensor`` over every logical rank, in logical order (Rule 4); not differentiable."""
        fiber = self._fiber("reduce")
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError("reduce", type(tensor).__name__, "a tensor")
        if tensor.dtype == torch.bool:
            tensor = tensor.long()
        return fiber.pause(_Request("reduce", tensor=tensor))

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
    if _current_fiber() is not None or any(s.leading for s in list(_STATES.values())):
        raise ConfigError("run_logical", "a call inside run_logical's fn", "a call from the process's own code")
    if mode not in ("rank", "zero"):
        raise ConfigError("mode", mode, "'rank' or 'zero'")
    if not callable(fn):
        raise ConfigError("fn", type(fn).__name__, "a callable taking the logical view")
    if not isinstance(trainer, Trainer):
        raise ConfigError("trainer", type(trainer).__name__, "a Trainer")
    timeout = _timeout(timeout_s, "RT_DIST_TIMEOUT_S", _DEFAULT_TIMEOUT_S)
    idle = _timeout(idle_timeout_s, "RT_DIST_IDLE_TIMEOUT_S", _DEFAULT_IDLE_TIMEOUT_S)
    state = _state_for(trainer, logical_dp, timeout, idle)
    label = state.label(f"run_logical(mode={mode!r})")
    calls = state.comm.exchange((mode, logical_dp), label)
    if len(set(calls)) > 1:
        raise PeerError(f"{label}: processes called run_logical differently: {calls} by physical rank", command=label)
    if mode == "rank":
        bodies = {lr: (lambda lr=lr: fn(LogicalRank(state, trainer, lr))) for lr in state.layout.hosted}
        return _drive(state, label, bodies)
    session = _ZeroSession(state, trainer)
    if state.comm.rank != 0:
        return session.serve(label)
    return session.lead(fn)

