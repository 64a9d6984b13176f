"""A Qwen3-shaped decoder in plain PyTorch.

``DecoderLM`` follows the published Qwen3 equations: RMSNorm (computed in FP32),
rotary position embeddings (``rotate_half`` convention), grouped-query attention
with per-head RMSNorm on queries and keys, a SwiGLU MLP and an untied LM head.
Parameter names are those of Hugging Face's ``Qwen3ForCausalLM``, so a real
state dict loads with ``load_state_dict(strict=True)`` as is.

Our additions: optional ``dropout`` (on attention probabilities and on both
residual branches), a ``dtype`` for the parameters, and LoRA attachment points:
every projection is a :class:`Projection` whose forward adds the low-rank term
of an attached adapter (see :mod:`reference_trainer.lora`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError, int_at_least, is_number
from .host_reads import padding_trusted, read_on_host

__all__ = ["ModelConfig", "DecoderLM", "Projection", "token_logprobs", "check_right_padded"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the decoder; field names are those of Hugging Face's ``Qwen3Config``."""

    vocab_size: int = 64
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    intermediate_size: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # Our own fields.
    dropout: float = 0.0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not int_at_least(value, 1):
                raise ConfigError(name, value, "a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads={self.num_attention_heads}",
            )
        if self.head_dim % 2:
            raise ConfigError("head_dim", self.head_dim, "an even int (rotary pairs)")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not is_number(value) or not 0 < value < math.inf:
                raise ConfigError(name, value, "a finite positive float")
        dropout = self.dropout
        if not is_number(dropout) or not 0.0 <= dropout < 1.0:
            raise ConfigError("dropout", self.dropout, "a float in [0, 1)")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError("dtype", self.dtype, "a floating-point torch.dtype")

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **changes: Any) -> ModelConfig:
        """CPU tests: a train step in milliseconds."""
        return cls(**changes)

    @classmethod
    def small(cls, **changes: Any) -> ModelConfig:
        """The CPU benchmark shape."""
        fields: dict[str, Any] = dict(
            vocab_size=4096,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            intermediate_size=768,
        )
        return cls(**{**fields, **changes})

    @classmethod
    def qwen3_8b(cls, **changes: Any) -> ModelConfig:
        """The exact shape of Qwen3-8B (8,190,735,360 parameters)."""
        fields: dict[str, Any] = dict(
            vocab_size=151936,
            hidden_size=4096,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=12288,
            max_position_embeddings=40960,
        )
        return cls(**{**fields, **changes})


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in FP32 like Qwen3."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Projection(nn.Linear):
    """A bias-free linear layer that a LoRA adapter can be attached to.

    ``lora`` is ``None`` or ``(A, B, scaling)`` with ``A: (rank, in)`` and
    ``B: (out, rank)``; the output is then ``x W^T + scaling * (x A^T) B^T``.
    It is set only inside :func:`reference_trainer.lora.attach_lora`.
    """

    __call__: Callable[..., torch.Tensor]  # what forward returns (nn.Module types a call as Any)

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.lora: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.lora is None:
            return y
        a, b, scaling = self.lora
        return y + F.linear(F.linear(x, a), b) * scaling


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``0..T-1`` (``inv_freq`` is not persistent)."""

    inv_freq: torch.Tensor  # a registered buffer

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(seq_len, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(positions, self.inv_freq)  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(-x2, x1)`` for the halves ``(x1, x2)`` of the last dimension (the rotary convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, d = config, config.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_proj = Projection(c.hidden_size, c.num_attention_heads * c.head_dim, d)
        self.k_proj = Projection(c.hidden_size, c.num_key_value_heads * c.head_dim, d)
        self.v_proj = Projection(c.hidden_size, c.num_key_value_heads * c.head_dim, d)
        self.o_proj = Projection(c.num_attention_heads * c.head_dim, c.hidden_size, d)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, d)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, d)
        self.dropout = c.dropout

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries (B, H, T, D), keys and values (B, Hkv, T, D) of ``x`` (B, T, hidden), rotated at ``cos``/``sin``."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        # Right padding needs only the causal mask: real tokens never see pads.
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, d = config, config.dtype
        self.gate_proj = Projection(c.hidden_size, c.intermediate_size, d)
        self.up_proj = Projection(c.hidden_size, c.intermediate_size, d)
        self.down_proj = Projection(c.intermediate_size, c.hidden_size, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def residual_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout whose keep-mask is always drawn in FP32.

    ``F.dropout`` draws different masks for FP32 and FP64 inputs from the same
    RNG state; drawing in FP32 makes the masks identical whatever the compute
    dtype, so BF16/FP32 runs can be checked against FP64 recomputations.
    """
    if not training or p == 0.0:
        return x
    keep = torch.empty(x.shape, dtype=torch.float32, device=x.device).bernoulli_(1.0 - p)
    return x * (keep * (1.0 / (1.0 - p))).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + residual_dropout(h, self.dropout, self.training)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + residual_dropout(h, self.dropout, self.training)


class TransformerBody(nn.Module):
    """What Hugging Face calls ``Qwen3Model`` (the ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)


class DecoderLM(nn.Module):
    """Qwen3-style causal LM: ``model(input_ids, attention_mask=None) -> logits``.

    ``input_ids``: ``(batch, seq)`` token ids. ``attention_mask``: optional
    ``(batch, seq)`` mask of real tokens, which must be right-padded (ones, then
    zeros); logits at padded positions are meaningless. Returns ``(batch, seq,
    vocab)`` logits in the parameter dtype. Weights are initialised from the
    global RNG, or from ``seed`` when given.
    """

    __call__: Callable[..., torch.Tensor]  # what forward returns (nn.Module types a call as Any)

    def __init__(self, config: ModelConfig, *, seed: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = TransformerBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=config.dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._init_weights(seed)

    def _init_weights(self, seed: int | None) -> None:
        generator = None
        if seed is not None and self.lm_head.weight.device.type != "meta":
            generator = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, self.config.initializer_range, generator=generator)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ConfigError("input_ids", tuple(input_ids.shape), "a (batch, seq) tensor")
        if attention_mask is not None and not padding_trusted():
            check_right_padded(attention_mask, tuple(input_ids.shape))
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = self.model.rotary_emb(input_ids.shape[1], x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))  # (B, T, V)
        return logits


def check_right_padded(attention_mask: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise ``ConfigError`` unless ``attention_mask`` has ``shape`` and is right-padded."""
    if tuple(attention_mask.shape) != shape:
        raise ConfigError("attention_mask", tuple(attention_mask.shape), f"shape {shape}")
    mask = attention_mask.bool()
    # Right padding: once a row turns False it stays False.
    if read_on_host((mask[:, 1:] & ~mask[:, :-1]).any(), "right padding"):
        raise ConfigError(
            "attention_mask",
            "a mask with a real token after padding",
            "right padding (ones, then zeros)",
            "move padding to the end of each row",
        )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log p(targets[..., t])`` under ``logits[..., t, :]``, in FP32 (FP64 for FP64 logits).

    A negative target masks its position: its log-prob is 0 and it gets no
    gradient. Shapes: logits ``(..., T, V)``, targets ``(..., T)``.
    """
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    picked = logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(targets < 0, 0.0)
