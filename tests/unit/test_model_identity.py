"""The base model's identity a save holds (reference_trainer/model_identity.py; NOTE [Resume] Rule 1).

The oracle is numpy's own bytes of each tensor: the digest earlier saves hold.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import reference_trainer as rt
from reference_trainer.model_identity import model_identity


def _numpy_digest(model: rt.DecoderLM) -> str:
    """The identity digest as numpy computes it (the oracle, and what earlier saves hold)."""
    digest = hashlib.sha256()
    for name, param in model.state_dict().items():
        tensor = param.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize(("dtype", "tied"), [(torch.float32, False), (torch.bfloat16, False), (torch.float16, True)])
def test_the_model_digest_is_the_raw_bytes_digest_earlier_saves_hold(dtype, tied):
    """Hashed without numpy (tests/dist/test_torch_only.py), bitwise what numpy's bytes give: BF16 and tied weights too."""
    model = rt.DecoderLM(rt.ModelConfig.tiny(dtype=dtype, tie_word_embeddings=tied), seed=0)
    original = model_identity(model)["digest"]
    assert original == _numpy_digest(model)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1
    changed = model_identity(model)["digest"]
    assert changed != original and changed == _numpy_digest(model)


def test_models_whose_weights_agree_but_configs_differ_have_different_identities():
    """The config is part of the identity: a save of a model with dropout does not load into one without."""
    plain = rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.0), seed=0)
    dropped = rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.1), seed=0)
    assert _numpy_digest(plain) == _numpy_digest(dropped), "premise: the same weights"
    assert model_identity(plain) != model_identity(dropped)
