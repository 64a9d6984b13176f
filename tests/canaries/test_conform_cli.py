"""``rtv conform``, in process: an adapter written outside the project (``examples/``) run by
``--adapter module:factory``, exit 0 / 1 / 2, the record and the report's adapters x checks table."""

from __future__ import annotations

from pathlib import Path

import pytest

from canaries.cli import main
from validation.evidence import verify

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worked example and the wrong adapters importable by module name, as a user's PYTHONPATH makes them."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "validation"))


def _run_folder(out: Path) -> Path:
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    return folder


def test_list_names_every_shipped_adapter_with_its_factory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conform", "--list"]) == 0
    shown = capsys.readouterr().out
    for name in ("reference", "sync", "naive-async", "snapshot-async", "hf-lora"):
        assert f"\n{name} " in f"\n{shown}"
    assert "--adapter validation.conform.adapters.plain:NaiveAsyncAdapter" in shown


def test_an_adapter_written_outside_the_project_passes_with_exit_0(
    importable: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["conform", "--adapter", "conform_adapter:make_adapter", "--out", str(tmp_path)]) == 0
    record = verify(_run_folder(tmp_path) / "conform.json")
    assert record["kind"] == "conform" and record["passed"]
    assert set(record["checks"]) == {"tiny-token-model sync", "tiny-token-model splits", "tiny-token-model resume"}
    assert set(record["skips"]) == {"tiny-token-model stale", "tiny-token-model processes"}
    page = (_run_folder(tmp_path) / "report" / "index.md").read_text()
    assert "| tiny-token-model | save | passed | not applicable | passed | passed | not applicable |" in page
    resumed = [line for line in capsys.readouterr().out.splitlines() if "tiny-token-model resume" in line]
    assert (
        resumed[0].startswith("PASS  tiny-token-model resume: saved after each of calls")
        and "bitwise equal" in resumed[0]
    )


def test_the_worked_example_keeps_float64_log_probs_at_a_float64_spec(importable: None) -> None:
    """Log-probs cast down to float32 miss float64's tolerance by orders of magnitude."""
    from validation.conform import PASSED, ConformSpec, conform

    report = conform("conform_adapter:make_adapter", ConformSpec(dtype="float64"), checks=("sync",))
    assert report.verdict("sync").status == PASSED, report.verdict("sync").reason


def test_a_failed_check_exits_1_and_the_report_names_its_worst_element(tmp_path: Path) -> None:
    assert main(["conform", "naive-async", "--out", str(tmp_path)]) == 1
    record = verify(_run_folder(tmp_path) / "conform.json")
    worst = record["measurements"]["adapters"]["naive-async"]["verdicts"]["stale"]["evidence"]["worst"]
    page = (_run_folder(tmp_path) / "report" / "index.md").read_text()
    assert "| naive-async | stale | passed | FAILED: staleness 1: the gradient is not the oracle's" in page
    row = f"| naive-async | stale | {worst['parameter']} | {worst['index']} |"
    assert row in page and f"{worst['oracle']:.6g}"[:6] in page.split(row)[1].splitlines()[0]


@pytest.mark.parametrize(
    ("adapter", "said"),
    [
        (
            "conform_wrong:MissingBackward",
            (
                "rtv conform: adapter 'missing-backward' is broken: missing method backward "
                "(needed: start, module, forward, backward, optim_step, zero_grad); fix: "
                "define backward() as in docs/conform.md#the-adapter-protocol"
            ),
        ),
        (
            "conform_wrong:SummedLogprobs",
            (
                "rtv conform: adapter 'summed-logprobs' is broken: forward(input_tokens "
                "(4, 8), target_tokens (4, 8)) returned a tensor of shape (4,), "
                "requires_grad=True; expected differentiable target log-probs of shape (4, 8); "
                "fix: return "
            ),
        ),
        (
            "no_such_module:factory",
            "rtv conform: adapter 'no_such_module:factory' is broken: cannot import no_such_module",
        ),
        (
            "conform_wrong:StartWithoutSpec",
            (
                "rtv conform: adapter 'start-without-spec' is broken: start() cannot be "
                "called as start(spec); fix: define start(spec) as in docs/conform.md"
            ),
        ),
        (
            "conform_wrong:BackwardWithoutLoss",
            (
                "rtv conform: adapter 'backward-without-loss' is broken: backward() cannot "
                "be called as backward(loss); fix: define backward(loss)"
            ),
        ),
        (
            "conform_wrong:ModuleNotTheModel",
            ("rtv conform: adapter 'module-not-the-model' is broken: module()(input_ids (4, 8)) raised RuntimeError: "),
        ),
        (
            "conform_wrong:raising_factory",
            (
                "rtv conform: adapter 'conform_wrong:raising_factory' is broken: the "
                "factory raised RuntimeError: no GPU second line; fix: make the factory "
                "return"
            ),
        ),
    ],
)
def test_a_broken_adapter_exits_2_named_in_one_line_with_the_fix(
    importable: None, tmp_path: Path, adapter: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["conform", "--adapter", adapter, "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(said) and "; fix: " in lines[0]
    assert not list(tmp_path.iterdir())  # no record of a suite that could not run


@pytest.mark.parametrize(
    ("source", "raised"),
    [("x = (\n", "SyntaxError"), ("raise RuntimeError('no GPU at import')\n", "RuntimeError: no GPU")],
)
def test_a_factory_module_that_fails_at_import_exits_2(
    source: str, raised: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "fails_at_import.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "fails_at_import", raising=False)
    assert main(["conform", "--adapter", "fails_at_import:factory", "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"rtv conform: adapter 'fails_at_import:factory' is broken: importing fails_at_import raised {raised}"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "named", [["sync", "sync"], ["sync", "--adapter", "validation.conform.adapters.plain:SyncAdapter"]]
)
def test_two_adapters_of_one_name_exit_2_before_any_check_runs(
    named: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["conform", *named, "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "its name 'sync' is also 'sync''s" in lines[0] and "; fix: " in lines[0]
    assert not list(tmp_path.iterdir())


def _key_figure(control_verdict, tmp_path: Path) -> str:
    from reports.conform import section
    from validation.conform import AdapterReport, ConformSpec, conform_record

    report = AdapterReport("naive-async", "x:y", ("stale",), "", (control_verdict,))
    record = conform_record([report], ConformSpec(), negative_controls={"naive-async": "stale"})
    return section(record, tmp_path).key_figure


def test_the_key_figure_counts_a_control_only_when_it_fired(tmp_path: Path) -> None:
    from validation.conform import FAILED, NOT_APPLICABLE, PASSED, Verdict

    fired = Verdict("stale", FAILED, "in place", {"diagnosis": "updated_weights"})
    assert _key_figure(fired, tmp_path) == "1 of 1 adapters as required"
    for not_fired in (
        Verdict("stale", PASSED, "ok"),
        Verdict("stale", NOT_APPLICABLE, "unclaimed"),
        Verdict("stale", FAILED, "the adapter raised RuntimeError: x", {"raised": "RuntimeError"}),
    ):
        assert _key_figure(not_fired, tmp_path) == "0 of 1 adapters as required", not_fired


def test_no_adapter_named_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conform"]) == 2
    assert "fix: name one (rtv conform --list)" in capsys.readouterr().err
