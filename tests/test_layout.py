"""The tests' layout, checked: ``tests/unit/test_X.py`` tests ``reference_trainer``'s module X (tests/README.md).

A unit test module is named after the module it tests, so the tests of a
module are found by its name and a module's tests live in one file. X is the
name of a module or subpackage anywhere in ``reference_trainer`` (``commit``,
``ranks``, ``zero``); a test of how modules work together goes to the module
whose contract it checks (the trainer's own methods: ``test_trainer.py``).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def unmirrored(root: Path) -> list[str]:
    """``tests/unit`` test files under ``root`` that name no module of ``root/reference_trainer``."""
    package = root / "reference_trainer"
    names = {p.stem for p in package.rglob("*.py") if p.stem != "__init__"} | {
        p.name for p in package.rglob("*") if p.is_dir()
    }
    return sorted(
        p.name for p in (root / "tests" / "unit").glob("test_*.py") if p.stem.removeprefix("test_") not in names
    )


def test_every_unit_test_module_names_the_module_it_tests() -> None:
    assert unmirrored(ROOT) == [], "rename it to tests/unit/test_<module>.py, or move its tests to that module's file"


def test_negative_control_a_unit_test_named_after_no_module_is_reported(tmp_path: Path) -> None:
    for relative in (
        "reference_trainer/__init__.py",
        "reference_trainer/commit.py",
        "reference_trainer/ranks/zero.py",
        "tests/unit/test_commit.py",
        "tests/unit/test_zero.py",
        "tests/unit/test_ranks.py",
        "tests/unit/test_commit_finite_check.py",
        "tests/unit/test_transaction.py",
        "tests/unit/support.py",
    ):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("")
    assert unmirrored(tmp_path) == ["test_commit_finite_check.py", "test_transaction.py"]
