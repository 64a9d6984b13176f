"""The arms of the learning comparison, and the loop that trains one arm on one seed.

NOTE [Arms]
  1. ``plain`` is the reference: ``torch.optim.AdamW`` on
     ``DecoderLM(seed=seed)`` with the trainer's own AdamW options
     (``rt.AdamWConfig``; torch's default implementation, on CPU the
     single-tensor loop) and FP32 masters for lower-precision parameters, as
     the trainer keeps them, so a versioned arm differs from it only by what
     it is meant to test.
  2. Versioned arms train one full checkpoint of ``rt.Trainer`` through the
     public API. ``delay`` k: the batch forwarded before step t is
     backpropagated after step t + k (k = 0 is ``strict``;
     ``max_gradient_staleness`` = k), so it has staleness ``min(t, k)``,
     recorded from each ``BackwardReport``. The last k batches are drained, so
     every arm takes ``steps`` steps, one backward each.
  3. ``corrected``: ``ImportanceCorrection(policy="always", level=level)``
     (``"token"`` unless the arm says otherwise), else ``corrections=()``;
     ``placement``: the forced ``backward_state``. Each corrected record's raw
     and clipped ratio statistics are kept.
  4. An arm differs from its ``baseline`` in one thing; ``exact_with`` names
     an arm whose curve and final weights must be bitwise equal per seed
     (FP32 on CPU).
  5. Sensitivity arms (``sabotage``), broken updates in the plain loop that
     the comparison must catch against ``plain``: ``dropped_updates`` loses
     every :data:`DROP_EVERY`-th update, a mild fault only the paired
     comparison shows (the arm still meets its criterion); ``flipped_layer``
     flips the gradient of one decoder layer (:data:`FLIPPED_LAYER`), which
     ascends the loss and misses the criterion.
  6. Shown arms (``enforced=False``): the other correction levels at
     staleness 2 (group ``levels``), each against ``strict`` like
     ``stale2_corrected``, to show which level learns best per workload; their
     verdicts are reported, never checks.
  7. Rollout arms (``loop="engine"``, group ``rollout``, shown, RL workload
     only): a ``RolloutEngine`` serves the weights of ``max(0, t - k)`` at step
     t (behaviour lag k), published from the trainer's checkpoint, which
     forwards the samples with their behaviour log-probs and backpropagates
     at once. ``drain``: every token of step t has lag ``min(t, k)``;
     ``inflight``: the next revision lands after each sequence's first token,
     so later tokens lag one less. ``corrected``:
     ``behaviour_corrections=(ImportanceCorrection(level),)``. Each step's
     largest behaviour lag is recorded as its staleness.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

import reference_trainer as rt
from canaries.learning.workloads import Batch, Workload
from validation.trainers import POLICY, trainer_with_policy

__all__ = ["Arm", "ArmRun", "ARMS", "DROP_EVERY", "FLIPPED_LAYER", "arm", "initial_metric", "run_arm"]

FLIPPED_LAYER = "model.layers.0."
DROP_EVERY = 3
CHECKPOINT = POLICY


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One arm (NOTE [Arms]); ``group`` says which panel of the report shows it."""

    name: str
    summary: str
    group: str
    loop: str = "versioned"
    delay: int = 0
    corrected: bool = False
    placement: str = "retain"
    level: str = "token"
    sabotage: str | None = None
    baseline: str | None = None
    exact_with: str | None = None
    enforced: bool = True
    publication: str = "drain"
    only_on: str | None = None  # the one workload the arm runs on (None: every workload)

    @property
    def sensitivity(self) -> bool:
        return self.sabotage is not None

    def describe(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


ARMS: tuple[Arm, ...] = (
    Arm(name="plain", summary="plain PyTorch loop, torch.optim.AdamW (reference)", group="staleness", loop="plain"),
    Arm(
        name="strict", summary="versioned trainer, staleness 0", group="staleness", baseline="plain", exact_with="plain"
    ),
    Arm(
        name="stale1_corrected",
        summary="backward after step t+1, importance-corrected",
        group="staleness",
        delay=1,
        corrected=True,
        baseline="strict",
    ),
    Arm(
        name="stale1_uncorrected",
        summary="backward after step t+1, no correction",
        group="staleness",
        delay=1,
        baseline="strict",
    ),
    Arm(
        name="stale2_corrected",
        summary="backward after step t+2, importance-corrected (retain)",
        group="staleness",
        delay=2,
        corrected=True,
        baseline="strict",
    ),
    Arm(
        name="stale2_uncorrected",
        summary="backward after step t+2, no correction",
        group="staleness",
        delay=2,
        baseline="strict",
    ),
    Arm(
        name="stale2_corrected_offload",
        summary="stale2_corrected with offloaded saved state",
        group="placement",
        delay=2,
        corrected=True,
        placement="offload",
        baseline="stale2_corrected",
        exact_with="stale2_corrected",
    ),
    Arm(
        name="stale2_corrected_replay",
        summary="stale2_corrected with replayed forwards",
        group="placement",
        delay=2,
        corrected=True,
        placement="replay",
        baseline="stale2_corrected",
        exact_with="stale2_corrected",
    ),
    *(
        Arm(
            name=f"stale2_{level}",
            summary=f"stale2_corrected at importance level {level!r} (shown)",
            group="levels",
            delay=2,
            corrected=True,
            level=level,
            baseline="strict",
            enforced=False,
        )
        for level in ("sequence", "geometric", "average")
    ),
    Arm(
        name="engine_lag0",
        summary="samples from the rollout engine, behaviour lag 0 (shown)",
        group="rollout",
        loop="engine",
        baseline="strict",
        enforced=False,
        only_on="pattern_rl",
    ),
    *(
        Arm(
            name=f"engine_lag{lag}_{mode}{'_corrected' if corrected else ''}",
            summary=f"engine samples at behaviour lag {lag}, {mode}, {'rollout-corrected' if corrected else 'uncorrected'}"
            " (shown)",
            group="rollout",
            loop="engine",
            delay=lag,
            publication=mode,
            corrected=corrected,
            baseline="strict",
            enforced=False,
            only_on="pattern_rl",
        )
        for lag in (1, 2)
        for mode in ("drain", "inflight")
        for corrected in (False, True)
    ),
    Arm(
        name="broken_dropped_updates",
        summary=f"plain loop, one optimizer update in {DROP_EVERY} lost (broken)",
        group="sensitivity",
        loop="plain",
        sabotage="dropped_updates",
        baseline="plain",
    ),
    Arm(
        name="broken_flipped_layer",
        summary=f"plain loop, gradient sign flipped on {FLIPPED_LAYER}* (broken)",
        group="sensitivity",
        loop="plain",
        sabotage="flipped_layer",
        baseline="plain",
    ),
)


def arm(name: str) -> Arm:
    for candidate in ARMS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"unknown arm {name!r}; expected one of {[a.name for a in ARMS]}")


