"""The benchmark runner and ``rtv bench``: plans, like-with-like arms, gates and exit codes (fake clock)."""

from __future__ import annotations

import functools
import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import reference_trainer as rt
from canaries.benchmark import canary as benchmark
from canaries.benchmark import profiling
from canaries.benchmark.arms import TimedWorkload, device_clock, plain_arm, versioned_arm
from canaries.cli import main
from canaries.registry import canary
from tests.benchmark_fakes import FAKE_PAUSES, TINY, FakeMachine, FakeMeter, FakeProbe, fake_pauses, run_fake, tiny_plan
from validation import history
from validation.evidence import source_fingerprint, verify


def test_default_cpu_plan_has_the_arms_that_matter_and_nightly_adds_the_rest() -> None:
    gated, others = benchmark.plan("cpu", "default").groups
    small = TimedWorkload(model="small", sequences=4, seq_len=64)
    assert gated.workload == others.workload == small and gated.gated and not others.gated
    assert gated.arms == ("plain", "retain@s0", "replay@s0"), "the gates are decided in blocks of their own, first"
    every = {"plain"} | {f"{p}@s{s}" for p in ("retain", "offload", "replay", "auto") for s in (0, 2)}
    assert set(gated.arms) | set(others.arms) == every and set(gated.arms) & set(others.arms) == {"plain"}
    assert gated.label != others.label and gated.label.startswith(small.label)
    nightly = benchmark.plan("cpu", "nightly").groups
    models = {(g.workload.model, g.workload.lora) for g in nightly}
    assert models == {(m, lora) for m in ("tiny", "small") for lora in (0, 1)}
    assert [g.gated for g in nightly].count(True) == 1
    quick = benchmark.plan("cpu", "quick")
    assert quick.budget_s <= 45 and {"plain", "retain@s0", "replay@s0"} == set(quick.groups[0].arms)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU stand-in of the GPU presets")
@pytest.mark.parametrize("preset", ["gpu", "gpu-8b"], ids=["small-preset", "8b-preset"])  # not the `gpu` keyword
def test_gpu_presets_swap_to_cpu_shapes_and_say_so(preset: str) -> None:
    plan = benchmark.plan(preset, "default")
    assert plan.swapped and all(g.workload.device == "cpu" and not g.gated for g in plan.groups)


@pytest.mark.parametrize("lora", [False, True])
def test_every_arm_computes_plain_pytorchs_first_loss(lora: bool) -> None:
    workload = TimedWorkload(model="tiny", sequences=1, seq_len=4, lora=lora)
    model = rt.DecoderLM(workload.config(), seed=0)
    ids, targets, advantages = workload.batch(model.config.vocab_size, 0)
    with torch.no_grad():
        oracle = float(-(rt.token_logprobs(model(ids), targets) * advantages).sum() / advantages.numel())
    assert oracle != 0
    arms = [plain_arm(workload), versioned_arm(workload, "replay", 0), versioned_arm(workload, "offload", 2)]
    firsts = [next(v for v in iter(arm, None) if not math.isnan(v)) for arm in arms]
    assert firsts == [pytest.approx(oracle, rel=1e-5)] * 3


def test_a_staleness_two_arm_backpropagates_two_revisions_late() -> None:
    arm = versioned_arm(TINY, "retain", 2)
    losses = [arm() for _ in range(5)]
    assert math.isnan(losses[0]) and math.isnan(losses[1]) and not any(map(math.isnan, losses[2:]))
    assert arm.held["device"] > 0  # two older forwards are pending when the third is made


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmark, "plan", tiny_plan)
    fake_pauses(monkeypatch)


def test_a_tie_passes_and_every_arm_is_measured(tmp_path: Path, tiny: None) -> None:
    record = run_fake(tmp_path, {"plain": 1.0, "retain@s0": 1.01, "replay@s0": 1.02, "offload@s2": 1.3})
    (group,) = record["measurements"]["groups"]
    verdicts = {c["arm"]: c["verdict"] for c in group["comparisons"]}
    assert verdicts == {"retain@s0": "tie", "replay@s0": "tie", "offload@s2": "regression"}  # offload: not enforced
    assert record["passed"] and set(group["arms"]) == {"plain", "retain@s0", "replay@s0", "offload@s2"}
    assert group["profile"] is None and group["traces"] == {}  # tiny_plan profiles no blocks; no traces folder asked
    for measured in group["arms"].values():
        assert measured["peak_bytes"] > 0 and measured["tokens_per_second"] == pytest.approx(
            4 / measured["step_seconds"]
        )
    assert group["arms"]["retain@s0"]["held_device_bytes"] > group["arms"]["replay@s0"]["held_device_bytes"] > 0


