"""The ``rtv`` command line: ``run`` passes and writes evidence, its negative control fails it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from canaries.cli import main

SUBCOMMANDS = ("run", "canary", "learn", "bench", "report", "ci")


def only_record(out: Path) -> dict:
    (path,) = out.glob("*.json")
    return json.loads(path.read_text())


def test_run_passes_and_writes_a_json_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--out", str(tmp_path)]) == 0

    record = only_record(tmp_path)
    stdout = capsys.readouterr().out
    assert record["passed"] is True
    assert record["checks"] and all(check["passed"] for check in record["checks"])
    assert record["environment"]["torch"]
    assert record["config"]["model"]["vocab_size"] == 64
    for check in record["checks"]:
        assert f"PASS  {check['name']}" in stdout
    assert f"wrote {next(tmp_path.glob('*.json'))}" in stdout


@pytest.mark.parametrize("how", ["flag", "env"])
def test_injected_failure_fails_the_run(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--out", str(tmp_path)]
    if how == "flag":
        argv.append("--inject-failure")
    else:
        monkeypatch.setenv("RTV_SMOKE_INJECT_FAILURE", "1")

    assert main(argv) != 0

    record = only_record(tmp_path)
    failed = [check["name"] for check in record["checks"] if not check["passed"]]
    assert record["passed"] is False and failed == ["frozen base gets no gradient"]
    assert "FAIL  frozen base gets no gradient" in capsys.readouterr().out


def test_installed_rtv_script_writes_to_rtv_out_by_default(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("rtv")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "canaries.cli"]

    done = subprocess.run(
        [*command, "run"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert only_record(tmp_path / "rtv-out")["passed"] is True
    assert "wrote rtv-out" in done.stdout


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert f"    {name} " in text

    with pytest.raises(SystemExit):
        main(["canary", "--help"])
    assert "{derivative,memory}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["canary", "derivative"], ["canary", "memory"], ["learn"], ["bench"], ["report"], ["ci"]]
)
def test_planned_subcommands_say_not_implemented(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert f"rtv {' '.join(argv)}: not implemented yet" in capsys.readouterr().err
