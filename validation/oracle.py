"""The FP64 oracle trainer: an independent model of a Trainer's contract for whole op sequences.

``OracleTrainer`` (NOTE [Oracle trainer] below) keeps every weight version,
predicts each op's error or gradients, steps its own FP64 AdamW
(``validation.oracle_step``), and never looks inside the trainer. The single-forward reference it builds on is
``validation.reference`` (re-exported here for existing callers).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from reference_trainer import (
    AdamWConfig,
    CheckpointBusyError,
    DecoderLM,
    GradientCommitError,
    ImportanceCorrection,
    LoRAConfig,
    token_logprobs,
)
from reference_trainer.lora import attach_lora
from reference_trainer.model import ModelConfig, RotaryEmbedding

from .enumeration import level_weights
from .oracle_state import (
    OracleBackward,
    OracleCheckpoint,
    OracleRecord,
    OracleRecordReport,
    OracleState,
    OracleStep,
    check_oracle_age,
)
from .oracle_step import oracle_optim_step
from .reference import WeightsAt, plain_gradients, relative_error, snapshot_weights, token_batch

__all__ = [
    "OracleTrainer",
    "OracleState",
    "OracleBackward",
    "OracleRecordReport",
    "OracleStep",
    # validation.reference, re-exported while tests/unit still import them from here
    "WeightsAt",
    "snapshot_weights",
    "plain_gradients",
    "relative_error",
]


# --- the FP64 oracle trainer ---------------------------------------------------------
#
# NOTE [Oracle trainer]
#   The oracle predicts what a Trainer must do, op by op, from the documented semantics alone (docs/semantics.md);
#   it shares only the model definition (DecoderLM, token_logprobs, attach_lora) and the public error types.
#   1. Versions: a checkpoint is at (generation, revision). The oracle keeps an FP64 copy of the trainable weights of
#      every version it has seen and never frees one.
#   2. A forward stores its sequences (copies), the RNG state it started from, its staleness bound and its
#      correction. Nothing is computed until a backward (or ``logprobs``) asks; then the FP64 model runs at the
#      forward's snapshot with that RNG state, from scratch.
#   3. Backward checks, in the trainer's documented order: an output whose record is gone (GradientCommitError); the
#      "user_autograd" fault (GradientCommitError, every record retryable); per record in submission order,
#      generation (CheckpointReplacedError) then age 0 <= current - forward revision <= bound (StaleGradientError),
#      the failing record released; the "model_backward" fault (the first record released); the "validate" fault and
#      the "publish" fault at index i < the number of staged parameters (every consumed record released). Any failure
#      changes no gradient.
#   4. A stale record with a correction gets token cotangents ``adv * clip(min(W, e**max_log_ratio), low, high)`` on
#      active tokens (non-zero cotangent, target not masked), ``W`` the level's weight formed from the ratios
#      ``exp(lp_current - lp_forward)`` over the row's unmasked targets (``validation.enumeration.level_weights``),
#      ``lp_current`` from the current weights with the forward's RNG state; the gradient is still taken at the
#      forward's weights. Fresh records are never corrected. Only ``policy="always"`` is modelled
#      (``"when_available"`` depends on what the trainer cached).
#   5. A success adds each record's gradient to the accumulated FP64 gradients and remembers (version, bound) as an
#      origin; records are released unless ``retain_graph``. With a ``baseline_dtype`` the oracle also computes every
#      gradient by plain autograd in that dtype (the trainer's): the rounding error any correct implementation has,
#      which scales the comparison tolerances (``validation.compare`` Rule 6).
#   6. ``optim_step`` re-checks every origin of every checkpoint first; then each checkpoint with gradients is clipped
#      (torch's rule: coefficient ``min(1, max_norm / (norm + 1e-6))``; the accumulated gradients stay clipped, as
#      ``clip_grad_norm_`` leaves ``.grad``) and stepped by ``torch.optim.AdamW`` on FP64 master copies; revision + 1.
#      The step can start from gradients the caller passes (the trainer's own), so it is judged from the same
#      starting point; ``sync`` then adopts the trainer's weights and optimizer state, so FP32 noise is not amplified
#      over many Adam steps.
#   7. ``load`` is refused (CheckpointBusyError) while the checkpoint has live records of any generation or
#      gradients, unless ``discard_graphs``; it drops gradients and origins and starts a new generation.


class OracleTrainer:
    """An independent FP64 model of a Trainer's contract (NOTE [Oracle trainer]).

    ``model_config`` and ``base_state`` describe the frozen base model (any
    dtype; run in FP64 on ``device``); ``training`` must match the trainer's
    model (dropout). Add checkpoints with :meth:`add_checkpoint` from the
    trainer's ``Checkpoint.state_dict()``. ``baseline_dtype``: also compute
    plain-autograd gradients in that dtype (Rule 5).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        base_state: Mapping[str, torch.Tensor],
        *,
        device: torch.device | str = "cpu",
        training: bool = True,
        baseline_dtype: torch.dtype | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.model = self._model(model_config, base_state, torch.float64, training)
        self.baseline_dtype = baseline_dtype
        self.baseline_model = None
        if baseline_dtype is not None:
            self.baseline_model = self._model(model_config, base_state, baseline_dtype, training)
        self._checkpoints: dict[str, OracleCheckpoint] = {}
        self._records: dict[int, OracleRecord] = {}
        self._next_record = 0

    def _model(
        self, config: ModelConfig, base_state: Mapping[str, torch.Tensor], dtype: torch.dtype, training: bool
    ) -> DecoderLM:
        """``base_state`` in ``dtype`` on the oracle's device: built on meta, storage allocated once on the
        device, filled tensor by tensor (never a second copy of the model: 8B in FP64 is 65 GB)."""
        config = config.replace(dtype=dtype)
        with torch.device("meta"):
            model = DecoderLM(config)
        model.to_empty(device=self.device)
        with torch.no_grad():
            for name, tensor in model.state_dict(keep_vars=True).items():
                tensor.copy_(base_state[name].detach())
            rotary = model.model.rotary_emb
            rotary.inv_freq.copy_(RotaryEmbedding(config.head_dim, config.rope_theta).inv_freq)
        return model.requires_grad_(False).train(training)

    # --- checkpoints -----------------------------------------------------------------

    def add_checkpoint(
        self,
        name: str,
        state_dict: Mapping[str, Any],
        *,
        lora: LoRAConfig | None,
        optimizer: AdamWConfig,
    ) -> None:
        """Start tracking checkpoint ``name`` at revision ``state_dict["revision"]``, generation 0."""
        params = state_dict["parameters"]
        dtype = next(iter(params.values())).dtype
        masters = {n: t.detach().to(self.device, torch.float64).clone().requires_grad_(True) for n, t in params.items()}
        adamw = torch.optim.AdamW(
            list(masters.values()),
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
            foreach=False,
        )
        ckpt = OracleCheckpoint(name, lora, dtype, {}, masters, adamw, revision=state_dict["revision"])
        self._checkpoints[name] = ckpt
        self.sync(name, state_dict)

    def sync(self, name: str, state_dict: Mapping[str, Any]) -> None:
        """Adopt a trainer checkpoint's weights, master weights and AdamW state (Rule 6).

        The revision and generation stay the oracle's own; the snapshot of the
        current version becomes these weights.
        """
        ckpt = self._checkpoints[name]
        masters = state_dict.get("master_parameters", {})
        with torch.no_grad():
            for n, value in state_dict["parameters"].items():
                ckpt.weights[n] = value.detach().to(self.device, torch.float64).clone()
                ckpt.masters[n].copy_(masters.get(n, value))
        ckpt.optimizer.load_state_dict(state_dict["optimizer"])
        ckpt.snapshot()

    def revision(self, name: str) -> int:
        return self._checkpoints[name].revision

    def generation(self, name: str) -> int:
        return self._checkpoints[name].generation

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        """FP64 values the live parameters must hold now."""
        return {n: w.clone() for n, w in self._checkpoints[name].weights.items()}

    def grads(self, name: str, *, baseline: bool = False) -> dict[str, torch.Tensor | None]:
        """Accumulated FP64 gradients (all None when there are none); ``baseline``: the plain ones."""
        ckpt = self._checkpoints[name]
        grads = ckpt.baseline_grads if baseline else ckpt.grads
        return {n: grads[n].clone() if n in grads else None for n in ckpt.weights}

    def is_live(self, record_id: int) -> bool:
        return not self._records[record_id].released

    def live_records(self, name: str | None = None) -> int:
        return sum(1 for r in self._records.values() if not r.released and name in (None, r.checkpoint))

    # --- forward ---------------------------------------------------------------------

    def forward(
        self,
        name: str,
        sequences: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        rng_state: torch.Tensor,
        cuda_rng_state: torch.Tensor | None = None,
        bound: int,
        correction: ImportanceCorrection | None,
    ) -> int:
        """Record a forward of ``sequences`` (one record, one padded batch) at the current version (Rule 2)."""
        if correction is not None and correction.policy != "always":
            raise ValueError(f"the oracle models corrections with policy 'always' only, found {correction.policy!r}")
        ckpt = self._checkpoints[name]
        ids, mask, targets, lengths = token_batch([(s.detach().cpu(), t.detach().cpu()) for s, t in sequences])
        to = self.device
        record = OracleRecord(
            self._next_record,
            name,
            ckpt.generation,
            ckpt.revision,
            bound,
            correction,
            ids.to(to),
            None if mask is None else mask.to(to),
            targets.to(to),
            lengths,
            rng_state.clone(),
            None if cuda_rng_state is None else cuda_rng_state.clone(),
            len(sequences),
        )
        self._next_record += 1
        self._records[record.id] = record
        return record.id

    def logprobs(self, record_id: int) -> list[torch.Tensor]:
        """The FP64 target log-probs the forward must have returned, one per sequence."""
        record = self._records[record_id]
        with torch.no_grad():
            lp = self._run(record, self._checkpoints[record.checkpoint].snapshots[(record.generation, record.revision)])
        return [lp[row, :length].clone() for row, length in enumerate(record.lengths)]

    def drop(self, record_id: int) -> None:
        """The caller dropped one output of the record; the last one releases it."""
        record = self._records[record_id]
        record.live_outputs -= 1
        if record.live_outputs == 0:
            record.released = True

    # --- backward (Rules 3-5) --------------------------------------------------------

    def backward(
        self,
        terms: Sequence[tuple[int, int, torch.Tensor]],
        *,
        retain_graph: bool = False,
        fault: tuple[str, int | None] | None = None,
    ) -> OracleBackward:
        """Predict ``trainer.backward(sum(adv . target_logprobs))`` over ``terms``.

        ``terms``: ``(record id, row, advantages)``, one per output the loss
        uses. ``fault``: the ``inject_fault(stage, index=...)`` armed around
        the backward. Returns the gradient it commits, or raises the error the
        trainer must raise (the same type and facts).
        """
        records = [self._records[i] for i in sorted({r for r, _, _ in terms})]
        stage, index = fault if fault is not None else (None, None)
        for record in records:
            if record.released:
                raise GradientCommitError(
                    f"oracle: output of record {record.id} was already backpropagated or released"
                )
        if stage == "user_autograd":
            raise GradientCommitError("oracle: injected fault at user_autograd", record_retryable=True)
        for record in records:
            try:
                check_oracle_age(self._checkpoints[record.checkpoint], record.generation, record.revision, record.bound)
            except GradientCommitError:
                record.released = True
                raise
        increments: dict[str, dict[str, torch.Tensor]] = {}
        baselines: dict[str, dict[str, torch.Tensor]] = {}
        reports = []
        for position, record in enumerate(records):
            if stage == "model_backward" and position == 0:
                record.released = True
                raise GradientCommitError("oracle: injected fault at model_backward")
            cotangent = torch.zeros(record.targets.shape, dtype=torch.float64, device=self.device)
            for r, row, advantage in terms:
                if r == record.id:
                    cotangent[row, : advantage.numel()] += advantage.detach().to(self.device, torch.float64)
            cotangent.masked_fill_(record.targets < 0, 0.0)  # masked targets: no gradient, never corrected
            grad, plain, report = self._record_gradient(record, cotangent)
            reports.append(report)
            for total, part in ((increments, grad), (baselines, plain)):
                summed = total.setdefault(record.checkpoint, {})
                for n, g in part.items():
                    summed[n] = g if n not in summed else summed[n] + g
        staged = sum(len(grad) for grad in increments.values())
        if stage == "validate" or (stage == "publish" and (index or 0) < staged):
            for record in records:
                record.released = True
            raise GradientCommitError(f"oracle: injected fault at {stage}")
        for name, grad in increments.items():
            ckpt = self._checkpoints[name]
            for n, g in grad.items():
                ckpt.grads[n] = ckpt.grads[n] + g if n in ckpt.grads else g.clone()
            for n, g in baselines.get(name, {}).items():
                ckpt.baseline_grads[n] = ckpt.baseline_grads[n] + g if n in ckpt.baseline_grads else g.clone()
        for record in records:
            self._checkpoints[record.checkpoint].origins.add((record.generation, record.revision, record.bound))
            if not retain_graph:
                record.released = True
        return OracleBackward(increments, reports, {n: b for n, b in baselines.items() if b})

    def _record_gradient(
        self, record: OracleRecord, cotangent: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], OracleRecordReport]:
        """FP64 gradient of one record at its forward's weights, its plain baseline, and its report."""
        ckpt = self._checkpoints[record.checkpoint]
        age = ckpt.revision - record.revision
        snapshot = ckpt.snapshots[(record.generation, record.revision)]
        leaves = {n: w.clone().requires_grad_(True) for n, w in snapshot.items()}
        logprobs = self._run(record, leaves)  # (B, T) FP64, at the forward's weights
        corrected, mean, tokens = False, None, None
        if age > 0 and record.correction is not None:
            with torch.no_grad():
                current = self._run(record, ckpt.weights)
            active, c = cotangent != 0, record.correction
            ratios = level_weights(torch.exp(current - logprobs.detach()), c.level, record.targets >= 0)
            weights = ratios.clamp(max=math.exp(c.max_log_ratio)).clamp(c.clip_low, c.clip_high)[active]
            cotangent = cotangent.clone()
            cotangent[active] = cotangent[active] * weights
            corrected, mean, tokens = True, float(weights.mean()), int(weights.numel())
        report = OracleRecordReport(record.id, age, corrected, mean, tokens)
        plain: dict[str, torch.Tensor] = {}
        if self.baseline_model is not None:
            low = {n: w.to(self.baseline_dtype, copy=True).requires_grad_(True) for n, w in snapshot.items()}
            plain_logprobs = self._run(record, low, self.baseline_model)
            plain = _gradient((plain_logprobs * cotangent.to(plain_logprobs.dtype)).sum(), low)
        return _gradient((logprobs * cotangent).sum(), leaves), plain, report

    def _run(
        self, record: OracleRecord, tensors: Mapping[str, torch.Tensor], model: DecoderLM | None = None
    ) -> torch.Tensor:
        """``(B, T)`` target log-probs of ``record``'s batch under ``tensors`` (FP64 model by default), RNG restored."""
        ckpt = self._checkpoints[record.checkpoint]
        model = self.model if model is None else model
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            torch.set_rng_state(record.rng_state)
            if record.cuda_rng_state is not None:
                torch.cuda.set_rng_state(record.cuda_rng_state, self.device)
            if ckpt.lora is None:
                logits = torch.func.functional_call(
                    model, dict(tensors), (record.ids,), {"attention_mask": record.mask}
                )
            else:
                with attach_lora(model, ckpt.lora, tensors):
                    logits = model(record.ids, attention_mask=record.mask)
        return token_logprobs(logits, record.targets)

    # --- optimizer (Rule 6) -----------------------------------------------------------

    def optim_step(
        self,
        *,
        lr: float | None = None,
        max_grad_norm: float | None = None,
        grads: Mapping[str, Mapping[str, torch.Tensor | None]] | None = None,
    ) -> dict[str, OracleStep]:
        """Predict ``trainer.optim_step(lr=, max_grad_norm=)`` for every checkpoint.

        ``grads[name]``: the gradients to step from (the trainer's, for a step
        from the same starting point); default: the oracle's own. Raises the
        ``StaleGradientError`` the trainer must raise, changing nothing.
        """
        return oracle_optim_step(self._checkpoints, self.device, lr, max_grad_norm, grads)

    def zero_grad(self) -> None:
        for ckpt in self._checkpoints.values():
            ckpt.grads, ckpt.baseline_grads, ckpt.origins = {}, {}, set()

    # --- persistence (Rule 7) --------------------------------------------------------

    def save(self, name: str) -> OracleState:
        ckpt = self._checkpoints[name]
        return OracleState(
            weights={n: w.clone() for n, w in ckpt.weights.items()},
            masters={n: m.detach().clone() for n, m in ckpt.masters.items()},
            optimizer=copy.deepcopy(ckpt.optimizer.state_dict()),
            revision=ckpt.revision,
        )

    def load(self, name: str, state: OracleState, *, discard_graphs: bool = False) -> None:
        ckpt = self._checkpoints[name]
        live = self.live_records(name)
        pending = len(ckpt.grads)
        if (live or pending) and not discard_graphs:
            raise CheckpointBusyError(name, live, pending)
        ckpt.optimizer.load_state_dict(copy.deepcopy(state.optimizer))
        with torch.no_grad():
            for n, master in ckpt.masters.items():
                master.copy_(state.masters[n])
        ckpt.weights = {n: w.clone() for n, w in state.weights.items()}
        ckpt.grads, ckpt.baseline_grads, ckpt.origins = {}, {}, set()
        ckpt.revision = state.revision
        ckpt.generation += 1
        ckpt.snapshot()


def _gradient(loss: torch.Tensor, leaves: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP64 gradients of ``loss`` for the leaves it reaches."""
    names = list(leaves)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return {n: g.double() for n, g in zip(names, grads) if g is not None}