def test_enforced_gates_fail_on_a_retain_regression_and_a_replay_beyond_its_floor(tmp_path: Path, tiny: None) -> None:
    # retain 1.5x plain: a regression. replay 4.5x plain = 3x retain, beyond any floor 1 + F/(F+B) <= 2.
    record = run_fake(tmp_path, {"plain": 1.0, "retain@s0": 1.5, "replay@s0": 4.5}, real_steps=3)
    failed = sorted(name for name, ok in record["checks"].items() if not ok)
    assert failed == [
        "tiny 1x4 full: replay@s0 vs its floor 1 + F/(F+B) is not a regression (±5% gate)",
        "tiny 1x4 full: retain@s0 vs plain is not a regression (±5% gate)",
    ]
    assert not record["passed"]


@pytest.mark.parametrize(
    ("argv", "costs", "code"),
    [
        ([], {"retain@s0": 1.0}, 0),
        (["--target", "0.5"], {"retain@s0": 1.0}, 1),  # a target that cannot be met
        (["--gate", "2"], {}, 2),
    ],
)
def test_rtv_bench_exit_codes(
    tmp_path: Path,
    tiny: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    argv: list[str],
    costs: dict,
    code: int,
) -> None:
    machine = FakeMachine(costs, real_steps=3)
    monkeypatch.setattr(
        benchmark,
        "measure",
        functools.partial(benchmark.measure, clock=machine.clock, load_probe=FakeProbe(), build=machine.build),
    )
    with pytest.raises(SystemExit) if code == 2 else _no_raise() as exit_info:
        assert main(["bench", "--profile", "quick", "--out", str(tmp_path), *argv]) == code
    if code == 2:
        assert exit_info.value.code == 2
        return
    out = capsys.readouterr().out
    html = Path(out.rsplit("report: ", 1)[1].strip())
    (evidence,) = tmp_path.glob("bench-*/benchmark-*.json")
    record = json.loads(evidence.read_text())
    ratios = html.parent / "plots" / f"benchmark-{record['digest'][:12]}-ratios.png"
    assert html.name == "index.html" and html.exists() and ratios.exists()
    assert record["passed"] is (code == 0)
    assert record["measurements"]["pauses"] == FAKE_PAUSES, "rtv bench measures the pause costs"
    assert "a save 0.80 [0.70..0.90] of a step" in html.with_suffix(".md").read_text()


