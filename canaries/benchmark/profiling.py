"""Where the versioned step's extra time goes: a differential profile of ``retain@s0`` against ``plain``.

The benchmark's comparisons say *how much* slower the versioned step is; this
says *why*, from measurements of the costs the versioned step adds, each timed
on the workload's own shapes in alternating order (A B B A, so drift cancels):

- ``saved_tensor_hooks``: a plain forward and backward run inside a retain
  ledger's saved-tensor hooks, minus the same without them (the median of
  paired differences). The hooks are what lets the
  trainer count the bytes a forward holds (admission, docs/semantics.md#placements-and-memory-admission), demote a
  retained forward to host memory under pressure, and refuse a backward whose
  saved tensors were modified in place (NOTE [Saved-state lifetime]).
- ``gradient_norm``: one fused norm pass over the trainable gradients. The
  commit makes it to refuse non-finite gradients before anything is
  published (NOTE [Gradient commit]); ``optim_step`` reuses it for its
  reported norm and clipping (NOTE [Gradient norm]). Before that reuse the
  step made the pass twice: ``saved_by_reuse`` is the pass no longer made.
- ``bookkeeping``: what is left of the measured extra time (records,
  captures, admission, the cotangent split, tagging and releasing outputs);
  being a remainder, it carries the noise of the other measurements, and comes
  out negative when the trainer's other differences from a plain step (one
  ``autograd.grad`` instead of ``backward`` into ``.grad``) win time back.

Written by hand: torch.profiler attributes time to operators, not to the
guarantees that call them, and its own overhead on a ~100 ms CPU step is of
the size being measured.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import reference_trainer as rt
from reference_trainer.grad_norms import total_norm
from reference_trainer.host_reads import read_on_host
from reference_trainer.planner import Placement
from reference_trainer.residency import SavedStateLedger, weight_storages
from validation.abba import run_block

from .arms import TimedArm, TimedWorkload, device_clock, plain_arm

__all__ = ["COMPONENTS", "TRACED", "profile", "chrome_traces"]

TRACED = ("plain", "retain@s0")  # the arms whose step `rtv bench` keeps a torch.profiler trace of

# What each cost buys: the report's "why it stays" column.
COMPONENTS = {
    "saved_tensor_hooks": "bytes held are counted (admission), a retained forward can be demoted to host memory, "
                          "and a saved tensor modified in place is refused (NOTE [Saved-state lifetime])",
    "gradient_norm": "a non-finite gradient is refused before anything is published (NOTE [Gradient commit]); "
                     "optim_step reuses this norm (NOTE [Gradient norm])",
    "bookkeeping": "forward records, weight captures, admission, the cotangent split, output tagging and release",
}


def _paired_difference(a: Callable[[], object], b: Callable[[], object], blocks: int,
                       clock: Callable[[], float]) -> float:
    """Median over ``blocks`` alternating blocks (``validation.abba.run_block``) of ``b``'s seconds minus ``a``'s."""
    return float(np.median([(t := run_block({"a": a, "b": b}, block, clock))["b"] - t["a"] for block in range(blocks)]))


def _hooked(arm: TimedArm) -> Callable[[], float]:
    """``arm``'s step inside a fresh retain ledger's saved-tensor hooks, as the trainer runs a retained forward."""
    weights = weight_storages(arm.model.parameters())

    def run() -> float:
        with SavedStateLedger(Placement.RETAIN, weights).hooks():
            return arm()

    return run


def _norm_pass(workload: TimedWorkload, model: rt.DecoderLM, seed: int) -> Callable[[], bool]:
    """One commit's finiteness check: the fused norm of gradients shaped like the trainable tensors, read once."""
    trainable = rt.LoRAAdapter(model, rt.LoRAConfig(), seed=seed).parameters() if workload.lora else model.parameters()
    grads = [torch.ones_like(p) for p in trainable]
    return lambda: read_on_host(torch.isfinite(total_norm(grads)), "benchmark profile")


def profile(workload: TimedWorkload, *, plain_seconds: float, extra_seconds: float, seed: int = 0,
            blocks: int = 12) -> dict:
    """Where ``extra_seconds`` goes (module docstring): the benchmark's median retain@s0 step minus its
    median ``plain_seconds``, both from the same alternating blocks.

    Returns ``plain_step_seconds`` (= ``plain_seconds``), ``extra_seconds``,
    ``saved_by_reuse_seconds`` (the norm pass ``optim_step`` no longer
    repeats) and ``components``: one ``{"name", "seconds", "buys"}`` per entry
    of :data:`COMPONENTS`, in that order. ``bookkeeping`` is the remainder: it
    carries the other two's noise and may come out negative.
    """
    clock = device_clock(workload.device)
    passes = plain_arm(workload, seed=seed, optimizer_step=False)
    hooked = _hooked(passes)
    for work in (passes, hooked, passes, hooked):  # warm-up: allocator, caches
        work()
    hooks_s = _paired_difference(passes, hooked, blocks, clock)
    norm = _norm_pass(workload, passes.model, seed)
    norm()
    norm_s = float(np.median([run_block({"norm": norm}, block, clock)["norm"] for block in range(blocks)]))
    del passes, hooked, norm
    seconds = {"saved_tensor_hooks": hooks_s, "gradient_norm": norm_s}
    seconds["bookkeeping"] = extra_seconds - sum(seconds.values())
    return {
        "plain_step_seconds": plain_seconds, "extra_seconds": extra_seconds, "saved_by_reuse_seconds": norm_s,
        "components": [{"name": name, "seconds": seconds[name], "buys": buys} for name, buys in COMPONENTS.items()],
    }


def chrome_traces(arms: dict[str, TimedArm], folder: Path, stem: str) -> dict[str, str]:
    """One more step of each :data:`TRACED` arm present in ``arms``, under ``torch.profiler``; ``{arm: trace path}``.

    Each trace is gzipped Chrome trace JSON (``traceEvents``: operators,
    CUDA kernels on a GPU) at ``folder/<stem>-<arm>.trace.json.gz``, to open
    in Perfetto or ``chrome://tracing`` (both read it gzipped). Not ``*.json``:
    the report reads every ``*.json`` under a run's folder as a record. The step is one after the
    measured blocks, run in a fresh profiler, so the comparison's timings never
    carry the profiler's overhead. Arms are traced in ``TRACED`` order.
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    paths = {}
    for name in (n for n in TRACED if n in arms):
        with torch_profile(activities=activities, with_stack=False) as trace:
            arms[name]()
        path = folder / f"{stem}-{name.replace('@', '-')}.trace.json.gz"  # torch gzips a .gz name
        trace.export_chrome_trace(str(path))
        paths[name] = str(path.resolve())
    return paths
