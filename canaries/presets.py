"""Canary presets: what a canary runs on, for the CPU suite and for GPU CI.

A preset names the model shape, the checkpoint kind, the dtype, the device and
the process layout. Every canary takes one. ``cpu`` runs in the test suite in
seconds; ``gpu`` is what GPU CI runs on 2 or 8 H200s (``small`` and
``qwen3_8b`` shapes with LoRA, BF16). ``Preset.on_this_machine()`` keeps a GPU
preset's code path but swaps the device for the CPU and the model for a small
shape when no GPU is present, so the GPU path runs end to end here (its
logical-rank parts still spawned, on at most two gloo processes); the checks
that need CUDA then report themselves as skipped. ``processes`` is what
``rtv run --nproc`` asks for when given: an argument of :func:`preset`,
resolved once per run into the request every canary reads
(``canaries.request.CanaryRun``; nothing goes through ``os.environ`` or
ambient state); a GPU preset's FP64
oracle canaries may run a declared subset of its layers (``oracle_layers``,
recorded in the evidence), and ``canaries.preset_budget`` checks its memory
estimate against the device before anything is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from reference_trainer import LoRAConfig, ModelConfig
from reference_trainer.planner import Placement
from validation.errors import SetupError

__all__ = ["PLACEMENTS", "PLACEMENT_REQUESTS", "Preset", "PRESETS", "preset"]

# Every canary names placements through these, derived from the trainer's own enum, so none keeps a copy.
PLACEMENTS: tuple[str, ...] = tuple(p.value for p in Placement)  # where a record keeps its saved state
PLACEMENT_REQUESTS: tuple[str, ...] = (*PLACEMENTS, "auto")  # what a forward may ask for ("auto": the planner picks)


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelConfig
    lora: LoRAConfig | None
    device: str
    processes: int
    logical_dp: int
    sequences: int
    seq_len: int
    memory_limit_bytes: int | None = None
    swapped: bool = False  # a GPU preset running on CPU with a small shape
    oracle_layers: int | None = None  # the FP64 oracle's canaries run the model's first N layers (None: all)
    hang_timeout_s: float = 120.0  # the collective watchdog's deadline (rtv run --hang-timeout; validation.hangs)

    @property
    def oracle_model(self) -> ModelConfig:
        """The model the derivative canary's trainer and FP64 oracle share: ``oracle_layers`` of ``model``'s."""
        if self.oracle_layers is None:
            return self.model
        return self.model.replace(num_hidden_layers=self.oracle_layers)

    @property
    def cuda_checks(self) -> bool:
        """Whether CUDA-only checks (allocator statistics, pinned memory) apply."""
        return self.device == "cuda" and torch.cuda.is_available()

    def on_this_machine(self) -> Preset:
        """This preset, or its CPU stand-in when it asks for CUDA and none is present."""
        if self.device != "cuda" or torch.cuda.is_available():
            return self
        return dataclasses.replace(
            self,
            model=ModelConfig.tiny(dtype=self.model.dtype, dropout=self.model.dropout),
            device="cpu",
            sequences=min(self.sequences, 4),
            seq_len=min(self.seq_len, 16),
            memory_limit_bytes=None,
            swapped=True,
            oracle_layers=None,
            processes=min(self.processes, 2),  # still spawned, as declared, but at most two CPU processes
        )

    def describe(self) -> dict:
        return {
            "name": self.name,
            "model": {f.name: str(getattr(self.model, f.name)) for f in dataclasses.fields(self.model)},
            "lora": None if self.lora is None else dataclasses.asdict(self.lora),
            "device": self.device,
            "processes": self.processes,
            "logical_dp": self.logical_dp,
            "sequences": self.sequences,
            "seq_len": self.seq_len,
            "memory_limit_bytes": self.memory_limit_bytes,
            "swapped_for_cpu": self.swapped,
            "oracle_layers": self.oracle_layers,
            "hang_timeout_s": self.hang_timeout_s,
        }


PRESETS: dict[str, Preset] = {
    "cpu": Preset("cpu", ModelConfig.tiny(dropout=0.1), LoRAConfig(rank=4), "cpu", 1, 1, 3, 9),
    "gpu": Preset(
        "gpu",
        ModelConfig.small(dtype=torch.bfloat16, dropout=0.0),
        LoRAConfig(rank=16),
        "cuda",
        processes=2,
        logical_dp=2,
        sequences=4,
        seq_len=256,
        hang_timeout_s=300.0,
    ),
    "gpu-8b": Preset(
        "gpu-8b",
        ModelConfig.qwen3_8b(dtype=torch.bfloat16),
        LoRAConfig(rank=16),
        "cuda",
        processes=8,
        logical_dp=8,
        sequences=4,
        seq_len=256,  # capped: the FP64 oracle's activations grow with every token
        oracle_layers=4,  # the FP64 oracle checks the 8B shape on its first 4 of 36 layers (stated in the evidence)
        hang_timeout_s=600.0,
    ),
}


def preset(name: str, processes: int | None = None) -> Preset:
    """The preset ``name``, on ``processes`` processes when given (else its own).

    ``logical_dp`` rises to the next multiple of the process count when it is
    not one. Raises ``SetupError`` for an unknown name or a count that is not
    a positive integer (a bool is not a count).
    """
    try:
        found = PRESETS[name]
    except KeyError:
        raise SetupError(f"unknown preset {name!r}", fix=f"use one of {', '.join(PRESETS)}") from None
    if processes is None:
        return found
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise SetupError(
            f"preset {name!r} on {processes!r} processes: expected a positive int", fix="pass --nproc N, N >= 1"
        )
    logical_dp = -(-found.logical_dp // processes) * processes
    return dataclasses.replace(found, processes=processes, logical_dp=logical_dp)
