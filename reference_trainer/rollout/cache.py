"""KV-cached incremental forward of a :class:`DecoderLM` over left-padded rows.

NOTE [KV-cached decoding]
  1. Rows are left-padded: row ``b`` holds ``pads[b]`` pad columns, then its
     real tokens. The real token in column ``t`` has position ``t - pads[b]``,
     the position it has in an unpadded forward, so its rotary angles are the
     trainer's.
  2. A query in column ``i`` sees the keys of columns ``j`` with
     ``pads[b] <= j <= i``; a pad query sees only itself (its output is never
     read), so no softmax row is empty.
  3. With a cache, a prefill runs every column so far once and keeps each
     layer's rotated keys and values; each later call runs the one new column
     and appends its keys and values. Without a cache every call runs every
     column so far, with the same positions and masks: the reference the
     cached path is checked against.
  4. The model runs in eval mode (no dropout) under ``torch.no_grad``; logits
     are in the parameter dtype, as the model's own forward returns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..model import DecoderLayer, DecoderLM

__all__ = ["KVCache", "CachedDecoder"]


@dataclass
class KVCache:
    """Every layer's rotated keys and values ``(B, Hkv, T, D)`` for the columns run so far (Rule 3)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def columns(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def truncate(self, columns: int) -> None:
        """Keep each layer's first ``columns`` columns: undo a call that failed part way (any number of layers)."""
        self.keys = [k[:, :, :columns] for k in self.keys]
        self.values = [v[:, :, :columns] for v in self.values]


class CachedDecoder(nn.Module):
    """``forward(input_ids, pads, cache) -> logits`` for the columns after those ``cache`` holds.

    ``input_ids``: ``(B, T)`` the new columns (all columns so far when
    ``cache`` is ``None`` or empty); ``pads``: ``(B,)`` left-pad counts
    (Rule 1). ``cache`` is extended in place when given. A module, so the
    weights it runs can be substituted by ``torch.func.functional_call``
    (names prefixed ``decoder.``).
    """

    def __init__(self, decoder: DecoderLM) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: torch.Tensor, pads: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        body = self.decoder.model
        start = cache.columns if cache is not None else 0
        batch, width = input_ids.shape
        columns = torch.arange(start, start + width, device=input_ids.device)  # (T,)
        positions = (columns.unsqueeze(0) - pads.unsqueeze(1)).clamp_min(0)  # (B, T), Rule 1
        x = body.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = body.rotary_emb(start + width, x.dtype)  # (S, D) tables for positions 0..S-1
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (B, 1, T, D)
        keys = torch.arange(start + width, device=input_ids.device)  # (S,)
        visible = (keys <= columns.unsqueeze(1)) & (keys >= pads.view(batch, 1, 1))  # (B, T, S), Rule 2
        visible = (visible | (keys == columns.unsqueeze(1))).unsqueeze(1)  # (B, 1, T, S)
        for index, layer in enumerate(body.layers):
            assert isinstance(layer, DecoderLayer)  # TransformerBody.layers holds DecoderLayers only (an nn.ModuleList)
            x = _layer(layer, x, cos, sin, visible, cache, index)
        logits: torch.Tensor = self.decoder.lm_head(body.norm(x))  # (B, T, V)
        return logits


def _layer(
    layer: DecoderLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    visible: torch.Tensor,
    cache: KVCache | None,
    index: int,
) -> torch.Tensor:
    """One decoder layer over the new columns; their keys and values join ``cache`` (Rule 3)."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    b, t, _ = h.shape
    q, k, v = attn.project(h, cos, sin)
    if cache is not None:
        if index < len(cache.keys):
            k = torch.cat((cache.keys[index], k), dim=2)  # (B, Hkv, S, D)
            v = torch.cat((cache.values[index], v), dim=2)
            cache.keys[index], cache.values[index] = k, v
        else:
            cache.keys.append(k)
            cache.values.append(v)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=attn.num_heads != attn.num_kv_heads)
    x = x + attn.o_proj(y.transpose(1, 2).reshape(b, t, attn.num_heads * attn.head_dim))
    out: torch.Tensor = x + layer.mlp(layer.post_attention_layernorm(x))
    return out
