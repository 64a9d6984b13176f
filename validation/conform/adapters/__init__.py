"""The shipped adapters (``rtv conform --list``): this project's trainer, plain PyTorch loops, a third-party stack.

Each is named ``package.module:factory`` in :data:`SHIPPED`, the way an outside
adapter is named on the command line; modules are imported only when run.
"""

from __future__ import annotations

__all__ = ["SHIPPED", "NEGATIVE_CONTROLS"]

SHIPPED = {  # name -> (factory path, one line)
    "reference": (
        "validation.conform.adapters.reference:ReferenceAdapter",
        "this project's Trainer: versioned stale backwards, saves, logical ranks (every capability)",
    ),
    "sync": ("validation.conform.adapters.plain:SyncAdapter", "a plain PyTorch loop: staleness 0 only"),
    "naive-async": (
        "validation.conform.adapters.plain:NaiveAsyncAdapter",
        "negative control: a stale backward through weights updated in place (must fail stale)",
    ),
    "snapshot-async": (
        "validation.conform.adapters.plain:SnapshotAsyncAdapter",
        "a deep copy of the weights per forward: correct, at a measured memory cost",
    ),
    "hf-lora": (
        "validation.conform.adapters.hf_lora:HFLoRAAdapter",
        (
            "Hugging Face transformers (Qwen3 config) + PEFT LoRA, stale backwards through "
            "allow_mutation_on_saved_tensors (needs the conform-hf extra)"
        ),
    ),
}
NEGATIVE_CONTROLS = {"naive-async": "stale"}  # adapter -> the one check it must fail
