"""Where committed gradients go: the live ``.grad`` fields, or the trainer's logical-rank sums.

A backward stages its gradients once and publishes them into a *sink*
(NOTE [Gradient commit] Rule 5, in ``commit.py``). :class:`LiveGradSink`
writes ``.grad``. :class:`RankGradients` is the sink a trainer owns for its
logical ranks (NOTE [Logical ranks] Rule 5, in ``ranks/__init__.py``): one
:class:`BufferGradSink` per logical rank this process hosts, each handing its
commits to the host's :class:`GradientFold` (Rule 4). ``optim_step``
flushes the sums into ``.grad`` before it steps;
``load_checkpoint``, ``zero_grad`` and the busy check see what it holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .checkpoints import Checkpoint, CheckpointVersion
from .errors import ConfigError, TrainerError
from .grad_norms import KnownNorm
from .rng import RngState
from .staleness import check_each, check_origins

__all__ = [
    "BufferGradSink",
    "GradientFold",
    "GradientSink",
    "LiveGradSink",
    "RankGradients",
    "RankHost",
    "SummedGradients",
]

Origin = tuple[CheckpointVersion, int]  # (forward version, staleness bound) of a committed gradient


class GradientSink(Protocol):
    """Where committed gradients live."""

    takes_ownership: bool  # keeps what ``assign`` gets: the transaction drops its own references (NOTE Rule 5)

    def current(self, checkpoint: Checkpoint, name: str) -> torch.Tensor | None: ...

    def assign(self, checkpoint: Checkpoint, name: str, value: torch.Tensor | None) -> None: ...

    def record_origins(self, checkpoint: Checkpoint, origins: set[Origin]) -> None: ...

    def record_norm(self, checkpoint: Checkpoint, known: KnownNorm) -> None:
        """``known`` measured this sink's gradients of ``checkpoint`` as just published (NOTE [Gradient norm])."""
        ...


class LiveGradSink:
    """Commit into each live parameter's ``.grad``."""

    takes_ownership = False

    def current(self, checkpoint: Checkpoint, name: str) -> torch.Tensor | None:
        return checkpoint.parameter(name).grad

    def assign(self, checkpoint: Checkpoint, name: str, value: torch.Tensor | None) -> None:
        checkpoint.forget_gradient_norm()
        checkpoint.parameter(name).grad = value

    def record_origins(self, checkpoint: Checkpoint, origins: set[Origin]) -> None:
        checkpoint.origins |= origins

    def record_norm(self, checkpoint: Checkpoint, known: KnownNorm) -> None:
        checkpoint.remember_gradient_norm(known)


class GradientFold(Protocol):
    """Where logical ranks' commits are folded as they arrive (``ranks/reduction.py``, NOTE [Logical ranks] Rule 4)."""

    def add(self, logical_rank: int, key: tuple[str, str], value: torch.Tensor) -> None: ...

    def discard(self) -> None:
        """Drop what the current round folded: one of its commits was rolled back."""
        ...

    def pending(self, checkpoint: str | None = None) -> int: ...

    def clear(self, checkpoint: str) -> None: ...


@dataclass
class BufferGradSink:
    """One logical rank's door into the process's fold of every logical rank's commits (summed by ``optim_step``).

    A logical rank commits once per round (NOTE [Logical ranks] Rule 3), so
    its leaf of the round starts empty (``current`` is ``None``) and each
    gradient is handed to the fold as published: the sink takes ownership
    (NOTE [Gradient commit] Rule 5). A rollback (``assign`` of ``None``)
    drops the round's fold: a rolled-back commit fails every logical rank.
    """

    logical_rank: int
    fold: GradientFold
    origins: dict[str, set[Origin]] = field(default_factory=dict)
    takes_ownership = True

    def current(self, checkpoint: Checkpoint, name: str) -> torch.Tensor | None:
        return None

    def assign(self, checkpoint: Checkpoint, name: str, value: torch.Tensor | None) -> None:
        if value is None:
            self.fold.discard()
        else:
            self.fold.add(self.logical_rank, (checkpoint.name, name), value)

    def record_origins(self, checkpoint: Checkpoint, origins: set[Origin]) -> None:
        self.origins.setdefault(checkpoint.name, set()).update(origins)

    def record_norm(self, checkpoint: Checkpoint, known: KnownNorm) -> None:
        """Nothing: the fold is summed into ``.grad`` at ``optim_step``, which measures the sum."""

    def clear(self, checkpoint_name: str | None = None) -> None:
        for name in [n for n in self.origins if checkpoint_name in (None, n)]:
            del self.origins[name]


@dataclass(frozen=True)
class SummedGradients:
    """Every logical rank's gradients of some checkpoints, summed in the fixed order (NOTE [Logical ranks] Rule 4).

    ``totals``: ``(checkpoint name, parameter name, gradient)`` for every
    parameter some logical rank holds; ``origins``: every logical rank's origins,
    by checkpoint name.
    """

    totals: list[tuple[str, str, torch.Tensor]]
    origins: dict[str, set[Origin]]


