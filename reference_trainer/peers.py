"""Processes of a job reaching each other: joining the job, control messages, collectives, errors.

It sits below the trainer, beside ``errors.py``: ``resume.py`` broadcasts a
save's outcome as a ``PeerFailure`` and the logical ranks (``ranks/``) build
on ``Comm``; it imports nothing of either.
``init_distributed`` joins the job a launcher describes and ``timeout_seconds``
bounds every collective step. ``Comm`` sends control messages through rank 0
(a star, so a silent peer is named) and tensors through collectives
(NOTE [Logical ranks] Rule 8, in ``ranks/__init__.py``); ``PeerFailure`` carries an
exception to another process, which raises the same type (Rule 6). A peer
that dies, hangs or answers out of turn makes ``Comm`` raise ``PeerError``;
each collective is traced and dumped on failure (NOTE [Collective watchdog]).

NOTE [NCCL timeouts]: on CUDA the backend follows the model's device
(:func:`select_backend`: NCCL only for a CUDA model), ``init_distributed``
binds the process to its device with ``device_id`` and the transport moves
tensors to the trainer's device, never ``torch.cuda.current_device()``
(:func:`transport_device`). NCCL's watchdog aborts the process when a
collective outlives the group's timeout, without a Python error; the group's
timeout is therefore :func:`watchdog_timeout_s`, longer than any step the
transport waits for, so ``Comm`` raises the same ``PeerError`` on every rank
first. A ``run_logical`` whose ``timeout_s`` or ``idle_timeout_s`` exceeds the
values given to ``init_distributed`` gives up that guarantee.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import ConfigError, PeerError, is_number
from .watchdog import bounded_wait_s, control_group, recorded

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "Comm",
    "PeerFailure",
    "TrafficCount",
    "init_distributed",
    "NCCL_WATCHDOG_MARGIN_S",
    "mark_from_peer",
    "select_backend",
    "timeout_seconds",
    "transport_device",
    "watchdog_timeout_s",
]

DEFAULT_TIMEOUT_S = 300.0
_COMMAND = "zero-mode command"  # the trace's call of a zero-mode command, sent or awaited (the same on every rank)
DEFAULT_IDLE_TIMEOUT_S = 3600.0
NCCL_WATCHDOG_MARGIN_S = 60.0
_FROM_PEER = "_rt_from_peer"  # the attribute that marks an exception rebuilt from a peer's


def select_backend(device: torch.device | str | None, cuda_available: bool) -> str:
    """NCCL for a CUDA model, gloo for a CPU one (even where CUDA exists); ``None``: NCCL iff CUDA exists."""
    if device is None:
        return "nccl" if cuda_available else "gloo"
    device = torch.device(device)
    if device.type == "cuda" and not cuda_available:
        raise ConfigError("device", str(device), "a device this machine has", hint="CUDA is not available here")
    return "nccl" if device.type == "cuda" else "gloo"


def transport_device(backend: str, trainer_device: torch.device) -> torch.device:
    """Where collectives' tensors live: the trainer's CUDA device under NCCL, the CPU otherwise."""
    if "nccl" not in backend:
        return torch.device("cpu")
    if trainer_device.type != "cuda" or trainer_device.index is None:
        raise ConfigError(
            "trainer",
            f"a model on {trainer_device}",
            "a model on an indexed CUDA device in an NCCL job",
            hint="init_distributed(device='cpu') uses gloo for a CPU model",
        )
    return trainer_device


def watchdog_timeout_s(timeout_s: float, idle_timeout_s: float) -> float:
    """A process group's timeout: longer than every wait of the transport, so ``PeerError`` comes first."""
    return max(timeout_s, idle_timeout_s) + NCCL_WATCHDOG_MARGIN_S


