"""Checkpoints own their trainable state and count its versions.

NOTE [Weight captures]
  1. A forward never differentiates the live parameters. It runs on a
     *capture*: one leaf tensor per trainable parameter that aliases the live
     storage but has its own autograd version counter (``param.data``), tagged
     with the :class:`CheckpointVersion` it was taken at. Captures of one
     version are shared by every forward at that version.
  2. Copy on write: before the trainer mutates a live parameter in place
     (optimizer step, load), it moves the live parameter to a fresh copy of its
     storage if a capture of the current version is still alive. The capture
     keeps the old storage, so old graphs still see exactly the forward's
     weights, at the cost of one copy per live revision and nothing at all
     when no graph outlives the step.
  3. Ledger: a capture records each parameter's version counter when taken.
     If a capture still aliases its live parameter at backward and that
     counter moved, the weights were written in place behind the trainer's
     back; the backward refuses instead of computing a wrong gradient.
  4. Kept versions: a loaded trainer holds the captures of older revisions
     that the saving trainer's pending forwards used (NOTE [Resume] Rule 2),
     so a forward made again at such a version (``checkpoint=`` a
     ``CheckpointVersion``) runs on exactly its weights. A kept version goes
     once no forward at it could be backpropagated any more: when the
     revision moves past the largest staleness bound those forwards had, or
     when the checkpoint is loaded over.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .adamw import AdamWConfig, check_adamw_state
from .errors import ConfigError, GradientCommitError, int_at_least, is_number
from .grad_norms import KnownNorm, total_norm
from .lora import LoRAAdapter, LoRAConfig
from .model import DecoderLM
from .weight_state import check_weight_state

__all__ = [
    "CheckpointVersion",
    "AdamWConfig",
    "Checkpoint",
    "CheckpointStep",
    "WeightCapture",
    "BASE",
    "check_step_arguments",
    "needs_master",
]


class _Base:
    def __repr__(self) -> str:
        return "BASE"

    def __reduce__(self) -> str:
        return "BASE"


BASE: Any = _Base()
"""Pass as ``checkpoint=`` to run the frozen base model with no grad."""


@dataclass(frozen=True, order=True)
class CheckpointVersion:
    """The exact weights a forward used: checkpoint name, generation, revision."""

    name: str
    generation: int
    revision: int


@dataclass(frozen=True, kw_only=True)
class CheckpointStep:
    """What ``optim_step`` did to one checkpoint: stepped or why not, the gradient norm, clipped, the revision after."""

    stepped: bool
    reason: str | None
    grad_norm: float | None
    clipped: bool
    revision: int


@dataclass(eq=False)
class WeightCapture:
    """Immutable leaves standing for a checkpoint's weights at one version (NOTE [Weight captures])."""

    version: CheckpointVersion
    tensors: dict[str, torch.Tensor]
    stamps: dict[str, int]
    targets: dict[str, nn.Parameter] = field(repr=False)

    def check_ledger(self) -> None:
        """Raise if a live parameter that still shares storage was written in place (Rule 3)."""
        for name, tensor in self.tensors.items():
            live = self.targets[name]
            shares = tensor.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
            if shares and live._version != self.stamps[name]:
                raise GradientCommitError(
                    f"checkpoint {self.version.name!r}: parameter {name!r} was modified in place "
                    f"outside the trainer after the forward (version counter {self.stamps[name]} "
                    f"at forward, {live._version} now); expected weight changes only through "
                    "optim_step or load_checkpoint. Forward again."
                )


