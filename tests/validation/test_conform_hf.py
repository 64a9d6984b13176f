"""The third-party adapter ``hf-lora`` (transformers' Qwen3 + PEFT LoRA) judged by the conformance suite.

Needs the ``conform-hf`` extra (transformers 4.x and peft, pyproject.toml):
skipped with that reason where transformers or peft is missing. Slow: building
the model imports transformers (seconds).
"""

from __future__ import annotations

from types import ModuleType

import pytest

from validation.conform import FAILED, NOT_APPLICABLE, PASSED, ConformSpec, conform

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def hf_lora() -> ModuleType:
    """The adapter's module, imported only when a test runs: collecting transformers and PEFT costs each xdist
    worker about 3 s, and every test here is slow."""
    for name in ("transformers", "peft"):
        pytest.importorskip(
            name, reason=f"needs the conform-hf extra (pip install -e '.[conform-hf]'): {name} not installed"
        )
    from validation.conform.adapters import hf_lora

    return hf_lora


def test_hf_lora_passes_every_check_it_claims() -> None:
    report = conform("hf-lora", ConformSpec())
    assert {v.check: v.status for v in report.verdicts} == {
        "sync": PASSED,
        "stale": PASSED,
        "splits": PASSED,
        "resume": NOT_APPLICABLE,
        "processes": NOT_APPLICABLE,
    }


def test_without_allow_mutation_on_saved_tensors_its_stale_backward_fails(
    monkeypatch: pytest.MonkeyPatch, hf_lora: ModuleType
) -> None:
    """The negative control: AdamW's in-place step then trips autograd's version check."""
    monkeypatch.setattr(hf_lora.HFLoRAAdapter, "_hold_context", lambda self: None)
    monkeypatch.setattr(hf_lora.HFLoRAAdapter, "backward", lambda self, loss: loss.backward())
    verdict = conform("hf-lora", ConformSpec(), checks=("stale",)).verdicts[0]
    assert verdict.status == FAILED and "modified by an inplace operation" in verdict.reason
