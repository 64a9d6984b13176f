"""``rtv bench --sweep``: the grid's comparisons and the cost fit recover known costs under a fake clock."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from canaries.benchmark import sweep
from canaries.cli import main
from tests.benchmark_fakes import FakeProbe

# Known costs (seconds): fixed, per token, per token² (B*T**2), per arm.
COSTS = {"plain": (2e-3, 1e-5, 0.0), "retain@s0": (3e-3, 1e-5, 0.0), "replay@s0": (2e-3, 1.4e-5, 2e-9)}


class CostClock:
    """A fake clock advanced by each arm's known cost at the shape it was built for."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def build(self, group, seed: int) -> dict:
        batch, length = group.workload.sequences, group.workload.seq_len

        def arm(name: str):
            fixed, per_token, per_token2 = COSTS[name]
            cost = fixed + per_token * batch * length + per_token2 * batch * length**2

            def run() -> None:
                self.now += cost
            return run
        return {name: arm(name) for name in group.arms}


def test_the_fit_recovers_known_fixed_per_token_and_quadratic_costs() -> None:
    clock = CostClock()
    judged = sweep.judge("cpu", "default", clock=clock, load_probe=FakeProbe(), build=clock.build)
    fits = judged.measurements["fits"]
    assert set(fits) == {"plain", "retain@s0", "replay@s0"} and judged.checks.passed
    for arm, known in COSTS.items():
        assert [fits[arm][t] for t in sweep.TERMS] == pytest.approx(known, rel=1e-6, abs=1e-12)
        assert max(map(abs, fits[arm]["residuals"])) < 1e-12
    points = judged.measurements["points"]
    assert [(p["batch"], p["seq_len"]) for p in points] == [(1, 64), (4, 64), (1, 256), (4, 256)]
    # a fixed extra cost: the ratio falls with tokens; the fit's prediction agrees with the closed form
    ratios = [next(c for c in p["comparisons"] if c["arm"] == "retain@s0")["ratio"] for p in points]
    assert ratios[0] > ratios[1] > ratios[3]
    closed = (3e-3 + 1e-5 * 4096) / (2e-3 + 1e-5 * 4096)
    assert sweep.predicted_ratio(fits["retain@s0"], fits["plain"], 4, 1024) == pytest.approx(closed, rel=1e-6)


def test_noisy_costs_leave_residuals_and_a_fit_near_the_truth() -> None:
    """Negative control for the residuals: 2% scatter on each point shows in them, the fit stays close."""
    import numpy as np

    rng = np.random.default_rng(0)
    batches, lengths = [1, 4, 8] * 3, [64] * 3 + [256] * 3 + [1024] * 3
    fixed, per_token = 2e-3, 1e-5
    seconds = [(fixed + per_token * b * t) * rng.lognormal(0, 0.02) for b, t in zip(batches, lengths)]
    fitted = sweep.fit(batches, lengths, seconds)
    assert max(map(abs, fitted["residuals"])) > 1e-6
    assert fitted["per_token"] == pytest.approx(per_token, rel=0.1)


def test_rtv_bench_sweep_records_the_fit_and_its_report_plots_ratio_against_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    clock = CostClock()
    monkeypatch.setattr(sweep, "judge", functools.partial(sweep.judge, clock=clock, load_probe=FakeProbe(),
                                                          build=clock.build))
    assert main(["bench", "--sweep", "--out", str(tmp_path)]) == 0
    html = Path(capsys.readouterr().out.rsplit("report: ", 1)[1].strip())
    (evidence,) = tmp_path.glob("bench-*/benchmark-*.json")
    record = json.loads(evidence.read_text())
    assert record["kind"] == "benchmark-sweep" and (html.parent / "plots" / f"sweep-{record['digest'][:12]}-ratios.png").exists()
    page = html.with_suffix(".md").read_text()
    assert "model, not a measurement" in page and "Cost fit" in page
