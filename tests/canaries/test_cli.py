"""The ``rtv`` command line, in process: ``run`` (the main job), ``canary``, ``bench``, ``report``.

Canaries are replaced by registered fakes that write real evidence, so these
tests check the wiring through ``canaries.registry``; each canary has its own tests (the memory canary also runs here,
for real, on a GPU preset). One subprocess check runs the installed script.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from canaries import cli, smoke, suite
from canaries.cli import main
from canaries.registry import CANARIES, PRESET_NAMES, Canary, Judged
from canaries.request import CanaryRun
from validation.errors import CheckFailed
from validation.evidence import Checks, make_record, verify, write_once

SUBCOMMANDS = ("run", "canary", "bench", "report")
REAL = dict(CANARIES)


class FakeCanaries:
    """Registered stand-ins for the canaries: each run writes one record (passing unless told) and is remembered.

    Registered the way a real canary is (a module plus a ``Canary`` line in
    ``canaries.registry.CANARIES``), so the CLI is exercised through the registry.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple] = []
        self.threads: list[int] = []  # torch CPU threads each canary ran with
        self.failing: set[str] = set()
        self.raising: set[str] = set()
        for name in REAL:
            module = ModuleType(f"fake_canary_{name}")
            module.judge = self._judge(name)
            monkeypatch.setitem(sys.modules, module.__name__, module)
            monkeypatch.setitem(CANARIES, name, Canary(name=name, module=module.__name__, summary=f"fake {name}"))

    def _judge(self, name: str):
        def judge(run: CanaryRun) -> Judged:
            self.calls.append((name, run.preset.name, run.profile))
            self.threads.append(torch.get_num_threads())
            if name in self.raising:
                raise RuntimeError(f"{name} blew up")
            return Judged(
                f"{name}-fake", {"preset": run.preset.name}, Checks.of({f"{name} ok": name not in self.failing}), {}
            )

        return judge


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> FakeCanaries:
    return FakeCanaries(monkeypatch)


@pytest.fixture
def quick_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    """A smoke stand-in (the real one runs in test_run_writes_every_record_and_a_report_and_passes)."""

    def quick(run: CanaryRun, *, seed: int = 0, inject_failure: bool = False) -> Judged:
        return Judged("smoke", {"seed": seed}, Checks.of({"smoke ok": True}), {})

    monkeypatch.setattr(smoke, "judge", quick)


def only_run_dir(out: Path) -> Path:
    (run_dir,) = out.glob("run-*")
    return run_dir


