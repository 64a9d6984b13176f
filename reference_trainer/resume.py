"""What a trainer's save holds, and how a loaded trainer takes it back.

NOTE [Resume]
  1. Kept: every checkpoint's parameters, AdamW state, FP32 masters, revision, generation, committed ``.grad`` and
     their origins (forward version, staleness bound); the ``ForwardOptions``, each checkpoint's LoRA/full choice and
     ``AdamWConfig``; the next generation number; the process RNG (CPU and the device's CUDA generator) and every
     logical rank's stream (NOTE [Logical ranks] Rule 2); the base model's config and a digest of its weights, so a
     different base is refused at load. Together these make a resumed job continue bitwise.
  2. Not kept: pending forwards (live autograd graphs); the saver can still backpropagate them, the loaded trainer
     has none and the caller makes them again. For that a save keeps the weights of every older revision a pending
     forward used, with the largest staleness bound at it, so a forward made again at ``checkpoint=output.version``
     runs on exactly its weights (NOTE [Weight captures] Rule 4), and the current log-probs a ``"when_available"``
     correction would use (NOTE [Importance correction] Rule 7), per logical rank and checkpoint, held while the
     checkpoint stays at their revision. Bitwise only when the remade forwards draw no randomness (dropout draws
     after the saved RNG). A save holds the saver's identity and lineage (NOTE [Forward records] Rule 5); the loaded
     trainer's lineage is that plus that identity, so a loss reaching an output of any trainer it resumed (through any
     chain of saves) raises ``CheckpointReplacedError`` and changes nothing, as after ``load_checkpoint``. Another
     trainer's output, or one of a checkpoint added after the save, is a ``ConfigError``; a save without a lineage
     loads with an empty one. Admission's memory knowledge, the limits and the calibration belong to the machine:
     ``Trainer.load`` takes them again, as ``Trainer`` does.
  3. Refused, nothing written: a save while logical-rank gradient buffers are pending (call ``optim_step`` or
     ``zero_grad`` first), and a save from inside ``run_logical``'s ``fn``; neither state could be restored whole.
  4. Staleness: revision and generation come back exactly, so a committed gradient's origin has the same age after
     the load (NOTE [Staleness] Rule 1) and ``optim_step`` accepts or refuses it as it would have without the save.
  5. Processes: logical ranks replicate the whole trainer state on every process, so rank 0 alone writes the one
     copy; ``save`` is collective in a process group. A forward pends where its logical rank is hosted
     (NOTE [Logical ranks] Rule 2), so Rule 2's kept state is gathered from every process (``save_pending.py``), as
     are the hosted ranks' streams; rank 0 writes and its outcome is agreed (before any ``run_logical``, broadcast
     over the default group as a ``PeerFailure``: the trainer's errors do not unpickle). At load every process reads
     the shared folder and takes the replicated state and rank 0's process RNG; the first ``run_logical`` with the
     saved ``logical_dp`` takes its hosted ranks' saved streams (``RankGradients.attach``), so any ``W`` dividing
     ``L`` continues the same job bitwise (NOTE [Logical ranks] Rule 4).
  6. A load verifies every file (NOTE [Durable saves] Rule 3), decodes and checks every field (``save_meta.py``;
     ``rng.pt`` too: a bad one is a ``CorruptSaveError`` naming it) and the base model before the trainer is built,
     and every checkpoint's state before any is restored; a load refused after construction froze the model puts its
     ``requires_grad`` back. So a refused load changes nothing: not the model passed, not the RNG. A path that is not
     a ``str`` or ``os.PathLike`` is a ``ConfigError``, at save and at load.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from .adamw import AdamWConfig
from .checkpoints import Checkpoint, CheckpointVersion
from .errors import ConfigError, CorruptSaveError
from .lora import LoRAConfig
from .model import DecoderLM
from .model_identity import model_identity
from .options import ForwardOptions
from .peers import PeerFailure
from .rng import RngState, rng_state, set_rng_state
from .save_meta import TRAINER, CheckpointMeta, check_revisions, decode_meta, encode_options
from .save_pending import (
    Kept,
    LogprobRow,
    agreed_kept,
    agreed_logprobs,
    check_logprobs,
    group_exchange,
    resume_logprobs,
)
from .saves import FileData, read_folder, write_folder
from .sinks import RankGradients

__all__ = ["FORMAT", "SavedCheckpoint", "SavedTrainer", "load_trainer", "read_save", "write_save"]

FORMAT = {"format": "reference-trainer-save", "version": 1}
_RNG = "rng.pt"
_Trainer = TypeVar("_Trainer")  # ``Trainer``, which imports this module


def _check_path(path: object) -> None:
    """A ``ConfigError`` unless ``path`` names a folder as a ``str`` or ``os.PathLike`` of one (Rule 6)."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise ConfigError("path", path, "a folder path: a str or an os.PathLike (e.g. pathlib.Path)")


