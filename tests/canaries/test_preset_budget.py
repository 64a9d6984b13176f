"""GPU presets estimate their device memory from shapes alone, print it and refuse what cannot fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import reference_trainer as rt
from canaries.preset_budget import check_fits, estimate, parameter_count
from canaries.presets import preset
from validation.errors import SetupError
from validation.oracle import OracleTrainer

QWEN3_8B_PARAMETERS = 8_190_735_360  # Qwen3-8B with an untied head: 36 layers, hidden 4096, vocab 151936


def test_the_8b_parameter_count_comes_from_meta_models_without_allocating() -> None:
    assert parameter_count(rt.ModelConfig.qwen3_8b()) == QWEN3_8B_PARAMETERS
    tiny = rt.ModelConfig.tiny()
    assert parameter_count(tiny) == sum(p.numel() for p in rt.DecoderLM(tiny, seed=0).parameters())


def test_the_8b_derivative_canary_is_estimated_to_fit_120_gb_and_says_what_it_checks() -> None:
    config = preset("gpu-8b")
    found = estimate(config, oracle=True)
    assert 5e9 < found.total <= 120e9, found.describe()
    assert found.parts["oracle FP64 model"] == 8 * parameter_count(config.oracle_model)
    assert config.describe()["oracle_layers"] == config.oracle_layers < config.model.num_hidden_layers
    assert config.seq_len <= 256


def test_a_preset_that_exceeds_the_device_is_refused_after_printing_its_estimate() -> None:
    printed: list[str] = []
    config = preset("gpu-8b")
    full = dataclasses.replace(config, oracle_layers=None, seq_len=1024)  # the uncapped 8B oracle
    with pytest.raises(SetupError, match="needs about"):
        check_fits(full, oracle=True, capacity=141 * 10**9, echo=printed.append)
    assert printed and "oracle FP64 model" in printed[0]
    check_fits(config, oracle=True, capacity=141 * 10**9, echo=printed.append)


def test_the_oracle_materialises_its_models_from_the_base_state_it_is_given() -> None:
    config = rt.ModelConfig.tiny()
    model = rt.DecoderLM(config, seed=3)
    oracle = OracleTrainer(config, model.state_dict(), training=False, baseline_dtype=torch.float32)
    for name, value in model.state_dict().items():
        assert torch.equal(oracle.model.state_dict()[name], value.double()), name
    ids = torch.randint(0, config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(oracle.model(ids).float(), model(ids), rtol=1e-4, atol=1e-4)
    assert torch.equal(oracle.model.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
