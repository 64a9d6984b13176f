"""A small synthetic RL task and an autoregressive sampler that records behaviour log-probs.

No downloads, no tokenizer: prompts are random token ids, and the reward checks a
pattern the prompt determines. The sampler draws completions from any
``logits_fn(input_ids (B, T)) -> logits (B, T, V)``, e.g. ``lambda ids: model(ids)``.

NOTE [Behaviour log-probs]

1. ``Sample.behaviour_logprobs[i]`` is the log-prob of the drawn completion
   token ``i`` under the **full** softmax of the last position's logits divided
   by ``temperature``: ``log_softmax(logits / temperature)[token]``.
2. Top-k / top-p truncation only decides which tokens may be drawn; it never
   changes the recorded log-prob (no renormalisation over the kept tokens).
   The trainer's ``target_logprobs`` are full-vocabulary log-probs too, so the
   ratio ``exp(target_logprobs - behaviour_logprobs)`` is 1 at unchanged weights
   instead of the kept mass's inverse.
3. At ``temperature=1`` (the default) rule 1 is exactly what the trainer's
   ``target_logprobs`` compute at the same weights. At another temperature the
   trainer (which applies none) disagrees by the temperature alone: sample at 1,
   or divide the logits by the temperature in the training forward.
4. Truncation order (as Hugging Face's warpers): temperature, then top-k (ties
   with the k-th logit are kept), then top-p on the distribution renormalised
   over the top-k survivors (keep the smallest most-likely prefix whose mass
   reaches ``top_p``; the most likely token is always kept).
5. Log-probs are computed in FP32. Every completion has ``max_new_tokens``
   tokens (no end-of-sequence token).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .errors import ConfigError, int_at_least, is_number

__all__ = ["PatternTask", "Sample", "sample", "draw", "check_draw_options", "prompt_batch", "PATTERNS"]

PATTERNS = ("count_up", "repeat")
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) over seed space


def _check_int(field: str, value: object, minimum: int) -> None:
    if not int_at_least(value, minimum):
        raise ConfigError(field, value, f"an int >= {minimum}")


@dataclass(frozen=True)
class PatternTask:
    """Prompts of random tokens; the reward is how well a completion follows them.

    With ``last`` the prompt's last token, the target completion is
    ``pattern="count_up"`` (default): ``(last + 1 + i) % vocab_size`` for
    ``i = 0 .. completion_len - 1``; ``pattern="repeat"``: ``last`` every time.
    The reward of a completion is the fraction of its ``completion_len``
    positions equal to the target, in ``[0, 1]``.

    Prompt ``i`` depends only on ``(seed, i)``: deterministic, and independent of
    how prompts are batched.
    """

    vocab_size: int
    prompt_len: int
    completion_len: int
    seed: int = 0
    pattern: str = "count_up"

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 2)
        _check_int("prompt_len", self.prompt_len, 1)
        _check_int("completion_len", self.completion_len, 1)
        _check_int("seed", self.seed, 0)
        if self.pattern not in PATTERNS:
            raise ConfigError("pattern", self.pattern, f"one of {PATTERNS}")

    def prompts(self, n: int, *, start: int = 0) -> torch.Tensor:
        """Prompts ``start .. start + n - 1`` as an int64 ``(n, prompt_len)`` tensor."""
        _check_int("n", n, 1)
        _check_int("start", start, 0)
        rows = []
        for index in range(start, start + n):
            g = torch.Generator().manual_seed((self.seed * _MIX + index) % 2**63)
            rows.append(torch.randint(self.vocab_size, (self.prompt_len,), generator=g))
        return torch.stack(rows)

    def targets(self, prompts: torch.Tensor) -> torch.Tensor:
        """The target completions: ``(..., completion_len)`` for ``(..., prompt_len)`` prompts."""
        self._check_tokens("prompts", prompts, self.prompt_len)
        last = prompts[..., -1:]  # (..., 1)
        if self.pattern == "repeat":
            return last.expand(*last.shape[:-1], self.completion_len).clone()
        steps = torch.arange(1, self.completion_len + 1, device=prompts.device)
        return (last + steps) % self.vocab_size

    def reward(self, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
        """FP32 rewards, one per prompt: ``(B,)`` for ``(B, P)``, 0-d for ``(P,)``."""
        self._check_tokens("completions", completions, self.completion_len)
        target = self.targets(prompts)
        if target.shape != completions.shape:
            raise ConfigError("completions", tuple(completions.shape), f"shape {tuple(target.shape)}")
        return (completions == target).float().mean(-1)

    def reward_samples(self, samples: Sequence[Sample]) -> torch.Tensor:
        """FP32 ``(N,)`` rewards of a list of :class:`Sample`."""
        prompts = torch.stack([s.prompt for s in samples])
        return self.reward(prompts, torch.stack([s.completion for s in samples]))

    def _check_tokens(self, field: str, tokens: torch.Tensor, length: int) -> None:
        integer = isinstance(tokens, torch.Tensor) and not tokens.dtype.is_floating_point
        if not integer or tokens.dim() == 0 or tokens.shape[-1] != length:
            found = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else tokens
            raise ConfigError(field, found, f"an integer tensor of shape (..., {length})")


@dataclass(frozen=True, eq=False)
class Sample:
    """One sampled sequence and what a trainer needs to learn from it.

    ``prompt`` ``(P,)`` and ``completion`` ``(C,)`` int64 token ids;
    ``behaviour_logprobs`` ``(C,)`` FP32 (NOTE [Behaviour log-probs]);
    ``version``: whatever object the sampler was given (e.g. the
    ``CheckpointVersion`` that produced it); a rollout engine's sample has the
    version of its oldest token there and, in ``behaviour_revisions`` and
    ``behaviour_generations`` ``(C,)`` int64, the revision and generation of
    the weights that drew each completion token.

    For a training forward, ``input_tokens`` ``(P+C-1,)`` and ``target_tokens``
    (the inputs shifted by one, prompt positions masked with -1) make the
    trainer's ``target_logprobs[P-1:]`` the completion's log-probs, aligned with
    ``behaviour_logprobs``; ``completion_mask`` and
    ``aligned_behaviour_logprobs`` have that full length.
    """

    prompt: torch.Tensor
    completion: torch.Tensor
    behaviour_logprobs: torch.Tensor
    version: object = None
    behaviour_revisions: torch.Tensor | None = None
    behaviour_generations: torch.Tensor | None = None

    @property
    def tokens(self) -> torch.Tensor:
        """Prompt then completion, ``(P+C,)``."""
        return torch.cat([self.prompt, self.completion])

    @property
    def input_tokens(self) -> torch.Tensor:
        """``tokens[:-1]``, ``(P+C-1,)``."""
        return self.tokens[:-1]

    @property
    def target_tokens(self) -> torch.Tensor:
        """``tokens[1:]`` with the ``P-1`` prompt targets set to -1, ``(P+C-1,)``."""
        targets = self.tokens[1:].clone()
        targets[: self.prompt.shape[0] - 1] = -1
        return targets

    @property
    def completion_mask(self) -> torch.Tensor:
        """``target_tokens >= 0``: True on the last ``C`` positions."""
        return self.target_tokens >= 0

    @property
    def aligned_behaviour_logprobs(self) -> torch.Tensor:
        """``behaviour_logprobs`` laid out like ``target_logprobs`` (0 where masked)."""
        out = self.behaviour_logprobs.new_zeros(self.input_tokens.shape[0])
        out[self.prompt.shape[0] - 1 :] = self.behaviour_logprobs
        return out

    @property
    def aligned_behaviour_revisions(self) -> torch.Tensor | None:
        """``behaviour_revisions`` laid out like ``target_logprobs`` (-1 where masked); ``None`` without them."""
        return self._aligned(self.behaviour_revisions)

    @property
    def aligned_behaviour_generations(self) -> torch.Tensor | None:
        """``behaviour_generations`` laid out like ``target_logprobs`` (-1 where masked); ``None`` without them."""
        return self._aligned(self.behaviour_generations)

    def _aligned(self, per_token: torch.Tensor | None) -> torch.Tensor | None:
        if per_token is None:
            return None
        out = torch.full_like(self.input_tokens, -1)
        out[self.prompt.shape[0] - 1 :] = per_token
        return out


def sample(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    prompts: torch.Tensor | Sequence[torch.Tensor],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    version: object = None,
) -> list[Sample]:
    """Draw ``max_new_tokens`` tokens after each prompt; one :class:`Sample` per prompt.

    ``prompts``: an integer ``(B, P)`` tensor, one ``(P,)`` prompt, or a list of
    equal-length 1-D tensors. ``logits_fn`` is called under ``torch.no_grad``
    on the whole ``(B, T)`` sequence so far (no KV cache: meant for small
    models) and must return ``(B, T, V)`` logits. Draws use ``generator``
    (default: the global RNG), so a seeded generator makes the result
    deterministic; it must be on the device of the logits (the model's: on
    CUDA, ``torch.Generator(device="cuda")``), and ``prompts`` on the model's
    device. ``temperature > 0`` (use ``top_k=1`` for greedy decoding),
    ``top_k >= 1``, ``0 < top_p <= 1``. Behaviour log-probs follow
    NOTE [Behaviour log-probs]. ``version`` is stored, as is, on every sample.
    """
    ids = prompt_batch(prompts)
    _check_int("max_new_tokens", max_new_tokens, 1)
    check_draw_options(temperature, top_k, top_p)

    prompt_len = ids.shape[1]
    logprobs = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = logits_fn(ids)
            _check_logits(logits, ids)
            token, logprob = draw(logits[:, -1, :], temperature, top_k, top_p, generator)
            logprobs.append(logprob)
            ids = torch.cat([ids, token.to(ids.dtype)], dim=1)

    behaviour = torch.cat(logprobs, dim=1)  # (B, C)
    return [
        Sample(
            prompt=ids[b, :prompt_len].clone(),
            completion=ids[b, prompt_len:].clone(),
            behaviour_logprobs=behaviour[b].clone(),
            version=version,
        )
        for b in range(ids.shape[0])
    ]


def check_draw_options(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ``ConfigError`` unless ``temperature > 0`` (finite), ``top_k`` None or >= 1, ``top_p`` None or in (0, 1]."""
    if not is_number(temperature) or not 0.0 < temperature < math.inf:
        raise ConfigError("temperature", temperature, "a finite float > 0", "top_k=1 is greedy")
    if top_k is not None:
        _check_int("top_k", top_k, 1)
    if top_p is not None and (not is_number(top_p) or not 0.0 < top_p <= 1.0):
        raise ConfigError("top_p", top_p, "None or a float in (0, 1]")


