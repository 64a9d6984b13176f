"""ci/node_install.sh: a GPU node's install from the committed lock, reproducible, and its refusals.

The slow case installs twice into fresh venvs, with a local PEP 503 index
holding a CPU torch wheel standing in for the CUDA build's index, and
compares ``pip freeze``. The fast cases check the lock against the
``harness`` extra and the refusals that need no install.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "node_install.sh"
LOCK = ROOT / "ci" / "node-requirements.lock"


def _pins() -> dict[str, str]:
    lines = [line for line in LOCK.read_text().splitlines() if line and not line.startswith("#")]
    pins = dict(line.split("==") for line in lines)
    assert len(pins) == len(lines), "every line pins one version with =="
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pins.items()}


def test_the_lock_pins_the_harness_extra_and_torch_and_nothing_of_test_or_ci():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = lambda extra: {re.split(r"[<>=~!\[ ]", spec)[0].lower() for spec in extras[extra]}  # noqa: E731
    pins = _pins()
    assert names("harness") <= set(pins) and pins["torch"] == "2.13.0"
    assert not (names("test") | names("ci")) & set(pins), "a node installs only the harness extra"


def _run(venv: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(venv)], capture_output=True, text=True, timeout=900, env=os.environ | env, check=False
    )


def test_a_missing_cuda_declaration_or_index_is_refused_before_anything_is_made(tmp_path: Path):
    venv = tmp_path / "venv"
    done = _run(venv, {"RTV_CUDA": "", "RTV_TORCH_INDEX": "file:///nowhere"})
    assert done.returncode != 0 and "RTV_CUDA" in done.stderr and not venv.exists()
    done = _run(venv, {"RTV_CUDA": "12.8", "RTV_TORCH_INDEX": ""})
    assert done.returncode == 1 and "RTV_TORCH_INDEX" in done.stderr and "fix:" in done.stderr and not venv.exists()


def test_python_without_venv_support_is_named_with_the_package_to_install(tmp_path: Path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\ncase "$*" in *ensurepip*) exit 1;; esac\nexit 0\n')
    (fake / "python3").chmod(0o755)
    done = _run(
        tmp_path / "venv",
        {"PATH": f"{fake}:{os.environ['PATH']}", "RTV_CUDA": "none", "RTV_TORCH_INDEX": "file:///nowhere"},
    )
    assert done.returncode == 1 and "python3-venv" in done.stderr


def _cpu_torch_index(tmp_path: Path) -> str:
    """A PEP 503 index with this machine's CPU torch wheel (pip's find-links folders), else PyTorch's CPU index."""
    for folder in filter(None, os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()):
        wheels = sorted(Path(folder).glob("torch-2.13.0+cpu-*.whl"))
        if wheels:
            page = tmp_path / "index" / "torch" / "index.html"
            page.parent.mkdir(parents=True)
            page.write_text(f'<a href="{wheels[0].as_uri()}">{wheels[0].name}</a>\n')
            return (tmp_path / "index").as_uri()
    return "https://download.pytorch.org/whl/cpu"


@pytest.mark.slow
def test_two_installs_from_the_lock_in_fresh_venvs_freeze_the_same(tmp_path: Path):
    env = {"RTV_CUDA": "none", "RTV_TORCH_INDEX": _cpu_torch_index(tmp_path)}
    freezes = []
    for name in ("a", "b"):
        venv = tmp_path / name
        done = _run(venv, env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "No broken requirements found" in done.stdout
        freeze = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        freezes.append(freeze)
        again = _run(venv, env)
        assert again.returncode == 0 and "reused" in again.stdout, "a venv made from this lock is reused"
    assert freezes[0] == freezes[1]
    frozen = {
        re.sub(r"[-_.]+", "-", line.split("==")[0]).lower(): line.split("==")[1]
        for line in freezes[0].splitlines()
        if "==" in line
    }
    frozen.pop("reference-trainer", None)  # the project itself (pip lists a worktree's editable install by version)
    assert {k: v for k, v in frozen.items() if k != "torch"} == {k: v for k, v in _pins().items() if k != "torch"}
