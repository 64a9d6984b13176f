"""Hugging Face transformers + PEFT LoRA behind the protocol: a third-party training stack, judged as any other.

The model is a tiny, randomly initialised ``Qwen3ForCausalLM`` built from a
``Qwen3Config`` of the spec's shape (nothing is downloaded), wrapped by
``peft.get_peft_model`` with LoRA on every projection; ``torch.optim.AdamW``
steps the LoRA factors. PEFT initialises each ``B`` factor to zero, which
would leave every ``A`` factor without a gradient at step 0, so ``start``
draws the ``B`` factors from N(0, 0.02) (seeded): every factor is judged.

Stale backwards use ``torch.autograd.graph.allow_mutation_on_saved_tensors``:
a tensor saved for backward is cloned before AdamW mutates it in place, so a
backward after k steps sees the forward's weights. The context is one per
process and cannot be nested, so the adapter holds it open only while one
of its forwards is pending (opened at a forward, closed by the backward that
consumed the last one), and claims no ``"save"`` (a save between a forward
and its backward would leave it open under a second adapter).

Needs ``transformers`` (4.51 to 4.x) and ``peft``: the ``conform-hf`` extra
(docs/conform.md#the-shipped-adapters); imported in ``start``, so the rest of
the suite runs without them.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import cast

import torch
from torch import Tensor

from ..protocol import AdapterError, ConformSpec

__all__ = ["HFLoRAAdapter"]

LORA_RANK = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _qwen3_lora(spec: ConformSpec) -> torch.nn.Module:
    try:
        import peft
        import transformers
    except ImportError as error:
        raise AdapterError(
            "hf-lora",
            f"needs transformers and peft, found {error}",
            fix="pip install -e '.[conform-hf]' (docs/conform.md#the-shipped-adapters)",
        ) from error
    config = transformers.Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        head_dim=spec.hidden_size // spec.heads,
        intermediate_size=2 * spec.hidden_size,
        max_position_embeddings=max(64, spec.seq_len),
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(spec.seed)
    base = transformers.Qwen3ForCausalLM(config).to(spec.torch_dtype)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=TARGETS)
    )
    generator = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.02)
    return cast(torch.nn.Module, model)


class HFLoRAAdapter:
    """transformers' Qwen3 + PEFT LoRA, AdamW on the LoRA factors, stale backwards by cloning saved tensors."""

    name = "hf-lora"
    capabilities = frozenset({"stale"})
    notes = (
        f"transformers Qwen3ForCausalLM (random init) + PEFT LoRA rank {LORA_RANK} on {', '.join(TARGETS)}; "
        "stale backwards under torch.autograd.graph.allow_mutation_on_saved_tensors"
    )

    def start(self, spec: ConformSpec) -> None:
        self._model = _qwen3_lora(spec)
        trained = [p for p in self._model.parameters() if p.requires_grad]
        self._optimizer = torch.optim.AdamW(
            trained, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
        )
        self._context = ExitStack()
        self._pending: set[int] = set()
        self._forwards = 0

    def module(self) -> torch.nn.Module:
        return self._model

    def _hold_context(self) -> None:
        if not self._pending:
            self._context.enter_context(torch.autograd.graph.allow_mutation_on_saved_tensors())

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor:
        self._hold_context()
        self._forwards += 1
        self._pending.add(self._forwards)
        logits = self._model(input_ids=input_tokens).logits  # (B, T, V)
        logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # never down
        picked = logprobs.gather(-1, target_tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        picked = picked * (target_tokens >= 0)  # (B, T); masked targets: 0, no gradient
        picked.register_hook(lambda grad, forward=self._forwards: self._pending.discard(forward))
        return picked

    def backward(self, loss: Tensor) -> None:
        loss.backward()
        if not self._pending:
            self._context.close()

    def optim_step(self) -> None:
        self._optimizer.step()

    def zero_grad(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)