class RankHost(Protocol):
    """The logical-rank runtime (``reference_trainer.ranks``) that fills a trainer's buffers."""

    # What the trainer reads (read-only here, so the runtime may hold a subtype or compute it).
    @property
    def hosted(self) -> range: ...

    @property
    def running(self) -> int | None:
        """The hosted logical rank whose code runs now; None: the process's own code."""
        ...

    @property
    def logical_dp(self) -> int: ...

    @property
    def leader(self) -> bool:
        """This is physical rank 0, the one that writes saves (NOTE [Resume] Rule 5)."""
        ...

    @property
    def sums(self) -> GradientFold:
        """Every hosted logical rank's commits, folded."""
        ...

    def check_caller(self, call: str) -> None:
        """Raise ``ConfigError`` unless ``trainer.<call>()`` is called from the process's own code."""
        ...

    def agree(self, error: Exception | None, label: str) -> None:
        """Raise on every process the lowest failing process's ``error``, or return on every process."""
        ...

    def sum_buffers(self, buffers: dict[int, BufferGradSink], checkpoints: list[Checkpoint]) -> SummedGradients:
        """Every logical rank's sums and origins of ``checkpoints``, on every process, in the fixed order."""
        ...

    def all_streams(self, label: str) -> dict[int, RngState]:
        """Every logical rank's RNG stream, on every process."""
        ...

    def exchange(self, obj: Any, label: str) -> list[Any]:
        """Every process's ``obj``, by physical rank, on every process."""
        ...

    def take_streams(self, streams: dict[int, RngState]) -> None:
        """The hosted logical ranks continue from ``streams`` (every logical rank's, as ``all_streams`` gave)."""
        ...


class RankGradients:
    """The trainer's logical-rank gradient buffers, by hosted logical rank; empty until ``run_logical`` runs."""

    def __init__(self) -> None:
        self.host: RankHost | None = None
        self.buffers: dict[int, BufferGradSink] = {}
        self.resumed: tuple[int, dict[int, RngState]] | None = None
        """``(logical_dp, every logical rank's stream)`` from ``Trainer.load``, for the next layout of that size."""

    def attach(self, host: RankHost) -> None:
        """Host ``host``'s logical ranks from now on (only while nothing is pending).

        A layout of the ``logical_dp`` a loaded save had continues its logical
        ranks' streams (NOTE [Resume] Rule 5, in ``resume.py``).
        """
        assert not self.pending(), "a new layout over pending logical gradients"
        self.host = host
        self.buffers = {logical_rank: BufferGradSink(logical_rank, host.sums) for logical_rank in host.hosted}
        if self.resumed is not None and self.resumed[0] == host.logical_dp:
            host.take_streams(self.resumed[1])
            self.resumed = None

    def running(self) -> int | None:
        """The logical rank whose code runs now (a forward's owner, NOTE [Importance correction] Rule 7); None outside."""
        return None if self.host is None else self.host.running

    def pending(self, checkpoint: str | None = None) -> int:
        """Tensors with a pending logical-rank sum, of one checkpoint or of all."""
        return 0 if self.host is None else self.host.sums.pending(checkpoint)

    def check_caller(self, call: str) -> None:
        """Refuse ``trainer.<call>()`` from inside ``run_logical``'s ``fn``: it would act on one logical rank's
        behalf outside the buffers every logical rank shares (NOTE [Logical ranks] Rule 5)."""
        if self.host is not None:
            self.host.check_caller(call)

    def check_route(self, owners: Iterable[int | None], sink: GradientSink | None) -> None:
        """Raise ``ConfigError`` unless a backward into ``sink`` may consume records of logical ranks ``owners``.

        ``sink`` None is a plain ``trainer.backward`` into ``.grad``: refused
        inside ``fn`` (use ``view.backward``). A record made by a logical rank's
        ``fn`` commits only into that rank's buffer, through its view (Rule 2).
        """
        target = sink.logical_rank if isinstance(sink, BufferGradSink) else None
        if sink is None:
            self.check_caller("backward")
        for owner in owners:
            if owner is not None and owner != target:
                where = "trainer.backward into .grad" if target is None else f"the view of logical rank {target}"
                raise ConfigError(
                    "loss",
                    f"a loss using an output of logical rank {owner}, backpropagated through {where}",
                    f"each output backpropagated through the view of its own logical rank ({owner})",
                    f"call view.backward in logical rank {owner}'s fn (a later run_logical call is fine)",
                )

    def clear(self, names: Iterable[str], *, call: str = "zero_grad") -> None:
        """Drop the buffered gradients and origins of the checkpoints ``names``."""
        self.check_caller(call)
        for name in names:
            if self.host is not None:
                self.host.sums.clear(name)
            for buffer in self.buffers.values():
                buffer.clear(name)

    def flush(self, checkpoints: list[Checkpoint]) -> None:
        """Validate every origin, then add every logical rank's sums of ``checkpoints`` to ``.grad`` and drop them.

        The origins already committed to ``.grad`` (``check_origins``, NOTE
        [Staleness] Rule 4) are validated for every checkpoint first;
        with logical ranks that outcome is agreed across processes (an error on
        one makes every process raise it, NOTE [Logical ranks] Rule 6), then the
        sums are gathered and every buffered origin (the same on every process
        after the exchange) is validated. Only then does any ``.grad`` change:
        a violation anywhere changes nothing, and the sums stay. Runs on every process.
        """
        if self.host is None:
            for checkpoint in checkpoints:
                check_origins(checkpoint)
            return
        self.check_caller("optim_step")
        self.host.agree(_first_error(checkpoints), "optim_step: committed origins")
        summed = self.host.sum_buffers(self.buffers, checkpoints)
        by_name = {c.name: c for c in checkpoints}
        for name, origins in summed.origins.items():
            check_each(by_name[name], origins)
        live = LiveGradSink()
        for name, pname, total in summed.totals:
            old = live.current(by_name[name], pname)
            live.assign(by_name[name], pname, total if old is None else old + total)
        for name, origins in summed.origins.items():
            live.record_origins(by_name[name], origins)
        self.clear(by_name, call="optim_step")


def _first_error(checkpoints: list[Checkpoint]) -> TrainerError | None:
    """The first checkpoint's error from ``check_origins``, or ``None`` when every checkpoint passes."""
    for checkpoint in checkpoints:
        try:
            check_origins(checkpoint)
        except TrainerError as exc:
            return exc
    return None
