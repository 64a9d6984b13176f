"""The rollout canary's scenarios: a trainer and an engine on the tiny model, and what each scenario measures.

Each function builds what it needs from seeds and returns plain numbers (the
canary judges them and writes them as measurements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import reference_trainer as rt
from reference_trainer.sampling import Sample
from reference_trainer.testing import inject_fault
from validation.trainers import trainer_with_policy

PROMPT_LENGTHS = (3, 6, 4, 5, 2, 6, 3, 5)
LR = 0.05  # large enough that one step moves every log-prob well past the FP32 tolerance


@dataclass(frozen=True)
class Setting:
    """One mismatch cell: the engine's dtype and cache, the batch size, and whether prompts are ragged
    (``"left+right"``: the engine left-pads them, the trainer's batch right-pads the sequences) or not (``"none"``)."""

    dtype: str
    kv_cache: bool
    batch: int
    padding: str

    @property
    def label(self) -> str:
        return f"{self.dtype} {'cache' if self.kv_cache else 'no cache'} B={self.batch} pad={self.padding}"


def policy_trainer(device: torch.device, *, seed: int = 0) -> rt.Trainer:
    """A LoRA policy on the tiny model whose factors are random (the adapter changes the base's log-probs)."""
    model = rt.DecoderLM(rt.ModelConfig.tiny(), seed=seed).to(
        device
    )  # drawn on the host: the same factors on any device
    trainer = trainer_with_policy(model, lora=rt.LoRAConfig(rank=4), optimizer=rt.AdamWConfig(lr=LR), seed=seed)
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for _, param in trainer.checkpoint("policy").named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return trainer


def sampler(device: torch.device, seed: int) -> torch.Generator:
    """The generator a scenario's samples are drawn from: seeded, never the process's global RNG (whose initial
    seed differs per process), so the samples are a function of the code alone."""
    return torch.Generator(device=device).manual_seed(seed)


def prompts(batch: int, padding: str, device: torch.device, *, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + batch)
    lengths = PROMPT_LENGTHS[:batch] if padding != "none" else (4,) * batch
    return [torch.randint(64, (n,), generator=generator).to(device) for n in lengths]


def engine_for(trainer: rt.Trainer, *, dtype: torch.dtype = torch.float32, kv_cache: bool = True) -> rt.RolloutEngine:
    engine = rt.RolloutEngine(trainer.model, dtype=dtype, kv_cache=kv_cache)
    trainer.publish(engine, checkpoint="policy")
    return engine


def step(trainer: rt.Trainer) -> None:
    """One optimizer step of the policy on a fixed sequence, unrelated to any sample."""
    tokens = (torch.arange(12) % 64).to(trainer.device)
    output = trainer.forward(rt.ForwardInput(input_tokens=tokens), checkpoint="policy")
    trainer.backward(-output.target_logprobs.sum())
    trainer.optim_step()
    trainer.zero_grad()


def forward_samples(
    trainer: rt.Trainer, samples: list, *, behaviour: bool = True, options: rt.ForwardOptions | None = None
) -> list[rt.ForwardOutput]:
    """The trainer's forward of the samples, one right-padded batch, carrying their behaviour data."""
    inputs = [
        rt.ForwardInput(
            input_tokens=s.input_tokens,
            target_tokens=s.target_tokens,
            options=options,
            behaviour_logprobs=s.aligned_behaviour_logprobs if behaviour else None,
            behaviour_revisions=s.aligned_behaviour_revisions if behaviour else None,
            behaviour_generations=s.aligned_behaviour_generations if behaviour else None,
        )
        for s in samples
    ]
    return trainer.forward(inputs, checkpoint="policy")


def mismatch(setting: Setting, tokens: int, device: torch.device) -> list[float]:
    """Per completion token, ``engine log-prob - trainer log-prob`` at the same weights."""
    trainer = policy_trainer(device)
    dtype = torch.bfloat16 if setting.dtype == "bf16" else torch.float32
    engine = engine_for(trainer, dtype=dtype, kv_cache=setting.kv_cache)
    samples = engine.generate(
        prompts(setting.batch, setting.padding, device),
        max_new_tokens=tokens,
        generator=sampler(device, 0),
    )
    with torch.no_grad():
        outputs = forward_samples(trainer, samples, behaviour=False)
    gaps = [
        s.behaviour_logprobs - o.target_logprobs.detach()[s.prompt.shape[0] - 1 :] for s, o in zip(samples, outputs)
    ]
    return torch.cat(gaps).double().cpu().tolist()


def behaviour_report(
    trainer: rt.Trainer, samples: list, *, options: rt.ForwardOptions | None = None, fill_from_trainer: bool = False
) -> rt.BehaviourStats:
    """The trainer's ``BehaviourStats`` for one batch of samples (summed log-prob loss, one backward).

    ``fill_from_trainer``: the negative control's bug: behaviour log-probs taken from the trainer's own forward
    (what a stack does when the engine's are missing), which forces every ratio to 1.
    """
    if fill_from_trainer:
        with torch.no_grad():
            own = forward_samples(trainer, samples, behaviour=False)
        samples = [
            Sample(
                prompt=s.prompt,
                completion=s.completion,
                version=s.version,
                behaviour_revisions=s.behaviour_revisions,
                behaviour_generations=s.behaviour_generations,
                behaviour_logprobs=o.target_logprobs.detach()[s.prompt.shape[0] - 1 :],
            )
            for s, o in zip(samples, own)
        ]
    outputs = forward_samples(trainer, samples, options=options)
    report = trainer.backward(-sum(o.target_logprobs.sum() for o in outputs))
    trainer.zero_grad()
    (record,) = report.records
    return record.behaviour


def publication_faults(device: torch.device) -> dict[str, object]:
    """A fault at every tensor of a publication; how many left the served outputs bitwise unchanged."""
    trainer = policy_trainer(device)
    engine = engine_for(trainer)
    step(trainer)
    fixed = prompts(2, "left+right", device)
    completion = torch.tensor([4, 4, 6], device=device)
    before = (engine.version, [engine.score(p, completion) for p in fixed])
    tensors, unchanged, typed = len(list(trainer.checkpoint("policy").parameters())), 0, 0
    for index in range(tensors):
        try:
            with inject_fault("weight_publication", index=index):
                trainer.publish(engine, checkpoint="policy")
        except rt.PublicationError:
            typed += 1
        after = (engine.version, [engine.score(p, completion) for p in fixed])
        unchanged += after[0] == before[0] and all(torch.equal(a, b) for a, b in zip(after[1], before[1]))
    report = trainer.publish(engine, checkpoint="policy")
    moved = not torch.equal(engine.score(fixed[0], completion), before[1][0])
    return {
        "tensors": tensors,
        "unchanged": unchanged,
        "typed_errors": typed,
        "clean_publication_moves": moved,
        "nbytes": report.nbytes,
        "seconds": report.seconds,
    }


def inflight(device: torch.device, tokens: int) -> dict[str, object]:
    """A generation spanning two ``inflight`` publications, each token checked against re-decoding."""
    trainer = policy_trainer(device)
    engine = engine_for(trainer)
    references = {0: engine_for(trainer)}
    generation = engine.start(prompts(2, "left+right", device), max_new_tokens=tokens, generator=sampler(device, 3))
    publish_after = {1, tokens - 2}
    while not generation.done:
        generation.step()
        if len(generation.versions) in publish_after:
            step(trainer)
            trainer.publish(engine, checkpoint="policy", mode="inflight")
            references[trainer.checkpoint("policy").revision] = engine_for(trainer)
    worst_own, nearest_other = 0.0, float("inf")
    for s in generation.samples():
        for i, revision in enumerate(s.behaviour_revisions.tolist()):
            prefix, token = torch.cat((s.prompt, s.completion[:i])), s.completion[i : i + 1]
            gaps = {r: float((e.score(prefix, token) - s.behaviour_logprobs[i]).abs()) for r, e in references.items()}
            worst_own = max(worst_own, gaps.pop(revision))
            nearest_other = min([nearest_other, *gaps.values()])
    return {
        "versions": [v.revision for v in generation.versions],
        "worst_own_version_gap": worst_own,
        "nearest_other_version_gap": nearest_other,
    }