def write_save(trainer: Any, path: str | os.PathLike[str]) -> None:
    """``trainer.save(path)``: refuse what Rule 3 refuses, then write on rank 0 (Rule 5). ``trainer``: a ``Trainer``."""
    _check_path(path)
    sink: RankGradients = trainer.rank_gradients
    sink.check_caller("save")
    host = sink.host
    pending = sink.pending()
    error = None
    if pending:
        error = ConfigError(
            "trainer.save",
            f"{pending} pending logical-rank gradient buffer(s)",
            "no pending logical-rank gradients",
            hint="call optim_step() or zero_grad() on every process, then save",
        )
    if host is not None:
        host.agree(error, "save: pending logical gradients")
    elif error is not None:
        raise error
    if host is None:
        agreed = agreed_kept(trainer, group_exchange), agreed_logprobs(trainer, group_exchange)
        _write_on_rank_zero(path, lambda: _encode(trainer, sink.resumed, *agreed))
        return
    streams = (host.logical_dp, host.all_streams("save: logical RNG streams"))
    agreed = agreed_kept(trainer, host.exchange), agreed_logprobs(trainer, host.exchange)
    written: Exception | None = None
    if host.leader:
        try:
            write_folder(path, _encode(trainer, streams, *agreed))
        except Exception as exc:  # noqa: BLE001 - every process raises it (Rule 5)
            written = exc
    host.agree(written, "save: written")


def _write_on_rank_zero(path: str | os.PathLike[str], files: Callable[[], dict[str, FileData]]) -> None:
    """Without logical ranks: write alone, or, in a process group, on rank 0 with its outcome broadcast (Rule 5)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        write_folder(path, files())
        return
    outcome: list[PeerFailure | None] = [None]
    if dist.get_rank() == 0:
        try:
            write_folder(path, files())
        except Exception as exc:
            outcome[0] = PeerFailure.of(exc, "rank 0")  # the trainer's errors do not unpickle (their __init__)
            dist.broadcast_object_list(outcome, src=0)
            raise
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise outcome[0].rebuild()


def _checkpoint_bytes(checkpoint: Checkpoint, kept: Kept, logprobs: list[LogprobRow]) -> memoryview:
    """One checkpoint's file: its live state serialised in place (no device copy), committed grads, the kept
    versions' weights and the current log-probs pending forwards can use included."""
    state = checkpoint.state_view()
    state["grads"] = {n: p.grad.detach() for n, p in checkpoint.named_parameters() if p.grad is not None}
    state["kept"] = {revision: {n: t.detach() for n, t in tensors.items()} for revision, (tensors, _) in kept.items()}
    state["logprobs"] = logprobs
    return _tensors(state)


def _encode(
    trainer: Any,
    streams: tuple[int, dict[int, RngState]] | None,
    agreed: dict[str, Kept],
    logprobs: dict[str, list[LogprobRow]],
) -> dict[str, FileData]:
    """The save's files, with what every process's pending forwards need (``save_pending``); each checkpoint's made
    only when written (NOTE [Durable saves] Rule 4)."""
    files: dict[str, FileData] = {}
    specs = []
    for index, checkpoint in enumerate(trainer.checkpoints.values()):
        file = f"checkpoint-{index}.pt"
        kept = agreed[checkpoint.name]
        files[file] = functools.partial(_checkpoint_bytes, checkpoint, kept, logprobs[checkpoint.name])
        specs.append(
            {
                "name": checkpoint.name,
                "file": file,
                "lora": None if checkpoint.lora_config is None else asdict(checkpoint.lora_config),
                "optimizer": asdict(checkpoint.optimizer_config),
                "generation": checkpoint.generation,
                "origins": sorted([v.generation, v.revision, bound] for v, bound in checkpoint.origins),
                "kept": sorted([revision, bound] for revision, (_, bound) in kept.items()),
            }
        )
    meta = {
        **FORMAT,
        "model": model_identity(trainer.model),
        "options": encode_options(trainer.options),
        "next_generation": trainer.next_generation,
        "checkpoints": specs,
        "logical_dp": None if streams is None else streams[0],
        "identity": trainer.records.identity,  # Rule 2
        "lineage": sorted(trainer.records.lineage),
    }
    files[TRAINER] = json.dumps(meta, indent=1).encode()
    files[_RNG] = _tensors({"process": rng_state(trainer.device), "streams": {} if streams is None else streams[1]})
    return files


