"""Small builders shared by the tests (not part of any package API)."""

from __future__ import annotations

import numpy as np
import torch

import reference_trainer as rt
from validation.evidence import content_digest, make_record
from validation.trainers import trainer_with_policy

NO_CORRECTION = rt.ForwardOptions(corrections=())


def make_trainer(kind: str, *, dropout: float = 0.1, lr: float = 5e-2, seed: int = 0, **trainer_kw) -> rt.Trainer:
    """``validation.trainers.trainer_with_policy`` with the unit tests' defaults: the tiny model with dropout,
    AdamW at ``lr``, a LoRA of rank 4 (``kind="lora"``) or a full checkpoint (``"full"``)."""
    lora = rt.LoRAConfig(rank=4) if kind == "lora" else None
    return trainer_with_policy(
        rt.ModelConfig.tiny(dropout=dropout), lora=lora, optimizer=rt.AdamWConfig(lr=lr), seed=seed, **trainer_kw
    )


def sequence(seed: int, length: int = 9, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (input_tokens, target_tokens) with the inputs shifted as targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (length + 1,), generator=g)
    return tokens[:-1].clone(), tokens[1:].clone()


def advantages(seed: int, length: int = 9) -> torch.Tensor:
    return torch.randn(length, generator=torch.Generator().manual_seed(seed))


def train_step(trainer: rt.Trainer, seed: int) -> None:
    """One fresh forward/backward/step on other data, so the live weights move."""
    ids, tgt = sequence(seed)
    out = trainer.forward(rt.ForwardInput(ids, tgt), options=NO_CORRECTION)
    trainer.backward(-(out.target_logprobs * advantages(seed)).sum())
    trainer.optim_step()
    trainer.zero_grad()


def grads_of(trainer: rt.Trainer, name: str = "policy") -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in trainer.checkpoint(name).named_parameters()}


def grad_snapshot(trainer: rt.Trainer, name: str = "policy") -> dict[str, tuple[object, torch.Tensor | None]]:
    """(object identity, value copy) of every ``.grad``, to prove nothing changed."""
    return {
        n: (p.grad, None if p.grad is None else p.grad.clone()) for n, p in trainer.checkpoint(name).named_parameters()
    }


def assert_grads_unchanged(trainer: rt.Trainer, before: dict, name: str = "policy") -> None:
    for n, p in trainer.checkpoint(name).named_parameters():
        obj, value = before[n]
        assert p.grad is obj, f"{n}: .grad object changed"
        if value is not None:
            assert torch.equal(p.grad, value), f"{n}: .grad value changed"


def assert_nested_equal(found: object, expected: object, where: str = "state") -> None:
    """Bitwise equality of nested dicts, lists and tuples of tensors (dtype too), numpy arrays and plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(found, torch.Tensor) and found.dtype == expected.dtype, f"{where}: dtype or type differs"
        assert torch.equal(found, expected), f"{where}: tensors differ"
    elif isinstance(expected, np.ndarray):
        assert found.dtype == expected.dtype and found.shape == expected.shape, f"{where}: dtype or shape differs"
        assert found.tobytes() == expected.tobytes(), f"{where}: bits differ"
    elif isinstance(expected, dict):
        assert isinstance(found, dict) and set(found) == set(expected), f"{where}: keys {set(found) ^ set(expected)}"
        for key in expected:
            assert_nested_equal(found[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(found) == len(expected), f"{where}: lengths differ"
        for index, (f, e) in enumerate(zip(found, expected)):
            assert_nested_equal(f, e, f"{where}[{index}]")
    else:
        assert found == expected, f"{where}: {found!r} != {expected!r}"


def checkless_passed_record() -> dict:
    """An evidence record with no checks that says passed, its digest recomputed: well formed, but it proves nothing."""
    record = make_record("k", config={}, checks={}, measurements={})
    record["passed"] = True
    record["digest"] = content_digest(record)
    return record


def model_snapshot(model: rt.DecoderLM) -> tuple:
    """Everything of ``model`` a call must leave as it was: ``requires_grad``, weights, buffers, mode, and the RNG."""
    return (
        [(n, p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()],
        [(n, b.clone()) for n, b in model.named_buffers()],
        model.training,
        torch.get_rng_state(),
    )


def assert_model_unchanged(model: rt.DecoderLM, before: tuple) -> None:
    params, buffers, training, rng = model_snapshot(model)
    assert [(n, g) for n, g, _ in params] == [(n, g) for n, g, _ in before[0]], "requires_grad changed"
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(params, before[0])), "weights changed"
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(buffers, before[1])), "buffers changed"
    assert training == before[2] and torch.equal(rng, before[3]), "mode or RNG changed"
