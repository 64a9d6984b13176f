"""The committed fixture records rendered once for every report test that reads them (rendering draws every plot)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reports import ReportPaths, render_report

FIXTURES = Path(__file__).parents[1] / "fixtures" / "evidence"


@pytest.fixture(scope="session")
def fixture_report(tmp_path_factory: pytest.TempPathFactory) -> ReportPaths:
    """``rtv report --in tests/fixtures/evidence`` (the folder named: read though it is a fixture), rendered once."""
    return render_report(FIXTURES, tmp_path_factory.mktemp("fixture-report") / "index.md", title="fixtures")
