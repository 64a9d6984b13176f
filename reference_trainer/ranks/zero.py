"""Zero mode: rank 0's ``fn`` drives every logical rank; the other processes serve its commands.

By Rule 7 of NOTE [Logical ranks] (``ranks/__init__.py``), rank 0 sends each command to
every process and all of them execute it. ``forward`` spreads the inputs over
the logical ranks and gives rank 0 leaf copies of every output; ``backward``
computes the outputs' cotangents on rank 0 and each logical rank
backpropagates the ones of the outputs it hosts. A command's error is raised
on every process (Rule 6).
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..cotangents import output_cotangents
from ..errors import ConfigError, GradientCommitError, PeerError
from ..inputs import ForwardInput, ForwardOutput, flatten_inputs
from ..peers import PeerFailure
from ..rng import rng_state, set_rng_state
from ..trainer import BackwardReport, StepReport, Trainer
from .fibers import FiberCoordinator
from .layout import spread
from .rounds import drive
from .state import LogicalState

__all__ = ["Backward", "Exit", "Forward", "Header", "RankZero", "TrainerCall", "ZeroSession", "payload_buffer"]


@dataclass(frozen=True)
class Forward:
    """Run a forward of ``len(lengths)`` inputs spread over the logical ranks; tokens follow as the payload."""

    lengths: tuple[int, ...]  # each input's length; the payload holds its input then its target ids
    options: tuple[Any, ...]  # each input's own ForwardOptions (or None)
    checkpoint: Any
    call_options: Any
    first: int  # the handle of the first output; the others follow in order


@dataclass(frozen=True)
class Backward:
    """Backpropagate the cotangents of the outputs in ``used``; the cotangents follow as the payload."""

    used: tuple[tuple[int, int, int], ...]  # (handle, owning logical rank, elements) in payload order
    retain_graph: bool
    dtype: str  # the payload's dtype name: receivers allocate what rank 0 sends


@dataclass(frozen=True)
class TrainerCall:
    """``trainer.<method>(**kwargs)`` on every process (``optim_step`` or ``zero_grad``)."""

    method: str
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Exit:
    """Rank 0's ``fn`` returned (``error=None``) or raised ``error``: every process stops serving."""

    error: PeerFailure | None


Command = Forward | Backward | TrainerCall | Exit


@dataclass(frozen=True)
class Header:
    """What rank 0 broadcasts: the command, its label and sequence number, the output handles dropped since the last."""

    command: Command
    label: str
    seq: int
    release: tuple[int, ...]


