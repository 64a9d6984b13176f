"""Logical data parallelism: L logical ranks over W processes, in rank mode and zero mode.

NOTE [Logical ranks]
  1. Layout: ``logical_dp = L`` logical ranks over the ``W`` processes of the
     default process group (none: ``W = 1``), ``L % W == 0``. Physical rank
     ``p`` hosts the consecutive logical ranks ``p*L/W ... (p+1)*L/W - 1``.
  2. Fibers: each hosted logical rank's code runs on its own thread, but only
     while it holds the process's baton, so hosted ranks run one at a time in
     logical order between collective points. Each draws from its own RNG
     stream (seeded by rank 0's seed and the logical rank), so what a logical
     rank computes does not depend on which process hosts it. A view's
     outputs belong to its logical rank: backpropagate them through the view
     of that logical rank (in a later ``run_logical`` call if need be).
  3. Rounds: at a collective point (``reduce``, a backward's agreement, the
     end of ``fn``) every process runs its fibers to their next point, then
     all processes exchange what each logical rank asked for and act
     together. Different requests in one round (one logical rank reduces
     while another returned) fail every logical rank.
  4. Fixed order: a sum over logical ranks gathers every logical rank's
     contribution to every process and adds them left to right in
     logical-rank order, ``((x0 + x1) + x2) + ...``, so the bits do not depend
     on ``W``. What is bitwise equal, then: the same job for every ``W``
     dividing ``L``; and zero mode, rank mode (per-rank losses summing to the
     global one) and a plain ``Trainer`` that makes one forward call per
     logical rank's chunk, in logical order, and one backward of the global
     loss per optimizer step. With k backwards per step the plain trainer
     associates ``sum_b (sum_r g[b][r])`` and logical ranks
     ``sum_r (sum_b g[b][r])``: equal in exact arithmetic only.
  5. Gradients: in a logical mode a backward commits into its logical rank's
     own buffer (NOTE [Gradient commit] Rule 5) and agrees with every other
     logical rank (Rule 6): all commit or none. ``optim_step``, called on
     every process, validates every buffered origin, then sums the buffers
     into ``.grad`` by Rule 4 (added to an existing ``.grad``) and steps, the
     same everywhere; ``zero_grad`` clears the buffers.
  6. Errors: the lowest logical rank's own error (not one it received from a
     peer) is the common error; every process raises it: the original object
     where it happened, elsewhere the same type rebuilt from its args and
     attributes. A process that dies, hangs past ``timeout_s`` or diverges
     makes the others raise ``PeerError`` naming it and the command; the job
     cannot go on after that.
  7. Zero mode: global rank 0 runs ``fn(zero)``; the other processes serve
     its commands. ``forward`` spreads inputs over logical ranks in
     contiguous chunks, in source order; rank 0 gets leaf copies of every
     output. ``backward`` computes every output's cotangent on rank 0 and
     each logical rank backpropagates ``sum((leaf * cotangent).sum())`` over
     its outputs, whose cotangents are then exactly the sent ones: the
     gradient is bitwise that of the direct path. A copy rank 0 drops frees
     the hosted output (and its graph) at the next command, before it runs.
     A command's error is raised on every process; rank 0's ``fn`` may catch
     it and go on, and the servers follow.
  8. Control messages go through rank 0 (a star), so a silent peer is named;
     tensors travel by collectives (gloo on CPU, NCCL on GPU). A data
     collective starts only when every process has received the command that
     needs it or has reported success in a control exchange, so a local
     failure never leaves a peer waiting in a collective.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import os
import pickle
import threading
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .commit import BufferGradSink, LiveGradSink
from .errors import ConfigError, GradientCommitError, TrainerError
from .graphs import ForwardInput, ForwardOutput, flatten_inputs
from .staleness import check_age
from .trainer import BackwardReport, StepReport, Trainer

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

_DEFAULT_TIMEOUT_S = 300.0
_DEFAULT_IDLE_TIMEOUT_S = 3600.0
_BUCKET_NUMEL = 1 << 24  # elements per gradient gather: bounds the L/W-fold staging copy


class PeerError(TrainerError):
    """Another process or logical rank did not take part in a collective step.

    It died, hung past the timeout, made different calls (logical ranks must
    call ``reduce`` and ``backward`` the same number of times, in the same
    order), or failed while this one waited. ``command`` names the step and
    ``peer`` the physical rank (``None`` when unknown). After a dead or silent
    peer the process group is unusable: read that peer's log and restart.
    """

    def __init__(self, message: str, *, command: str, peer: int | None = None) -> None:
        self.command = command
        self.peer = peer
        super().__init__(message)


# --- layout (Rule 1) -----------------------------------------------------------------


@dataclass(frozen=True)
class LogicalLayout:
    """Which logical ranks physical rank ``rank`` of ``world_size`` hosts (Rule 1)."""

    logical_dp: int
    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("logical_dp", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
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


def init_distributed(backend: str | None = None, *, timeout_s: float | None = None) -> tuple[int, int]:
    """Join the job a launcher (``torchrun``) describes in the environment; return ``(rank, world_size)``.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (env://);
    gloo on CPU, NCCL when CUDA is available. Without a launcher (no ``RANK``)
    it does nothing and returns ``(0, 1)``: one process hosts every logical rank.
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            return 0, 1
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(seconds=_timeout(timeout_s, "RT_DIST_TIMEOUT_S", _DEFAULT_TIMEOUT_S))
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _timeout(value: float | None, env: str, default: float) -> float:
    value = float(os.environ.get(env, default)) if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError("timeout_s", value, "None or a number of seconds > 0")
    return float(value)


# --- errors across processes (Rule 6) ------------------------------------------------


def _picklable(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class _Failure:
    """Enough of an exception to raise the same type on another process."""

    module: str
    qualname: str
    args: tuple
    attrs: dict
    text: str
    where: str
    logical_rank: int | None
    traceback: str
    from_peer: bool

    @classmethod
    def of(cls, exc: BaseException, where: str, logical_rank: int | None = None) -> _Failure:
        attrs = {k: v for k, v in vars(exc).items() if not k.startswith("_rt_") and _picklable(v)}
        return cls(
            type(exc).__module__,
            type(exc).__qualname__,
            exc.args if _picklable(exc.args) else (str(exc),),
            attrs,
            str(exc),
            where,
            logical_rank,
            "".join(traceback.format_exception(exc)),
            bool(getattr(exc, "_rt_from_peer", False)),
        )

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    def rebuild(self) -> BaseException:
        try:
            cls: Any = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                cls = getattr(cls, part)
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise TypeError(cls)
            # The constructor may take other arguments than ``args``; never call it.
            exc = cls.__new__(cls, *self.args)
            exc.args = self.args
            vars(exc).update(self.attrs)
        except Exception:
            exc = PeerError(f"{self.where} raised {self.qualname}: {self.text}", command="?")
        exc._rt_from_peer = self.from_peer
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised on {self.where}; its traceback there:\n{self.traceback}")
        return exc


def _from_peer(exc: BaseException) -> BaseException:
    exc._rt_from_peer = True
    return exc


# --- transport (Rule 8) --------------------------------------------------------------


@dataclass(frozen=True)
class _Abort:
    failure: _Failure


class _Comm:
    """Objects through rank 0 (a silent peer is named), tensors through collectives."""

    def __init__(self, timeout_s: float, idle_timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.device = torch.device("cpu")
        if self.distributed:
            if "nccl" in str(dist.get_backend()):
                self.device = torch.device("cuda", torch.cuda.current_device())
            # A gloo group of its own: control messages never interleave with data collectives.
            timeout = datetime.timedelta(seconds=max(timeout_s, idle_timeout_s))
            self.control = dist.new_group(backend="gloo", timeout=timeout)

    # objects ---------------------------------------------------------------------------

    def exchange(self, obj: Any, label: str) -> list[Any]:
        """Every process's ``obj``, by physical rank; raises ``PeerError`` if a peer does not answer in kind."""
        if not self.distributed:
            return [obj]
        if self.rank != 0:
            self._send((label, obj), 0, label)
            return self._expect(0, label, self.timeout_s)
        # Hear every peer out even after one failed: a live peer blocks in its send until
        # rank 0 receives it, and only then can it take the abort.
        parts, dead, failure = [obj], set(), None
        for peer in range(1, self.world_size):
            try:
                their_label, value = self._recv(peer, label, self.timeout_s)
            except PeerError as exc:
                dead.add(peer)
                failure = failure or exc
                continue
            if their_label != label and failure is None:
                failure = PeerError(
                    f"{label}: physical rank {peer} is at {their_label!r}, expected {label!r}; every "
                    "process must make the same calls in the same order",
                    command=label,
                    peer=peer,
                )
            parts.append(value)
        if failure is not None:
            self._abort(failure, skip=dead)
            raise failure
        self._fan_out((label, parts), label)
        return parts

    def broadcast_command(self, header: dict) -> None:
        """Rank 0 sends a zero-mode command to every other process."""
        self._fan_out((header["label"], header), header["label"])

    def next_command(self, after: str) -> dict:
        label = f"waiting for rank 0's next command (after {after})"
        return self._expect(0, label, self.idle_timeout_s, any_label=True)

    def _fan_out(self, message: Any, label: str) -> None:
        for peer in range(1, self.world_size):
            try:
                self._send(message, peer, label)
            except PeerError as exc:
                self._abort(exc, skip={peer})
                raise

    def _expect(self, peer: int, label: str, timeout_s: float, any_label: bool = False) -> Any:
        their_label, value = self._recv(peer, label, timeout_s)
        if their_label == "abort":
            raise value.failure.rebuild()
        if not any_label and their_label != label:
            raise PeerError(
                f"{label}: physical rank {peer} sent {their_label!r}, expected {label!r}; every process "
                "must make the same calls in the same order",
                command=label,
                peer=peer,
            )
        return value

    def _abort(self, exc: PeerError, skip: set[int]) -> None:
        """Rank 0 tells every live peer why the job stops, so none waits for a dead one."""
        failure = _Failure.of(exc, f"physical rank {self.rank}")
        for peer in range(1, self.world_size):
            if peer not in skip:
                try:
                    self._send(("abort", _Abort(failure)), peer, exc.command, timeout_s=min(self.timeout_s, 5.0))
                except PeerError:
                    pass

    def _send(self, obj: Any, peer: int, label: str, timeout_s: float | None = None) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        timeout_s = timeout_s or self.timeout_s
        try:
            for tensor in (size, data):
                dist.isend(tensor, peer, group=self.control).wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise PeerError(
                f"{label}: could not send to physical rank {peer} within {timeout_s:g} s; it died or "
                f"hung (check its log): {exc}",
                command=label,
                peer=peer,
            ) from exc

    def _recv(self, peer: int, label: str, timeout_s: float) -> Any:
        size = torch.zeros(1, dtype=torch.int64)
        try:
            dist.irecv(size, peer, group=self.control).wait(datetime.timedelta(seconds=timeout_s))
            data = torch.empty(int(size), dtype=torch.uint8)
            dist.irecv(data, peer, group=self.control).wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise PeerError(
                f"{label}: lost physical rank {peer} (its connection closed, or no answer within "
                f"{timeout_s:g} s): it died, hung or ran other code; check its log. {exc}",
                command=label,
                peer=peer,
            ) from exc
        return pickle.loads(data.numpy().tobytes())

    # tensors -----------------------------------------------------------------------------

    def all_gather(self, local: torch.Tensor, label: str) -> torch.Tensor:
        """``(k, ...)`` on every process -> ``(W*k, ...)`` in physical-rank order, on every process."""
        if not self.distributed:
            return local
        local = local.to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self._wait(dist.all_gather(parts, local, async_op=True), label)
        return torch.cat(parts)

    def broadcast(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """Rank 0's ``tensor`` on every process (others pass a buffer of the right shape)."""
        if not self.distributed:
            return tensor
        tensor = tensor.to(self.device).contiguous()
        self._wait(dist.broadcast(tensor, 0, async_op=True), label)
        return tensor

    def gather(self, local: torch.Tensor, sizes: list[int], label: str) -> list[torch.Tensor] | None:
        """Each process's 1-D ``local`` (``sizes[p]`` elements) on rank 0, by physical rank."""
        if not self.distributed:
            return [local]
        width = max(max(sizes), 1)
        padded = torch.zeros(width, dtype=local.dtype, device=self.device)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in sizes] if self.rank == 0 else None
        self._wait(dist.gather(padded, parts, dst=0, async_op=True), label)
        return None if parts is None else [part[:size] for part, size in zip(parts, sizes)]

    def _wait(self, work: Any, label: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            others = [r for r in range(self.world_size) if r != self.rank]
            peer = others[0] if len(others) == 1 else None
            raise PeerError(
                f"{label}: a collective with physical ranks {others} failed within {self.timeout_s:g} s; "
                f"a peer died or hung (check their logs): {exc}",
                command=label,
                peer=peer,
            ) from exc


# --- per-trainer state ---------------------------------------------------------------


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _seeded_state(seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The RNG state ``manual_seed(seed)`` would give, without touching the live generators."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    if device.type != "cuda":
        return cpu, None
    return cpu, torch.Generator(device=device).manual_seed(seed).get_state()


def _stream_seed(seed: int, logical_rank: int) -> int:
    digest = hashlib.sha256(f"{seed}/{logical_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class _LogicalState:
    """A trainer's logical layout, transport, gradient buffers, RNG streams and zero-mode outputs."""

    def __init__(self, layout: LogicalLayout, comm: _Comm, seed: int, device: torch.device) -> None:
        self.layout = layout
        self.comm = comm
        self.device = device
        self.buffers = {lr: BufferGradSink() for lr in layout.hosted}
        self.rng = {lr: _seeded_state(_stream_seed(seed, lr), device) for lr in layout.hosted}
        self.commands = 0
        self.leading = False  # rank 0 is inside a zero-mode fn
        # Zero mode: the outputs hosted here by handle; on rank 0 also the caller's copies,
        # their logical ranks and the handles of copies the caller dropped (sent with the next command).
        self.outputs: dict[int, tuple[int, torch.Tensor]] = {}
        self.proxies: dict[int, weakref.ref[torch.Tensor]] = {}
        self.owners: dict[int, int] = {}
        self.dropped: list[int] = []
        self.next_handle = 0

    def busy(self) -> bool:
        return bool(self.outputs or self.proxies) or any(b.grads for b in self.buffers.values())

    def label(self, command: str) -> str:
        self.commands += 1
        return f"{command} (#{self.commands})"


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


# --- fibers and rounds (Rules 2-3) ---------------------------------------------------

_thread = threading.local()


def _current_fiber() -> _Fiber | None:
    return getattr(_thread, "fiber", None)


@dataclass
class _Raise:
    error: BaseException


@dataclass
class _Request:
    kind: str  # "reduce" | "agree"
    tensor: torch.Tensor | None = None
    error: BaseException | None = None


class _Fiber:
    """A logical rank's code on a thread that runs only between ``step`` and its next ``pause``."""

    def __init__(self, logical_rank: int, body: Callable[[], Any]) -> None:
        self.logical_rank = logical_rank
        self.body = body
        self.request: _Request | None = None
        self.reply: Any = None
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._run = threading.Semaphore(0)
        self._paused = threading.Semaphore(0)
        self._grad_enabled = torch.is_grad_enabled()
        self._thread = threading.Thread(target=self._main, name=f"logical-rank-{logical_rank}", daemon=True)
        self._started = False

    def _main(self) -> None:
        self._run.acquire()
        _thread.fiber = self
        try:
            with torch.set_grad_enabled(self._grad_enabled):
                self.result = self.body()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done = True
            self.request = None
            self._paused.release()

    def step(self, reply: Any = None) -> None:
        """Give this fiber the baton until it pauses or finishes (main thread)."""
        self.reply = reply
        if not self._started:
            self._started = True
            self._thread.start()
        self._run.release()
        self._paused.acquire()
        if self.done:
            self._thread.join()

    def pause(self, request: _Request) -> Any:
        """Hand the baton back with ``request``; return the round's reply (fiber thread)."""
        self.request = request
        self._paused.release()
        self._run.acquire()
        self.request = None
        reply, self.reply = self.reply, None
        if isinstance(reply, _Raise):
            raise reply.error
        return reply


@dataclass(frozen=True)
class _Status:
    logical_rank: int
    kind: str  # "reduce" | "agree" | "done" | "error"
    detail: Any = None


class _FiberCoordinator:
    """The trainer's ``Coordinator`` for one logical rank: agreement is a round (Rule 3)."""

    def agree(self, error: BaseException | None) -> None:
        fiber = _current_fiber()
        assert fiber is not None, "logical-rank backward outside its fiber"
        fiber.pause(_Request("agree", error=error))


def _where(state: _LogicalState, logical_rank: int) -> str:
    return f"logical rank {logical_rank} (physical rank {state.layout.rank})"


def _status(state: _LogicalState, fiber: _Fiber, share: bool) -> _Status:
    lr = fiber.logical_rank
    if fiber.done:
        if fiber.error is not None:
            return _Status(lr, "error", _Failure.of(fiber.error, _where(state, lr), lr))
        return _Status(lr, "done", fiber.result if share else None)
    request = fiber.request
    if request.kind == "reduce":
        return _Status(lr, "reduce", (tuple(request.tensor.shape), str(request.tensor.dtype)))
    error = request.error
    return _Status(lr, "agree", None if error is None else _Failure.of(error, _where(state, lr), lr))


def _drive(state: _LogicalState, label: str, bodies: dict[int, Callable[[], Any]], share: bool = False) -> list[Any]:
    """Run one body per hosted logical rank through rounds; results by logical rank (all of them if ``share``)."""
    fibers = [_Fiber(lr, body) for lr, body in bodies.items()]
    caller = _rng_state(state.device)
    replies: dict[int, Any] = {f.logical_rank: None for f in fibers}
    try:
        while True:
            for fiber in fibers:
                if not fiber.done:
                    _set_rng_state(state.rng[fiber.logical_rank], state.device)
                    fiber.step(replies[fiber.logical_rank])
                    state.rng[fiber.logical_rank] = _rng_state(state.device)
            local = [_status(state, f, share) for f in fibers]
            statuses = [s for part in state.comm.exchange(local, label) for s in part]
            if all(s.kind in ("done", "error") for s in statuses):
                return _finish(statuses, fibers, share)
            replies = _decide(state, label, statuses, fibers)
    except BaseException as exc:
        _unwind(fibers, exc, label)
        raise
    finally:
        _set_rng_state(caller, state.device)


def _decide(state: _LogicalState, label: str, statuses: list[_Status], fibers: list[_Fiber]) -> dict[int, Any]:
    kinds = {s.kind for s in statuses}
    if kinds == {"reduce"}:
        if len({s.detail for s in statuses}) == 1:
            mine = torch.stack([f.request.tensor.detach() for f in fibers])  # (L/W, *shape)
            total = ordered_sum(list(state.comm.all_gather(mine, label)))
            return {f.logical_rank: total.to(f.request.tensor.device).clone() for f in fibers}
        found = ", ".join(f"logical rank {s.logical_rank}: {s.detail[0]} {s.detail[1]}" for s in statuses)
        message = f"{label}: reduce expects one shape and dtype on every logical rank, found {found}"
        return {f.logical_rank: _Raise(PeerError(message, command=label)) for f in fibers}
    if kinds == {"agree"}:
        failed = [s for s in statuses if s.detail is not None]
        common = min(failed, key=lambda s: (s.detail.from_peer, s.logical_rank)) if failed else None
        replies: dict[int, Any] = {}
        for fiber in fibers:
            if common is None or common.logical_rank == fiber.logical_rank:
                replies[fiber.logical_rank] = None  # success, or its own error: the trainer raises it
            else:
                replies[fiber.logical_rank] = _Raise(_as_commit_error(common.detail))
        return replies
    failed = [s for s in statuses if s.kind == "error"]
    root = min(failed, key=lambda s: (s.detail.from_peer, s.logical_rank)) if failed else None
    replies = {}
    for fiber in fibers:
        if fiber.done:
            continue
        if root is not None:
            cause = f"logical rank {root.logical_rank} raised {root.detail.name}: {root.detail.text}"
        else:
            doings = ", ".join(f"logical rank {s.logical_rank} {_doing(s.kind)}" for s in statuses)
            cause = f"logical ranks diverged: {doings}"
            cause += "; every logical rank must call reduce and backward the same number of times, in the same order"
        doing = _doing(fiber.request.kind)
        if fiber.request.kind == "agree":
            error: BaseException = GradientCommitError(
                f"{label}: backward committed nothing: {cause} while this one {doing}"
            )
        else:
            error = PeerError(f"{label}: {cause} while logical rank {fiber.logical_rank} {doing}", command=label)
        replies[fiber.logical_rank] = _Raise(_from_peer(error) if root is not None else error)
    return replies


def _doing(kind: str) -> str:
    return {"reduce": "called reduce", "agree": "was in backward", "done": "returned", "error": "raised"}[kind]


def _as_commit_error(failure: _Failure) -> BaseException:
    """What a backward raises when a peer's backward failed: its error if a commit error, else a wrapper."""
    rebuilt = failure.rebuild()
    if not isinstance(rebuilt, GradientCommitError):
        rebuilt = GradientCommitError(
            f"backward failed and committed nothing: {failure.where} raised {failure.name}: {failure.text}"
        )
    return _from_peer(rebuilt)


def _finish(statuses: list[_Status], fibers: list[_Fiber], share: bool) -> list[Any]:
    failed = [s for s in statuses if s.kind == "error"]
    if failed:
        root = min(failed, key=lambda s: (s.detail.from_peer, s.logical_rank))
        mine = [f for f in fibers if f.logical_rank == root.logical_rank]
        if mine:
            raise mine[0].error
        raise root.detail.rebuild()
    if share:
        return [s.detail for s in statuses]
    return [f.result for f in fibers]


def _unwind(fibers: list[_Fiber], exc: BaseException, label: str) -> None:
    """Let every paused fiber raise, so its backward rolls back and its thread ends."""
    message = f"{label}: stopped because {type(exc).__name__}: {exc}"
    for _ in range(16):
        waiting = [f for f in fibers if not f.done and f._started]
        if not waiting:
            return
        for fiber in waiting:
            fiber.step(_Raise(_from_peer(PeerError(message, command=label))))


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


# --- zero mode (Rule 7) ----------------------------------------------------------------


class RankZero:
    """What ``fn`` gets in zero mode, on global rank 0 only: it drives every logical rank.

    There is no ``reduce``: the loss lives here and already sees every output.
    """

    def __init__(self, session: _ZeroSession) -> None:
        self._session = session
        self.trainer = session.trainer
        self.logical_world_size = session.state.layout.logical_dp

    def __getattr__(self, name: str) -> Any:
        if name == "reduce":
            raise AttributeError(
                "zero mode has no reduce: the loss is computed on rank 0 from every logical rank's "
                "outputs; use run_logical(mode='rank') for per-rank reductions"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def forward(self, inputs: Any, *, checkpoint: Any = None, options: Any = None) -> Any:
        """Spread ``inputs`` (a list) over logical ranks in contiguous chunks; outputs in source order."""
        return self._session.forward(inputs, checkpoint, options)

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> BackwardReport:
        """Backpropagate ``loss`` on every logical rank; all commit or none (Rules 5-7)."""
        return self._session.backward(loss, retain_graph)

    def optim_step(self, **kwargs: Any) -> StepReport:
        """``trainer.optim_step(**kwargs)`` on every process."""
        return self._session.run({"cmd": "optim_step", "kwargs": kwargs})

    def zero_grad(self, **kwargs: Any) -> None:
        """``trainer.zero_grad(**kwargs)`` on every process."""
        self._session.run({"cmd": "zero_grad", "kwargs": kwargs})


class _ZeroSession:
    """Zero-mode commands: rank 0 sends a header and every process executes it."""

    def __init__(self, state: _LogicalState, trainer: Trainer) -> None:
        self.state = state
        self.trainer = trainer
        self.comm = state.comm
        self.last = "run_logical"

    # rank 0 --------------------------------------------------------------------------

    def lead(self, fn: Callable[[RankZero], Any]) -> Any:
        self.state.leading = True
        try:
            result = fn(RankZero(self))
        except BaseException as exc:
            try:
                self.run({"cmd": "exit", "error": _Failure.of(exc, "rank 0's fn")})
            except PeerError:
                pass
            raise
        finally:
            self.state.leading = False
        self.run({"cmd": "exit", "error": None})
        return result

    def run(self, header: dict, payload: torch.Tensor | None = None) -> Any:
        header["label"] = self.state.label(f"zero.{header['cmd']}")
        header["seq"] = self.state.commands
        header["release"] = self.state.dropped[:]
        del self.state.dropped[: len(header["release"])]  # the same list: proxies' finalizers append to it
        self.comm.broadcast_command(header)
        leading, self.state.leading = self.state.leading, False  # the trainer calls below are this command's own
        try:
            return self.execute(header, payload)
        finally:
            self.state.leading = leading

    def forward(self, inputs: Any, checkpoint: Any, options: Any) -> Any:
        flat, rebuild = flatten_inputs(inputs)
        tokens = torch.cat(
            [t.reshape(-1).long().cpu() for item in flat for t in (item.input_tokens, item.targets())]
        )
        first = self.state.next_handle
        self.state.next_handle += len(flat)
        header = {
            "cmd": "forward",
            "lengths": [int(item.input_tokens.numel()) for item in flat],
            "options": [item.options for item in flat],
            "checkpoint": checkpoint,
            "call_options": options,
            "first": first,
        }
        return rebuild(self.run(header, tokens))

    def backward(self, loss: torch.Tensor, retain_graph: bool) -> BackwardReport:
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ConfigError("loss", type(loss).__name__, "a tensor that depends on zero.forward outputs")
        live = [(h, p) for h, ref in self.state.proxies.items() if (p := ref()) is not None and p.requires_grad]
        if not live:
            raise ConfigError("loss", "no live zero.forward outputs", "a loss built from zero.forward outputs")
        try:
            cotangents = torch.autograd.grad(loss, [p for _, p in live], retain_graph=retain_graph, allow_unused=True)
        except Exception as exc:
            raise GradientCommitError(
                f"the loss's own autograd failed ({exc}); nothing was committed and the outputs "
                "can be backpropagated again",
                record_retryable=True,
            ) from exc
        used = [(h, c) for (h, _), c in zip(live, cotangents) if c is not None]
        if not used:
            raise ConfigError("loss", "a loss that reaches no zero.forward output", "a loss built from them")
        header = {
            "cmd": "backward",
            "used": [(h, self.state.owners[h], c.numel()) for h, c in used],
            "retain_graph": retain_graph,
        }
        return self.run(header, torch.cat([c.reshape(-1) for _, c in used]))

    # every process ---------------------------------------------------------------------

    def serve(self, label: str) -> None:
        """Execute rank 0's commands until it exits; a command's common error is rank 0's to handle."""
        while True:
            header = self.comm.next_command(self.last)
            self.last, self.state.commands = header["label"], header["seq"]
            if header["cmd"] == "exit":
                self._release(header["release"])
                if header["error"] is not None:
                    raise header["error"].rebuild()
                return None
            try:
                self.execute(header, None)
            except PeerError:
                raise
            except Exception:
                continue  # every process raised it at this command; rank 0's fn decides what follows

    def execute(self, header: dict, payload: torch.Tensor | None) -> Any:
        self._release(header["release"])
        cmd = header["cmd"]
        if cmd == "forward":
            return self._forward(header, payload)
        if cmd == "backward":
            return self._backward(header, payload)
        if cmd == "exit":
            return None
        call = {"optim_step": self.trainer.optim_step, "zero_grad": self.trainer.zero_grad}[cmd]
        return self._agreed(header["label"], lambda: call(**header["kwargs"]))

    def _agreed(self, label: str, work: Callable[[], Any]) -> Any:
        """Run ``work`` here, then make every process raise the same error if any failed."""
        error: Exception | None = None
        try:
            result = work()
        except Exception as exc:
            error, result = exc, None
        failure = None if error is None else _Failure.of(error, f"physical rank {self.comm.rank}")
        failures = self.comm.exchange(failure, f"{label}: outcome")
        first = next((rank for rank, f in enumerate(failures) if f is not None), None)
        if first is None:
            return result
        if first == self.comm.rank:
            raise error
        raise failures[first].rebuild()

    def _release(self, handles: list[int]) -> None:
        for handle in handles:
            self.state.outputs.pop(handle, None)
            self.state.proxies.pop(handle, None)
            self.state.owners.pop(handle, None)

    def _forward(self, header: dict, tokens: torch.Tensor | None) -> Any:
        state, label = self.state, header["label"]
        lengths = header["lengths"]
        if tokens is None:
            tokens = torch.empty(2 * sum(lengths), dtype=torch.long)
        tokens = self.comm.broadcast(tokens, label).cpu()
        chunks = spread(len(lengths), state.layout.logical_dp)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + 2 * n)

        def item(i: int) -> ForwardInput:
            ids = tokens[offsets[i] : offsets[i + 1]].view(2, -1)
            return ForwardInput(ids[0].to(state.device), ids[1].to(state.device), header["options"][i])

        def work() -> list[tuple[int, int, ForwardOutput]]:
            made = []
            caller = _rng_state(state.device)
            try:
                for lr in state.layout.hosted:
                    if not chunks[lr]:
                        continue
                    _set_rng_state(state.rng[lr], state.device)
                    outputs = self.trainer.forward(
                        [item(i) for i in chunks[lr]], checkpoint=header["checkpoint"], options=header["call_options"]
                    )
                    state.rng[lr] = _rng_state(state.device)
                    made.extend((header["first"] + i, lr, out) for i, out in zip(chunks[lr], outputs))
            finally:
                _set_rng_state(caller, state.device)
            return made

        made = self._agreed(label, work)
        for handle, lr, out in made:
            state.outputs[handle] = (lr, out.target_logprobs)
        per_process = state.layout.per_process
        sizes = [  # output elements each process hosts
            sum(lengths[i] for lr in range(p * per_process, (p + 1) * per_process) for i in chunks[lr])
            for p in range(self.comm.world_size)
        ]
        local = torch.cat([out.target_logprobs.detach().reshape(-1) for _, _, out in made]) if made else torch.zeros(0)
        gathered = self.comm.gather(local.to(self.comm.device), sizes, label)
        described = [(h, out.version, out.placement, out.decision) for h, _, out in made]
        metas = self.comm.exchange(described, f"{label}: outputs")
        if gathered is None:
            return None
        values = torch.cat([g.to(state.device) for g in gathered])
        results, offset = [], 0
        for (handle, version, placement, decision) in (m for part in metas for m in part):
            n = lengths[handle - header["first"]]
            proxy = values[offset : offset + n].clone().requires_grad_(version is not None)
            offset += n
            state.proxies[handle] = weakref.ref(proxy)
            state.owners[handle] = next(lr for lr, c in enumerate(chunks) if handle - header["first"] in c)
            weakref.finalize(proxy, state.dropped.append, handle)
            results.append(ForwardOutput(proxy, version, placement, decision))
        return results

    def _backward(self, header: dict, cotangents: torch.Tensor | None) -> BackwardReport | None:
        state, label = self.state, header["label"]
        used = header["used"]
        if cotangents is None:
            cotangents = torch.empty(sum(n for _, _, n in used), dtype=torch.float32)
        cotangents = self.comm.broadcast(cotangents, label).to(state.device)
        per_rank: dict[int, list[tuple[int, torch.Tensor]]] = {lr: [] for lr in state.layout.hosted}
        offset = 0
        for handle, lr, n in used:
            if lr in per_rank:
                per_rank[lr].append((handle, cotangents[offset : offset + n]))
            offset += n

        def body(lr: int) -> BackwardReport:
            pairs = per_rank[lr]
            if not pairs:
                _FiberCoordinator().agree(None)  # nothing to commit, but this rank still takes part
                return BackwardReport([])
            terms = []
            for handle, cotangent in pairs:
                if handle not in state.outputs:
                    raise GradientCommitError(f"zero-mode output {handle} was already released; forward again")
                leaf = state.outputs[handle][1]
                terms.append((leaf * cotangent.view_as(leaf)).sum())
            surrogate = torch.stack(terms).sum() if len(terms) > 1 else terms[0]
            return self.trainer.backward(
                surrogate, retain_graph=header["retain_graph"], sink=state.buffers[lr], coordinator=_FiberCoordinator()
            )

        reports = _drive(state, label, {lr: (lambda lr=lr: body(lr)) for lr in state.layout.hosted}, share=True)
        return BackwardReport([r for report in reports for r in report.records])
