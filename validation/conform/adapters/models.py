"""The decoder a spec describes, built with this project's plain-PyTorch ``DecoderLM`` (Qwen3-style)."""

from __future__ import annotations

import reference_trainer as rt

from ..protocol import ConformSpec

__all__ = ["decoder_config", "decoder"]


def decoder_config(spec: ConformSpec) -> rt.ModelConfig:
    """Every shape field of ``spec``; one KV head per query head; an MLP twice the hidden size."""
    return rt.ModelConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        head_dim=spec.hidden_size // spec.heads,
        intermediate_size=2 * spec.hidden_size,
        dtype=spec.torch_dtype,
    )


def decoder(spec: ConformSpec) -> rt.DecoderLM:
    """A ``DecoderLM`` of ``spec``'s shape with weights from ``spec.seed``."""
    return rt.DecoderLM(decoder_config(spec), seed=spec.seed)
