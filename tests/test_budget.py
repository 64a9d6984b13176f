"""The suite's time budget, kept by design (tests/README.md#the-time-budget).

``make test`` runs every test module in each xdist worker's collection, so a
module-level import is paid by every worker; a folder of modules that share a
costly import or a run-wide fixture goes to one worker whole
(``conftest.xdist_scope``); the tests moved to ``slow`` for the budget still run
in CI (``.ci/run``'s slow tier).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import GROUPED_SCOPES, xdist_scope

ROOT = Path(__file__).resolve().parents[1]
# Libraries that cost each collecting worker seconds and only a few tests use: imported inside those tests.
COLLECTION_FORBIDDEN = ("transformers", "peft", "sky")


def module_level_imports(source: str) -> set[str]:
    """The top-level packages a module imports at its top level (not inside a function, class or ``if``)."""
    found: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def heavy_collection_imports(root: Path) -> list[str]:
    """``path: package`` for each test module that imports a :data:`COLLECTION_FORBIDDEN` package at its top."""
    return [
        f"{path.relative_to(root)}: {package}"
        for path in sorted((root / "tests").rglob("test_*.py"))
        for package in sorted(module_level_imports(path.read_text()) & set(COLLECTION_FORBIDDEN))
    ]


def test_no_test_module_imports_a_heavy_optional_library_at_collection() -> None:
    assert heavy_collection_imports(ROOT) == [], "import it inside the test or a fixture (see this module's docstring)"


def test_negative_control_a_module_level_import_is_found_and_one_inside_a_function_is_not(tmp_path: Path) -> None:
    (tmp_path / "tests" / "ci").mkdir(parents=True)
    (tmp_path / "tests" / "ci" / "test_a.py").write_text("import os\nfrom sky.server import common\n")
    (tmp_path / "tests" / "test_b.py").write_text("import pytest\n\ndef test_x():\n    import transformers\n")
    assert heavy_collection_imports(tmp_path) == ["tests/ci/test_a.py: sky"]


@pytest.mark.parametrize(
    ("nodeid", "scope"),
    [
        ("tests/ci/test_launcher.py::test_x[a-b]", "tests/ci/"),
        ("tests/dist/test_logical_invariance.py::test_y", "spawned ranks"),
        ("tests/validation/test_world.py::test_r", "spawned ranks"),
        ("tests/validation/test_worlds.py::test_q", "tests/validation/test_worlds.py"),
        ("tests/reports/test_board.py::TestBoard::test_z", "tests/reports/"),
        ("tests/unit/test_saves.py::test_w[1]", "tests/unit/test_saves.py"),
        ("tests/unit/test_saves.py::TestGroup::test_v", "tests/unit/test_saves.py"),
        ("tests/test_docs.py::test_u", "tests/test_docs.py"),
        ("tests/cinema/test_t.py::test_s", "tests/cinema/test_t.py"),
    ],
)
def test_a_grouped_folder_is_one_unit_of_work_and_any_other_test_its_module(nodeid: str, scope: str) -> None:
    assert xdist_scope(nodeid) == scope


def test_every_grouped_path_holds_test_modules() -> None:
    for prefix in GROUPED_SCOPES:
        found = list((ROOT / prefix).glob("test_*.py")) if prefix.endswith("/") else [ROOT / prefix]
        assert found and all(p.is_file() for p in found), f"{prefix} holds no test module: update GROUPED_SCOPES"


NODE_INSTALLS = "tests/ci/test_node_install.py::test_two_installs_from_the_lock_in_fresh_venvs_freeze_the_same"


def test_ci_runs_the_slow_tier() -> None:
    """The tests moved out of ``make test`` for its budget run in every CI run, not only nightly."""
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.lstrip().startswith("#")]
    assert any(re.search(r"pytest .*--runslow .*-m '?slow\b", line) for line in commands), ".ci/run must run -m slow"
    # It leaves out only the lock's fresh installs from the registry (minutes of downloads), nothing by keyword: a run
    # whose verdict a busy runner could turn is mended, not left to the nightly job.
    (tier,) = [c for c in "\n".join(commands).replace("\\\n", " ").splitlines() if "--runslow" in c]
    assert re.findall(r"--deselect\s+(\S+)", tier) == [NODE_INSTALLS], tier
    assert not re.search(r"\s-k\s", tier), tier
