"""The learning section inspects its own figures: one line and one band per arm, labelled axes, a legend, files on the page."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
from matplotlib.collections import PolyCollection

from reports.learning import GROUPS, curves_figure, differences_figure, section


@pytest.fixture
def record(tiny_learning_record: dict) -> dict:
    """A real record of the canary's tiny configuration, with arms in every panel group."""
    return copy.deepcopy(tiny_learning_record)  # a test may change its copy, never the others'


@pytest.fixture(scope="module")
def built(tiny_learning_record: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, object, Path]:
    """The section of a copy of the tiny record, built once for the tests that only read it (it draws every figure)."""
    record, folder = copy.deepcopy(tiny_learning_record), tmp_path_factory.mktemp("learning-section")
    return record, section(record, folder), folder


def _panels(name: str, workload: dict):
    figure = curves_figure(name, workload)
    return figure, [a for a in figure.axes if a.get_legend() is not None]


@pytest.mark.slow  # draws every curve panel again (about 2.4 s); the section's figures are checked in the default run
def test_curves_have_one_line_and_one_band_per_arm_with_the_data(record: dict) -> None:
    for name, workload in record["measurements"]["workloads"].items():
        arms = workload["arms"]
        _, panels = _panels(name, workload)
        groups = [g for g in GROUPS if any(a["group"] == g for a in arms.values())]
        assert len(panels) == len(groups) >= 2
        shown = set()
        for axes in panels:
            lines = {line.get_label(): line for line in axes.get_lines() if not line.get_label().startswith("_")}
            bands = {c.get_gid(): c for c in axes.collections if isinstance(c, PolyCollection)}
            plotted = set(lines) - {"success threshold"}
            assert plotted == set(bands) and plotted <= set(arms)
            for arm in plotted:
                curves = np.asarray(arms[arm]["curves"])
                x, y = lines[arm].get_data()
                assert list(x) == arms[arm]["steps"] and np.allclose(y, curves.mean(0))  # the data, not a stand-in
                vertices = bands[arm].get_paths()[0].vertices
                assert np.isclose(vertices[:, 1].max(), curves.max()) and np.isclose(vertices[:, 1].min(), curves.min())
            legend = {t.get_text() for t in axes.get_legend().get_texts()}
            assert plotted <= legend
            assert axes.get_xlabel() == "optimizer step"
            assert workload["unit"] in axes.get_ylabel() and workload["metric"] in axes.get_ylabel()
            shown |= plotted
        assert shown == set(arms)  # every arm is drawn somewhere


@pytest.mark.slow  # draws every difference panel again (about 2 s); the section's figures are checked in the default run
def test_differences_show_every_seed_the_interval_and_the_margin(record: dict) -> None:
    for name, workload in record["measurements"]["workloads"].items():
        figure = differences_figure(name, workload)
        pairs = {(v["arm"], v["baseline"]) for v in workload["verdicts"]}
        assert len(figure.axes) == 2
        for axes, metric in zip(figure.axes, ("final", "auc")):
            assert len(axes.get_yticklabels()) == len(pairs)
            dots = [line for line in axes.get_lines() if line.get_marker() == "o"]
            expected = sorted(d for v in workload["verdicts"] if v["metric"] == metric for d in v["differences"])
            assert sorted(x for line in dots for x in line.get_xdata()) == pytest.approx(expected)
            margins = [c for c in axes.collections if isinstance(c, PolyCollection)]
            widths = sorted(np.ptp(c.get_paths()[0].vertices[:, 0]) / 2 for c in margins)
            assert widths == pytest.approx(sorted(v["margin"] for v in workload["verdicts"] if v["metric"] == metric))
            assert "arm − baseline" in axes.get_xlabel() and workload["unit"] in axes.get_xlabel()
            legend = {t.get_text() for t in axes.get_legend().get_texts()}
            assert {"seed", "mean, 90% CI", "equivalence margin (±)"} <= legend


def test_section_writes_the_figures_and_lists_them_with_the_verdict_tables(built: tuple) -> None:
    record, result, tmp_path = built
    workloads = record["measurements"]["workloads"]
    assert result.kind == "learning" and result.passed == record["passed"]
    assert len(result.figures) == 2 * len(workloads)
    for figure in result.figures:
        assert figure.path.parent == tmp_path and figure.path.stat().st_size > 1000
        assert figure.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name, workload in workloads.items():
        table = result.tables[f"{name}: verdicts (paired TOST, α = 0.05)"]
        assert len(table) == len(workload["verdicts"]) and set(table["verdict"]) <= {
            "equivalent",
            "worse",
            "better",
            "inconclusive",
        }
    assert "stale2_corrected vs strict" in result.key_figure


def test_the_arms_table_shows_each_corrected_arms_raw_and_clipped_ratios(built: tuple) -> None:
    record, result, _ = built
    for name, workload in record["measurements"]["workloads"].items():
        table = result.tables[f"{name}: arms"].set_index("arm")
        for arm, evidence in workload["arms"].items():
            raw, clipped = evidence["raw_ratio"], evidence["clipped_ratio"]
            if raw is None:  # nothing corrected: nothing to show
                assert table.loc[arm, "raw ratio (min / median / max)"] == "-"
                continue
            assert table.loc[arm, "raw ratio (min / median / max)"] == (
                f"{raw['min']:.3g} / {raw['quantiles']['0.5']:.3g} / {raw['max']:.3g}"
            )
            assert table.loc[arm, "clipped ratio (min / median / max)"] == (
                f"{clipped['min']:.3g} / {clipped['quantiles']['0.5']:.3g} / {clipped['max']:.3g}"
            )
        assert table.loc["stale2_sequence", "raw ratio (min / median / max)"] != "-"
