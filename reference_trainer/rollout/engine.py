"""The rollout engine: KV-cached batched sampling at a published version, with per-token versions.

The engine keeps its own copy of the base model (in its own dtype) and
serves the weights of the last publication it switched to (NOTE [Weight
publication] in ``publication.py``). A generation draws one token per row
per ``step`` (NOTE [KV-cached decoding] in ``cache.py``; truncation and
log-probs as NOTE [Behaviour log-probs] in ``sampling.py``) and records,
per completion token, its behaviour log-prob and the revision that drew it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, TypedDict

import torch
from torch.func import functional_call

from ..checkpoints import CheckpointVersion
from ..errors import ConfigError, EngineBusyError, int_at_least
from ..lora import attach_lora, freeze
from ..model import DecoderLM
from ..sampling import Sample, check_draw_options, draw, prompt_batch
from .cache import CachedDecoder, KVCache
from .publication import MODES, PublicationReport, ServedWeights, WeightPublication, check_newer, stage

if TYPE_CHECKING:  # typing.Unpack from Python 3.11; for the annotations only, never imported at run time
    from typing_extensions import Unpack

__all__ = ["FP32_LOGPROB_TOLERANCE", "RolloutEngine", "Generation"]

FP32_LOGPROB_TOLERANCE = 1e-4
"""The most an FP32 engine's behaviour log-prob may differ from the trainer's ``target_logprobs`` at the same
weights, per token, whatever the cache, batch size and padding (measured: about 1e-6 on the tiny model)."""


class _DrawOptions(TypedDict, total=False):
    """:meth:`RolloutEngine.start`'s keyword options that have defaults."""

    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None


class _StartOptions(_DrawOptions):
    """:meth:`RolloutEngine.start`'s keyword options, as :meth:`RolloutEngine.generate` passes them on."""

    max_new_tokens: int


