"""The canary spine: every registered canary is one module with the one entry point; names are checked."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from canaries.registry import CANARIES, Canary, canary
from validation.errors import SetupError


@pytest.mark.parametrize("name", list(CANARIES))
def test_each_registered_canary_has_the_registry_entry_point(name: str) -> None:
    entry = CANARIES[name]
    run = importlib.import_module(entry.module).run
    parameters = list(inspect.signature(run).parameters.values())
    assert [p.name for p in parameters[:3]] == ["preset", "profile", "out_dir"]
    assert all(p.default is not inspect.Parameter.empty for p in parameters[3:]), "extras must be optional"
    assert inspect.signature(run).return_annotation in (Path, "Path")
    assert entry.summary and canary(name) is entry


def test_an_unknown_canary_is_refused_with_the_registered_names() -> None:
    with pytest.raises(SetupError, match="unknown canary 'learnin'") as info:
        canary("learnin")
    assert all(name in info.value.fix for name in CANARIES)


def test_a_new_canary_is_one_module_plus_one_registration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The spine's promise, exercised: ``rtv canary --help`` lists it, ``rtv canary NAME`` runs it."""
    from canaries.cli import main

    (tmp_path / "toy_canary.py").write_text(
        "from pathlib import Path\n"
        "from validation.evidence import evidence_path, make_record, write_once\n\n"
        "def run(preset: str, profile: str, out_dir: Path) -> Path:\n"
        "    record = make_record('toy', config={'preset': preset, 'profile': profile}, checks={'toy holds': True},\n"
        "                         measurements={})\n"
        "    return write_once(evidence_path(out_dir, 'toy'), record)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(CANARIES, "toy", Canary(name="toy", module="toy_canary", summary="a canary this test adds"))
    with pytest.raises(SystemExit):
        main(["canary", "--help"])
    assert f"  {'toy':12} a canary this test adds" in capsys.readouterr().out
    assert main(["canary", "toy", "--profile", "quick", "--out", str(tmp_path / "out")]) == 0
    (evidence,) = (tmp_path / "out").rglob("toy-*.json")
    assert '"passed": true' in evidence.read_text()