def payload_buffer(command: Backward) -> torch.Tensor:
    """The buffer a serving process receives a backward's cotangents into: rank 0's dtype, from the command."""
    dtype = getattr(torch, command.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError("Backward.dtype", command.dtype, "the name of a torch dtype, e.g. 'bfloat16'")
    return torch.empty(sum(n for _, _, n in command.used), dtype=dtype)


class RankZero:
    """What ``fn`` gets in zero mode, on global rank 0 only: it drives every logical rank.

    There is no ``reduce``: the loss lives here and already sees every output.
    """

    def __init__(self, session: ZeroSession) -> None:
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
        report: StepReport = self._session.run(TrainerCall("optim_step", kwargs))
        return report

    def zero_grad(self, **kwargs: Any) -> None:
        """``trainer.zero_grad(**kwargs)`` on every process."""
        self._session.run(TrainerCall("zero_grad", kwargs))


_LEADING: contextvars.ContextVar[bool] = contextvars.ContextVar("zero_mode_fn_running", default=False)


class ZeroSession:
    """Zero-mode commands: rank 0 sends a header and every process executes it."""

    @staticmethod
    def leading_here() -> bool:
        """True inside a zero-mode ``fn`` on this process (``run_logical`` may not be called there)."""
        return _LEADING.get()

    def __init__(self, state: LogicalState, trainer: Trainer) -> None:
        self.state = state
        self.trainer = trainer
        self.comm = state.comm
        self.last = "run_logical"

    # rank 0 --------------------------------------------------------------------------

    def lead(self, fn: Callable[[RankZero], Any]) -> Any:
        self.state.leading = True
        token = _LEADING.set(True)
        try:
            result = fn(RankZero(self))
        except BaseException as exc:
            try:
                self.run(Exit(PeerFailure.of(exc, "rank 0's fn")))
            except PeerError:
                pass
            raise
        finally:
            self.state.leading = False
            _LEADING.reset(token)
        self.run(Exit(None))
        return result

    def run(self, command: Command, payload: torch.Tensor | None = None) -> Any:
        """Send ``command`` to every process and execute it here (rank 0)."""
        name = _NAMES[type(command)] if not isinstance(command, TrainerCall) else command.method
        release = tuple(self.state.dropped)
        del self.state.dropped[: len(release)]  # the same list: proxies' finalizers append to it
        header = Header(command, self.state.label(f"zero.{name}"), self.state.commands, release)
        self.comm.broadcast_command(header, header.label)
        leading, self.state.leading = self.state.leading, False  # the trainer calls below are this command's own
        try:
            return self.execute(header, payload)
        finally:
            self.state.leading = leading

    def forward(self, inputs: Any, checkpoint: Any, options: Any) -> Any:
        flat, rebuild = flatten_inputs(inputs)
        behaviour = ("behaviour_logprobs", "behaviour_revisions", "behaviour_generations")
        if any(getattr(i, name) is not None for i in flat for name in behaviour):
            raise ConfigError(
                "inputs",
                "inputs carrying behaviour log-probs or revisions",
                "inputs without them under RankZero (only tokens and targets are sent to the ranks)",
                "forward them through a Trainer of one process, or drop the behaviour fields",
            )
        tokens = torch.cat([t.reshape(-1).long().cpu() for item in flat for t in (item.input_tokens, item.targets())])
        first = self.state.next_handle
        self.state.next_handle += len(flat)
        command = Forward(
            lengths=tuple(int(item.input_tokens.numel()) for item in flat),
            options=tuple(item.options for item in flat),
            checkpoint=checkpoint,
            call_options=options,
            first=first,
        )
        return rebuild(self.run(command, tokens))

    def backward(self, loss: torch.Tensor, retain_graph: bool) -> BackwardReport:
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ConfigError("loss", type(loss).__name__, "a tensor that depends on zero.forward outputs")
        live = [(h, p) for h, ref in self.state.proxies.items() if (p := ref()) is not None and p.requires_grad]
        if not live:
            raise ConfigError("loss", "no live zero.forward outputs", "a loss built from zero.forward outputs")
        cotangents = output_cotangents(loss, [p for _, p in live], retain_graph)
        used = [(h, c) for (h, _), c in zip(live, cotangents) if c is not None]
        if not used:
            raise ConfigError("loss", "a loss that reaches no zero.forward output", "a loss built from them")
        payload = torch.cat([c.reshape(-1) for _, c in used])
        command = Backward(
            used=tuple((h, self.state.owners[h], c.numel()) for h, c in used),
            retain_graph=retain_graph,
            dtype=str(payload.dtype).removeprefix("torch."),
        )
        report: BackwardReport = self.run(command, payload)
        return report

    # every process ---------------------------------------------------------------------

    def serve(self, label: str) -> None:
        """Execute rank 0's commands until it exits; a command's common error is rank 0's to handle."""
        while True:
            header = self.comm.next_command(self.last)
            self.last, self.state.commands = header.label, header.seq
            if isinstance(header.command, Exit):
                self._release(header.release)
                if header.command.error is not None:
                    raise header.command.error.rebuild()
                return None
            try:
                self.execute(header, None)
            except PeerError:
                raise
            except Exception:  # noqa: BLE001 - see below
                continue  # every process raised it at this command; rank 0's fn decides what follows

    def execute(self, header: Header, payload: torch.Tensor | None) -> Any:
        """Execute one command here: the function of its type (``_EXECUTORS``), after dropping the released outputs."""
        self._release(header.release)
        return _EXECUTORS[type(header.command)](self, header.command, header.label, payload)

    def _trainer_call(self, command: TrainerCall, label: str, payload: torch.Tensor | None) -> Any:
        calls: dict[str, Callable[..., Any]] = {
            "optim_step": self.trainer.optim_step,
            "zero_grad": self.trainer.zero_grad,
        }
        call = calls[command.method]
        return self._agreed(label, lambda: call(**command.kwargs))

    def _exit(self, command: Exit, label: str, payload: torch.Tensor | None) -> None:
        return None

    def _agreed(self, label: str, work: Callable[[], Any]) -> Any:
        """Run ``work`` here, then make every process raise the same error if any failed."""
        error: Exception | None = None
        try:
            result = work()
        except Exception as exc:  # noqa: BLE001 - agreed with every process, which all raise it
            error, result = exc, None
        self.comm.agree(error, f"{label}: outcome")
        return result

    def _release(self, handles: tuple[int, ...]) -> None:
        for handle in handles:
            self.state.outputs.pop(handle, None)
            self.state.proxies.pop(handle, None)
            self.state.owners.pop(handle, None)

    def _forward(self, command: Forward, label: str, tokens: torch.Tensor | None) -> list[ForwardOutput] | None:
        """Every process: receive the tokens, run its logical ranks' inputs, gather the outputs on rank 0 as proxies."""
        state = self.state
        tokens = self._received_tokens(command, label, tokens)
        chunks = spread(len(command.lengths), state.layout.logical_dp)
        made = self._agreed(label, lambda: self._forward_hosted(command, chunks, tokens))
        for handle, logical_rank, out in made:
            state.outputs[handle] = (logical_rank, out.target_logprobs)
        gathered, described = self._gathered(command, chunks, made, label)
        if gathered is None:  # not rank 0: its outputs stay here, rank 0 holds the proxies
            return None
        return self._proxies(command, chunks, gathered, described)

    def _received_tokens(self, command: Forward, label: str, tokens: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's token payload, on the CPU: each input's ids then its target ids."""
        if tokens is None:
            tokens = torch.empty(2 * sum(command.lengths), dtype=torch.long)
        return self.comm.broadcast(tokens, label).cpu()

    def _forward_hosted(
        self, command: Forward, chunks: list[range], tokens: torch.Tensor
    ) -> list[tuple[int, int, ForwardOutput]]:
        """``(handle, logical rank, output)`` for the inputs of every logical rank this process hosts; the caller's RNG kept."""
        state = self.state
        offsets = [0]
        for n in command.lengths:
            offsets.append(offsets[-1] + 2 * n)

        def item(i: int) -> ForwardInput:
            ids = tokens[offsets[i] : offsets[i + 1]].view(2, -1)
            return ForwardInput(ids[0].to(state.device), ids[1].to(state.device), command.options[i])

        made: list[tuple[int, int, ForwardOutput]] = []
        caller = rng_state(state.device)
        try:
            for logical_rank in state.layout.hosted:
                if not chunks[logical_rank]:
                    continue
                with state.as_rank(logical_rank):
                    outputs = self.trainer.forward(
                        [item(i) for i in chunks[logical_rank]],
                        checkpoint=command.checkpoint,
                        options=command.call_options,
                    )
                made.extend((command.first + i, logical_rank, out) for i, out in zip(chunks[logical_rank], outputs))
        finally:
            set_rng_state(caller, state.device)
        return made

    def _gathered(
        self, command: Forward, chunks: list[range], made: list[tuple[int, int, ForwardOutput]], label: str
    ) -> tuple[list[torch.Tensor] | None, list[tuple[Any, ...]]]:
        """Every process's output values (rank 0 only; ``None`` elsewhere) and their descriptions, in process order."""
        per_process = self.state.layout.per_process
        sizes = [  # output elements each process hosts
            sum(
                command.lengths[i]
                for logical_rank in range(p * per_process, (p + 1) * per_process)
                for i in chunks[logical_rank]
            )
            for p in range(self.comm.world_size)
        ]
        local = torch.cat([out.target_logprobs.detach().reshape(-1) for _, _, out in made]) if made else torch.zeros(0)
        gathered = self.comm.gather(local.to(self.comm.device), sizes, label)
        described = [(h, out.version, out.placement, out.decision) for h, _, out in made]
        metas = self.comm.exchange(described, f"{label}: outputs")
        return gathered, [m for part in metas for m in part]

    def _proxies(
        self, command: Forward, chunks: list[range], gathered: list[torch.Tensor], described: list[tuple[Any, ...]]
    ) -> list[ForwardOutput]:
        """Rank 0's outputs: a leaf copy of each gathered output, released everywhere once the caller drops it."""
        state = self.state
        values = torch.cat([g.to(state.device) for g in gathered])
        results, offset = [], 0
        for handle, version, placement, decision in described:
            index = handle - command.first
            n = command.lengths[index]
            proxy = values[offset : offset + n].clone().requires_grad_(version is not None)
            offset += n
            state.proxies[handle] = weakref.ref(proxy)
            state.owners[handle] = next(logical_rank for logical_rank, c in enumerate(chunks) if index in c)
            weakref.finalize(proxy, state.dropped.append, handle)
            results.append(
                ForwardOutput(target_logprobs=proxy, version=version, placement=placement, decision=decision)
            )
        return results

    def _backward(self, command: Backward, label: str, cotangents: torch.Tensor | None) -> BackwardReport | None:
        state = self.state
        used = command.used
        if cotangents is None:
            cotangents = payload_buffer(command)
        cotangents = self.comm.broadcast(cotangents, label).to(state.device)
        per_rank: dict[int, list[tuple[int, torch.Tensor]]] = {logical_rank: [] for logical_rank in state.layout.hosted}
        offset = 0
        for handle, logical_rank, n in used:
            if logical_rank in per_rank:
                per_rank[logical_rank].append((handle, cotangents[offset : offset + n]))
            offset += n

        def body(logical_rank: int) -> BackwardReport:
            pairs = per_rank[logical_rank]
            if not pairs:
                FiberCoordinator().agree(None)  # nothing to commit, but this rank still takes part
                return BackwardReport(records=[])
            terms = []
            for handle, cotangent in pairs:
                if handle not in state.outputs:
                    raise GradientCommitError(f"zero-mode output {handle} was already released; forward again")
                leaf = state.outputs[handle][1]
                terms.append((leaf * cotangent.view_as(leaf)).sum())
            surrogate = torch.stack(terms).sum() if len(terms) > 1 else terms[0]
            sink = self.trainer.rank_gradients.buffers[logical_rank]
            return self.trainer.backward(
                surrogate, retain_graph=command.retain_graph, sink=sink, coordinator=FiberCoordinator()
            )

        bodies = {rank: (lambda rank=rank: body(rank)) for rank in state.layout.hosted}
        reports = drive(state, label, bodies, share=True)
        return BackwardReport(records=[r for report in reports for r in report.records])


_NAMES: dict[type, str] = {Forward: "forward", Backward: "backward", Exit: "exit"}
_EXECUTORS: dict[type, Callable[[ZeroSession, Any, str, torch.Tensor | None], Any]] = {
    Forward: ZeroSession._forward,
    Backward: ZeroSession._backward,
    TrainerCall: ZeroSession._trainer_call,
    Exit: ZeroSession._exit,
}
