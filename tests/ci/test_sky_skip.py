"""Without the ``ci`` extra, the SkyPilot tests are skipped with the reason at collection; with it they are slow (CI's
slow tier runs them); the rest of tests/ci runs in ``make test``."""

from __future__ import annotations

import pytest

from . import conftest


class _Item:
    """The part of a collected ``pytest.Item`` the hook reads and writes."""

    def __init__(self, *fixtures: str) -> None:
        self.fixturenames = list(fixtures)
        self.markers: list[pytest.MarkDecorator] = []

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.markers.append(marker)


def _collect(monkeypatch: pytest.MonkeyPatch, *, installed: bool) -> tuple[_Item, _Item]:
    monkeypatch.setattr(conftest, "skypilot_installed", lambda: installed)
    needs_sky, plain = _Item("sky_sandbox", "tmp_path"), _Item("repo_root", "tmp_path")
    conftest.pytest_collection_modifyitems(None, [needs_sky, plain])
    return needs_sky, plain


def test_without_skypilot_only_the_tests_that_need_it_are_skipped_with_the_fix(monkeypatch) -> None:
    needs_sky, plain = _collect(monkeypatch, installed=False)
    assert [m.name for m in needs_sky.markers] == ["skip"] and plain.markers == []
    assert (
        needs_sky.markers[0].kwargs["reason"] == "needs the ci extra (pip install -e '.[ci]'): skypilot not installed"
    )


def test_with_skypilot_the_tests_that_need_it_are_slow_and_the_rest_unmarked(monkeypatch) -> None:
    needs_sky, plain = _collect(monkeypatch, installed=True)
    assert [m.name for m in needs_sky.markers] == ["slow"] and plain.markers == []


def test_the_check_finds_skypilot_without_importing_it() -> None:
    """``import sky`` must happen first inside ``sky_sandbox`` (its HOME); the check only looks for the module."""
    import sys

    was_imported = "sky" in sys.modules
    conftest.skypilot_installed()
    assert ("sky" in sys.modules) == was_imported
