"""The extras carry what the code imports: ``pip install -e '.[harness]'`` alone runs ``rtv run``.

Every module of the harness packages (``validation``, ``canaries``,
``reports``) is parsed for imports (top level and inside functions); each
third-party one must be provided by a distribution that ``harness`` or the
core dependencies declare, and nothing the test runner alone provides
(``pytest``) may be needed at runtime. The mapping from import name to
distribution comes from the installed metadata, not from a list kept here.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
HARNESS_PACKAGES = ("validation", "canaries", "reports")
FIRST_PARTY = {"reference_trainer", "validation", "canaries", "reports", "ci", "tests"}


def _declared(extra: str | None) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower().replace("_", "-") for spec in specs}


@functools.cache
def _distributions() -> dict[str, list[str]]:
    """``importlib.metadata.packages_distributions()``, read once (it scans every installed distribution)."""
    return packages_distributions()


def imported_modules(folder: Path) -> dict[str, set[str]]:
    """Top-level names of absolute imports in every module under ``folder`` -> the files importing them."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(folder.parent)))
    return found


def missing_from_extras(folders: list[Path], declared: set[str]) -> dict[str, str]:
    """Third-party imports whose distribution is not ``declared``: import name -> why, naming a file."""
    distributions = _distributions()
    missing = {}
    for folder in folders:
        for name, files in imported_modules(folder).items():
            if name in FIRST_PARTY or name in sys.stdlib_module_names or name == "__future__":
                continue
            provided = {d.lower().replace("_", "-") for d in distributions.get(name, [name])}
            if not provided & declared:
                missing[name] = f"imported by {sorted(files)[0]}, provided by {sorted(provided)}"
    return missing


# Imports of a part of the harness run only on request, which refuses with its extra's install command when they
# are missing: the ``hf-lora`` conformance adapter (``rtv conform hf-lora``), import name -> its extra.
ON_REQUEST = {"transformers": "conform-hf", "peft": "conform-hf"}


def test_the_harness_extra_carries_every_runtime_import_of_the_harness() -> None:
    declared = _declared(None) | _declared("harness")
    missing = missing_from_extras([ROOT / p for p in HARNESS_PACKAGES], declared)
    missing = {name: why for name, why in missing.items() if name not in ON_REQUEST}
    assert not missing, f"add these to the `harness` extra in pyproject.toml: {missing}"
    assert all(name in _declared(extra) for name, extra in ON_REQUEST.items()), "declare them in their extra"


# Imports a test may make without its extra installed: the tests needing them skip with the reason
# (``sky``: every test requesting ``sky_sandbox``, tests/ci/conftest.py).
SKIPPED_WITHOUT = {"sky": "ci"}


def test_test_and_harness_carry_every_import_of_the_tests() -> None:
    """``pip install -e '.[test,harness]'`` then ``pytest``: no test fails to import what it needs (tests/README.md)."""
    declared = _declared(None) | _declared("harness") | _declared("test")
    local = {path.stem for folder in ("tests", "examples") for path in (ROOT / folder).rglob("*.py")}  # put on sys.path
    missing = {
        name: why
        for name, why in missing_from_extras([ROOT / "tests"], declared).items()
        if name not in SKIPPED_WITHOUT and name not in local
    }
    assert not missing, f"add these to the `test` extra in pyproject.toml: {missing}"


def distributions_imported(folders: list[Path]) -> set[str]:
    """Distributions providing the third-party imports under ``folders``."""
    distributions = _distributions()
    return {
        d.lower().replace("_", "-")
        for folder in folders
        for name in imported_modules(folder)
        for d in distributions.get(name, [name])
    }


def test_the_test_extra_holds_only_what_tests_need() -> None:
    """``test`` = the runner plus tools only tests use (a browser driver, a workflow linter), never a runtime need."""
    test_only = _declared("test")
    assert {"pytest", "pytest-xdist"} <= test_only
    assert not test_only & _declared("harness")
    assert not test_only & distributions_imported([ROOT / p for p in HARNESS_PACKAGES])


def test_the_scan_reports_an_undeclared_import(tmp_path: Path) -> None:
    """Negative control: a harness module importing hypothesis, with hypothesis left out of the extra."""
    package = tmp_path / "canaries"
    package.mkdir()
    (package / "explore.py").write_text("def f():\n    from hypothesis import given\n    import torch\n")
    missing = missing_from_extras([package], _declared(None) | (_declared("harness") - {"hypothesis"}))
    assert set(missing) == {"hypothesis"} and "canaries/explore.py" in missing["hypothesis"]
