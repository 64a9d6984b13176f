"""The benchmark's profile from traces: a synthetic trace of known event durations, and the paired-difference rule."""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from canaries.benchmark import profiling
from canaries.benchmark.arms import TimedArm
from reports.benchmark import difference_text


def _event(name: str, cat: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


# One 100 µs step of known nesting (start, duration in µs), and what each component must get by hand:
#   model.py frame [0, 30) holds aten::mm [5, 25)                       -> model_forward 30
#   an autograd node [30, 70) holds ledger.py's unpack hook [40, 50),
#       which holds aten::clone [42, 46)                                -> backward_operators 30, saved_tensor_hooks 10
#   trainer.py frame [70, 90) holds grad_norms.py [75, 83)              -> bookkeeping 12, gradient_norm 8
#   Optimizer.step annotation [90, 95)                                  -> optimizer 5
#   the step range's own gaps [95, 100)                                 -> other 5
SYNTHETIC = {
    "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {}},
        _event("rtv bench step: plain", "user_annotation", 1000, 100),
        _event("reference_trainer/model.py(10): forward", "python_function", 1000, 30),
        _event("aten::mm", "cpu_op", 1005, 20),
        _event("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 1030, 40),
        _event("reference_trainer/ledger.py(127): _unpack", "python_function", 1040, 10),
        _event("aten::clone", "cpu_op", 1042, 4),
        _event("reference_trainer/trainer.py(300): backward", "python_function", 1070, 20),
        _event("reference_trainer/grad_norms.py(40): total_norm", "python_function", 1075, 8),
        _event("Optimizer.step#AdamW.step", "user_annotation", 1090, 5),
        _event("aten::mm", "cpu_op", 900, 50),  # before the step: not counted
        _event("aten::mm", "cpu_op", 1010, 50, tid=2),  # another thread: not counted
        _event("gemm_kernel", "kernel", 1010, 30),  # a device kernel: host time only
    ]
}
EXPECTED_US = {
    "saved_tensor_hooks": 10,
    "gradient_norm": 8,
    "bookkeeping": 12,
    "model_forward": 30,
    "backward_operators": 30,
    "optimizer": 5,
    "other": 5,
}


@pytest.mark.parametrize(
    "root",
    ["", "/home/u/clone/", "/venv/lib/python3.11/site-packages/"],
    ids=["relative (pytest)", "absolute (installed rtv)", "site-packages"],
)
def test_a_synthetic_trace_splits_into_its_components_by_the_innermost_named_frame(root: str) -> None:
    trace = {
        "traceEvents": [
            {**e, "name": root + e["name"]} if e.get("cat") == "python_function" else e
            for e in SYNTHETIC["traceEvents"]
        ]
    }  # the file names a code object carries
    seconds, split = profiling.components(trace, "plain")
    assert seconds == pytest.approx(100e-6)
    assert split == pytest.approx({name: us * 1e-6 for name, us in EXPECTED_US.items()})
    assert list(split) == list(profiling.COMPONENTS) and sum(split.values()) == pytest.approx(seconds)
    with pytest.raises(ValueError, match="expected one 'rtv bench step: retain@s0' range"):
        profiling.components(trace, "retain@s0")
    foreign = {
        "traceEvents": [
            {**e, "name": e["name"].replace("reference_trainer/", "other_reference_trainer/")}
            for e in trace["traceEvents"]
        ]
    }  # another package of a similar name: not ours
    assert profiling.components(foreign, "plain")[1]["saved_tensor_hooks"] == 0


@pytest.mark.parametrize(("shift", "reading"), [(0.5, "cost"), (0.0, "within noise"), (-0.5, "saving")])
def test_paired_differences_get_a_t_interval_and_a_saving_is_never_a_negative_cost(shift: float, reading: str) -> None:
    plain = [10.0, 11.0, 9.5, 10.5, 10.2]
    noise = [0.05, -0.04, 0.02, -0.03, 0.0]
    retain = [p + shift + n for p, n in zip(plain, noise)]
    found = profiling.differences(plain, retain)
    paired = np.subtract(retain, plain)
    half = stats.t.ppf(0.975, len(paired) - 1) * paired.std(ddof=1) / np.sqrt(len(paired))  # by hand
    assert found["mean_seconds"] == pytest.approx(paired.mean())
    assert found["ci"] == pytest.approx([paired.mean() - half, paired.mean() + half])
    assert found["reading"] == reading
    text = difference_text(found)
    assert not text.startswith(("−", "-")), "no component reads as a negative cost"
    assert {"cost": text.startswith("+"), "saving": "faster" in text, "within noise": "within noise" in text}[reading]
    with pytest.raises(ValueError, match="at least 2 paired blocks"):
        profiling.differences(plain[:1], retain[:1])


def test_the_profiled_blocks_alternate_the_arms_after_a_warm_up_and_keep_the_median_blocks_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.profiler`` faked by synthetic traces of scripted durations (µs): the median block is known."""
    scripted = {"plain": [999, 300, 100, 200], "retain@s0": [999, 250, 450, 350]}  # a warm-up, then 3 blocks
    calls: list[str] = []

    def fake_step(arm: TimedArm, name: str, path: Path) -> dict:
        arm()
        us = scripted[name][sum(call == name for call in calls) - 1]
        trace = {
            "traceEvents": [
                _event(f"rtv bench step: {name}", "user_annotation", 0, us),
                _event("reference_trainer/ledger.py(70): _pack", "python_function", 0, us / 10),
            ]
        }
        path.write_text(json.dumps(trace))
        return trace

    monkeypatch.setattr(profiling, "_profiled_step", fake_step)
    arms = {name: TimedArm(name=name, step=lambda name=name: calls.append(name) or 0.0) for name in profiling.TRACED}
    profile, paths = profiling.profiled_pass(arms, plain_seconds=1.0, folder=tmp_path, stem="w", blocks=3)
    a, b = profiling.TRACED
    assert calls == [a, b] + [a, b, b, a, a, b], "one discarded warm-up block, then A B, B A, A B"
    for name, durations in scripted.items():
        kept = profile["arms"][name]
        assert kept["block_seconds"] == pytest.approx(np.multiply(durations[1:], 1e-6))
        assert kept["median_seconds"] == pytest.approx(np.median(durations[1:]) * 1e-6)
        events = json.loads(gzip.decompress(Path(paths[name]).read_bytes()))["traceEvents"]
        assert events[0]["dur"] == np.median(durations[1:]), "the kept trace is the median block's"
    hooks = next(c for c in profile["components"] if c["name"] == "saved_tensor_hooks")
    assert hooks["mean_seconds"] == pytest.approx((np.mean(scripted["retain@s0"][1:]) - 200) / 10 * 1e-6)
    with pytest.raises(ValueError, match="odd number of profiled blocks"):
        profiling.profiled_pass(arms, plain_seconds=1.0, folder=None, stem="x", blocks=4)


def test_a_profiled_step_keeps_the_profilers_notices_off_stderr_and_lets_real_messages_through(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Kineto writes ``USDT: ... profiler_start``/``profiler_stop`` to file descriptor 2 per session; what the step
    itself writes there, from C (``os.write``) or Python, still reaches stderr."""

    def step() -> float:
        os.write(2, b"a message written to fd 2\n")
        print("a message from Python", file=sys.stderr)
        return float(torch.ones(3).sum())

    trace = profiling._profiled_step(TimedArm(name="plain", step=step), "plain", tmp_path / "step.json")
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_start" not in err, err
    assert "a message written to fd 2\n" in err and "a message from Python\n" in err, err
    assert any(event.get("name") == "rtv bench step: plain" for event in trace["traceEvents"])
