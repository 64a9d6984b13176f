"""The canary spine: every registered canary is one module with ``judge``; the registry writes its one record."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from canaries.registry import CANARIES, Canary, Judged, canary
from validation.errors import SetupError
from validation.evidence import SCHEMA_VERSION, verify


@pytest.mark.parametrize("name", list(CANARIES))
def test_each_registered_canary_has_the_registry_entry_point(name: str) -> None:
    entry = CANARIES[name]
    module = importlib.import_module(entry.module)
    parameters = list(inspect.signature(module.judge).parameters.values())
    assert [p.name for p in parameters[:2]] == ["preset", "profile"]
    assert all(p.default is not inspect.Parameter.empty for p in parameters[2:]), "extras must be optional"
    assert inspect.signature(module.judge).return_annotation in (Judged, "Judged")
    assert not hasattr(module, "run"), "the registry writes the record: a canary has no run of its own"
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
        "from canaries.registry import Judged\n"
        "from validation.evidence import Checks\n\n"
        "def judge(preset: str, profile: str) -> Judged:\n"
        "    checks = Checks()\n"
        "    checks.check('toy holds', True, 'as it should')\n"
        "    return Judged('toy', {'preset': preset, 'profile': profile}, checks, {'answer': 42})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(CANARIES, "toy", Canary(name="toy", module="toy_canary", summary="a canary this test adds"))
    with pytest.raises(SystemExit):
        main(["canary", "--help"])
    assert f"  {'toy':12} a canary this test adds" in capsys.readouterr().out
    assert main(["canary", "toy", "--profile", "quick", "--out", str(tmp_path / "out")]) == 0
    (evidence,) = (tmp_path / "out").rglob("toy-*.json")
    assert '"passed": true' in evidence.read_text()


def _register(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> Canary:
    (tmp_path / f"{name}_canary.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = Canary(name=name, module=f"{name}_canary", summary="a canary this test adds")
    monkeypatch.setitem(CANARIES, name, entry)
    return entry


def test_the_registry_writes_exactly_one_verified_schema_2_record_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = _register(tmp_path, monkeypatch, "judged", (
        "from canaries.registry import Judged\n"
        "from validation.evidence import Checks\n\n"
        "def judge(preset: str, profile: str) -> Judged:\n"
        "    checks = Checks()\n"
        "    checks.check('holds', True, 'it held')\n"
        "    checks.check('breaks', False, 'expected 1, found 2')\n"
        "    checks.skip('cuda only', 'no CUDA device')\n"
        "    return Judged('judged-kind', {'preset': preset, 'profile': profile}, checks, {'n': 3})\n"
    ))
    out = tmp_path / "out"
    path = entry.run("cpu", "quick", out)
    assert list(out.glob("*.json")) == [path] and path.name.startswith("judged-cpu-")
    record = verify(path)
    assert record["schema_version"] == SCHEMA_VERSION == 2 and record["kind"] == "judged-kind"
    assert record["config"] == {"preset": "cpu", "profile": "quick"} and record["measurements"] == {"n": 3}
    assert record["checks"] == {"holds": True, "breaks": False} and not record["passed"]
    assert record["details"]["breaks"] == "expected 1, found 2" and record["skips"] == {"cuda only": "no CUDA device"}
    assert capsys.readouterr().out.splitlines() == ["judged canary: FAILED (1 of 2 checks); 1 skipped", f"wrote {path}"]


@pytest.mark.parametrize(("source", "found"), [
    ("from pathlib import Path\n\ndef run(preset: str, profile: str, out_dir: Path) -> Path:\n    raise AssertionError\n",
     "an old-style run"),
    ("VALUE = 1\n", "no judge"),
])
def test_a_canary_module_without_judge_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, found: str
) -> None:
    entry = _register(tmp_path, monkeypatch, f"old{len(found)}", source)
    with pytest.raises(SetupError, match=f"expected old{len(found)}_canary.judge.*found {found}") as info:
        entry.run("cpu", "quick", tmp_path / "out")
    assert "Judged" in info.value.fix and not (tmp_path / "out").exists()


def test_a_judge_that_returns_something_else_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _register(tmp_path, monkeypatch, "loose", "def judge(preset, profile):\n    return {'ok': True}\n")
    with pytest.raises(SetupError, match="expected judge to return a Judged, found dict"):
        entry.run("cpu", "quick", tmp_path / "out")
    assert not (tmp_path / "out").exists()