class Checkpoint:
    """A named set of trainable parameters with its AdamW state and version counters.

    ``revision`` counts successful optimizer steps; ``generation`` changes when
    the checkpoint is loaded over. Parameters below FP32 (BF16, FP16) step
    through FP32 master copies; FP32 and FP64 parameters step in place, at
    their own precision (:func:`needs_master`).
    """

    def __init__(
        self,
        name: str,
        model: DecoderLM,
        *,
        lora: LoRAConfig | None,
        full: bool,
        optimizer: AdamWConfig,
        generation: int,
        seed: int | None = None,
    ) -> None:
        self.name = name
        self.lora_config = lora
        self.optimizer_config = optimizer
        self.generation = generation
        self.revision = 0
        if lora is not None:
            self.adapter: LoRAAdapter | None = LoRAAdapter(model, lora, seed=seed)
            params = dict(self.adapter.named_parameters())
        else:
            self.adapter = None
            params = {n: nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
        self._params: dict[str, nn.Parameter] = params
        self._masters = {
            n: p.detach().float().clone().requires_grad_(True) for n, p in params.items() if needs_master(p.dtype)
        }
        self._master_grads: dict[str, torch.Tensor] = {}  # FP32 gradient buffers, allocated at the first step
        stepped = [self._masters.get(n, p) for n, p in params.items()]
        self._optimizer = torch.optim.AdamW(
            stepped,
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
        )
        self._capture_ref: weakref.ref[WeightCapture] | None = None
        self.kept: dict[int, tuple[WeightCapture, int]] = {}  # revision -> (capture, staleness bound) (Rule 4)
        # (forward version, staleness bound) of every committed gradient.
        self.origins: set[tuple[CheckpointVersion, int]] = set()
        self._known_norm: KnownNorm | None = None  # NOTE [Gradient norm] in grad_norms.py

    @property
    def is_full(self) -> bool:
        return self.adapter is None

    @property
    def version(self) -> CheckpointVersion:
        return CheckpointVersion(self.name, self.generation, self.revision)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The live trainable parameters; ``.grad`` holds committed gradients."""
        yield from self._params.items()

    def parameters(self) -> Iterator[nn.Parameter]:
        yield from self._params.values()

    def parameter(self, name: str) -> nn.Parameter:
        """The live trainable parameter ``name`` (``KeyError`` if it has none of that name)."""
        return self._params[name]

    def has_gradients(self) -> bool:
        return any(p.grad is not None for p in self._params.values())

    def trainable_nbytes(self) -> int:
        return sum(_nbytes(p) for p in self._params.values())

    def held_nbytes(self) -> int:
        """Device bytes held, what the next step allocates included (NOTE [Memory admission] Rule 1): parameters,
        masters and their gradient buffers, AdamW's ``exp_avg``/``exp_avg_sq`` (like each stepped tensor), ``.grad``,
        the weights of kept versions (Rule 4)."""
        masters = sum(_nbytes(m) for m in self._masters.values())
        moments = sum(_nbytes(self._masters.get(n, p)) for n, p in self._params.items())
        grads = sum(_nbytes(p.grad) for p in self._params.values() if p.grad is not None)
        kept = sum(_nbytes(t) for capture, _ in self.kept.values() for t in capture.tensors.values())
        return self.trainable_nbytes() + 2 * masters + 2 * moments + grads + kept

    # --- captures (NOTE [Weight captures]) -------------------------------------------

    def capture(self) -> WeightCapture:
        """The capture of the current version, shared while any forward holds it (Rule 1)."""
        current = self._capture_ref() if self._capture_ref is not None else None
        if current is not None and current.version == self.version:
            return current
        tensors = {n: p.data.requires_grad_(True) for n, p in self._params.items()}
        capture = WeightCapture(
            version=self.version,
            tensors=tensors,
            stamps={n: p._version for n, p in self._params.items()},
            targets=dict(self._params),
        )
        self._capture_ref = weakref.ref(capture)
        return capture

    def capture_at(self, version: CheckpointVersion) -> WeightCapture:
        """The capture of ``version``: the current one, or a kept one (Rule 4); ``ConfigError`` for any other."""
        if version == self.version:
            return self.capture()
        kept = self.kept.get(version.revision) if version.generation == self.generation else None
        if kept is None:
            held = [self.version, *(c.version for c, _ in self.kept.values())]
            raise ConfigError(
                "checkpoint",
                version,
                f"a version of {self.name!r} this trainer holds, one of {held}",
                hint="only a loaded trainer keeps older versions: those its save's pending forwards used",
            )
        return kept[0]

    def keep(self, revision: int, tensors: Mapping[str, torch.Tensor], bound: int) -> None:
        """Hold ``tensors`` (already checked against this checkpoint's names, shapes, dtypes) as the weights of
        ``revision`` of this generation, for forwards made again at it with staleness bound up to ``bound`` (Rule 4)."""
        leaves = {n: t.to(self._params[n].device).requires_grad_(True) for n, t in tensors.items()}
        version = CheckpointVersion(self.name, self.generation, revision)
        stamps = {n: t._version for n, t in leaves.items()}
        self.kept[revision] = (WeightCapture(version, leaves, stamps, dict(self._params)), bound)

    def _copy_on_write(self) -> None:
        """Give live parameters fresh storage if a capture still aliases it (Rule 2)."""
        current = self._capture_ref() if self._capture_ref is not None else None
        if current is not None:
            for name, param in self._params.items():
                if current.tensors[name].untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
                    param.data = param.data.clone()
        self._capture_ref = None

    # --- optimizer ------------------------------------------------------------------

    def remember_gradient_norm(self, known: KnownNorm) -> None:
        """``known`` measured the tensors that are now this checkpoint's ``.grad`` (NOTE [Gradient norm] Rule 2)."""
        self._known_norm = known

    def forget_gradient_norm(self) -> None:
        """A ``.grad`` is about to change: the remembered norm no longer applies (NOTE [Gradient norm] Rule 4)."""
        self._known_norm = None

    def clear_gradients(self) -> None:
        self.forget_gradient_norm()
        for param in self._params.values():
            param.grad = None
        for master in self._masters.values():
            master.grad = None
        self.origins.clear()

    def _stepped_tensors(self) -> list[torch.Tensor]:
        """The tensors AdamW steps, each with its ``.grad`` set: FP32 and FP64 parameters as they are,
        FP32 masters (gradient upcast) for lower-precision ones, so norms and clipping run in FP32 or better.

        A master's gradient is upcast into one buffer allocated at the first
        step and reused by every later one (held between steps: allocating
        the FP32 gradients of an 8B model anew every step fragments the pool)."""
        for name, master in self._masters.items():
            grad = self._params[name].grad
            if grad is None:
                master.grad = None
                continue
            if name not in self._master_grads:
                self._master_grads[name] = torch.empty_like(master)
            master.grad = self._master_grads[name].copy_(grad)
        return [self._masters.get(n, p) for n, p in self._params.items() if self._params[n].grad is not None]

    def _copy_back_clipped_gradients(self) -> None:
        """After clipping the masters' gradients, leave ``.grad`` clipped too, as for FP32 parameters."""
        with torch.no_grad():
            for name, master in self._masters.items():
                grad = self._params[name].grad
                if grad is not None and master.grad is not None:
                    grad.copy_(master.grad)

    def step(self, lr: float | None, max_grad_norm: float | None) -> CheckpointStep:
        """One AdamW step on the committed gradients, if any and if their norm is finite (clipped first)."""
        if not self.has_gradients():
            return CheckpointStep(
                stepped=False, reason="no gradients", grad_norm=None, clipped=False, revision=self.revision
            )
        params = self._stepped_tensors()  # FP32: the live parameters; else FP32 masters
        known, grads = self._known_norm, [p.grad for p in params if p.grad is not None]
        if known is not None and known.matches(grads):  # NOTE [Gradient norm] Rule 3: no pass, no host read
            value, norm = known.norm, known.tensor
        else:
            measured = total_norm(grads)
            value, norm = float(measured), lambda: measured
        if not math.isfinite(value):
            self.clear_gradients()
            reason = f"non-finite gradient norm ({value}); gradients cleared"
            return CheckpointStep(stepped=False, reason=reason, grad_norm=value, clipped=False, revision=self.revision)
        clipped = False
        if max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm())
            self._copy_back_clipped_gradients()
            clipped = value > max_grad_norm
        self._apply_step(lr)
        return CheckpointStep(stepped=True, reason=None, grad_norm=value, clipped=clipped, revision=self.revision)

    def _apply_step(self, lr: float | None) -> None:
        """One AdamW step on the gradients of :meth:`_stepped_tensors`; revision + 1."""
        self._copy_on_write()
        group = self._optimizer.param_groups[0]
        saved_lr = group["lr"]
        if lr is not None:
            group["lr"] = lr
        try:
            self._optimizer.step()
        finally:
            group["lr"] = saved_lr
        with torch.no_grad():
            for name, master in self._masters.items():
                self._params[name].copy_(master)
        self.revision += 1
        self.kept = {r: kept for r, kept in self.kept.items() if self.revision - r <= kept[1]}  # Rule 4

    # --- persistence ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"parameters", "optimizer", "revision"}`` (+ ``"master_parameters"`` for low precision)."""
        state: dict[str, Any] = {
            "parameters": {n: p.detach().clone() for n, p in self._params.items()},
            "optimizer": _clone_nested(self._optimizer.state_dict()),
            "revision": self.revision,
        }
        if self._masters:
            state["master_parameters"] = {n: m.detach().clone() for n, m in self._masters.items()}
        return state

    def state_view(self) -> dict[str, Any]:
        """What :meth:`state_dict` holds, but the live tensors themselves (detached, not copied).

        For serialising in place (``trainer.save``): a copy of a large
        model's state would double its device memory. Must not be modified,
        nor kept past the next step.
        """
        state: dict[str, Any] = {
            "parameters": {n: p.detach() for n, p in self._params.items()},
            "optimizer": self._optimizer.state_dict(),
            "revision": self.revision,
        }
        if self._masters:
            state["master_parameters"] = {n: m.detach() for n, m in self._masters.items()}
        return state

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise ``ConfigError`` unless ``state`` fits this checkpoint exactly.

        Everything ``load`` touches is checked here, so a refused state changes nothing.
        """
        check_weight_state(state, self._params)
        self._check_optimizer_state(state["optimizer"])
        revision = state["revision"]
        if not int_at_least(revision, 0):
            raise ConfigError("state_dict['revision']", revision, "an int >= 0")

    def _check_optimizer_state(self, optimizer: Any) -> None:
        """An AdamW state this checkpoint's optimizer can step: one group over these parameters (``adamw.py``)."""
        shapes = [tuple(p.shape) for p in self._params.values()]
        check_adamw_state(optimizer, self._optimizer.state_dict(), shapes, "state_dict['optimizer']")

    def load(self, state: Mapping[str, Any], generation: int) -> None:
        """Copy ``state`` in (already checked) and take ``generation``."""
        self._optimizer.load_state_dict(_clone_nested(state["optimizer"]))
        self._copy_on_write()
        self.clear_gradients()
        masters = state.get("master_parameters", {})
        with torch.no_grad():
            for name, param in self._params.items():
                param.copy_(state["parameters"][name])
                if name in self._masters:
                    self._masters[name].copy_(masters.get(name, state["parameters"][name]))
        self.revision = state["revision"]
        self.generation = generation
        self.kept = {}  # Rule 4: no forward at an older generation can step


def needs_master(dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` parameter steps through an FP32 master: only below FP32 (an FP64 one would be rounded)."""
    return dtype.itemsize < torch.float32.itemsize


def check_step_arguments(lr: float | None, max_grad_norm: float | None) -> None:
    """Raise ``ConfigError`` unless ``lr`` is None or finite >= 0 and ``max_grad_norm`` None or finite > 0."""
    for label, value, allowed in (
        ("lr", lr, "None or a finite number >= 0"),
        ("max_grad_norm", max_grad_norm, "None or a finite number > 0"),
    ):
        if value is None:
            continue
        if not is_number(value) or not math.isfinite(value) or value < 0:
            raise ConfigError(label, value, allowed)
        if label == "max_grad_norm" and value == 0:
            raise ConfigError(label, value, allowed)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _clone_nested(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_nested(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone_nested(v) for v in value]
    return value
