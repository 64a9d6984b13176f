"""What the learning comparison trains on: two workloads made by the project, nothing downloaded.

- :class:`NextByteWorkload`: supervised next-token prediction on the bytes of
  a few of the Python standard library's own source files (vocabulary 256).
  Metric: held-out loss in nats per byte (lower is better).
- :class:`PatternRLWorkload`: the synthetic RL task of ``reference_trainer.sampling``
  (``PatternTask``): sample completions from the current policy, reward each
  token that follows the prompt's pattern, train with REINFORCE on
  reward-to-go minus the group mean (per position). Metric: greedy-decoding
  reward on held-out prompts (higher is better).

NOTE [Matched schedule]
  1. Everything an arm sees is a function of ``(seed, step)`` and, for RL, of
     the weights it samples with: the model init (``DecoderLM(seed=seed)``),
     the data windows, the prompts and the sampling generator. Arms that
     differ in one thing see the same schedule.
  2. The learning rate is a function of the optimizer step alone
     (:class:`Schedule`), the same for every arm.
  3. The metric is measured at the same optimizer steps for every arm
     (``Schedule.eval_steps``), on held-out data independent of the seed.
  4. Precondition: the untrained model (step 0) does not meet the success
     criterion. Success: the metric after the last step meets it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

import reference_trainer as rt
from reference_trainer.losses import reinforce_loss
from reference_trainer.sampling import PatternTask, Sample, sample
from validation.errors import SetupError

__all__ = ["Schedule", "Batch", "Workload", "NextByteWorkload", "PatternRLWorkload", "STDLIB_FILES"]

LogitsFn = Callable[[torch.Tensor], torch.Tensor]

STDLIB_FILES = ("textwrap.py", "heapq.py", "bisect.py", "string.py", "colorsys.py", "shlex.py")
_EVAL_SEED = 1_000_003  # held-out prompts and windows: the same for every seed


def _generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_033 + step)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Steps, learning rate and evaluation points shared by every arm (NOTE rules 2-3).

    The learning rate warms up linearly over ``warmup`` steps to ``peak_lr``,
    then follows a cosine down to ``final_fraction * peak_lr`` at the last step.
    """

    steps: int
    peak_lr: float
    warmup: int
    eval_every: int
    final_fraction: float = 0.1
    weight_decay: float = 0.0

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - 1 - self.warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.peak_lr * (self.final_fraction + (1 - self.final_fraction) * cosine)

    def eval_steps(self) -> list[int]:
        """Optimizer steps after which the metric is read: 0, every ``eval_every``, and the last."""
        points = list(range(0, self.steps, self.eval_every))
        return points + [self.steps]