def test_run_writes_every_record_and_a_report_and_passes(
    tmp_path: Path, fakes: FakeCanaries, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--out", str(tmp_path)]) == 0

    run_dir = only_run_dir(tmp_path)
    records = {path.name.split("-")[0]: verify(path) for path in run_dir.glob("*.json")}
    assert set(records) == {"smoke", *REAL}
    assert all(record["passed"] for record in records.values())
    assert records["smoke"]["kind"] == "smoke" and records["smoke"]["config"]["model"]["vocab_size"] == 64
    assert fakes.calls == [(name, "cpu", "quick") for name in REAL] and fakes.threads == [1] * len(REAL)
    stdout = capsys.readouterr().out
    for label in ("smoke", *(f"canary {name} (quick)" for name in REAL)):
        assert f"PASS  {label}" in stdout
    for check in records["smoke"]["checks"]:
        assert f"PASS  {check}" in stdout
    report = run_dir / "report" / "index.md"
    assert f"**PASSED**: {1 + len(REAL)} records" in report.read_text() and (run_dir / "report" / "index.html").exists()
    assert (
        f"report: {report.with_suffix('.html')}" in stdout and f"rtv run: PASSED; everything is in {run_dir}" in stdout
    )


@pytest.mark.slow  # the memory canary whole on a second preset (about 1 s)
def test_canary_memory_on_a_gpu_preset_runs_here(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``rtv canary memory --preset gpu``: the real canary, end to end on whatever this machine has (the test
    suite's ``quick`` profile, which leaves the logical-rank scale check to the default one)."""
    assert main(["canary", "memory", "--preset", "gpu", "--profile", "quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("memory-gpu-*.json")
    record = verify(path)
    assert record["passed"] is True and record["config"]["name"] == "gpu"
    assert f"rtv canary memory: PASSED; evidence: {path}" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert record["config"]["swapped_for_cpu"] is True and record["config"]["device"] == "cpu"
        skipped = record["skips"]
        swapped = {name: why for name, why in skipped.items() if "swapped for the CPU" in why}
        assert len(swapped) == 5 and len(skipped) == 8, skipped  # and the quick profile's 3 logical-rank scale checks
        assert not any(name.startswith("cuda") for name in record["checks"])
    else:
        assert any(name.startswith("cuda") for name in record["checks"])


@pytest.mark.parametrize("how", ["failing", "raising"])
def test_run_fails_when_a_canary_fails_or_raises(
    how: str, tmp_path: Path, fakes: FakeCanaries, quick_smoke: None, capsys: pytest.CaptureFixture[str]
) -> None:
    getattr(fakes, how).add("derivative")
    assert main(["run", "--out", str(tmp_path)]) == 1

    stdout = capsys.readouterr().out
    assert "FAIL  canary derivative (quick)" in stdout and "PASS  canary mutations" in stdout, "later steps still run"
    assert "rtv run: FAILED: canary derivative (quick)" in stdout
    if how == "raising":
        assert "raised RuntimeError: derivative blew up" in stdout
    else:
        page = (only_run_dir(tmp_path) / "report" / "index.md").read_text()
        assert re.search(r"^### derivative-\S+: FAILED$", page, re.MULTILINE), page
        assert page.index("**derivative ok**: ") < page.index("## Verdict board"), "the failure comes first"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_injected_failure_fails_the_run(
    how: str, tmp_path: Path, fakes: FakeCanaries, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--out", str(tmp_path)]
    if how == "flag":
        argv.append("--inject-failure")
    else:
        monkeypatch.setenv(cli.INJECT_ENV, "1")

    assert main(argv) == 1

    (smoke,) = only_run_dir(tmp_path).glob("smoke-*.json")
    record = verify(smoke)
    assert record["passed"] is False and [n for n, ok in record["checks"].items() if not ok] == [
        "frozen base gets no gradient"
    ]
    stdout = capsys.readouterr().out
    assert "FAIL  frozen base gets no gradient" in stdout and "FAIL  smoke" in stdout


@pytest.mark.parametrize("failing", [False, True])
def test_canary_command_passes_preset_profile_and_out_through(
    failing: bool, tmp_path: Path, fakes: FakeCanaries, capsys: pytest.CaptureFixture[str]
) -> None:
    if failing:
        fakes.failing.add("derivative")
    threads = torch.get_num_threads()
    argv = ["canary", "derivative", "--preset", "gpu", "--profile", "nightly", "--out", str(tmp_path), "--threads", "3"]
    assert main(argv) == (1 if failing else 0)
    assert fakes.calls == [("derivative", "gpu", "nightly")]
    assert fakes.threads == [3] and torch.get_num_threads() == threads, "threads set for the canary, then restored"
    (path,) = tmp_path.glob("derivative-*.json")
    assert f"evidence: {path}" in capsys.readouterr().out


def test_report_command_renders_a_folder_and_refuses_a_missing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_once(tmp_path / "ev" / "a.json", make_record("k", config={}, checks={"ok": True}, measurements={"x": 1}))
    page = tmp_path / "out" / "index.md"
    assert main(["report", "--in", str(tmp_path / "ev"), "--out", str(page)]) == 0
    assert page.exists() and page.with_suffix(".html").exists()
    assert f"wrote {page}" in capsys.readouterr().out
    assert main(["report", "--in", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"rtv report: {tmp_path / 'nowhere'} is not a folder of evidence",
        "fix: pass --in DIR, a folder of records",
    ]


def test_help_lists_every_subcommand_and_every_registered_canary(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert f"    {name} " in text

    with pytest.raises(SystemExit):
        main(["canary", "--help"])
    text = capsys.readouterr().out
    assert "{cpu,gpu,gpu-8b}" in text and "{quick,default,nightly}" in text
    for entry in REAL.values():
        assert f"  {entry.name:12} {entry.summary}" in text


def test_a_harness_error_becomes_its_reason_its_fix_and_its_exit_code(
    tmp_path: Path, fakes: FakeCanaries, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(run: CanaryRun) -> Judged:
        raise CheckFailed("the evidence did not verify", fix="re-run the canary")

    monkeypatch.setattr(sys.modules[CANARIES["memory"].module], "judge", refuse)
    assert main(["canary", "memory", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.splitlines() == ["rtv canary: the evidence did not verify", "fix: re-run the canary"]


@pytest.mark.slow  # starts the installed console script in a fresh interpreter (about 1 s)
def test_installed_rtv_script_reports_rtv_out_by_default(tmp_path: Path) -> None:
    """The one subprocess check: the console script, with its default folders."""
    script = Path(sys.executable).with_name("rtv")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "canaries.cli"]
    write_once(tmp_path / "rtv-out" / "a.json", make_record("k", config={}, checks={"ok": True}, measurements={}))

    done = subprocess.run([*command, "report"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "wrote rtv-out/report/index.md" in done.stdout
    assert "## a: PASSED" in (tmp_path / "rtv-out" / "report" / "index.md").read_text()


def test_preset_choices_match_the_presets() -> None:
    """``rtv --help`` stays instant by not importing torch; the names it offers must still be the real ones."""
    from canaries.presets import PRESETS

    assert PRESET_NAMES == tuple(PRESETS)


@pytest.mark.parametrize("gate", [False, True])
def test_a_shown_verdict_fails_the_run_only_under_gate(
    gate: bool,
    tmp_path: Path,
    fakes: FakeCanaries,
    quick_smoke: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    shown = CANARIES["benchmark"]
    monkeypatch.setitem(
        CANARIES, "benchmark", Canary(name="benchmark", module=shown.module, summary="", enforced=False)
    )
    fakes.failing.add("benchmark")
    assert main(["run", "--out", str(tmp_path), *(["--gate"] if gate else [])]) == (1 if gate else 0)
    stdout = capsys.readouterr().out
    assert ("FAIL  canary benchmark (quick)" if gate else "SHOWN canary benchmark (quick)") in stdout


# "gpu" alone is a marker; the gpu preset's run is the same path (nightly, to keep make test within its minute)
@pytest.mark.parametrize(
    "preset", ["cpu", pytest.param("gpu", marks=pytest.mark.slow)], ids=["preset-cpu", "preset-gpu"]
)
def test_a_mutation_left_in_fails_the_run_and_tops_the_report_with_its_reason(
    preset: str, tmp_path: Path, quick_smoke: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The negative control of ``rtv run`` itself, with the real derivative canary and a real bug of the mutation suite.

    ``gpu`` goes through the same run function: its CUDA check stood in by the
    seam ``suite.cuda_devices``, the canary's shapes swapped for CPU ones as
    ``rtv canary --preset gpu`` does here, and its profile the quick one (the
    ``default`` the GPU run uses takes 20 s here, for the same verdict).
    """
    monkeypatch.setattr("canaries.registry.CANARIES", {"derivative": REAL["derivative"]})
    if preset == "gpu":
        monkeypatch.setattr(suite, "cuda_devices", lambda: 2)
        monkeypatch.setitem(suite.RUN_PROFILES, "gpu", "quick")
        argv = ["run", "--preset", "gpu", "--inject-mutation", "staleness_off_by_one"]
    else:
        monkeypatch.setenv(cli.MUTATION_ENV, "staleness_off_by_one")
        argv = ["run"]
    assert main([*argv, "--out", str(tmp_path)]) == 1
    stdout = capsys.readouterr().out
    assert "mutation 'staleness_off_by_one' left in on purpose" in stdout
    assert "rtv run: FAILED: canary derivative (quick)" in stdout
    assert only_run_dir(tmp_path).name.startswith(f"run-{preset}-")
    html_path = Path(stdout.rsplit("report: ", 1)[1].split()[0])
    page = html_path.with_suffix(".md").read_text()
    (derivative,) = only_run_dir(tmp_path).glob("derivative-*.json")
    failed = [name for name, ok in verify(derivative)["checks"].items() if not ok]
    assert failed, "the bug must be caught"
    top = page[: page.index("## Verdict board")]
    assert "## What failed, and why" in top and all(f"**{name}**: " in top for name in failed)
    html = html_path.read_text()
    assert html.index('id="failures"') < html.index('id="verdict-board"')


def test_an_unknown_mutation_is_a_setup_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--out", str(tmp_path), "--inject-mutation", "no_such_bug"]) == 2
    assert "unknown mutation 'no_such_bug'" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_a_full_disk_while_writing_evidence_exits_2_with_the_fix(
    tmp_path: Path,
    fakes: FakeCanaries,
    quick_smoke: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import errno
    import io

    import validation.evidence

    class FullDisk(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(validation.evidence.os, "fdopen", lambda fd, mode: (os.close(fd), FullDisk())[1])
    assert main(["run", "--out", str(tmp_path)]) == 2
    reason, fix = capsys.readouterr().err.splitlines()[-2:]
    assert reason.startswith("rtv run: no space left on the device while writing evidence") and "rtv-out/" in fix
    assert fakes.calls == [], "the run stops: nothing later could be written"
    assert not list(tmp_path.rglob("*.json")) and not list(tmp_path.rglob(".*.tmp")), "nothing half-written is left"


@pytest.mark.parametrize(
    "command", [["canary", "memory", "--profile", "quick"], pytest.param(["run"], marks=pytest.mark.slow)]
)  # the run: ~15 s (a report)
def test_under_torchrun_the_request_carries_the_worlds_process_count(
    command: list[str], tmp_path: Path, fakes: FakeCanaries, quick_smoke: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [Joined worlds]: the world's size reaches every canary in the one request, not in ambient state."""
    seen: list[CanaryRun] = []

    def judge(run: CanaryRun) -> Judged:
        seen.append(run)
        return Judged("memory-fake", {}, Checks.of({"ok": True}), {})

    monkeypatch.setattr(sys.modules[CANARIES["memory"].module], "judge", judge)
    monkeypatch.setattr(cli, "given_world", lambda: SimpleNamespace(world_size=3))
    monkeypatch.setattr(cli, "joined", lambda world, command: command())
    assert main([*command, "--out", str(tmp_path)]) == 0
    (run,) = seen
    assert (run.preset.processes, run.preset.logical_dp) == (3, 3)
