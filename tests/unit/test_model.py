"""DecoderLM: Qwen3 names and shapes, the published equations, causality, padding, config."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st

from reference_trainer.errors import ConfigError
from reference_trainer.model import DecoderLM, ModelConfig

# Every dimension distinct (q width 32 != hidden 24 != kv width 16), so a swapped
# or transposed weight cannot go unnoticed.
SHAPES = ModelConfig.tiny(
    vocab_size=50,
    hidden_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=40,
)


def qwen3_state_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of Hugging Face's ``Qwen3ForCausalLM`` (untied)."""
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_width, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv_width, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_width, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_width),
            p + "self_attn.q_norm.weight": (c.head_dim,),
            p + "self_attn.k_norm.weight": (c.head_dim,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
        }
    shapes |= {"model.norm.weight": (c.hidden_size,), "lm_head.weight": (c.vocab_size, c.hidden_size)}
    return shapes


def random_qwen3_state(c: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A Qwen3-named state dict with O(1) activations and non-trivial norm weights."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in qwen3_state_shapes(c).items():
        if len(shape) == 1:  # an RMSNorm weight
            state[name] = 0.5 + torch.rand(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            state[name] = torch.randn(shape, generator=g)
        else:
            state[name] = torch.randn(shape, generator=g) / math.sqrt(shape[1])
    return state


@functools.cache
def loaded_model(c: ModelConfig = SHAPES, seed: int = 0) -> DecoderLM:
    model = DecoderLM(c).eval()
    model.load_state_dict(random_qwen3_state(c, seed), strict=True)
    return model


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# --- Names and shapes ---------------------------------------------------------


def test_qwen3_state_dict_loads_strictly_with_identical_keys() -> None:
    expected = qwen3_state_shapes(SHAPES)
    model = DecoderLM(SHAPES)
    state = random_qwen3_state(SHAPES, seed=1)

    model.load_state_dict(state, strict=True)

    ours = model.state_dict()
    assert set(ours) == set(expected)
    assert {k: tuple(v.shape) for k, v in ours.items()} == expected
    assert all(torch.equal(ours[k], state[k]) for k in expected)


def test_qwen3_8b_preset_has_the_exact_parameter_count() -> None:
    config = ModelConfig.qwen3_8b()
    with torch.device("meta"):
        model = DecoderLM(config)

    assert sum(p.numel() for p in model.parameters()) == 8_190_735_360
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (36, 4096, 12288)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert (config.vocab_size, config.rope_theta, config.tie_word_embeddings) == (151936, 1e6, False)


def test_small_preset_is_the_cpu_benchmark_shape() -> None:
    c = ModelConfig.small()
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (4096, 256, 4, 768)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (8, 4, 32)


# --- The published Qwen3 equations, in FP64 -----------------------------------


def reference_logits(state: dict[str, torch.Tensor], c: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Qwen3ForCausalLM's forward written from its equations, in float64."""
    w = {k: v.double() for k, v in state.items()}
    b, t = ids.shape
    h_q, h_kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)

    inv_freq = c.rope_theta ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)  # (D/2,)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq  # (T, D/2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)  # (T, D)

    def rope(x: torch.Tensor) -> torch.Tensor:  # (B, H, T, D)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    causal = torch.ones(t, t, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][ids]  # (B, T, C)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(b, t, h_q, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(b, t, h_kv, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(b, t, h_kv, d)
        q = rope(rms_norm(q, w[p + "self_attn.q_norm.weight"]).transpose(1, 2))  # (B, Hq, T, D)
        k = rope(rms_norm(k, w[p + "self_attn.k_norm.weight"]).transpose(1, 2))  # (B, Hkv, T, D)
        v = v.transpose(1, 2)
        k = k.repeat_interleave(h_q // h_kv, dim=1)  # (B, Hq, T, D): kv head j serves q heads j*r..
        v = v.repeat_interleave(h_q // h_kv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)  # (B, Hq, T, T)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = (probs @ v).transpose(1, 2).reshape(b, t, h_q * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T  # (B, T, V)


def test_logits_match_an_fp64_reference_of_the_qwen3_equations() -> None:
    model = loaded_model()
    ids = torch.randint(0, SHAPES.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))

    with torch.no_grad():
        ours = model(ids)
    expected = reference_logits(model.state_dict(), SHAPES, ids)

    assert ours.shape == (2, 9, SHAPES.vocab_size)
    # Not vacuous: logits vary across positions and vocabulary.
    assert expected.std() > 0.5
    assert (expected[:, 1:] - expected[:, :-1]).abs().amax() > 0.5
    assert rel_l2(ours, expected) < 1e-5


# --- Causality ----------------------------------------------------------------


@given(data=st.data(), seq_len=st.integers(2, 12))
def test_changing_a_token_never_changes_earlier_logits(data: st.DataObject, seq_len: int) -> None:
    model = loaded_model()
    tokens = st.lists(st.integers(0, SHAPES.vocab_size - 1), min_size=seq_len, max_size=seq_len)
    ids = torch.tensor([data.draw(tokens, label="ids")])
    t = data.draw(st.integers(1, seq_len - 1), label="t")
    token = data.draw(st.integers(0, SHAPES.vocab_size - 1), label="token")
    assume(token != int(ids[0, t]))
    changed = ids.clone()
    changed[0, t] = token

    with torch.no_grad():
        before, after = model(ids), model(changed)

    assert torch.equal(before[:, :t], after[:, :t])
    assert not torch.equal(before[:, t], after[:, t])  # the change itself is seen


# --- Right padding ------------------------------------------------------------


def test_right_padded_batch_matches_each_sequence_alone() -> None:
    model = loaded_model()
    g = torch.Generator().manual_seed(3)
    lengths = [9, 5, 2]
    seqs = [torch.randint(0, SHAPES.vocab_size, (n,), generator=g) for n in lengths]
    # Pads hold arbitrary tokens: the mask, not the pad id, keeps them out.
    ids = torch.randint(0, SHAPES.vocab_size, (len(seqs), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1

    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        for row, seq in enumerate(seqs):
            alone = model(seq[None])[0]
            torch.testing.assert_close(batched[row, : len(seq)], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "mask",
    [[[0, 0, 1, 1]], [[1, 1, 1, 1], [1, 0, 1, 0]], [[1, 1, 1]]],
    ids=["left-padded", "hole", "wrong-shape"],
)
def test_a_mask_that_is_not_right_padding_is_refused(mask: list[list[int]]) -> None:
    model = loaded_model()
    ids = torch.zeros(len(mask), 4, dtype=torch.long)
    with pytest.raises(ConfigError, match="attention_mask") as info:
        model(ids, attention_mask=torch.tensor(mask))
    assert info.value.field == "attention_mask"


# --- Config validation ----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vocab_size", 0),
        ("hidden_size", -8),
        ("num_hidden_layers", 1.5),
        ("num_attention_heads", True),
        ("num_key_value_heads", 3),  # does not divide 4 query heads
        ("head_dim", 7),  # rotary needs pairs
        ("intermediate_size", "64"),
        ("max_position_embeddings", 0),
        ("dropout", 1.0),
        ("dropout", -0.1),
        ("dropout", "0.1"),
        ("dtype", torch.int64),
        ("dtype", "float32"),
        ("rms_norm_eps", 0.0),
        ("rms_norm_eps", float("nan")),
        ("rope_theta", -1.0),
        ("rope_theta", float("inf")),
    ],
)
def test_bad_config_field_raises_config_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        ModelConfig.tiny(**{field: value})
    assert info.value.field == field


def test_replace_validates_again() -> None:
    with pytest.raises(ConfigError, match="head_dim"):
        ModelConfig.tiny().replace(head_dim=3)


# --- Dropout --------------------------------------------------------------------


def test_dropout_is_random_in_train_mode_seeded_and_off_in_eval() -> None:
    model = DecoderLM(ModelConfig.tiny(dropout=0.2), seed=0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))

    with torch.no_grad():
        model.train()
        torch.manual_seed(5)
        first = model(ids)
        second = model(ids)
        torch.manual_seed(5)
        replayed = model(ids)
        model.eval()
        eval_a, eval_b = model(ids), model(ids)

    assert not torch.equal(first, second)
    assert torch.equal(first, replayed)
    assert torch.equal(eval_a, eval_b)
    assert not torch.equal(eval_a, first)
