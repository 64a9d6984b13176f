"""A CPU smoke of the model: one LoRA training step on the tiny config, checked.

Builds ``DecoderLM(ModelConfig.tiny())`` from a seed, attaches a LoRA adapter,
runs forward, loss (mean negative token log-prob), backward and one AdamW step
on synthetic tokens, and checks each step. :func:`judge` takes the run's
request (``canaries.request.CanaryRun``: the smoke reads only its ``echo``;
it runs the tiny model on the CPU whatever the preset) and returns a
``canaries.registry.Judged`` of kind ``"smoke"``, every check recorded
through ``validation.evidence.Checks``; ``rtv run`` writes it through
``canaries.registry.Canary.record``, like every canary's.

Negative control: ``inject_failure=True`` (``rtv run --inject-failure`` or
``RTV_SMOKE_INJECT_FAILURE=1``) leaves ``lm_head`` trainable, so the check that
the frozen base gets no gradient must fail.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch

from reference_trainer.lora import LoRAAdapter, LoRAConfig, freeze
from reference_trainer.model import DecoderLM, ModelConfig, token_logprobs
from validation.evidence import Checks

from .registry import Judged
from .request import CanaryRun

__all__ = ["judge", "KIND"]

KIND = "smoke"


def judge(
    run: CanaryRun,
    *,
    seed: int = 0,
    batch: int = 4,
    seq_len: int = 16,
    lr: float = 1e-3,
    inject_failure: bool = False,
) -> Judged:
    """Run the smoke (``seed``: the weights' and tokens'; module docstring); each check is shown as it is made."""
    run.runs_every_check("smoke")
    model_config = ModelConfig.tiny()
    lora_config = LoRAConfig(rank=4, alpha=8.0)
    checks = Checks(echo=run.echo)
    check = checks.check

    model = freeze(DecoderLM(model_config, seed=seed))
    if inject_failure:
        model.lm_head.weight.requires_grad_(True)
    adapter = LoRAAdapter(model, lora_config, seed=seed + 1)
    base_before = {name: p.detach().clone() for name, p in model.named_parameters()}
    adapter_before = {name: p.detach().clone() for name, p in adapter.named_parameters()}
    g = torch.Generator().manual_seed(seed + 2)
    tokens = torch.randint(0, model_config.vocab_size, (batch, seq_len + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each

    def loss_fn() -> torch.Tensor:
        with adapter.attached(model):
            return -token_logprobs(model(inputs), targets).mean()

    loss = loss_fn()
    check("loss is finite", bool(torch.isfinite(loss)), f"loss={loss.item():.6f}")
    uniform = math.log(model_config.vocab_size)
    check(
        "initial loss is near log(vocab)",
        abs(loss.item() - uniform) < 0.5,
        f"loss={loss.item():.4f}, log(vocab)={uniform:.4f}",
    )

    loss.backward()
    grads = [p.grad for p in adapter.parameters() if p.grad is not None]
    missing = sum(p.grad is None for p in adapter.parameters())
    check(
        "every adapter parameter has a finite gradient",
        not missing and all(torch.isfinite(gr).all() for gr in grads),
        f"{len(grads)} with gradients, {missing} without",
    )
    grad_norm = math.sqrt(sum(float(gr.double().pow(2).sum()) for gr in grads))
    check("adapter gradient is nonzero", grad_norm > 0, f"grad norm={grad_norm:.3e}")
    base_grads = sorted(name for name, p in model.named_parameters() if p.grad is not None)
    check("frozen base gets no gradient", not base_grads, f"base parameters with gradients: {base_grads}")

    torch.optim.AdamW(adapter.parameters(), lr=lr).step()
    changed = sum(not torch.equal(p, adapter_before[name]) for name, p in adapter.named_parameters())
    check("AdamW step changed the adapter", changed > 0, f"{changed} of {len(adapter_before)} tensors changed")
    base_changed = sorted(n for n, p in model.named_parameters() if not torch.equal(p, base_before[n]))
    check("base weights unchanged", not base_changed, f"changed: {base_changed}")

    with torch.no_grad():
        after = loss_fn().item()
    check("loss decreased on the same batch", after < loss.item(), f"{loss.item():.6f} -> {after:.6f}")

    config = {
        "seed": seed,
        "batch": batch,
        "seq_len": seq_len,
        "lr": lr,
        "inject_failure": inject_failure,
        "model": {**asdict(model_config), "dtype": str(model_config.dtype)},
        "lora": asdict(lora_config),
    }
    return Judged(KIND, config, checks, {})
