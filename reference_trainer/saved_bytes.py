"""The analytic count of what a forward saves for backward (NOTE [Memory admission] Rule 5 in ``planner.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .lora import LoRAConfig
from .model import ModelConfig

__all__ = ["SavedTerms", "analytic_saved_bytes", "autocast_weight_bytes", "element_size", "saved_terms"]


@dataclass(frozen=True)
class SavedTerms:
    """A forward's analytic saved bytes by how they grow with its length ``T`` (Rule 5): a constant (the weight
    casts autocast saves), a term per ``T`` and one per ``T²`` (attention's squares)."""

    constant: int
    per_length: int
    per_square: int

    def at(self, seq_len: int) -> int:
        return self.constant + self.per_length * seq_len + self.per_square * seq_len * seq_len

    def worst_case(self, seen_len: int, seen_bytes: int, seq_len: int) -> float:
        """The most a ``seq_len`` forward saves if one of ``seen_len`` saved ``seen_bytes`` and each term holds at
        most its analytic count: the seen bytes fill the terms that grow most towards ``seq_len`` first (what no
        term holds grows like the fastest)."""
        terms = sorted(
            [
                (self.per_square * seen_len**2, (seq_len / seen_len) ** 2),
                (self.per_length * seen_len, seq_len / seen_len),
                (self.constant, 1.0),
            ],
            key=lambda term: term[1],
            reverse=True,
        )
        left, total = float(seen_bytes), 0.0
        for count, growth in terms:
            share = min(count, left)
            left, total = left - share, total + share * growth
        return total + left * terms[0][1]


def saved_terms(
    config: ModelConfig,
    batch: int,
    *,
    scores_saved: bool = True,
    lora: LoRAConfig | None = None,
    dropout_active: bool = False,
    autocast: torch.dtype | None = None,
) -> SavedTerms:
    """The terms of :func:`analytic_saved_bytes` for ``batch`` sequences (its contract)."""
    elem = max(element_size(config), 4) if dropout_active else element_size(config)
    c, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer_token = 8 * c + 6 * q + 6 * kv + 6 * i + 4 * config.num_attention_heads
    if lora is not None:
        per_layer_token += lora.rank * len(lora.targets)
    # Math attention saves its probabilities; with dropout also the mask and the dropped probabilities.
    squares = (3 if dropout_active else 2) * config.num_attention_heads * batch if scores_saved else 0
    layers = config.num_hidden_layers
    return SavedTerms(
        constant=autocast_weight_bytes(config, lora, autocast),
        per_length=batch
        * (layers * per_layer_token * elem + 4 * c * elem + 3 * v * 4 + 16),  # + final norm, logits, ids
        per_square=layers * squares * elem,
    )


def autocast_weight_bytes(config: ModelConfig, lora: LoRAConfig | None, autocast: torch.dtype | None) -> int:
    """Bytes of the weight copies autocast casts to ``autocast`` and saves for backward, once per forward: every
    projection's and the LM head's weight (and each LoRA factor), none where the weights already are in ``autocast``."""
    if autocast is None or autocast == config.dtype:
        return 0
    c, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {
        "q_proj": (c, q),
        "k_proj": (c, kv),
        "v_proj": (c, kv),
        "o_proj": (q, c),
        "gate_proj": (c, i),
        "up_proj": (c, i),
        "down_proj": (i, c),
    }
    per_layer = sum(n * m for n, m in shapes.values())
    if lora is not None:
        per_layer += sum(lora.rank * sum(shapes[t]) for t in lora.targets)
    return (config.num_hidden_layers * per_layer + c * v) * autocast.itemsize


def analytic_saved_bytes(
    config: ModelConfig,
    batch: int,
    seq_len: int,
    *,
    scores_saved: bool = True,
    lora: LoRAConfig | None = None,
    dropout_active: bool = False,
    autocast: torch.dtype | None = None,
) -> int:
    """A conservative count of the bytes a ``(batch, seq_len)`` forward saves for backward.

    A LoRA target saves its ``(B, T, rank)`` ``x·Aᵀ`` for ``B``'s gradient.
    With dropout active every element is priced at FP32 or wider: keep-masks
    are drawn in FP32 (``model.residual_dropout``) and math attention's dropout
    path saves FP32 intermediates, so a BF16 model saves more than half of
    what its FP32 twin does. Under ``autocast`` (its dtype, ``None``: off) the
    weight copies it casts are saved once per forward
    (:func:`autocast_weight_bytes`); activations stay priced at the model's dtype."""
    terms = saved_terms(
        config, batch, scores_saved=scores_saved, lora=lora, dropout_active=dropout_active, autocast=autocast
    )
    return terms.at(seq_len)


def element_size(config: ModelConfig) -> int:
    """Bytes per activation element the estimate prices ``config``'s dtype at."""
    return {2: 2, 4: 4, 8: 8}.get(config.dtype.itemsize, 4)
