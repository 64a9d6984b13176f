"""The canary spine: every registered canary is one module with ``judge(run)``; the registry writes its one record."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from canaries import suite
from canaries.presets import preset
from canaries.registry import CANARIES, Canary, Judged, canary
from canaries.request import CanaryRun, CannotFocus, canary_run, silent
from validation.errors import SetupError
from validation.evidence import SCHEMA_VERSION, verify

CPU = preset("cpu").on_this_machine()


def _asked(**changes: object) -> CanaryRun:
    return CanaryRun(**{"preset": CPU, "profile": "quick", **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(CANARIES))
def test_each_registered_canary_has_the_registry_entry_point(name: str) -> None:
    entry = CANARIES[name]
    module = importlib.import_module(entry.module)
    parameters = list(inspect.signature(module.judge).parameters.values())
    assert [p.name for p in parameters[:1]] == ["run"] and parameters[0].annotation in (CanaryRun, "CanaryRun")
    assert all(p.default is not inspect.Parameter.empty for p in parameters[1:]), "extras must be optional"
    assert inspect.signature(module.judge).return_annotation in (Judged, "Judged")
    assert not hasattr(module, "run"), "the registry writes the record: a canary has no run of its own"
    assert entry.summary and canary(name) is entry


def test_an_unknown_canary_is_refused_with_the_registered_names() -> None:
    with pytest.raises(SetupError, match="unknown canary 'learnin'") as info:
        canary("learnin")
    assert all(name in info.value.fix for name in CANARIES)


def test_a_new_canary_is_one_module_plus_one_registration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The spine's promise, exercised: ``rtv canary --help`` lists it, ``rtv canary NAME`` runs it."""
    from canaries.cli import main

    (tmp_path / "toy_canary.py").write_text(
        "from canaries.registry import Judged\n"
        "from validation.evidence import Checks\n\n"
        "def judge(run) -> Judged:\n"
        "    checks = Checks(echo=run.echo)\n"
        "    checks.check('toy holds', True, 'as it should')\n"
        "    return Judged('toy', {'preset': run.preset.name, 'profile': run.profile}, checks, {'answer': 42})\n"
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
    entry = _register(
        tmp_path,
        monkeypatch,
        "judged",
        (
            "from canaries.registry import Judged\n"
            "from validation.evidence import Checks\n\n"
            "def judge(run) -> Judged:\n"
            "    checks = Checks()\n"
            "    checks.check('holds', True, 'it held')\n"
            "    checks.check('breaks', False, 'expected 1, found 2')\n"
            "    checks.skip('cuda only', 'no CUDA device')\n"
            "    return Judged('judged-kind', {'preset': run.preset.name, 'profile': run.profile}, checks, {'n': 3})\n"
        ),
    )
    out = tmp_path / "out"
    path = entry.run(_asked(), out)
    assert list(out.glob("*.json")) == [path] and path.name.startswith("judged-cpu-")
    record = verify(path)
    assert record["schema_version"] == SCHEMA_VERSION == 2 and record["kind"] == "judged-kind"
    assert record["config"] == {"preset": "cpu", "profile": "quick"} and record["measurements"] == {"n": 3}
    assert record["checks"] == {"holds": True, "breaks": False} and not record["passed"]
    assert record["details"]["breaks"] == "expected 1, found 2" and record["skips"] == {"cuda only": "no CUDA device"}
    assert capsys.readouterr().out.splitlines() == ["judged canary: FAILED (1 of 2 checks); 1 skipped", f"wrote {path}"]


@pytest.mark.parametrize(
    ("source", "found"),
    [
        (
            "from pathlib import Path\n\ndef run(preset: str, profile: str, out_dir: Path) -> Path:\n    raise AssertionError\n",
            "an old-style run",
        ),
        ("VALUE = 1\n", "no judge"),
    ],
)
def test_a_canary_module_without_judge_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, found: str
) -> None:
    entry = _register(tmp_path, monkeypatch, f"old{len(found)}", source)
    with pytest.raises(SetupError, match=f"expected old{len(found)}_canary.judge.*found {found}") as info:
        entry.run(_asked(), tmp_path / "out")
    assert "Judged" in info.value.fix and not (tmp_path / "out").exists()


