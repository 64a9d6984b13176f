"""The suite's time budget, kept by design (tests/README.md#the-time-budget).

``make test`` runs every test module in each xdist worker's collection, so a
module-level import is paid by every worker; a folder of modules that share a
costly import or a run-wide fixture goes to one worker whole
(``conftest.xdist_scope``); the tests moved to ``slow`` for the budget still run
in CI (``.ci/slow_tier``, run by ``.ci/run`` and the CPU workflow); and no test
of the default run spawns ranks.
"""

from __future__ import annotations

import ast
import multiprocessing
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib

from tests import conftest
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


def slow_tier_arguments(root: Path, scratch: Path) -> list[str]:
    """What ``root``'s ``.ci/slow_tier`` hands pytest, argument by argument: the script run from a copy in ``scratch``
    beside a stand-in ``.venv/bin/pytest`` that prints its arguments, so the shell's quoting is undone as CI's is."""
    (scratch / ".ci").mkdir()
    script = scratch / ".ci" / "slow_tier"
    shutil.copy2(root / ".ci" / "slow_tier", script)
    stand_in = scratch / ".venv" / "bin" / "pytest"
    stand_in.parent.mkdir(parents=True)
    stand_in.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    stand_in.chmod(0o755)
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.splitlines()


def test_ci_runs_the_slow_tier(tmp_path: Path) -> None:
    """The tests moved out of ``make test`` for its budget run in every CI run, not only nightly: ``.ci/run`` calls
    ``.ci/slow_tier`` (so does the CPU workflow: ``tests/ci/test_workflows.py``)."""
    commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ".ci/slow_tier" in commands, ".ci/run must run the slow tier"
    arguments = slow_tier_arguments(ROOT, tmp_path)
    assert "--runslow" in arguments and re.match(r"slow\b", arguments[arguments.index("-m") + 1]), arguments
    # It leaves out only the lock's fresh installs from the registry (minutes of downloads), nothing by keyword: a run
    # whose verdict a busy runner could turn is mended, not left to the nightly job.
    deselected = [arguments[i + 1] for i, argument in enumerate(arguments) if argument == "--deselect"]
    assert deselected == [NODE_INSTALLS], arguments
    assert not [a for a in arguments if a.startswith(("-k", "--keyword", "--deselect="))], arguments


# --- make test starts no process of its own ---------------------------------------------------------------------------


def test_a_default_run_refuses_to_start_a_process(request: pytest.FixtureRequest) -> None:
    """A test of ``make test`` that starts ranks (or any ``multiprocessing`` process) fails with the fix, whatever
    path it takes there: ``conftest.refuse_process_starts``."""
    if not conftest.is_default_run(request.config):
        pytest.skip("only make test's run refuses: the slow tier, the bench tests and the Slurm stage start processes")
    with pytest.raises(conftest.DefaultRunStartedAProcess, match="mark the test slow"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_the_default_selection_is_pyprojects() -> None:
    """``conftest.DEFAULT_MARKEXPR`` names the run ``make test`` makes: pyproject.toml's ``-m`` in ``addopts``."""
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert f"-m '{conftest.DEFAULT_MARKEXPR}'" in addopts, addopts
