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
import os
import re
import shutil
import subprocess
import types
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


# --- make test spawns no ranks ---------------------------------------------------------------------------------------

# The functions that start rank processes (validation.spawn's forkserver: torch imported afresh, about 4 s of CPU).
SPAWNERS = frozenset({"spawn_ranks", "spawn_watched", "run_ranks"})
_NAMES_A_SPAWNER = re.compile(rf"\b(?:{'|'.join(sorted(SPAWNERS))})\b")


def spawn_scope(tests: Path) -> list[Path]:
    """What a run must collect to meet every test under ``tests`` that can reach a spawner: each folder whose
    ``conftest.py`` names one (its fixtures serve the folder), then each test module elsewhere that names one.

    Collecting the whole suite costs about 11 s of CPU; this, about 0.15 s in a worker that has already imported the
    modules (``make test``'s), about 1 s alone. A conftest that spawns through another module's function, naming no
    spawner, is not seen.
    """
    named = [p for p in sorted(tests.rglob("*.py")) if _NAMES_A_SPAWNER.search(p.read_text())]
    folders = [p.parent for p in named if p.name == "conftest.py"]
    modules = [p for p in named if p.name.startswith("test_") and not any(f in p.parents for f in folders)]
    return folders + modules


def _reached_names(function: object, seen: set[int]) -> set[str]:
    """The global and attribute names ``function``'s code uses, its lambdas and inner functions included, and those
    of each plain function of its own module it names, transitively. A wrapped helper (``functools.cache``) is not
    followed: whether it spawns may hang on its arguments (``world == 1`` runs in process)."""
    code = getattr(function, "__code__", None)
    if code is None or id(function) in seen:
        return set()
    seen.add(id(function))
    names: set[str] = set()
    codes = [code]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    module_globals = getattr(function, "__globals__", {})
    for name in list(names):
        helper = module_globals.get(name)
        if isinstance(helper, types.FunctionType) and helper.__module__ == getattr(function, "__module__", None):
            names |= _reached_names(helper, seen)
    return names


def spawner_reached(item: pytest.Item) -> str | None:
    """Why ``item`` spawns ranks: ``fixture NAME`` for a fixture of its closure whose code reaches a spawner, ``its
    code`` for the test function's own; None when neither does."""
    if SPAWNERS & _reached_names(getattr(item, "obj", None), set()):
        return "its code"
    fixture_info = getattr(item, "_fixtureinfo", None)  # the closure pytest resolved: it has no public accessor
    definitions = fixture_info.name2fixturedefs if fixture_info else {}
    for name in getattr(item, "fixturenames", ()):
        chain = definitions.get(name)  # the last definition is the one the item gets (the nearest override)
        if chain and SPAWNERS & _reached_names(chain[-1].func, set()):
            return f"fixture {name}"
    return None


class _Collected:
    """A plugin that keeps a session's items after every selection, and the order its
    ``pytest_collection_modifyitems`` implementations ran in (plugin names: a conftest's is its path)."""

    def __init__(self) -> None:
        self.items: list[pytest.Item] = []
        self.hook_order: list[str] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = list(session.items)
        implementations = session.config.hook.pytest_collection_modifyitems.get_hookimpls()
        manager = session.config.pluginmanager
        self.hook_order = [str(manager.get_name(i.plugin)) for i in reversed(implementations)]  # pluggy's call order


# Collection only, in this process: no xdist, no cache written, and no unraisable-exception plugin (its unconfigure
# runs two full garbage collections over the worker's heap: two thirds of the cost).
COLLECT_ONLY = ("--collect-only", "-qq", "-p", "no:xdist", "-p", "no:cacheprovider", "-p", "no:unraisableexception")


def default_run(paths: list[Path]) -> _Collected:
    """``paths`` collected in this process as ``make test`` collects them: no ``--runslow``, no ``RTV_SLOW``."""
    collected = _Collected()
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RTV_SLOW", raising=False)
        code = pytest.main([*COLLECT_ONLY, *map(str, paths)], plugins=[collected])
    assert code == pytest.ExitCode.OK, f"collecting {paths} failed: exit {code!r}"
    return collected