def test_a_judge_that_returns_something_else_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _register(tmp_path, monkeypatch, "loose", "def judge(run):\n    return {'ok': True}\n")
    with pytest.raises(SetupError, match="expected judge to return a Judged, found dict"):
        entry.run(_asked(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_canary_added_as_its_folder_and_one_registry_line_runs_in_rtv_run_and_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/harness.md "Adding a canary", done: a package with ``judge(run)`` and one registration; the run's one
    request reaches it whole (preset, process count, profile, gate), and its record says what it read."""
    package = tmp_path / "toyfolder"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "canary.py").write_text(
        "from canaries.registry import Judged\n"
        "from canaries.request import CanaryRun\n"
        "from validation.evidence import Checks\n\n"
        "def judge(run: CanaryRun) -> Judged:\n"
        "    run.runs_every_check('toy')\n"
        "    checks = Checks(echo=run.echo)\n"
        "    checks.check('toy holds', run.preset.processes == 3, f'{run.preset.processes} processes')\n"
        "    config = {'preset': run.preset.describe(), 'profile': run.profile, 'gate': run.gate}\n"
        "    return Judged('toy', config, checks, {'answer': 42})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    toy = Canary(name="toy", module="toyfolder.canary", summary="a canary this test adds")  # the one registry line
    monkeypatch.setattr(suite.registry, "CANARIES", {"toy": toy})  # the run's canaries: this one alone
    asked = canary_run("cpu", "quick", processes=3, gate=True)
    (outcome,) = suite.run_canaries(asked, tmp_path / "run")
    assert outcome.passed and outcome.enforced, outcome
    record = verify(Path(outcome.where))
    assert Path(outcome.where).name.startswith("toy-cpu-") and record["passed"]
    assert record["config"]["preset"]["processes"] == 3 and record["config"]["preset"]["logical_dp"] == 3
    assert record["config"]["profile"] == "quick" and record["config"]["gate"] is True
    assert record["measurements"] == {"answer": 42} and record["details"] == {"toy holds": "3 processes"}
    shown = capsys.readouterr().out
    assert "PASS  toy holds: 3 processes" in shown and "toy canary: PASSED; 0 skipped" in shown
    alone = toy.run(canary_run("cpu", "default", processes=3, echo=silent), tmp_path)
    assert verify(alone)["config"]["profile"] == "default" and capsys.readouterr().out == ""
    with pytest.raises(CannotFocus, match="canary 'toy' runs all its checks"):
        toy.run(canary_run("cpu", "quick", checks=["toy holds"]), tmp_path / "never")
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"preset": "cpu"}, "expected a resolved canaries.presets.Preset, found the name 'cpu'"),
        ({"profile": "deep"}, "unknown profile 'deep'"),
        ({"checks": "state_machine"}, "expected a tuple of check names or None"),
        ({"checks": ["state_machine"]}, "expected a tuple of check names or None"),
    ],
)
def test_a_request_that_is_not_resolved_or_not_well_formed_is_refused(changes: dict, match: str) -> None:
    with pytest.raises(SetupError, match=match):
        _asked(**changes)


def test_the_request_resolves_the_preset_once_on_its_process_count() -> None:
    asked = canary_run("gpu", "quick", processes=3, checks=["a", "b"])
    assert asked.preset == preset("gpu", 3).on_this_machine() and asked.checks == ("a", "b")
    assert canary_run("gpu", "quick").preset == preset("gpu").on_this_machine()
    with pytest.raises(SetupError, match="on 0 processes"):
        canary_run("cpu", "quick", processes=0)
