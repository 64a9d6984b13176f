"""``rtv``'s entry point refuses a too-old Python and a missing torch with one reason, one fix and exit 2."""

from __future__ import annotations

import sys

import pytest

from canaries import entry


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
