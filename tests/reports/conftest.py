"""The committed fixture records rendered once per test run for every report test that reads them (rendering draws
every plot; ``tests.once`` shares it between xdist workers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reports import ReportPaths, render_report
from tests.once import once_per_run

FIXTURES = Path(__file__).parents[1] / "fixtures" / "evidence"


@pytest.fixture(scope="session")
def fixture_report(tmp_path_factory: pytest.TempPathFactory) -> ReportPaths:
    """``rtv report --in tests/fixtures/evidence`` (the folder named: read though it is a fixture), rendered once."""
    return once_per_run(
        tmp_path_factory,
        "fixture-report",
        lambda folder: render_report(FIXTURES, folder / "index.md", title="fixtures"),
    )
