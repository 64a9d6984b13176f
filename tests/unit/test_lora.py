"""LoRA adapters: exact identity when fresh, equal to merged weights, gradients only to the adapter."""

from __future__ import annotations

import math

import pytest
import torch

from reference_trainer.errors import ConfigError
from reference_trainer.lora import ALL_PROJECTIONS, LoRAAdapter, LoRAConfig, freeze
from reference_trainer.model import DecoderLM, ModelConfig, token_logprobs

CONFIG = ModelConfig.tiny()
LORA = LoRAConfig(rank=4, alpha=8.0)


def make(lora: LoRAConfig = LORA) -> tuple[DecoderLM, LoRAAdapter, torch.Tensor]:
    model = DecoderLM(CONFIG, seed=0).eval()
    adapter = LoRAAdapter(model, lora, seed=1)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    return model, adapter, ids


def perturb_b(adapter: LoRAAdapter, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return -token_logprobs(logits[:, :-1], ids[:, 1:]).mean()


def test_parameter_names_follow_peft_for_the_targets_only() -> None:
    model, adapter, _ = make(LoRAConfig(rank=2, targets=("q_proj", "down_proj")))

    names = {name for name, _ in adapter.named_parameters()}

    expected = {
        f"model.layers.{i}.{path}.{factor}.weight"
        for i in range(CONFIG.num_hidden_layers)
        for path in ("self_attn.q_proj", "mlp.down_proj")
        for factor in ("lora_A", "lora_B")
    }
    assert names == expected
    a = dict(adapter.named_parameters())["model.layers.0.mlp.down_proj.lora_A.weight"]
    b = dict(adapter.named_parameters())["model.layers.0.mlp.down_proj.lora_B.weight"]
    assert a.shape == (2, CONFIG.intermediate_size) and b.shape == (CONFIG.hidden_size, 2)


def test_fresh_adapter_reproduces_base_logits_exactly() -> None:
    model, adapter, ids = make()
    with torch.no_grad():
        base = model(ids)
        with adapter.attached(model):
            adapted = model(ids)

    assert torch.equal(adapted, base)
    assert any(a.abs().sum() > 0 for n, a in adapter.named_parameters() if ".lora_A." in n)


def test_attached_adapter_equals_merged_weights_and_detaches_after() -> None:
    model, adapter, ids = make()
    perturb_b(adapter)
    merged = DecoderLM(CONFIG).eval()
    merged.load_state_dict(adapter.merged_state_dict(model), strict=True)

    with torch.no_grad():
        base = model(ids)
        with adapter.attached(model):
            adapted = model(ids)
        after = model(ids)
        expected = merged(ids)

    assert (adapted - base).abs().amax() > 1e-2  # the adapter does something
    torch.testing.assert_close(adapted, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, base)


def test_adapter_detaches_when_the_block_raises() -> None:
    model, adapter, ids = make()
    perturb_b(adapter)
    with torch.no_grad():
        base = model(ids)
        with pytest.raises(RuntimeError, match="boom"), adapter.attached(model):
            raise RuntimeError("boom")
        assert torch.equal(model(ids), base)


def test_after_freeze_only_the_adapter_trains() -> None:
    model, adapter, ids = make()
    freeze(model)
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.requires_grad for p in adapter.parameters())

    with adapter.attached(model):
        loss_of(model(ids), ids).backward()

    assert all(p.grad is None for p in model.parameters())
    grads = {name: p.grad for name, p in adapter.named_parameters()}
    # B == 0 at init, so A's gradient (scaling * B^T g x) is exactly zero; B's is not.
    assert all(g is not None and torch.count_nonzero(g) > 0 for n, g in grads.items() if ".lora_B." in n)
    assert all(g is not None and torch.count_nonzero(g) == 0 for n, g in grads.items() if ".lora_A." in n)

    perturb_b(adapter)
    for p in adapter.parameters():
        p.grad = None
    with adapter.attached(model):
        loss_of(model(ids), ids).backward()

    assert all(p.grad is None for p in model.parameters())
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in adapter.parameters()
    )


def test_scaling_is_alpha_over_rank() -> None:
    assert LoRAConfig(rank=4, alpha=8.0).scaling == 2.0
    assert LoRAConfig().targets == ALL_PROJECTIONS


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("rank", {"rank": 0}),
        ("rank", {"rank": -2}),
        ("rank", {"rank": 2.0}),
        ("rank", {"rank": True}),
        ("alpha", {"alpha": 0.0}),
        ("alpha", {"alpha": -1.0}),
        ("alpha", {"alpha": math.inf}),
        ("alpha", {"alpha": math.nan}),
        ("alpha", {"alpha": "16"}),
        ("alpha", {"alpha": True}),  # a bool is not a number (errors.is_number)
        ("targets", {"targets": ()}),
        ("targets", {"targets": ("qkv_proj",)}),
        ("targets", {"targets": ("q_proj", "lm_head")}),
        ("targets", {"targets": "q_proj"}),  # a string is not a tuple of names
    ],
)
def test_bad_lora_config_raises_config_error_naming_the_field(field: str, changes: dict) -> None:
    with pytest.raises(ConfigError, match=f"LoRAConfig.{field}") as info:
        LoRAConfig(**changes)
    assert info.value.field == f"LoRAConfig.{field}"
