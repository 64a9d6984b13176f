"""The planner canary: ``auto``'s choices and the planner's estimates against every measured placement.

A grid of cells (:data:`CELL_GRIDS`: checkpoint kind × dropout × batch × sequence
length × pending forwards (staleness) × device limit × host limit), chosen
so retain, offload and replay each win somewhere and some cells admit
nothing. Per cell (NOTE [Planner certificate] in ``certificate.py``):

1. every placement runs once on an unlimited trainer under the memory census
   (``validation.memory``), after a shorter forward of another shape class:
   measured peak, host bytes, predicted peak, and what each forward's record
   holds (both pools) against the saved bytes its plan admitted;
2. the cell's limits are set from those predictions: ``none``; ``tight`` (the
   device limit is offload's predicted peak: with two pending forwards
   retaining both does not fit); ``nothing`` (one byte under every measured
   peak: a right refusal); the host limit ``none`` or ``zero`` (what the other
   placements hold on the host, replay's RNG states: offload does not fit) or
   ``one`` (room for one offloaded record's estimate: auto retains one forward
   and offloads the next, forced offload of both is refused, replay wins);
3. on a trainer under those limits every admitted placement and ``auto``
   are timed in alternating blocks (``validation.abba.run_block``), ``auto``'s
   decisions (placements, predicted prices) recorded; blocks either load
   witness flags (the CPU share, the machine meter: :func:`timed_blocks`) are
   replaced while the grid's budget lasts, and a cell still loaded
   records its measured load instead of timings to judge (NOTE [Planner
   certificate] Rule 9).

What runs is :func:`plan`'s: the CPU grid on the tiny model, or with CUDA present a GPU
preset's declared subset (:data:`GPU_PLANS`) on its own model and LoRA rank, within
its declared budget.

Bytes are on the work's scale: the census counts storages made after the
checkpoint was added; the prediction is ``predicted_bytes`` less what the
checkpoints hold (``Checkpoint.held_nbytes``), which the trainer's limit adds
back.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

import reference_trainer as rt
from validation import abba
from validation.evidence import Checks
from validation.memory import StorageCensus, frozen_heap
from validation.trainers import trainer_with_policy

from ..presets import PLACEMENTS, Preset
from ..registry import Judged
from ..request import CanaryRun
from . import calibration
from .certificate import AUTO, ArmMemory, CellResult, Gates, certify, loaded_detail
from .timing import timed_blocks

__all__ = [
    "Cell",
    "CELL_GRIDS",
    "BLOCKS",
    "CPU_BUDGET_S",
    "GPU_PLANS",
    "GridPlan",
    "KIND",
    "judge",
    "plan",
    "run_cell",
]

KIND = "planner-canary"


@dataclass(frozen=True)
class Cell:
    lora: bool
    dropout: float
    batch: int
    seq_len: int
    pending: int  # forwards pending before their backwards (staleness)
    device: str  # "none" | "tight" | "nothing"
    host: str  # "none" | "zero" | "one" (room for one offloaded record)
    rank: int = 4  # the LoRA rank (a GPU preset's own)

    @property
    def label(self) -> str:
        kind = "lora" if self.lora else "full"
        return (
            f"{kind} p{self.dropout:g} {self.batch}x{self.seq_len} s{self.pending} dev:{self.device} host:{self.host}"
        )


def _levels(lora: bool, dropout: float, batch: int, seq_len: int) -> list[Cell]:
    shape = dict(lora=lora, dropout=dropout, batch=batch, seq_len=seq_len)
    return [
        Cell(**shape, pending=1, device="none", host="none"),
        Cell(**shape, pending=2, device="tight", host="none"),
        Cell(**shape, pending=2, device="tight", host="zero"),
        Cell(**shape, pending=2, device="tight", host="one"),
        Cell(**shape, pending=1, device="nothing", host="none"),
    ]


_GRID = [
    c
    for lora in (True, False)
    for dropout in (0.0, 0.1)
    for b, t in ((2, 16), (4, 32))
    for c in _levels(lora, dropout, b, t)
]

# Quick: retain, offload and replay each win, and a right refusal, in seconds. Its tight no-offload cell
# (dropout on: replay restores the masks) is where only replaying both pending forwards fits: `auto` retains
# the first, then demotes it to replay (NOTE [Memory admission] Rule 6; a wrong refusal before). Its regret
# is the first forward's retain hooks, sunk before the second forward is known: 1-2% at 2x32, up to ~8% at
# 2x16 LoRA (measured single-threaded on a loaded 2-core machine), so quick takes 2x32. Default and
# nightly: the whole grid, nightly with more blocks.
CELL_GRIDS: dict[str, list[Cell]] = {
    "quick": [
        Cell(True, 0.0, 2, 16, 1, "none", "none"),
        Cell(False, 0.1, 2, 32, 2, "tight", "none"),
        Cell(False, 0.1, 2, 32, 2, "tight", "one"),
        Cell(False, 0.1, 2, 32, 2, "tight", "zero"),
        Cell(True, 0.1, 2, 32, 1, "nothing", "none"),
    ],
    "default": _GRID,
    "nightly": _GRID,
}
BLOCKS = {"quick": 16, "default": 16, "nightly": 32}


@dataclass(frozen=True)
class GridPlan:
    """What one preset x profile runs: its cells, blocks per cell, the model (each cell sets its dropout), the
    device, and the wall-clock budget declared for the whole grid (docs/harness.md#time-budgets)."""

    cells: tuple[Cell, ...]
    blocks: int
    model: rt.ModelConfig
    device: str
    budget_s: float


def _gpu_cells(
    lora: bool, dropouts: tuple[float, ...], shapes: tuple[tuple[int, int], ...], rank: int = 16
) -> list[Cell]:
    return [replace(c, rank=rank) for d in dropouts for b, t in shapes for c in _levels(lora, d, b, t)]


def _quick(cells: list[Cell]) -> tuple[Cell, ...]:
    """A GPU grid's quick subset: the first shape's levels, where each placement wins and one is refused."""
    first = cells[0]
    return tuple(
        c
        for c in cells
        if (c.lora, c.dropout, c.batch, c.seq_len) == (first.lora, first.dropout, first.batch, first.seq_len)
    )


# A GPU preset's declared subset (the CPU grid's levels on the preset's model, LoRA rank and lengths) when CUDA
# is present; swapped for the CPU, the CPU grid runs (said in the evidence). gpu-8b: LoRA only (a full 8B copy's
# masters and AdamW state alone outgrow the device), batch 1 at 2K with every level and 4K with the one-forward
# levels (two offloaded 4K forwards would pin about 80 GB of host memory), few blocks: 8B steps take seconds.
_GPU_SMALL = _gpu_cells(True, (0.0, 0.1), ((4, 512), (4, 1024))) + _gpu_cells(False, (0.0,), ((4, 512),))
_GPU_8B = _gpu_cells(True, (0.0,), ((1, 2048),)) + [c for c in _gpu_cells(True, (0.0,), ((1, 4096),)) if c.pending == 1]
GPU_PLANS: dict[str, dict[str, GridPlan]] = {
    "gpu": {
        "quick": GridPlan(_quick(_GPU_SMALL), 8, rt.ModelConfig.small(dtype=torch.bfloat16), "cuda", 60.0),
        "default": GridPlan(tuple(_GPU_SMALL), 16, rt.ModelConfig.small(dtype=torch.bfloat16), "cuda", 300.0),
    },
    "gpu-8b": {
        "quick": GridPlan(_quick(_GPU_8B), 4, rt.ModelConfig.qwen3_8b(dtype=torch.bfloat16), "cuda", 300.0),
        "default": GridPlan(tuple(_GPU_8B), 8, rt.ModelConfig.qwen3_8b(dtype=torch.bfloat16), "cuda", 900.0),
    },
}
CPU_BUDGET_S = {"quick": 10.0, "default": 300.0, "nightly": 600.0}  # docs/harness.md#time-budgets


def plan(preset: Preset, profile: str) -> GridPlan:
    """What ``preset`` (as it runs on this machine) x ``profile`` runs: a GPU preset's declared subset on CUDA
    (nightly: its default), else the CPU grid."""
    if preset.device == "cuda":
        plans = GPU_PLANS[preset.name]
        return plans.get(profile, plans["default"])
    return GridPlan(tuple(CELL_GRIDS[profile]), BLOCKS[profile], rt.ModelConfig.tiny(), "cpu", CPU_BUDGET_S[profile])


def _inputs(cell: Cell, vocab: int, seed: int) -> list[rt.ForwardInput]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (cell.batch, cell.seq_len + 1), generator=g)
    return [rt.ForwardInput(row[:-1].clone(), row[1:].clone()) for row in tokens]