def init_distributed(
    backend: str | None = None, *, timeout_s: float | None = None, device: torch.device | str | None = None
) -> tuple[int, int]:
    """Join the job a launcher (``torchrun``) describes in the environment; return ``(rank, world_size)``.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
    (env://). ``backend`` defaults to :func:`select_backend` of ``device`` (the
    model's device type; ``None``: NCCL when CUDA is available). Under NCCL the
    process is bound to ``cuda:LOCAL_RANK`` (``device_id``) and the group's
    timeout is :func:`watchdog_timeout_s`. Without a launcher (no ``RANK``) it
    does nothing and returns ``(0, 1)``: one process hosts every logical rank.
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            return 0, 1
        backend = backend or select_backend(device, torch.cuda.is_available())
        timeout_s = timeout_seconds(timeout_s, "RT_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)
        options: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if backend == "nccl":
            idle_s = timeout_seconds(None, "RT_DIST_IDLE_TIMEOUT_S", DEFAULT_IDLE_TIMEOUT_S)
            local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(local)
            options = {"timeout": datetime.timedelta(seconds=watchdog_timeout_s(timeout_s, idle_s)), "device_id": local}
        dist.init_process_group(backend, init_method="env://", **options)
    return dist.get_rank(), dist.get_world_size()


def timeout_seconds(value: float | None, env: str, default: float) -> float:
    value = float(os.environ.get(env, default)) if value is None else value
    if not is_number(value) or not value > 0:
        raise ConfigError("timeout_s", value, "None or a number of seconds > 0")
    return float(value)


# --- errors across processes (Rule 6) ------------------------------------------------


def _picklable(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - whatever pickle raises, the value cannot travel
        return False
    return True


@dataclass(frozen=True)
class PeerFailure:
    """Enough of an exception to raise the same type on another process."""

    module: str
    qualname: str
    args: tuple[Any, ...]
    attrs: dict[str, Any]
    text: str
    where: str
    logical_rank: int | None
    traceback: str
    from_peer: bool

    @classmethod
    def of(cls, exc: BaseException, where: str, logical_rank: int | None = None) -> PeerFailure:
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
            bool(getattr(exc, _FROM_PEER, False)),
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
        except Exception:  # noqa: BLE001 - a class that cannot be rebuilt here travels as a PeerError
            exc = PeerError(f"{self.where} raised {self.qualname}: {self.text}", command="?")
        setattr(exc, _FROM_PEER, self.from_peer)
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised on {self.where}; its traceback there:\n{self.traceback}")
        return exc


def _wait(work: dist.Work | None, timeout_s: float) -> None:
    """Wait for a point-to-point transfer (``None`` only for a process outside the group: never the control group)."""
    assert work is not None, "every process is in the control group"
    work.wait(datetime.timedelta(seconds=timeout_s))


def mark_from_peer(exc: BaseException) -> BaseException:
    setattr(exc, _FROM_PEER, True)
    return exc


# --- transport (Rule 8) --------------------------------------------------------------


@dataclass
class TrafficCount:
    """What one process sent to and received from its peers through one kind of message, in bytes.

    Counted logically: the payload each peer must get, whatever algorithm
    the backend runs (a ring all-gather moves the same bytes into each
    process). ``"control"`` counts the pickled control messages (metadata).
    """

    calls: int = 0
    sent: int = 0
    received: int = 0


@dataclass(frozen=True)
class _Abort:
    failure: PeerFailure


class Comm:
    """Objects through rank 0 (a silent peer is named), tensors through collectives."""

    def __init__(self, timeout_s: float, idle_timeout_s: float, device: torch.device) -> None:
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.device = torch.device("cpu")
        self.traffic: dict[str, TrafficCount] = {}  # by collective; see :class:`TrafficCount`
        if self.distributed:
            self.device = transport_device(str(dist.get_backend()), device)
            # A gloo group of its own: control messages never interleave with data collectives.
            timeout = datetime.timedelta(seconds=max(timeout_s, idle_timeout_s))
            self.control = control_group(timeout)

    # objects ---------------------------------------------------------------------------

    def exchange(self, obj: Any, label: str) -> list[Any]:
        """Every process's ``obj``, by physical rank; raises ``PeerError`` if a peer does not answer in kind."""
        if not self.distributed:
            return [obj]
        with recorded("exchange", "control", (), label):
            if self.rank != 0:
                self._send((label, obj), 0, label)
                everyone: list[Any] = self._expect(0, label, self.wait_s)
                return everyone
            # Hear every peer out even after one failed: a live peer blocks in its send until
            # rank 0 receives it, and only then can it take the abort.
            parts, dead, failure = [obj], set(), None
            for peer in range(1, self.world_size):
                try:
                    their_label, value = self._recv(peer, label, self.wait_s)
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

    def agree(self, error: Exception | None, label: str) -> None:
        """Every process's outcome of one local step; the lowest failing physical rank's error is raised everywhere.

        Returns only when every process succeeded. The failing process raises
        its own exception object, the others the same type rebuilt (Rule 6).
        """
        failure = None if error is None else PeerFailure.of(error, f"physical rank {self.rank}")
        failures = self.exchange(failure, label)
        first = next((rank for rank, f in enumerate(failures) if f is not None), None)
        if first is None:
            return
        if first == self.rank:
            assert error is not None, "this process's failure is its own error"
            raise error
        raise failures[first].rebuild()

    def broadcast_command(self, header: Any, label: str) -> None:
        """Rank 0 sends a zero-mode command (``zero.Header``) to every other process."""
        with recorded("command", "control", (), _COMMAND):
            self._fan_out((label, header), label)

    def next_command(self, after: str) -> Any:
        label = f"waiting for rank 0's next command (after {after})"
        with recorded("command", "control", (), _COMMAND):
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
        failure = PeerFailure.of(exc, f"physical rank {self.rank}")
        for peer in range(1, self.world_size):
            if peer not in skip:
                try:
                    self._send(("abort", _Abort(failure)), peer, exc.command, timeout_s=min(self.wait_s, 5.0))
                except PeerError:
                    pass

    def _send(self, obj: Any, peer: int, label: str, timeout_s: float | None = None) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        self._count("control", sent=data.numel() + 8)
        timeout_s = timeout_s or self.wait_s
        try:
            for tensor in (size, data):
                _wait(dist.isend(tensor, peer, group=self.control), timeout_s)
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
            _wait(dist.irecv(size, peer, group=self.control), timeout_s)
            buffer = bytearray(int(size))  # pickles are never empty; irecv writes into it
            data = torch.frombuffer(buffer, dtype=torch.uint8)
            _wait(dist.irecv(data, peer, group=self.control), timeout_s)
        except RuntimeError as exc:
            raise PeerError(
                f"{label}: lost physical rank {peer} (its connection closed, or no answer within "
                f"{timeout_s:g} s): it died, hung or ran other code; check its log. {exc}",
                command=label,
                peer=peer,
            ) from exc
        self._count("control", received=len(buffer) + 8)
        return pickle.loads(buffer)

    # tensors -----------------------------------------------------------------------------

    def all_gather(self, local: torch.Tensor, label: str) -> torch.Tensor:
        """``(k, ...)`` on every process -> ``(W*k, ...)`` in physical-rank order, on every process."""
        if not self.distributed:
            return local
        local = local.to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        with recorded("all_gather", "data", (local,), label):
            self._wait(dist.all_gather(parts, local, async_op=True), label)
        others = self.world_size - 1
        self._count("all_gather", sent=_nbytes(local) * others, received=_nbytes(local) * others)
        return torch.cat(parts)

    def all_to_all(self, parts: list[torch.Tensor], sizes: list[int], label: str) -> list[torch.Tensor]:
        """Send the 1-D ``parts[q]`` to physical rank ``q``; return what each rank sent here (``sizes[q]`` elements)."""
        if not self.distributed:
            return parts
        local = torch.cat([part.to(self.device) for part in parts])
        received = torch.empty(sum(sizes), dtype=local.dtype, device=self.device)
        with recorded("all_to_all", "data", (local,), label):
            work = dist.all_to_all_single(
                received, local, output_split_sizes=sizes, input_split_sizes=[p.numel() for p in parts], async_op=True
            )
            self._wait(work, label)
        mine = parts[self.rank].numel()
        item = local.element_size()
        self._count("all_to_all", sent=(local.numel() - mine) * item, received=(sum(sizes) - sizes[self.rank]) * item)
        return list(received.split(sizes))

    def broadcast(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """Rank 0's ``tensor`` on every process (others pass a buffer of the right shape)."""
        if not self.distributed:
            return tensor
        tensor = tensor.to(self.device).contiguous()
        with recorded("broadcast", "data", (tensor,), label):
            self._wait(dist.broadcast(tensor, 0, async_op=True), label)
        if self.rank == 0:
            self._count("broadcast", sent=_nbytes(tensor) * (self.world_size - 1))
        else:
            self._count("broadcast", received=_nbytes(tensor))
        return tensor

    def gather(self, local: torch.Tensor, sizes: list[int], label: str) -> list[torch.Tensor] | None:
        """Each process's 1-D ``local`` (``sizes[p]`` elements) on rank 0, by physical rank."""
        if not self.distributed:
            return [local]
        width = max(max(sizes), 1)
        padded = torch.zeros(width, dtype=local.dtype, device=self.device)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in sizes] if self.rank == 0 else None
        with recorded("gather", "data", (padded,), label):
            self._wait(dist.gather(padded, parts, dst=0, async_op=True), label)
        if self.rank == 0:
            self._count("gather", received=_nbytes(padded) * (self.world_size - 1))
        else:
            self._count("gather", sent=_nbytes(padded))
        return None if parts is None else [part[:size] for part, size in zip(parts, sizes)]

    def _count(self, kind: str, *, sent: int = 0, received: int = 0) -> None:
        count = self.traffic.setdefault(kind, TrafficCount())
        count.calls += 1
        count.sent += sent
        count.received += received

    @property
    def wait_s(self) -> float:
        """How long one wait may take: ``timeout_s``, or a watchdog's shorter deadline (NOTE [Collective watchdog])."""
        return bounded_wait_s(self.timeout_s)

    def _wait(self, work: Any, label: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.wait_s))
        except RuntimeError as exc:
            others = [r for r in range(self.world_size) if r != self.rank]
            peer = others[0] if len(others) == 1 else None
            raise PeerError(
                f"{label}: a collective with physical ranks {others} failed within {self.wait_s:g} s; "
                f"a peer died or hung (check their logs): {exc}",
                command=label,
                peer=peer,
            ) from exc


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