@dataclass(frozen=True)
class SavedCheckpoint:
    """One checkpoint of a save: how to build it, and the state to load into it."""

    name: str
    lora: LoRAConfig | None
    optimizer: AdamWConfig
    generation: int
    state: dict[str, Any]  # Checkpoint.state_dict() plus "grads" and "kept"
    origins: set[tuple[CheckpointVersion, int]]
    kept: dict[int, int]  # revision -> staleness bound (Rule 2)

    def check(self, checkpoint: Checkpoint) -> None:
        """Raise ``ConfigError`` unless the state, committed gradients and kept weights fit ``checkpoint`` exactly."""
        checkpoint.check_state_dict(self.state)
        kept = self.state.get("kept", {})
        if not isinstance(kept, dict) or set(kept) != set(self.kept):
            raise ConfigError(f"saved kept versions of {self.name!r}", sorted(kept), f"revisions {sorted(self.kept)}")
        for where, tensors in [("gradient", self.state["grads"]), *((f"revision {r}", t) for r, t in kept.items())]:
            if not isinstance(tensors, dict) or not set(tensors) <= {n for n, _ in checkpoint.named_parameters()}:
                found = sorted(map(str, tensors)) if isinstance(tensors, dict) else type(tensors).__name__
                raise ConfigError(f"saved {where} of {self.name!r}", found, "tensors of this checkpoint's parameters")
            for name, tensor in tensors.items():
                live = checkpoint.parameter(name)
                if not isinstance(tensor, torch.Tensor) or (tensor.shape, tensor.dtype) != (live.shape, live.dtype):
                    wrong = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else tensor
                    raise ConfigError(
                        f"saved {where} of {self.name!r} parameter {name!r}",
                        wrong,
                        f"shape {tuple(live.shape)}, dtype {live.dtype}",
                    )
        if any(set(t) != {n for n, _ in checkpoint.named_parameters()} for t in kept.values()):
            raise ConfigError(f"saved kept versions of {self.name!r}", sorted(kept), "every parameter's weights")
        check_logprobs(self.name, self.state.get("logprobs", []))

    def restore(self, checkpoint: Checkpoint) -> None:
        """Load the state, the generation, the committed gradients, their origins and the kept versions (checked)."""
        checkpoint.load(self.state, self.generation)
        for name, grad in self.state["grads"].items():
            live = checkpoint.parameter(name)
            live.grad = grad.to(live.device)
        checkpoint.origins |= self.origins
        for revision, tensors in self.state.get("kept", {}).items():
            checkpoint.keep(revision, tensors, self.kept[revision])


@dataclass(frozen=True)
class SavedTrainer:
    """A verified, decoded save: everything ``Trainer.load`` builds the trainer from (Rule 6)."""

    options: ForwardOptions | None
    next_generation: int
    checkpoints: list[SavedCheckpoint]
    process_rng: RngState
    streams: tuple[int, dict[int, RngState]] | None
    lineage: frozenset[str]  # the saving trainer's lineage and identity (Rule 2)

    def restore(self, trainer: Any) -> None:
        """Into ``trainer`` (a ``Trainer`` just built with these checkpoints): every checkpoint's state checked, then
        restored, the lineage, then the RNG (Rules 1, 2, 5, 6)."""
        for saved in self.checkpoints:
            saved.check(trainer.checkpoint(saved.name))
        for saved in self.checkpoints:
            saved.restore(trainer.checkpoint(saved.name))
            resume_logprobs(trainer, trainer.checkpoint(saved.name), saved.state.get("logprobs", []))
        trainer.records.resume(self.lineage, lambda name: _generation(trainer, name))
        trainer.rank_gradients.resumed = self.streams
        set_rng_state(self.process_rng, trainer.device)


def _generation(trainer: Any, name: str) -> int | None:
    """The current generation of ``trainer``'s checkpoint ``name``, or ``None`` without one."""
    checkpoint = trainer.checkpoints.get(name)
    return None if checkpoint is None else checkpoint.generation


def load_trainer(
    cls: Callable[..., _Trainer],
    path: str | os.PathLike[str],
    model: DecoderLM,
    memory_limit_bytes: int | None,
    host_memory_limit_bytes: int | None,
    planner_calibration: Any = None,
) -> _Trainer:
    """``Trainer.load``: read and check everything (Rule 6), then build ``cls`` (the ``Trainer``) and restore it."""
    saved = read_save(path, model)
    with _unfrozen_if_refused(model):
        trainer: Any = cls(
            model,
            options=saved.options,
            memory_limit_bytes=memory_limit_bytes,
            host_memory_limit_bytes=host_memory_limit_bytes,
            planner_calibration=planner_calibration,
        )
        for spec in saved.checkpoints:
            trainer.add_checkpoint(spec.name, lora=spec.lora, full=spec.lora is None, optimizer=spec.optimizer, seed=0)
        trainer.next_generation = saved.next_generation
        saved.restore(trainer)
    return cast(_Trainer, trainer)  # built by ``cls``