def _trainer(
    model: rt.DecoderLM, cell: Cell, device_limit: int | None = None, host_limit: int | None = None
) -> rt.Trainer:
    """A trainer of ``cell``'s checkpoint kind under ``device_limit`` (the plan's scale, holdings included) and ``host_limit``."""
    lora = rt.LoRAConfig(rank=cell.rank) if cell.lora else None
    return trainer_with_policy(model, lora=lora, memory_limit_bytes=device_limit, host_memory_limit_bytes=host_limit)


def _steps(
    trainer: rt.Trainer,
    batches: list[list[rt.ForwardInput]],
    placement: str,
    after_forward: Callable[[list[rt.ForwardOutput]], None] = lambda outs: None,
) -> list[rt.PlacementDecision]:
    """``len(batches)`` forwards under ``placement``, then their backwards; a refusal backpropagates what ran, then raises."""
    options = rt.ForwardOptions(backward_state=placement, corrections=())
    pending: list[list[rt.ForwardOutput]] = []
    try:
        for inputs in batches:
            pending.append(trainer.forward(inputs, options=options))
            after_forward(pending[-1])
    finally:
        decisions = [outputs[0].decision for outputs in pending]
        while pending:
            trainer.backward(-sum(o.target_logprobs.sum() for o in pending.pop(0)))
        trainer.zero_grad()
    return decisions