class RolloutEngine:
    """Samples from a :class:`DecoderLM` at published versions.

    ``model``: the base the trainer's checkpoints were made from (copied;
    the engine never writes it). ``dtype``: the engine's weights and compute
    (default the model's; e.g. ``torch.bfloat16``). ``kv_cache``: decode
    incrementally (default) or run every column at every token (the
    reference). ``columns_run`` counts the token columns the model has run.
    """

    def __init__(self, model: DecoderLM, *, dtype: torch.dtype | None = None, kv_cache: bool = True) -> None:
        if not isinstance(model, DecoderLM):
            raise ConfigError("model", type(model).__name__, "a reference_trainer.DecoderLM")
        dtype = model.config.dtype if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError("dtype", dtype, "None or a floating-point torch.dtype")
        if not isinstance(kv_cache, bool):
            raise ConfigError("kv_cache", kv_cache, "a bool")
        self.dtype, self.kv_cache = dtype, kv_cache
        self._decoder = CachedDecoder(freeze(copy.deepcopy(model).to(dtype).eval()))
        self._served: ServedWeights | None = None
        self._pending: ServedWeights | None = None
        self._running: list[Generation] = []
        self.columns_run = 0

    @property
    def version(self) -> CheckpointVersion | None:
        """The version served now (``None`` before the first publication)."""
        return self._served.version if self._served is not None else None

    @property
    def pending_version(self) -> CheckpointVersion | None:
        """A drained publication's version, waiting for the running generations to finish."""
        return self._pending.version if self._pending is not None else None

    def apply(
        self, publication: WeightPublication, *, mode: str = "drain", expected: CheckpointVersion | None = None
    ) -> PublicationReport:
        """Switch to ``publication``'s weights, all or nothing, after a compare-and-set on ``expected`` (Rules 2-4)."""
        if not isinstance(publication, WeightPublication):
            raise ConfigError(
                "publication", type(publication).__name__, "a WeightPublication (Trainer.publish makes one)"
            )
        if mode not in MODES:
            raise ConfigError("mode", mode, f"one of {MODES}")
        if expected is not None and not isinstance(expected, CheckpointVersion):
            raise ConfigError("expected", expected, "None or a CheckpointVersion")
        started = time.perf_counter()
        previous = self.version
        check_newer(publication, previous, expected)
        if self._pending is not None:
            check_newer(publication, self._pending.version, None)
        staged = stage(publication, self._decoder.decoder, self.dtype)
        switched = mode == "inflight" or not self._running
        if switched:
            self._served, self._pending = staged, None
        else:
            self._pending = staged
        return PublicationReport(
            version=publication.version,
            previous=previous,
            mode=mode,
            switched=switched,
            tensors=len(publication.tensors),
            nbytes=publication.nbytes,
            seconds=time.perf_counter() - started,
        )

    def start(
        self,
        prompts: torch.Tensor | Sequence[torch.Tensor],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """A generation of ``max_new_tokens`` per prompt, drawn by :meth:`Generation.step`.

        ``prompts``: a ``(B, P)`` integer tensor or a list of 1-D prompts of
        any lengths (left-padded, NOTE [KV-cached decoding] Rule 1). The
        options are :func:`reference_trainer.sampling.sample`'s.
        """
        if self._served is None:
            raise EngineBusyError(
                "the engine serves no version yet: expected a publication first "
                "(trainer.publish(engine, checkpoint=...)), found none"
            )
        if self._pending is not None:
            raise EngineBusyError(
                f"a drained publication of {self._pending.version} waits for {len(self._running)} "
                "running generation(s): expected none pending; finish them first, or publish "
                "with mode='inflight'"
            )
        if not int_at_least(max_new_tokens, 1):
            raise ConfigError("max_new_tokens", max_new_tokens, "an int >= 1")
        check_draw_options(temperature, top_k, top_p)
        ids, pads = _left_padded(prompts, self._decoder.decoder.lm_head.weight.device)
        _check_token_range(ids, self._decoder.decoder.config.vocab_size)
        generation = Generation(self, ids, pads, max_new_tokens, (temperature, top_k, top_p), generator)
        self._running.append(generation)
        return generation

    def generate(
        self, prompts: torch.Tensor | Sequence[torch.Tensor], **options: Unpack[_StartOptions]
    ) -> list[Sample]:
        """:meth:`start` with ``options``, stepped to the end: one :class:`Sample` per prompt.

        If a step raises (anything, ``KeyboardInterrupt`` and out-of-memory included) the generation is cancelled
        before the exception propagates, so it holds no drained publication back and the engine can start again.
        """
        generation = self.start(prompts, **options)
        try:
            while not generation.done:
                generation.step()
        except BaseException:
            generation.cancel()
            raise
        return generation.samples()

    def score(self, prompt: torch.Tensor, completion: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        """FP32 ``(C,)`` log-probs of ``completion`` after ``prompt`` at the served version: one full forward, no cache."""
        if self._served is None:
            raise EngineBusyError("the engine serves no version yet: expected a publication first, found none")
        check_draw_options(temperature, None, None)
        for name, tokens in (("prompt", prompt), ("completion", completion)):
            if (
                not isinstance(tokens, torch.Tensor)
                or tokens.dim() != 1
                or tokens.numel() == 0
                or tokens.dtype.is_floating_point
                or tokens.dtype == torch.bool
            ):
                found = (
                    (tuple(tokens.shape), tokens.dtype) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
                )
                raise ConfigError(name, found, "a non-empty 1-D integer tensor")
        ids = torch.cat((prompt, completion)).long().unsqueeze(0)  # (1, P+C)
        pads = torch.zeros(1, dtype=torch.long, device=ids.device)
        logits = self.logits(self._served, ids, pads, None)[0, prompt.shape[0] - 1 : -1]  # (C, V)
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return logp.gather(-1, completion.long().unsqueeze(-1)).squeeze(-1)

    def logits(
        self, served: ServedWeights, ids: torch.Tensor, pads: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        """The decoder's logits for ``ids`` at ``served`` (NOTE [KV-cached decoding] Rule 3)."""
        self.columns_run += ids.numel()
        weights = served.tensors if served.lora is None else {}
        adapter = (
            nullcontext() if served.lora is None else attach_lora(self._decoder.decoder, served.lora, served.tensors)
        )
        with torch.no_grad(), adapter:
            logits: torch.Tensor = functional_call(self._decoder, dict(weights), (ids, pads, cache))
        return logits

    def finished(self, generation: Generation) -> None:
        """``generation`` drew its last token; a drained publication switches once none runs (Rule 4)."""
        self._running = [g for g in self._running if g is not generation]
        if not self._running and self._pending is not None:
            self._served, self._pending = self._pending, None


class Generation:
    """Prompts being completed by one engine, a token per row per :meth:`step`."""

    def __init__(
        self,
        engine: RolloutEngine,
        ids: torch.Tensor,
        pads: torch.Tensor,
        max_new_tokens: int,
        options: tuple[float, int | None, float | None],
        generator: torch.Generator | None,
    ) -> None:
        self._engine, self._ids, self._pads, self._prompt_width = engine, ids, pads, ids.shape[1]
        self.max_new_tokens, self._options, self._generator = max_new_tokens, options, generator
        self._logprobs: list[torch.Tensor] = []
        self._versions: list[CheckpointVersion] = []
        self._cache: KVCache | None = None
        self._cache_version: CheckpointVersion | None = None
        self.cancelled = False

    @property
    def done(self) -> bool:
        return len(self._versions) == self.max_new_tokens

    def cancel(self) -> None:
        """Stop this generation: it draws nothing more, has no samples and no longer holds a drain back."""
        if not self.done and not self.cancelled:
            self.cancelled = True
            self._cache = None
            self._engine.finished(self)

    @property
    def versions(self) -> list[CheckpointVersion]:
        """The version that drew each completion column so far."""
        return list(self._versions)

    def step(self) -> None:
        """Draw the next token of every row at the version served now (NOTE [Weight publication] Rule 4).

        All or nothing: if the forward or the draw raises, the KV cache is rolled back to the columns drawn so far
        and nothing is recorded, so the generation can step again or be cancelled.
        """
        if self.done or self.cancelled:
            raise ConfigError("step", "a finished or cancelled generation", "a generation with tokens left to draw")
        cache, version = self._cache, self._cache_version
        columns = cache.columns if cache is not None else 0
        try:
            self._draw()
        except BaseException:
            if cache is not None:
                cache.truncate(columns)
            self._cache, self._cache_version = cache, version
            raise
        if self.done:
            self._engine.finished(self)

    def _draw(self) -> None:
        """One token per row, appended with its log-prob and version; the KV cache grows by the columns run."""
        engine = self._engine
        served = engine._served
        assert served is not None  # start() refuses an engine serving nothing, and a served version is only replaced
        if not engine.kv_cache:
            logits = engine.logits(served, self._ids, self._pads, None)
        elif self._cache is None or self._cache_version != served.version:  # prefill, or rebuild at a new version
            self._cache, self._cache_version = KVCache(), served.version
            logits = engine.logits(served, self._ids, self._pads, self._cache)
        else:
            logits = engine.logits(served, self._ids[:, -1:], self._pads, self._cache)
        token, logprob = draw(logits[:, -1, :], *self._options, self._generator)  # (B, 1) each
        self._ids = torch.cat((self._ids, token.to(self._ids.dtype)), dim=1)
        self._logprobs.append(logprob)
        self._versions.append(served.version)

    def samples(self) -> list[Sample]:
        """One :class:`Sample` per prompt (real tokens only); ``version`` is the oldest token's."""
        if not self.done or self.cancelled:
            raise ConfigError(
                "samples",
                f"{len(self._versions)} of {self.max_new_tokens} tokens drawn",
                "a finished generation",
                "step until done",
            )
        behaviour = torch.cat(self._logprobs, dim=1)  # (B, C)
        revisions = torch.tensor([v.revision for v in self._versions], dtype=torch.long, device=self._ids.device)
        generations = torch.tensor([v.generation for v in self._versions], dtype=torch.long, device=self._ids.device)
        completions = self._ids[:, self._prompt_width :]
        pads = self._pads.tolist()
        return [
            Sample(
                prompt=self._ids[b, pads[b] : self._prompt_width].clone(),
                completion=completions[b].clone(),
                behaviour_logprobs=behaviour[b].clone(),
                version=self._versions[0],
                behaviour_revisions=revisions.clone(),
                behaviour_generations=generations.clone(),
            )
            for b in range(completions.shape[0])
        ]


def _check_token_range(ids: torch.Tensor, vocab_size: int) -> None:
    """``ConfigError`` unless every prompt token is an id of the model's vocabulary (one host read)."""
    low, high = (int(v) for v in torch.stack((ids.min(), ids.max())).tolist())
    if low < 0 or high >= vocab_size:
        raise ConfigError(
            "prompts",
            f"token ids from {low} to {high}",
            f"token ids in [0, {vocab_size})",
            "map the prompt through the model's tokenizer (ModelConfig.vocab_size)",
        )


def _left_padded(
    prompts: torch.Tensor | Sequence[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (B, P), pads (B,))``: prompts of any lengths left-padded with token 0 (NOTE [KV-cached decoding] Rule 1)."""
    if not isinstance(prompts, (list, tuple)):
        ids = prompt_batch(prompts).to(device)
        return ids, torch.zeros(ids.shape[0], dtype=torch.long, device=device)
    if not prompts or any(not isinstance(p, torch.Tensor) or p.dim() != 1 for p in prompts):
        found = [tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__ for p in prompts]
        raise ConfigError("prompts", found, "a (B, P) integer tensor or a non-empty list of 1-D integer tensors")
    rows = [prompt_batch(p)[0].to(device) for p in prompts]
    width = max(row.shape[0] for row in rows)
    pads = torch.tensor([width - row.shape[0] for row in rows], dtype=torch.long, device=device)
    ids = torch.stack([torch.nn.functional.pad(row, (width - row.shape[0], 0)) for row in rows])  # (B, P)
    return ids, pads
