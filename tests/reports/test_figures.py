"""Figures a reader can read: legends of a readable size as the page shows them, the lifecycle in lifecycle order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reports import canaries as canary_sections
from reports.learning import curves_figure, differences_figure

FIXTURES = Path(__file__).parents[1] / "fixtures" / "evidence"
PAGE_PX = 76 * 16  # report.html.j2: body max-width 76em at the default 16 px: a wider PNG is scaled down to it
DPI = 100  # reports.plots saves at 100 dpi


def _displayed_px(figure, points: float) -> float:
    """The height in screen pixels of text of ``points`` once the page has scaled the PNG to fit."""
    width_px = figure.get_size_inches()[0] * DPI
    return points * DPI / 72 * min(1.0, PAGE_PX / width_px)


@pytest.mark.parametrize("make", [curves_figure, differences_figure])
def test_learning_legends_reach_the_reader_at_9_px_or_more(make) -> None:
    record = json.loads((FIXTURES / "learning.json").read_text())
    for name, workload in record["measurements"]["workloads"].items():
        figure = make(name, workload)
        legends = [axes.get_legend() for axes in figure.axes if axes.get_legend() is not None]
        assert legends, "every panel has its legend"
        sizes = [_displayed_px(figure, text.get_fontsize()) for legend in legends for text in legend.get_texts()]
        assert min(sizes) >= 9, f"{make.__name__}({name}): legend text {min(sizes):.1f} px on the page"


def test_the_lifecycle_chart_follows_the_lifecycle_not_the_alphabet(monkeypatch, tmp_path: Path) -> None:
    record = json.loads((FIXTURES / "memory.json").read_text())
    plotted = []
    monkeypatch.setattr(canary_sections, "plot_lifecycle", lambda table, path, **_: plotted.append(table) or path)
    built = canary_sections.section(record, tmp_path)
    lifecycle = record["config"]["points"]  # the order the canary passes them (canaries.memory.lifecycle.POINTS)
    assert lifecycle[:2] == ["after_forward", "after_backward"] and sorted(lifecycle) != lifecycle
    assert list(dict.fromkeys(plotted[0]["point"])) == lifecycle
    columns = list(built.tables["bytes held at each lifecycle point"].columns)[1:]
    assert list(dict.fromkeys(c.split(" (")[0] for c in columns)) == lifecycle
