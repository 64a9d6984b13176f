"""``rtv``'s entry point refuses a too-old Python, a missing torch and a missing extra with one reason, one fix
and exit 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import tomllib

from canaries import entry, extras


def test_too_old_python_exits_2_before_importing_the_command_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "version_info", (3, 9, 18, "final", 0))
    monkeypatch.setitem(sys.modules, "canaries.cli", None)  # importing it would fail: it must not be reached
    assert entry.main(["--help"]) == 2
    reason, fix = capsys.readouterr().err.splitlines()
    assert reason.startswith("rtv: rtv needs Python 3.10 or newer, found 3.9.18") and fix.startswith("fix: ")


def test_missing_torch_exits_2_with_the_install_command(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # what `import torch` sees when it is not installed
    monkeypatch.setitem(sys.modules, "canaries.cli", None)
    assert entry.main(["run"]) == 2
    reason, fix = capsys.readouterr().err.splitlines()
    assert reason.startswith("rtv: torch is not installed") and "make install" in fix


def test_with_everything_there_it_hands_over_to_the_command_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        entry.main(["--help"])
    assert exit_info.value.code == 0 and "rtv" in capsys.readouterr().out


ROOT = Path(__file__).resolve().parents[2]


def _without(tmp_path: Path, package: str) -> dict[str, str]:
    """An environment whose ``import package`` raises what a missing package raises (a stub first on PYTHONPATH)."""
    stub = tmp_path / "stubs" / package
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{package}' (test stub)\", name={package!r})\n"
    )
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub.parent), str(ROOT)]))


@pytest.mark.parametrize(
    "package, command",
    [
        ("pandas", ["report", "--in", str(ROOT / "tests" / "fixtures" / "evidence"), "--out", "{tmp}/report/index.md"]),
        ("numpy", ["run", "--out", "{tmp}/out"]),
        ("tqdm", ["--help"]),
    ],
)
def test_a_command_without_a_package_of_the_harness_extra_exits_2_naming_the_extra(
    tmp_path: Path, package: str, command: list[str]
) -> None:
    argv = [part.format(tmp=tmp_path) for part in command]
    done = subprocess.run(
        [sys.executable, "-m", "canaries.entry", *argv],
        env=_without(tmp_path, package),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    reason, fix = done.stderr.strip().splitlines()[-2:]
    assert "Traceback" not in done.stderr, done.stderr
    assert reason.startswith("rtv: this command needs the harness extra") and f"'{package}'" in reason, reason
    assert fix.startswith("fix: pip install -e '.[harness]'"), fix
    assert not (tmp_path / "out").exists() and not (tmp_path / "report").exists(), "refused before writing anything"


def test_another_import_error_is_not_taken_for_a_missing_extra(monkeypatch) -> None:
    """Only the packages pyproject.toml's extras provide are named; a bug's ImportError keeps its traceback."""

    def broken(argv):
        raise ModuleNotFoundError("No module named 'canaries.nowhere'", name="canaries.nowhere")

    monkeypatch.setattr("canaries.cli.main", broken)
    with pytest.raises(ModuleNotFoundError, match=r"canaries\.nowhere"):
        entry.main(["--help"])


def test_the_extra_packages_are_what_pyproject_toml_declares() -> None:
    """Each extra's import names map (installed metadata; the import name where it is not installed) to exactly the
    distributions pyproject.toml lists for that extra."""
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    provided_by = packages_distributions()
    for extra, packages in extras.EXTRA_PACKAGES.items():
        declared = {re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower() for spec in optional[extra]}
        mapped = {dist.lower() for package in packages for dist in provided_by.get(package, [package])}
        assert mapped == declared, (
            f"extra {extra!r}: the import names give {sorted(mapped)}, pyproject {sorted(declared)}"
        )
    assert set(extras.EXTRA_PACKAGES) == set(optional) - {"test"}, "every extra rtv may need, not the test runner's"
