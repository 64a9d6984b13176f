"""Where the versioned step's extra time goes: ``torch.profiler`` traces of ``retain@s0`` and ``plain``, compared.

NOTE [Profiled blocks]
1. After the timed comparison, :func:`profiled_pass` runs ``blocks`` more
   blocks of the two :data:`TRACED` arms, each step under its own
   ``torch.profiler`` session (operators and, ``with_stack``, Python
   functions) in a ``record_function`` range named after the arm, alternating
   A B B A (NOTE [Alternating blocks]) after one discarded warm-up. They are
   not the timed blocks, so the comparison's timings never carry the
   profiler's overhead, and these carry it on both arms alike. Tracing slows
   Python-heavy code most, so a profiled millisecond of the trainer's hooks is
   an upper bound on its unprofiled cost.
2. A block's duration is its step range's length in its own trace; ``blocks``
   is odd, so the median block's trace is the one kept
   (``<stem>-<arm>.trace.json.gz``, Chrome trace JSON for Perfetto), with
   which block it was, its duration and every block's.
3. :func:`components`: each complete event's self time (less its direct
   children's) inside the step range goes to the component of the innermost
   enclosing event a rule of :data:`RULES` names (a Python frame's file, an
   operator's or annotation's prefix), else to ``other``, so one step's
   components add up to its range exactly.
4. :func:`differences`: per component, ``retain@s0`` minus ``plain`` in each
   block (blocks pair the arms), their mean and Student t interval
   (``scipy.stats``): ``cost`` when the interval lies above 0, ``saving``
   below (never shown as a negative cost), ``within noise`` when it covers 0.

Hand-written: no library splits a trace's time by the code that spends it
(torch.profiler's ``key_averages`` groups by operator name only); the nesting
is Chrome trace JSON's own (``ts``, ``dur`` per thread). On a GPU the table
counts host time; kernel time is in the trace itself.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from scipy import stats as scipy_stats

from .arms import TimedArm

__all__ = ["COMPONENTS", "RULES", "TRACED", "PROFILED_BLOCKS", "components", "differences", "profiled_pass"]

TRACED = ("plain", "retain@s0")  # the arms `rtv bench` profiles: the baseline, then the gated arm
PROFILED_BLOCKS = 7  # odd: the median block is one block (NOTE [Profiled blocks] rule 2)
CONFIDENCE = 0.95

# What each cost buys: the report's "why it stays" column, in the table's order.
COMPONENTS = {
    "saved_tensor_hooks": "bytes held are counted (admission), a retained forward can be demoted to host memory, "
    "and a saved tensor modified in place is refused (NOTE [Saved-state lifetime])",
    "gradient_norm": "a non-finite gradient is refused before anything is published (NOTE [Gradient commit]); "
    "optim_step reuses this norm (NOTE [Gradient norm])",
    "bookkeeping": "forward records, weight captures, admission, the cotangent split, output tagging and release",
    "model_forward": "the model's own forward and loss: the same work in both arms",
    "backward_operators": "autograd's backward operators: the same gradients in both arms",
    "optimizer": "AdamW's step and zero_grad: the same update in both arms",
    "other": "everything else in the step: torch's Python, the benchmark's own loop",
}

# (component, event category, name prefix): the innermost enclosing event that matches names the component.
RULES = (
    *(
        ("saved_tensor_hooks", "python_function", f"reference_trainer/{m}.py(")
        for m in ("ledger", "residency", "host_arena")
    ),
    ("gradient_norm", "python_function", "reference_trainer/grad_norms.py("),
    *(("model_forward", "python_function", f"reference_trainer/{m}.py(") for m in ("model", "lora", "losses")),
    ("bookkeeping", "python_function", "reference_trainer/"),
    ("backward_operators", "cpu_op", "autograd::engine::evaluate_function"),
    ("optimizer", "user_annotation", "Optimizer."),
)
_COUNTED = {"cpu_op", "python_function", "user_annotation"}  # host events; kernels and the profiler's own span are not
# Kineto's trace-point notices, two per profiler session ("USDT:<time> <pid>:<tid> <file>:<line>] profiler_start"),
# written to file descriptor 2 by C++; neither KINETO_LOG_LEVEL nor TORCH_CPP_LOG_LEVEL silences them.
_PROFILER_NOTICE = re.compile(rb"^USDT:")
_ROUNDING_US = 1e-3  # a trace's times are rounded to nanoseconds: a child may end that much past its parent


def _component(event: dict) -> str | None:
    """The first rule naming ``event`` (more specific rules come first), or None.

    A Python frame's name starts with its source file as the code object has
    it: relative under pytest (``reference_trainer/ledger.py(70): _pack``),
    absolute from an installed ``rtv`` (``/work/p/reference_trainer/...`` or
    ``.../site-packages/reference_trainer/...``), so a frame rule matches the
    path from a folder boundary on.
    """
    name = event.get("name", "")
    return next(
        (
            component
            for component, category, prefix in RULES
            if event.get("cat") == category
            and (name.startswith(prefix) or (category == "python_function" and f"/{prefix}" in name))
        ),
        None,
    )


def _step_range(events: list[dict], arm: str) -> dict:
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == _range_name(arm)]
    if len(ranges) != 1:
        raise ValueError(f"expected one {_range_name(arm)!r} range in the trace, found {len(ranges)}")
    return ranges[0]


def _range_name(arm: str) -> str:
    return f"rtv bench step: {arm}"


def components(trace: dict, arm: str) -> tuple[float, dict[str, float]]:
    """``(step seconds, {component: seconds})`` of ``arm``'s step in one Chrome trace (NOTE [Profiled blocks] rule 3).

    ``trace`` is the parsed JSON (``traceEvents``, times in microseconds);
    the step is its one ``record_function`` range for ``arm``. Every
    :data:`COMPONENTS` name is a key; the values add up to the step's
    seconds (the range's own self time, between its children, is ``other``).
    Raises ``ValueError`` when the trace has no such range, or more than one.
    """
    events = trace["traceEvents"]
    step = _step_range(events, arm)
    end = step["ts"] + step["dur"] + _ROUNDING_US
    inside = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X"
            and e.get("cat") in _COUNTED
            and (e["pid"], e["tid"]) == (step["pid"], step["tid"])
            and e["ts"] >= step["ts"]
            and e["ts"] + e["dur"] <= end
        ),
        key=lambda e: (e["ts"], -e["dur"]),
    )  # a parent before the children it starts with
    totals = dict.fromkeys(COMPONENTS, 0.0)
    open_events: list[list] = []  # [end, component, self time so far] of each enclosing event, innermost last

    def close() -> None:
        _, component, own = open_events.pop()
        totals[component] += own

    for event in inside:
        while open_events and open_events[-1][0] <= event["ts"] + _ROUNDING_US:
            close()
        parent = open_events[-1] if open_events else None
        if parent is not None:
            parent[2] -= event["dur"]  # a direct child's time is not its parent's self time
        component = _component(event) or (parent[1] if parent is not None else "other")
        open_events.append([event["ts"] + event["dur"], component, float(event["dur"])])
    while open_events:
        close()
    return step["dur"] * 1e-6, {name: us * 1e-6 for name, us in totals.items()}


def differences(plain: list[float], retain: list[float], confidence: float = CONFIDENCE) -> dict:
    """``retain`` minus ``plain``, paired by block: mean, Student t interval, reading (NOTE [Profiled blocks] rule 4).

    Returns ``{"mean_seconds", "ci": [low, high], "reading"}`` with reading
    ``cost`` (interval above 0), ``saving`` (below 0) or ``within noise``
    (covers 0). Identical differences give a zero-width interval. Raises
    ``ValueError`` for fewer than two pairs or lists of different lengths.
    """
    if len(plain) != len(retain) or len(plain) < 2:
        raise ValueError(
            f"expected two equally long lists of at least 2 paired blocks, found {len(plain)} and {len(retain)}"
        )
    paired = np.asarray(retain, dtype=float) - np.asarray(plain, dtype=float)
    mean, sem = float(paired.mean()), float(scipy_stats.sem(paired))
    low, high = (mean, mean) if sem == 0 else scipy_stats.t.interval(confidence, paired.size - 1, loc=mean, scale=sem)
    reading = "cost" if low > 0 else "saving" if high < 0 else "within noise"
    return {"mean_seconds": mean, "ci": [float(low), float(high)], "reading": reading}


@contextmanager
def _without_profiler_notices() -> Iterator[None]:
    """Run the block with file descriptor 2 in a temporary file, then write back every line of it that is not a
    kineto notice (:data:`_PROFILER_NOTICE`), in order: real messages (Python's or C++'s) still come through,
    once the block is over. What other threads write to stderr meanwhile is delayed the same way, never lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile(prefix="rtv-profiler-stderr-") as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                captured.seek(0)
                kept = b"".join(
                    line for line in captured.read().splitlines(keepends=True) if not _PROFILER_NOTICE.match(line)
                )
                while kept:  # a write may take part of it
                    kept = kept[os.write(2, kept) :]
    finally:
        os.close(saved)


def _profiled_step(arm: TimedArm, name: str, path: Path) -> dict:
    """One step of ``arm`` under a fresh ``torch.profiler`` session (its notices kept off stderr), exported to
    ``path`` and read back."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with _without_profiler_notices():
        with torch_profile(activities=activities, with_stack=True) as session:
            with record_function(_range_name(name)):
                arm()
        session.export_chrome_trace(str(path))
    return json.loads(path.read_text())


def _block_order(block: int) -> tuple[str, ...]:
    return TRACED if block % 2 == 0 else TRACED[::-1]


def profiled_pass(
    arms: dict[str, TimedArm], *, plain_seconds: float, folder: Path | None, stem: str, blocks: int = PROFILED_BLOCKS
) -> tuple[dict, dict[str, str]]:
    """The profiled blocks of :data:`TRACED` (NOTE [Profiled blocks]): ``(profile, {arm: kept trace path})``.

    ``arms`` must hold both traced arms, already warm (the timed comparison
    ran them). ``plain_seconds``: the comparison's median plain step, the
    table's "% of plain step" base. ``folder``: where the median blocks'
    traces are kept (``<stem>-<arm>.trace.json.gz``: not ``*.json``, which
    the report reads as records); ``None`` keeps none (``rtv run``) and
    the paths are ``{}``. ``blocks`` must be odd and at least 3.

    The profile holds ``blocks``, ``warmup_blocks``, ``confidence``,
    ``note``, ``plain_step_seconds``, per arm its ``block_seconds``,
    ``block_components`` (:func:`components` of each block), ``median_block``
    (index) and ``median_seconds``, ``extra`` (the step's difference), one entry
    per :data:`COMPONENTS` name in ``components`` (``name``, ``buys``,
    ``plain_seconds`` and ``retain_seconds`` means, and
    :func:`differences`' keys) and ``saved_by_reuse_seconds`` (the norm pass
    ``optim_step`` no longer repeats: retain's mean ``gradient_norm``).
    """
    if blocks < 3 or blocks % 2 == 0:
        raise ValueError(f"expected an odd number of profiled blocks >= 3, found {blocks}")
    measured: dict[str, list[tuple[float, dict[str, float]]]] = {arm: [] for arm in TRACED}
    with tempfile.TemporaryDirectory(prefix="rtv-profile-") as scratch:
        for name in TRACED:  # the warm-up block (rule 1), discarded
            _profiled_step(arms[name], name, Path(scratch) / "warm-up.json")
        for block in range(blocks):
            for name in _block_order(block):
                trace = _profiled_step(arms[name], name, Path(scratch) / f"{block}-{name}.json")
                measured[name].append(components(trace, name))
        per_arm = {
            name: {
                **_median_block([seconds for seconds, _ in steps]),
                "block_components": [split for _, split in steps],
            }
            for name, steps in measured.items()
        }
        paths = (
            {}
            if folder is None
            else {
                name: _keep(Path(scratch) / f"{arm['median_block']}-{name}.json", folder, stem, name)
                for name, arm in per_arm.items()
            }
        )
    plain, retain = (measured[name] for name in TRACED)
    table = _table([split for _, split in plain], [split for _, split in retain])
    return {
        "blocks": blocks,
        "warmup_blocks": 1,
        "confidence": CONFIDENCE,
        "plain_step_seconds": plain_seconds,
        "note": "profiled blocks, run after the timed comparison under torch.profiler: not the timed blocks",
        "arms": per_arm,
        "extra": differences([s for s, _ in plain], [s for s, _ in retain]),
        "components": table,
        "saved_by_reuse_seconds": next(c["retain_seconds"] for c in table if c["name"] == "gradient_norm"),
    }, paths


def _table(plain: list[dict[str, float]], retain: list[dict[str, float]]) -> list[dict]:
    """One row per :data:`COMPONENTS` name: what it buys, each arm's mean, and retain minus plain by block."""
    return [
        {
            "name": name,
            "buys": buys,
            "plain_seconds": float(np.mean([split[name] for split in plain])),
            "retain_seconds": float(np.mean([split[name] for split in retain])),
            **differences([split[name] for split in plain], [split[name] for split in retain]),
        }
        for name, buys in COMPONENTS.items()
    ]


def _median_block(seconds: list[float]) -> dict:
    """The block whose duration is the median (an odd count: one block's own)."""
    block = int(np.argmin(np.abs(np.asarray(seconds) - np.median(seconds))))
    return {"block_seconds": seconds, "median_block": block, "median_seconds": seconds[block]}


def _keep(trace: Path, folder: Path, stem: str, arm: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}-{arm.replace('@', '-')}.trace.json.gz"
    path.write_bytes(gzip.compress(trace.read_bytes(), compresslevel=6))
    return str(path.resolve())