@contextlib.contextmanager
def _unfrozen_if_refused(model: DecoderLM) -> Iterator[None]:
    """Put back every parameter's ``requires_grad`` (what building a trainer changes) if the block raises (Rule 6)."""
    flags = [(param, param.requires_grad) for param in model.parameters()]
    try:
        yield
    except BaseException:
        for param, flag in flags:
            param.requires_grad_(flag)
        raise


def read_save(path: str | os.PathLike[str], model: DecoderLM) -> SavedTrainer:
    """The save in force under ``path``, verified and decoded for ``model``, which must be the saved base (Rule 6)."""
    _check_path(path)
    if not isinstance(model, DecoderLM):
        raise ConfigError("model", type(model).__name__, "a reference_trainer.DecoderLM")
    files = read_folder(path)
    for required in (TRAINER, _RNG):
        if required not in files:
            raise CorruptSaveError(
                path, required, "missing", "a file every save writes", f"a manifest of {sorted(files)}"
            )
    meta = decode_meta(path, files[TRAINER], set(files), FORMAT)
    identity = model_identity(model)
    if meta.model != identity:
        differs = "config" if meta.model["config"] != identity["config"] else "weights"
        raise ConfigError(
            "model",
            f"a base model whose {differs} differ from the saved one's",
            f"the base model the save was made with ({meta.model['config']})",
        )
    # Decoded on the host: a checkpoint copies its state onto the device one tensor at a time (a whole decoded
    # save on the device would double its memory, and the default limit, taken at construction, would count
    # it), and AdamW's step counters stay on the host, where torch keeps them in a run that never stopped.
    rng = _load_tensors(files[_RNG])
    _check_rng(path, rng, meta.logical_dp)
    checkpoints = [
        _saved_checkpoint(path, index, spec, _load_tensors(files[spec.file]))
        for index, spec in enumerate(meta.checkpoints)
    ]
    streams = None if meta.logical_dp is None else (meta.logical_dp, rng["streams"])
    return SavedTrainer(meta.options, meta.next_generation, checkpoints, rng["process"], streams, meta.lineage)


def _check_rng(path: str | os.PathLike[str], rng: Any, logical_dp: int | None) -> None:
    """``CorruptSaveError`` on ``rng.pt`` unless it holds what a save writes: the process RNG state and, with
    ``logical_dp``, a stream of every logical rank, else none (Rule 6: checked before anything changes)."""

    def fail(expected: str, found: object) -> CorruptSaveError:
        return CorruptSaveError(path, _RNG, "invalid", expected, repr(found)[:200])

    if not isinstance(rng, dict) or set(rng) != {"process", "streams"}:
        raise fail("a dict of 'process' and 'streams'", sorted(rng) if isinstance(rng, dict) else type(rng).__name__)
    streams = rng["streams"]
    ranks = set(range(logical_dp or 0))
    if not isinstance(streams, dict) or set(streams) != ranks:
        raise fail(
            f"'streams' a dict of logical ranks {sorted(ranks)} (logical_dp {logical_dp})",
            sorted(streams) if isinstance(streams, dict) else type(streams).__name__,
        )
    cpu = torch.get_rng_state()
    for where, state in [("process", rng["process"]), *((f"streams[{r}]", s) for r, s in streams.items())]:
        ok = (
            isinstance(state, (tuple, list))
            and len(state) == 2
            and all(
                t is None or (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1) for t in state
            )
        )
        if not ok or state[0] is None or state[0].shape != cpu.shape:
            raise fail(
                f"'{where}' an RNG state: a CPU generator state (uint8, {tuple(cpu.shape)}) and a CUDA one "
                "(uint8) or None",
                state,
            )


def _saved_checkpoint(path: str | os.PathLike[str], index: int, spec: CheckpointMeta, state: Any) -> SavedCheckpoint:
    """A checkpoint's entry and its file's state, their revisions checked against each other."""
    revision = state.get("revision") if isinstance(state, dict) else None
    if not isinstance(revision, int) or isinstance(revision, bool) or not isinstance(state.get("grads"), dict):
        raise ConfigError(
            f"saved state of {spec.name!r}",
            type(state).__name__,
            "Checkpoint.state_dict() with an int 'revision' and 'grads'",
        )
    check_revisions(path, index, spec, revision)
    return SavedCheckpoint(
        name=spec.name,
        lora=spec.lora,
        optimizer=spec.optimizer,
        generation=spec.generation,
        state=state,
        origins=spec.origins,
        kept=spec.kept,
    )


def _tensors(value: Any) -> memoryview:
    """``value`` serialised: a view of the buffer itself (``getvalue`` would hold a second host copy)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getbuffer()


def _load_tensors(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