@dataclass(frozen=True, eq=False)
class Batch:
    """One step's sequences and its objective.

    ``sequences``: ``(input_tokens, target_tokens)`` pairs of equal length (one
    padded-free batch); ``objective(logprobs)`` maps their per-token target
    log-probs (one 1-D tensor per sequence, in order) to the scalar loss.
    """

    sequences: list[tuple[torch.Tensor, torch.Tensor]]
    objective: Callable[[Sequence[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A task, its metric and its criteria (NOTE [Matched schedule]); subclasses make batches.

    ``success``: the threshold the final metric must meet (``<=`` when lower
    is better, ``>=`` otherwise). ``floor_final`` / ``floor_auc``: the stated
    equivalence-margin floors (``validation.equivalence``), in metric units.
    """

    name: str
    metric: str
    unit: str
    higher_is_better: bool
    success: float
    floor_final: float
    floor_auc: float
    schedule: Schedule
    model: rt.ModelConfig
    device: str = "cpu"

    def meets(self, value: float) -> bool:
        """Whether ``value`` meets the success threshold."""
        return value >= self.success if self.higher_is_better else value <= self.success

    def criterion(self) -> str:
        sign = ">=" if self.higher_is_better else "<="
        return f"{self.metric} {sign} {self.success} {self.unit} after {self.schedule.steps} steps"

    def replace(self, **changes: object) -> Workload:
        return dataclasses.replace(self, **changes)

    def batch(self, seed: int, step: int, logits_fn: LogitsFn) -> Batch:
        raise NotImplementedError

    def evaluate(self, logits_fn: LogitsFn) -> float:
        raise NotImplementedError

    def describe(self) -> dict:
        """The workload's settings as plain JSON types, for the evidence."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("model", "schedule")}
        out["schedule"] = dataclasses.asdict(self.schedule)
        out["model"] = {f.name: str(getattr(self.model, f.name)) for f in dataclasses.fields(self.model)}
        out["criterion"] = self.criterion()
        return out


@dataclass(frozen=True, kw_only=True)
class NextByteWorkload(Workload):
    """Next-byte prediction on standard-library source text (vocabulary 256).

    The text is :data:`STDLIB_FILES` concatenated; the first 90% trains
    (random windows per ``(seed, step)``), the rest is held out
    (``eval_windows`` fixed windows). Objective: mean negative log-likelihood.
    """

    seq_len: int = 64
    batch_size: int = 8
    eval_windows: int = 16
    files: tuple[str, ...] = STDLIB_FILES

    @cached_property
    def _splits(self) -> tuple[torch.Tensor, torch.Tensor]:
        text = _stdlib_text(self.files)
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        cut = int(0.9 * data.numel())
        return data[:cut], data[cut:]

    @cached_property
    def _eval_set(self) -> torch.Tensor:
        return self._windows(self._splits[1], self.eval_windows, _generator(_EVAL_SEED, 0))

    def _windows(self, data: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
        starts = torch.randint(data.numel() - self.seq_len - 1, (count,), generator=generator)
        return torch.stack([data[s : s + self.seq_len + 1] for s in starts.tolist()]).to(self.device)  # (N, L+1)

    def batch(self, seed: int, step: int, logits_fn: LogitsFn) -> Batch:
        windows = self._windows(self._splits[0], self.batch_size, _generator(seed, step))
        return Batch([(w[:-1], w[1:]) for w in windows], _mean_nll)

    def evaluate(self, logits_fn: LogitsFn) -> float:
        windows = self._eval_set
        with torch.no_grad():
            logprobs = rt.token_logprobs(logits_fn(windows[:, :-1]), windows[:, 1:])  # (N, L)
        return float(-logprobs.double().mean())

    def describe(self) -> dict:
        out = super().describe()
        out["text_sha256"] = hashlib.sha256(_stdlib_text(self.files)).hexdigest()
        out["text_bytes"] = len(_stdlib_text(self.files))
        return out


def _mean_nll(logprobs: Sequence[torch.Tensor]) -> torch.Tensor:
    return -torch.cat(list(logprobs)).mean()


def _stdlib_text(files: Sequence[str]) -> bytes:
    folder = Path(sysconfig.get_paths()["stdlib"])
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise SetupError(
            f"the learning canary's text workload reads standard-library sources {list(files)} from {folder}; "
            f"missing {missing}",
            fix="use a Python installation that ships its standard library as .py files",
        )
    return b"".join((folder / name).read_bytes() for name in files)


@dataclass(frozen=True, kw_only=True)
class PatternRLWorkload(Workload):
    """The synthetic RL task: ``prompts`` prompts per step, ``group`` samples each.

    Token ``t`` of a completion earns 1 when it equals the pattern's target.
    Its advantage is the reward-to-go ``sum_{u >= t} r_u`` minus the mean
    reward-to-go at position ``t`` over its group (the same prompt's samples):
    REINFORCE with a per-position group baseline (``reinforce_loss``,
    ``token_mean``). Sampling uses temperature 1, a generator per ``(seed,
    step)``. Evaluation decodes ``eval_prompts`` held-out prompts greedily
    and returns their mean reward.
    """

    prompt_len: int = 3
    completion_len: int = 3
    prompts: int = 8
    group: int = 8
    eval_prompts: int = 64
    pattern: str = "repeat"

    def task(self, seed: int) -> PatternTask:
        return PatternTask(
            vocab_size=self.model.vocab_size,
            prompt_len=self.prompt_len,
            completion_len=self.completion_len,
            seed=seed,
            pattern=self.pattern,
        )

    def batch(self, seed: int, step: int, logits_fn: LogitsFn) -> Batch:
        samples = sample(
            logits_fn,
            self._step_prompts(seed, step),
            max_new_tokens=self.completion_len,
            generator=_generator(seed, step, self.device),
        )
        return self.batch_of(seed, samples)

    def engine_samples(
        self, seed: int, step: int, engine: rt.RolloutEngine, after_token: Callable[[int], None]
    ) -> list[Sample]:
        """Step ``step``'s samples drawn by a rollout engine (same prompts and generator as :meth:`batch`);
        ``after_token(n)`` runs after the n-th token of every row (a publication may land there)."""
        generation = engine.start(
            self._step_prompts(seed, step),
            max_new_tokens=self.completion_len,
            generator=_generator(seed, step, self.device),
        )
        while not generation.done:
            generation.step()
            after_token(len(generation.versions))
        return generation.samples()

    def _step_prompts(self, seed: int, step: int) -> torch.Tensor:
        prompts = self.task(seed).prompts(self.prompts, start=step * self.prompts)
        return prompts.repeat_interleave(self.group, dim=0).to(self.device)  # (prompts * group, P)

    def batch_of(self, seed: int, samples: Sequence[Sample]) -> Batch:
        """The REINFORCE batch of one step's samples (the class docstring's advantages)."""
        task = self.task(seed)
        completions = torch.stack([s.completion for s in samples])  # (B, C)
        rewards = (completions == task.targets(torch.stack([s.prompt for s in samples]))).float()  # (B, C)
        to_go = rewards.flip(-1).cumsum(-1).flip(-1)  # (B, C)
        group_mean = to_go.view(-1, self.group, self.completion_len).mean(1)  # (prompts, C)
        advantages = to_go - group_mean.repeat_interleave(self.group, dim=0)  # (B, C)
        aligned = [torch.cat([a.new_zeros(self.prompt_len - 1), a]) for a in advantages]
        masks = [s.completion_mask for s in samples]

        def objective(logprobs: Sequence[torch.Tensor]) -> torch.Tensor:
            return reinforce_loss(list(logprobs), aligned, masks, reduction="token_mean")

        return Batch([(s.input_tokens, s.target_tokens) for s in samples], objective)

    def evaluate(self, logits_fn: LogitsFn) -> float:
        task = self.task(_EVAL_SEED)
        prompts = task.prompts(self.eval_prompts).to(self.device)
        samples = sample(
            logits_fn,
            prompts,
            max_new_tokens=self.completion_len,
            top_k=1,
            generator=_generator(_EVAL_SEED, 0, self.device),
        )
        return float(task.reward_samples(samples).double().mean())