def unskipped_spawns(collected: _Collected) -> list[str]:
    """``nodeid: why`` for each item of a default run that reaches a spawner and is not skipped: a ``slow`` marker
    added after the root conftest's hook skipped the slow tests would leave it to run."""
    found = [(item, spawner_reached(item)) for item in collected.items]
    return [f"{item.nodeid}: {why}" for item, why in found if why and item.get_closest_marker("skip") is None]


# The conftest that marks the two-process suite's readers slow, and the root one that skips slow tests by default.
CONFTESTS = (Path("tests", "dist", "conftest.py"), Path("tests", "conftest.py"))


@pytest.fixture(scope="module")
def spawn_scope_run() -> _Collected:
    return default_run(spawn_scope(ROOT / "tests"))


def test_make_test_spawns_no_ranks(spawn_scope_run: _Collected) -> None:
    """tests/README.md#the-time-budget: a forkserver's start alone is about 4 s of CPU; a spawning test is ``slow``."""
    assert unskipped_spawns(spawn_scope_run) == [], "mark each slow, with a fast sibling in the default run"
    seen = {spawner_reached(item) for item in spawn_scope_run.items}
    assert {"fixture two_process", "its code"} <= seen, f"the scope shows none of the known spawns (vacuous): {seen}"


def test_the_two_process_suites_readers_are_marked_slow_before_the_skip_and_the_m_selection(
    spawn_scope_run: _Collected,
) -> None:
    """The mark must come before the root conftest skips the slow tests of a default run, and before pytest's ``-m``
    selection: CI's slow tier selects ``-m slow`` (``.ci/slow_tier``), which would leave a late-marked test out."""
    order = spawn_scope_run.hook_order
    conftests = [next(i for i, name in enumerate(order) if name.endswith(f"{os.sep}{path}")) for path in CONFTESTS]
    marks, skips = conftests
    assert marks < skips and marks < order.index("mark"), order


PLANTED = {
    "pytest.ini": "[pytest]\naddopts = --import-mode=importlib\n",
    "conftest.py": "from tests.conftest import pytest_addoption, pytest_collection_modifyitems, pytest_configure\n",
    "planted_ranks/conftest.py": """
import pytest
from validation.spawn import spawn_ranks


def _suite():
    return spawn_ranks(print, 2)


@pytest.fixture(scope="session")
def ranks():
    return _suite()


@pytest.fixture
def early_ranks():
    return _suite()


@pytest.fixture
def late_ranks():
    return _suite()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if "early_ranks" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
""",
    "planted_ranks/test_planted_readers.py": """
import pytest


def test_unmarked(ranks):
    pass


@pytest.mark.slow
def test_marked(ranks):
    pass


def test_marked_by_the_folders_hook(early_ranks):
    pass
""",
    "planted_ranks/late/conftest.py": """
import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if "late_ranks" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
""",
    "planted_ranks/late/test_planted_late.py": "def test_marked_after_the_skip(late_ranks):\n    pass\n",
    "test_planted_direct.py": """
import pytest
from validation.world import run_ranks


def _two():
    return run_ranks(print, 2)


def test_through_a_helper():
    assert _two()


@pytest.mark.slow
def test_marked():
    assert _two()


def test_names_it_in_a_string_only(monkeypatch):
    monkeypatch.setattr("validation.world.run_ranks", print)
""",
    "test_planted_plain.py": "def test_nothing():\n    pass\n",
}


def test_negative_control_an_unmarked_or_late_marked_spawning_test_is_found_and_a_skipped_one_is_not(
    tmp_path: Path,
) -> None:
    for name, text in PLANTED.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    scope = spawn_scope(tmp_path)
    assert scope == [tmp_path / "planted_ranks", tmp_path / "test_planted_direct.py"]
    assert unskipped_spawns(default_run(scope)) == [
        "planted_ranks/late/test_planted_late.py::test_marked_after_the_skip: fixture late_ranks",
        "planted_ranks/test_planted_readers.py::test_unmarked: fixture ranks",
        "test_planted_direct.py::test_through_a_helper: its code",
    ]