@pytest.mark.slow  # a second rtv bench and a history page (about 1.5 s); the history is tested alone in tests/validation/test_history.py
def test_rtv_bench_appends_to_the_history_and_rtv_history_renders_it(
    tmp_path: Path, tiny: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine = FakeMachine({"retain@s0": 1.0}, real_steps=3)
    monkeypatch.setattr(
        benchmark,
        "measure",
        functools.partial(benchmark.measure, clock=machine.clock, load_probe=FakeProbe(), build=machine.build),
    )
    for _ in range(2):
        assert main(["bench", "--profile", "quick", "--out", str(tmp_path)]) == 0
    table = history.load(tmp_path / "history.sqlite")
    assert len(table) == 2 * 4 and set(table["arm"]) == {"plain", "retain@s0", "replay@s0", "offload@s2"}
    assert set(table["commit_id"]) == {source_fingerprint()["git_commit"]} and table["ci_low"].notna().all()
    out = tmp_path / "trend" / "index.md"
    assert main(["history", "--store", str(tmp_path / "history.sqlite"), "--arm", "retain@s0", "--out", str(out)]) == 0
    page = out.read_text()
    assert "insufficient data" in page and "retain@s0" in page and "offload@s2" not in page
    assert out.with_suffix(".html").exists() and list((out.parent / "plots").glob("history-*.png"))
    assert main(["history", "--store", str(tmp_path / "none.sqlite")]) == 2  # a SetupError: no store there


class _no_raise:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_arms_on_different_weights_fail_the_like_with_like_check(tmp_path: Path, tiny: None) -> None:
    machine = FakeMachine({}, real_steps=3)

    def build(group: benchmark.Group, seed: int) -> dict:
        arms = machine.build(group, seed)
        other = versioned_arm(group.workload, "retain", 0, seed=seed + 1)  # other weights
        other.step = machine.advancing("retain@s0", other.step)
        arms["retain@s0"] = other
        return arms

    judged = benchmark.measure("cpu", "quick", clock=machine.clock, load_probe=FakeProbe(), build=build)
    path = canary("benchmark").record("cpu", judged, tmp_path)
    checks = verify(path)["checks"]
    assert checks == {**checks, "tiny 1x4 full: every arm's first loss equals plain's": False}


def test_clock_readings_of_cuda_work_wait_for_the_device_first() -> None:
    """A CUDA call returns once its kernels are queued: each reading must synchronise, a CPU reading need not."""
    events: list[str] = []
    ticks = iter(range(10))

    def clock() -> float:
        events.append("read")
        return float(next(ticks))

    synced = device_clock("cuda:1", clock, synchronize=lambda device: events.append(f"sync {device}"))
    assert (synced(), synced()) == (0.0, 1.0)
    assert events == ["sync cuda:1", "read", "sync cuda:1", "read"]
    assert device_clock("cpu", clock, synchronize=lambda device: events.append("sync")) is clock


@pytest.mark.slow  # profiles blocks with torch.profiler (about 3 s); the profile table is drawn from a fake in tests/reports
def test_rtv_bench_keeps_the_median_profiled_blocks_trace_and_the_report_links_it_and_its_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reports import render_report

    monkeypatch.setattr(benchmark, "plan", functools.partial(tiny_plan, profiled_blocks=3))
    record = run_fake(tmp_path, {}, traces=tmp_path / "traces")
    (group,) = record["measurements"]["groups"]
    traces, profile = group["traces"], group["profile"]
    assert list(traces) == ["plain", "retain@s0"] and record["config"]["profiled_blocks"] == profile["blocks"] == 3
    assert "not the timed blocks" in profile["note"]
    for arm, path in traces.items():
        durations = profile["arms"][arm]["block_seconds"]
        median = profile["arms"][arm]["median_block"]
        assert len(durations) == 3 and durations[median] == np.median(durations), "the kept block is the median one"
        events = json.loads(gzip.decompress(Path(path).read_bytes()))["traceEvents"]
        assert any(e.get("name", "").startswith("aten::") for e in events), "a real step's operators are in the trace"
        (step,) = [e for e in events if e.get("name") == f"rtv bench step: {arm}"]
        assert step["dur"] * 1e-6 == pytest.approx(durations[median]), "the kept file is that block's trace"
        split = profile["arms"][arm]["block_components"]
        assert profiling.components({"traceEvents": events}, arm)[1] == pytest.approx(split[median])
    plain, retain = (profile["arms"][arm]["block_components"] for arm in traces)
    for component in profile["components"]:
        name, (low, high) = component["name"], component["ci"]
        assert component["mean_seconds"] == pytest.approx(np.mean([r[name] - p[name] for p, r in zip(plain, retain)]))
        assert component["reading"] == ("cost" if low > 0 else "saving" if high < 0 else "within noise")
    hooks = next(c for c in profile["components"] if c["name"] == "saved_tensor_hooks")
    assert hooks["plain_seconds"] == 0 < hooks["retain_seconds"], "only the versioned step runs the trainer's hooks"
    page = render_report(tmp_path, tmp_path / "report" / "index.md")
    assert page.passed and page.records == 1, "a trace is not read as an (invalid) record"
    markdown, html = page.markdown.read_text(), page.html.read_text()
    for path in traces.values():
        link = f"../traces/{Path(path).name}"
        assert f"]({link})" in markdown and f'href="{link}"' in html and (page.markdown.parent / link).is_file()
    for component in profile["components"]:
        assert f"| {component['name']} |" in markdown and component["buys"] in markdown
    assert "one norm pass where it made two" in markdown


@pytest.mark.parametrize(("others", "passed"), [(1.6, True), (0.1, False)])
def test_a_loaded_machine_makes_the_gates_inconclusive_loaded_an_idle_one_still_fails_them(
    tmp_path: Path, tiny: None, others: float, passed: bool
) -> None:
    """The same 1.5x retain and 4.5x replay costs: loaded, the gates cannot decide (skips, no failure); idle, they fail."""
    costs = {"plain": 1.0, "retain@s0": 1.5, "replay@s0": 4.5}
    record = run_fake(tmp_path, costs, real_steps=3, meter=FakeMeter(idle=others), target=1.03)
    assert record["passed"] is passed
    (group,) = record["measurements"]["groups"]
    retain = next(c for c in group["comparisons"] if c["arm"] == "retain@s0")
    target = "tiny 1x4 full: retain@s0 / plain median <= 1.03"
    if passed:
        assert retain["verdict"] == "inconclusive" and retain["load"].startswith("32 of 32 blocks loaded")
        assert record["skips"][target].startswith("inconclusive (loaded: 32 of 32 blocks loaded, median 1.60 of 2")
        assert group["replay_floor"]["load"].startswith("32 of 32 blocks loaded")
    else:
        assert retain["verdict"] == "regression" and retain["load"] == "" and not record["checks"][target]