@dataclass
class ArmRun:
    """What one arm did on one seed: its metric curve and what its records looked like."""

    arm: str
    seed: int
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # per backward record, in step order
    corrected: list[bool] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # mean importance weight of each corrected record
    raw_ratios: list[dict] = field(default_factory=list)  # each corrected record's raw (pre-clip) RatioStats, as a dict
    clipped_ratios: list[dict] = field(default_factory=list)  # and its clipped one
    digest: str = ""  # SHA-256 of the final trainable weights
    wall_s: float = 0.0

    @property
    def fraction_corrected(self) -> float:
        return sum(self.corrected) / len(self.corrected) if self.corrected else 0.0


def run_arm(spec: Arm, workload: Workload, seed: int) -> ArmRun:
    """Train ``spec`` on ``workload`` for ``workload.schedule.steps`` steps from seed ``seed``."""
    start = time.perf_counter()
    result = ArmRun(arm=spec.name, seed=seed)
    loop = {"plain": _plain_loop, "versioned": _versioned_loop, "engine": _engine_loop}[spec.loop]
    loop(spec, workload, seed, result)
    result.wall_s = time.perf_counter() - start
    return result


def initial_metric(workload: Workload, seed: int) -> float:
    """The untrained model's metric for ``seed`` (the precondition of NOTE [Matched schedule])."""
    model = rt.DecoderLM(workload.model, seed=seed).to(workload.device)
    return workload.evaluate(_plain_policy(model))