def draw(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``(B, V)`` next-token logits: ``(tokens (B, 1), behaviour log-probs (B, 1) FP32)``.

    Truncation and log-probs follow NOTE [Behaviour log-probs]; the options are
    those :func:`check_draw_options` accepts (not checked again here).
    ``generator`` must be on the logits' device (``None``: the global RNG).
    """
    _check_generator(generator, logits.device)
    full = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, V)
    kept = _kept_tokens(full, top_k, top_p)  # (B, V)
    # multinomial normalises, so the kept probabilities need no renormalising.
    token = torch.multinomial(full.exp() * kept, 1, generator=generator)  # (B, 1)
    return token, full.gather(-1, token)  # see NOTE rule 1


def _check_logits(logits: object, ids: torch.Tensor) -> None:
    if isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[:2] == ids.shape:
        return
    found = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
    raise ConfigError("logits_fn", found, f"logits of shape {tuple(ids.shape)} + (V,)")


def _check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    if generator is None or generator.device.type == device.type:
        return
    raise ConfigError(
        "generator",
        f"a generator on {generator.device}",
        f"a generator on the logits' device ({device})",
        f"build it with torch.Generator(device={str(device)!r}) and keep the prompts on the model's device",
    )


def prompt_batch(prompts: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """``prompts`` as an int64 ``(B, P)`` tensor (see :func:`sample`); ``ConfigError`` otherwise."""
    if isinstance(prompts, (list, tuple)):
        shapes = [tuple(p.shape) if isinstance(p, torch.Tensor) else p for p in prompts]
        if len(set(shapes)) != 1 or not isinstance(prompts[0], torch.Tensor):
            allowed = "a non-empty list of equal-length 1-D tensors"
            raise ConfigError("prompts", shapes, allowed, "group prompts by length")
        prompts = torch.stack(list(prompts))
    expected = "integer token ids of shape (B, P) or (P,), P >= 1"
    if not isinstance(prompts, torch.Tensor):
        raise ConfigError("prompts", prompts, expected)
    if (
        prompts.dim() not in (1, 2)
        or prompts.dtype.is_floating_point
        or prompts.dtype == torch.bool
        or prompts.shape[-1] < 1
        or prompts.numel() == 0
    ):
        raise ConfigError("prompts", (tuple(prompts.shape), prompts.dtype), expected)
    return (prompts if prompts.dim() == 2 else prompts[None]).long()


def _kept_tokens(logp: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Bool ``(B, V)``: the tokens truncation allows (NOTE rule 4)."""
    kept = torch.ones_like(logp, dtype=torch.bool)
    if top_k is not None and top_k < logp.shape[-1]:
        kth = logp.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        kept = logp >= kth
    if top_p is not None and top_p < 1.0:
        probs = torch.softmax(logp.masked_fill(~kept, float("-inf")), dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
        in_nucleus = torch.zeros_like(kept).scatter(-1, order, mass_before < top_p)
        kept = kept & in_nucleus
    return kept