def _memory(model: rt.DecoderLM, cell: Cell, batches: list[list[rt.ForwardInput]], placement: str) -> ArmMemory:
    """Rule 1: ``placement`` once on an unlimited trainer, its sampled census peak against its predicted peak."""
    trainer = _trainer(model, cell)
    holdings = trainer.checkpoint("policy").held_nbytes()
    # A shorter forward first (another shape class): its measured scale must not reach this class (Rule 5).
    _steps(trainer, [_inputs(replace(cell, seq_len=max(1, cell.seq_len // 4)), model.config.vocab_size, 99)], placement)
    census = StorageCensus(model.lm_head.weight.device)
    kept: list[torch.Tensor] = []
    sample = census.sample_hook(ignore=lambda: kept)

    def in_backward(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(sample)

    layers = model.model.layers
    handles = [layers[-1].register_forward_hook(sample), layers[0].register_forward_hook(in_backward)]
    held = [0]  # what the pending records hold after each forward, both pools: each record's growth is its saved state

    def after_forward(outputs: list[rt.ForwardOutput]) -> None:
        kept.extend(o.target_logprobs for o in outputs)
        held.append(census.measure(ignore=kept).total)

    try:
        decisions = _steps(trainer, batches, placement, after_forward)
    finally:
        for handle in handles:
            handle.remove()
    grown = [after - before for before, after in zip(held, held[1:])]
    return ArmMemory(
        measured_peak=census.peak.device,
        predicted_peak=max(d.predicted_bytes for d in decisions) - holdings,
        measured_host=census.peak.host,
        saved_estimate=max(d.saved_bytes for d in decisions),
        saved_ratio=max(g / d.saved_bytes for g, d in zip(grown, decisions)),
    )


def _limits(cell: Cell, memory: dict[str, ArmMemory]) -> tuple[int | None, int | None]:
    """Step 2 of the module docstring, on the work scale."""
    device = {
        "none": None,
        "tight": memory["offload"].predicted_peak,
        "nothing": min(m.measured_peak for m in memory.values()) - 1,
    }[cell.device]
    # The host bytes a placement other than offload holds (replay's RNG states): offload alone goes over.
    others = max(m.measured_host for p, m in memory.items() if p != "offload")
    host = {"none": None, "zero": others, "one": others + memory["offload"].saved_estimate}[cell.host]
    return device, host


def run_cell(
    model: rt.DecoderLM,
    cell: Cell,
    blocks: int,
    clock: Callable[[], float] = time.perf_counter,
    probe: abba.LoadProbe | None = None,
    *,
    meter: abba.LoadMeter | None = None,
    idle_share: float = 0.0,
    extend_until: float | None = None,
) -> CellResult:
    """Measure one cell (module docstring); a cell that raises is returned with its error (Rule 6).
    ``probe``, ``meter``, ``idle_share`` and ``extend_until``: :func:`timed_blocks`'s; as ``abba.witnesses``
    gives them: the real ones without a ``probe``. A loaded cell records its load (Rule 9)."""
    batches = [_inputs(cell, model.config.vocab_size, 100 + k) for k in range(cell.pending)]
    probe, meter = abba.witnesses(probe, meter)
    result = CellResult(cell.label, None, None)
    try:
        result.memory = {p: _memory(model, cell, batches, p) for p in PLACEMENTS}
        result.device_limit, result.host_limit = _limits(cell, result.memory)
        holdings = _trainer(model, cell).checkpoint("policy").held_nbytes()
        device_limit = None if result.device_limit is None else result.device_limit + holdings
        trainer = _trainer(model, cell, device_limit, result.host_limit)
        for placement in PLACEMENTS:
            try:
                _steps(trainer, batches, placement)
            except rt.MemoryAdmissionError:
                continue
            result.admitted.append(placement)
        try:
            decisions = _steps(trainer, batches, AUTO)
        except rt.MemoryAdmissionError:
            return result
        result.auto = [str(d.placement) for d in decisions]
        arms = {p: (lambda p=p: _steps(trainer, batches, p)) for p in [*result.admitted, AUTO]}
        timing = timed_blocks(arms, blocks, clock, probe, meter=meter, idle_share=idle_share, extend_until=extend_until)
        result.seconds, result.loaded_blocks, result.load = timing.seconds, timing.loaded, timing.load
        decisions = _steps(trainer, batches, AUTO)  # the prices with the speed the timed forwards taught
        result.predicted = {p: sum(d.predicted_seconds[p] for d in decisions) for p in PLACEMENTS}
        moved, tokens = 2.0 * sum(d.saved_bytes for d in decisions), float(cell.batch * cell.seq_len * cell.pending)
        result.features = {
            "retain": [0.0, 0.0, 0.0],
            "offload": [moved, 0.0, float(cell.pending)],
            "replay": [0.0, tokens, float(cell.pending)],
        }
    except Exception:  # noqa: BLE001 - Rule 6: a failed cell is recorded, never lost
        result.error = traceback.format_exc(limit=4)
    return result


def judge(run: CanaryRun) -> Judged:
    """The registry's entry point: every cell of ``run.profile``'s grid, then the certificate."""
    run.runs_every_check("planner")
    started, profile = time.perf_counter(), run.profile
    plan_ = plan(run.preset, profile)
    cells = plan_.cells
    models: dict[float, rt.DecoderLM] = {}
    results: dict[str, CellResult] = {}
    # One core's share on an idle machine for a CPU run (``rtv run`` takes one thread); a GPU run waits on its
    # device, so only its warm-up's share is the reference there.
    idle_share = 1.0 if plan_.device == "cpu" else 0.0
    for dropout in dict.fromkeys(c.dropout for c in cells):
        with torch.device(plan_.device):
            models[dropout] = rt.DecoderLM(plan_.model.replace(dropout=dropout), seed=0)
    with frozen_heap():  # each census then collects only what its cell made (NOTE [Memory census] Rule 5)
        for cell in cells:
            results[cell.label] = run_cell(
                models[cell.dropout], cell, plan_.blocks, idle_share=idle_share, extend_until=started + plan_.budget_s
            )
    gates = Gates()
    figures, verdicts = certify([c.label for c in cells], results, gates)
    calibrated = calibration.held_out(list(results.values()), gates.confidence)
    verdicts.append(calibration.held_out_check(calibrated, loaded_detail(list(results.values()))))
    checks = Checks(echo=run.echo)
    for name, ok, detail in verdicts:
        if ok is None:
            checks.skip(name, detail)
        else:
            checks.check(name, ok, detail)
    measurements = {
        "calibration": calibrated,
        "certificate": figures,
        "cells": {label: asdict(r) for label, r in results.items()},
        "gates": asdict(gates),
        "seconds": time.perf_counter() - started,
    }
    config = {
        "preset": run.preset.describe(),
        "profile": profile,
        "blocks": plan_.blocks,
        "budget_s": plan_.budget_s,
        "grid": [asdict(c) for c in cells],
        "device": plan_.device,
        "model": {f: str(v) for f, v in asdict(plan_.model).items()},
    }
    return Judged(KIND, config, checks, measurements)