def _evaluate_at(workload: Workload, step: int, logits_fn: Callable, result: ArmRun) -> None:
    if step in workload.schedule.eval_steps():
        result.steps.append(step)
        result.values.append(workload.evaluate(logits_fn))


def _digest(named: Iterator[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for name, tensor in named:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --- the plain PyTorch loop (NOTE rule 1) --------------------------------------------


def _plain_policy(model: rt.DecoderLM) -> Callable[[torch.Tensor], torch.Tensor]:
    def logits_fn(ids: torch.Tensor) -> torch.Tensor:
        model.eval()
        try:
            with torch.no_grad():
                return model(ids)
        finally:
            model.train()

    return logits_fn


def _plain_loop(spec: Arm, workload: Workload, seed: int, result: ArmRun) -> None:
    schedule = workload.schedule
    model = rt.DecoderLM(workload.model, seed=seed).to(workload.device)
    params = dict(model.named_parameters())
    masters = {
        n: p.detach().float().clone().requires_grad_(True) for n, p in params.items() if p.dtype != torch.float32
    }
    adamw = rt.AdamWConfig(lr=schedule.lr(0), weight_decay=schedule.weight_decay)
    optimizer = torch.optim.AdamW(
        [masters.get(n, p) for n, p in params.items()],
        lr=adamw.lr,
        betas=adamw.betas,
        eps=adamw.eps,
        weight_decay=adamw.weight_decay,
    )
    policy = _plain_policy(model)
    _evaluate_at(workload, 0, policy, result)
    for step in range(schedule.steps):
        batch = workload.batch(seed, step, policy)
        ids = torch.stack([inputs for inputs, _ in batch.sequences])  # (B, T)
        targets = torch.stack([target for _, target in batch.sequences])  # (B, T)
        logprobs = rt.token_logprobs(model(ids), targets)  # (B, T)
        batch.objective(list(logprobs.unbind(0))).backward()
        if spec.sabotage == "flipped_layer":
            for name, param in params.items():
                if name.startswith(FLIPPED_LAYER):
                    param.grad.neg_()
        for name, master in masters.items():
            master.grad = params[name].grad.float()
        optimizer.param_groups[0]["lr"] = schedule.lr(step)
        if not (spec.sabotage == "dropped_updates" and step % DROP_EVERY == DROP_EVERY - 1):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, master in masters.items():
                params[name].copy_(master)
        _evaluate_at(workload, step + 1, policy, result)
    result.staleness = [0] * schedule.steps
    result.corrected = [False] * schedule.steps
    result.digest = _digest(model.named_parameters())


# --- the versioned trainer (NOTE rules 2-3, 5) ---------------------------------------


def _options(spec: Arm) -> rt.ForwardOptions:
    corrections = (rt.ImportanceCorrection(policy="always", level=spec.level),) if spec.corrected else ()
    return rt.ForwardOptions(max_gradient_staleness=spec.delay, corrections=corrections, backward_state=spec.placement)


def _versioned_loop(spec: Arm, workload: Workload, seed: int, result: ArmRun) -> None:
    schedule = workload.schedule
    adamw = rt.AdamWConfig(lr=schedule.lr(0), weight_decay=schedule.weight_decay)
    trainer = trainer_with_policy(rt.DecoderLM(workload.model, seed=seed).to(workload.device), optimizer=adamw)
    options = _options(spec)
    pending: deque[tuple[Batch, list[rt.ForwardOutput]]] = deque()
    _evaluate_at(workload, 0, trainer.policy()[0], result)

    def backward_and_step() -> None:
        batch, outputs = pending.popleft()
        report = trainer.backward(batch.objective([o.target_logprobs for o in outputs]))
        result.staleness.append(max(r.staleness for r in report.records))
        result.corrected.append(bool(report.corrected))
        result.weights.extend(r.correction.mean for r in report.corrected)
        result.raw_ratios.extend(asdict(r.correction.raw) for r in report.corrected)
        result.clipped_ratios.extend(asdict(r.correction.clipped) for r in report.corrected)
        step = len(result.staleness) - 1
        trainer.optim_step(lr=schedule.lr(step))
        trainer.zero_grad()
        _evaluate_at(workload, step + 1, trainer.policy()[0], result)

    for step in range(schedule.steps):
        batch = workload.batch(seed, step, trainer.policy()[0])
        inputs = [rt.ForwardInput(tokens, targets) for tokens, targets in batch.sequences]
        pending.append((batch, trainer.forward(inputs, options=options)))
        if len(pending) > spec.delay:
            backward_and_step()
    while pending:
        backward_and_step()
    result.digest = _digest(trainer.checkpoint(CHECKPOINT).named_parameters())


# --- samples from the rollout engine (NOTE rule 7) -----------------------------------


def _engine_loop(spec: Arm, workload: Workload, seed: int, result: ArmRun) -> None:
    schedule = workload.schedule
    adamw = rt.AdamWConfig(lr=schedule.lr(0), weight_decay=schedule.weight_decay)
    trainer = trainer_with_policy(rt.DecoderLM(workload.model, seed=seed).to(workload.device), optimizer=adamw)
    checkpoint = trainer.checkpoint(CHECKPOINT)
    corrections = (rt.ImportanceCorrection(level=spec.level),) if spec.corrected else ()
    options = rt.ForwardOptions(max_gradient_staleness=0, corrections=(), behaviour_corrections=corrections)
    engine = rt.RolloutEngine(trainer.model)
    publications = {0: rt.rollout.publication_of(checkpoint)}
    _evaluate_at(workload, 0, trainer.policy()[0], result)
    for step in range(schedule.steps):
        served = max(0, step - spec.delay)
        if engine.version is None or engine.version.revision < served:
            engine.apply(publications[served])

        def after_token(drawn: int, newer: int = served + 1, steady: bool = step >= spec.delay) -> None:
            if spec.publication == "inflight" and steady and drawn == 1 and newer in publications:
                engine.apply(publications[newer], mode="inflight")

        samples = workload.engine_samples(seed, step, engine, after_token)
        inputs = [
            rt.ForwardInput(
                s.input_tokens,
                s.target_tokens,
                behaviour_logprobs=s.aligned_behaviour_logprobs,
                behaviour_revisions=s.aligned_behaviour_revisions,
                behaviour_generations=s.aligned_behaviour_generations,
            )
            for s in samples
        ]
        outputs = trainer.forward(inputs, options=options)
        report = trainer.backward(workload.batch_of(seed, samples).objective([o.target_logprobs for o in outputs]))
        behaviour = [r.behaviour for r in report.records]
        result.staleness.append(max(b.lag_max for b in behaviour))
        corrected = [b.correction for b in behaviour if b.correction is not None]
        result.corrected.append(bool(corrected))
        result.weights.extend(c.mean for c in corrected)
        result.raw_ratios.extend(asdict(c.raw) for c in corrected)
        result.clipped_ratios.extend(asdict(c.clipped) for c in corrected)
        trainer.optim_step(lr=schedule.lr(step))
        trainer.zero_grad()
        publications[checkpoint.revision] = rt.rollout.publication_of(checkpoint)
        publications.pop(step - spec.delay, None)  # no later step serves it
        _evaluate_at(workload, step + 1, trainer.policy()[0], result)
    result.digest = _digest(checkpoint.named_parameters())
