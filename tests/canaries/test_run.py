"""``rtv run`` on every preset through the one run function (``canaries.suite.run``).

A GPU preset refuses without CUDA (exit 2, with the reason); with the CUDA
check stood in by its seam (``canaries.suite.cuda_devices``) it runs the same
steps as ``cpu``: smoke, every registered canary, one report, in a
``run-<preset>-...`` folder, every flag honoured. The canaries here are
registered fakes that record what they were given; the mutation left in with
the real derivative canary is in ``test_cli.py`` (on ``cpu`` and ``gpu``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from canaries import presets, registry, smoke, suite
from canaries.cli import main
from canaries.registry import Judged
from canaries.request import CanaryRun
from validation.evidence import Checks, evidence_path, make_record, verify, write_once


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("preset", ["gpu", "gpu-8b"], ids=["preset-gpu", "preset-gpu-8b"])  # "gpu" alone is a marker
def test_a_gpu_preset_without_cuda_exits_2_with_the_reason(preset, tmp_path, capsys):
    assert main(["run", "--preset", preset, "--nproc", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "fix:" in err and "--preset cpu" in err
    assert not any(tmp_path.iterdir()), "nothing may be written when the run is refused"


class FakeCanary:
    """A registered stand-in: records the preset, profile, folder, process count and torch threads it ran with."""

    def __init__(self, name: str, *, passed: bool = True, enforced: bool = True, raises: bool = False) -> None:
        self.name, self.passed, self.enforced, self.raises = name, passed, enforced, raises
        self.calls: list[tuple] = []

    def run(self, run: CanaryRun, out_dir: Path) -> Path:
        processes = run.preset.processes  # how a real canary reads --nproc: the request carries it
        self.calls.append((run.preset.name, run.profile, Path(out_dir), processes, torch.get_num_threads()))
        if self.raises:
            raise RuntimeError("the canary broke")
        record = make_record(f"canary-{self.name}", config={}, checks={"ok": self.passed}, measurements={})
        return write_once(evidence_path(out_dir, f"canary-{self.name}"), record)

    def record_raised(self, run: CanaryRun, error: BaseException, out_dir: Path) -> Path:
        """The registry's own writer of a raised run, as a registered canary of this name has it."""
        return registry.Canary(name=self.name, module="unused", summary="a stand-in").record_raised(run, error, out_dir)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's CUDA check stood in: two GPUs seen (the canaries' shapes still swap for CPU ones without CUDA)."""
    monkeypatch.setattr(suite, "cuda_devices", lambda: 2)


@pytest.fixture
def smokes(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """A smoke stand-in that records its arguments and fails one check under ``inject_failure``, as the real one does."""
    calls: list[dict] = []

    def quick(run: CanaryRun, *, seed: int = 0, inject_failure: bool = False) -> Judged:
        calls.append({"seed": seed, "inject_failure": inject_failure})
        return Judged(
            "smoke", {"seed": seed, "inject_failure": inject_failure}, Checks.of({"smoke ok": not inject_failure}), {}
        )

    monkeypatch.setattr(smoke, "judge", quick)
    return calls


@pytest.mark.parametrize(
    ("canaries", "code"),
    [
        ([FakeCanary("a"), FakeCanary("b")], 0),
        ([FakeCanary("a"), FakeCanary("b", passed=False)], 1),
        ([FakeCanary("a"), FakeCanary("b", passed=False, enforced=False)], 0),
        ([FakeCanary("a", raises=True), FakeCanary("b")], 1),
    ],
)
def test_every_registered_canary_runs_on_the_gpu_preset(two_gpus, smokes, monkeypatch, tmp_path, canaries, code):
    monkeypatch.setattr(registry, "CANARIES", {c.name: c for c in canaries})
    assert main(["run", "--preset", "gpu", "--nproc", "2", "--out", str(tmp_path)]) == code
    (run_dir,) = tmp_path.glob("run-gpu-*")
    for canary in canaries:
        ((preset, profile, out_dir, nproc, _),) = canary.calls
        assert (preset, profile, nproc, out_dir) == ("gpu", "default", 2, run_dir)
    assert smokes and list(run_dir.glob("smoke-*.json")), "the smoke runs on every preset"
    assert (run_dir / "report" / "index.md").exists()


def test_more_processes_than_gpus_exits_2(two_gpus, tmp_path, capsys):
    assert main(["run", "--preset", "gpu", "--nproc", "4", "--out", str(tmp_path)]) == 2
    assert "--nproc 2 or fewer" in capsys.readouterr().err and not any(tmp_path.iterdir())


@pytest.mark.parametrize("preset", ["cpu", "gpu", "gpu-8b"], ids=["preset-cpu", "preset-gpu", "preset-gpu-8b"])
def test_every_flag_is_honoured_on_every_preset(preset, two_gpus, smokes, monkeypatch, tmp_path, capsys):
    """``--nproc``, ``--threads``, ``--seed``, ``--inject-failure`` reach the steps on ``cpu`` and the GPU presets alike."""
    fake = FakeCanary("a")
    monkeypatch.setattr(registry, "CANARIES", {"a": fake})
    monkeypatch.delenv("RTV_NPROC", raising=False)
    environ = dict(os.environ)
    argv = ["run", "--preset", preset, "--nproc", "2", "--threads", "3", "--seed", "7", "--inject-failure"]
    assert main([*argv, "--out", str(tmp_path)]) == 1, "the injected smoke failure fails the run"
    ((_, profile, _, nproc, threads),) = fake.calls
    assert (profile, nproc, threads) == (suite.RUN_PROFILES[preset], 2, 3)
    assert smokes == [{"seed": 7, "inject_failure": True}]
    (smoke_record,) = tmp_path.glob(f"run-{preset}-*/smoke-*.json")
    assert verify(smoke_record)["config"]["seed"] == 7
    assert "rtv run: FAILED: smoke" in capsys.readouterr().out
    # torch sets TORCHINDUCTOR_CACHE_DIR itself the first time a process compiles anything: not ours.
    changed = {k for k in set(os.environ) | set(environ) if os.environ.get(k) != environ.get(k)}
    assert not {k for k in changed if not k.startswith("TORCHINDUCTOR_")}, (
        f"nothing travels through the environment: {changed}"
    )
    assert presets.preset(preset).processes == presets.PRESETS[preset].processes, "the count ends with the run"


def test_a_mutation_that_cannot_show_on_the_preset_is_a_usage_error(two_gpus, tmp_path, capsys):
    """``replay_without_rng`` needs dropout; the GPU presets have none: exit 2, never a run that ignores the flag."""
    assert main(["run", "--preset", "gpu", "--inject-mutation", "replay_without_rng", "--out", str(tmp_path)]) == 2
    assert "cannot show on preset 'gpu'" in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_a_preset_over_the_device_memory_is_refused_before_anything_is_written(two_gpus, monkeypatch, tmp_path, capsys):
    from canaries import preset_budget

    monkeypatch.setattr(preset_budget, "device_bytes", lambda device: 10**6)
    assert main(["run", "--preset", "gpu", "--out", str(tmp_path)]) == 2
    assert "the device has 0.0 GB" in capsys.readouterr().err and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("flag", "fault"),
    [
        (["--inject-mutation", "staleness_off_by_one"], "mutation staleness_off_by_one"),
        (["--inject-failure"], "failure: a smoke check fails on purpose"),
    ],
)
def test_every_record_of_a_negative_control_carries_its_fault_and_the_board_says_what_it_did(
    smokes, monkeypatch, tmp_path, flag, fault
):
    """A mutation made every record (a pass was made by a broken trainer, never green); a forced failure only fails
    the record it forces (the board marks that one, the banner says the trainer was not changed)."""
    monkeypatch.setattr(registry, "CANARIES", {"a": FakeCanary("a"), "b": FakeCanary("b", passed=False)})
    main(["run", "--preset", "cpu", *flag, "--out", str(tmp_path)])
    records = sorted(tmp_path.glob("run-cpu-*/*.json"))
    assert len(records) == 3 and all(verify(p)["config"]["injected"] == [fault] for p in records)
    page = next(tmp_path.glob("run-cpu-*/report/index.md")).read_text()
    board = page[page.index("## Verdict board") : page.index("## Environment")]
    assert f"**Injected on purpose: {fault}.**" in page
    html = next(tmp_path.glob("run-cpu-*/report/index.html")).read_text()
    assert 'id="injected"' in html
    marked = [line for line in board.splitlines() if f"· injected: {fault} |" in line]
    if fault.startswith("mutation"):
        assert len(marked) == 3 and "a pass was made by a deliberately broken trainer" in page
        assert f'<td class="shown">passed · injected: {fault}</td>' in html, "a mutated run's pass is not a clean one"
    else:  # the smoke record it forced to fail; canary b failed by itself, canary a passed
        assert len(marked) == 1 and "| smoke | failed · injected" in marked[0]
        assert "deliberately broken trainer" not in page and "the trainer was not changed" in page
        assert '<td class="passed">passed</td>' in html, "a canary the forced failure did not touch passed"
        assert '<td class="failed">failed</td>' in html, "canary b's own failure is not the control's"
    assert make_record("smoke", config={}, checks={"ok": True}, measurements={})["config"] == {}, "only inside the run"


class WatchedCanary(FakeCanary):
    """A stand-in that reads the hang deadline a multi-process call of it would get, and can hang on purpose."""

    def __init__(self, name: str, *, hangs: bool = False) -> None:
        super().__init__(name)
        self.hangs, self.deadlines, self.summary = hangs, [], "a stand-in that may hang"

    def run(self, run: CanaryRun, out_dir: Path) -> Path:
        from validation.hangs import HangDetected, next_watch

        watch = next_watch()
        self.deadlines.append(watch.deadline_s)
        if self.hangs:
            raise HangDetected([], {"text": "rank 1 never reached it", "folder": watch.folder})
        return super().run(run, out_dir)


@pytest.mark.parametrize(
    ("argv", "deadline"), [([], presets.PRESETS["gpu"].hang_timeout_s), (["--hang-timeout", "4.5"], 4.5)]
)
def test_the_hang_deadline_is_the_flag_or_the_presets(two_gpus, smokes, monkeypatch, tmp_path, argv, deadline):
    fake = WatchedCanary("a")
    monkeypatch.setattr(registry, "CANARIES", {"a": fake})
    assert main(["run", "--preset", "gpu", "--nproc", "2", *argv, "--out", str(tmp_path)]) == 0
    assert fake.deadlines == [deadline]


def test_a_hung_canary_makes_the_run_exit_7_and_the_others_still_run(smokes, monkeypatch, tmp_path, capsys):
    hung, after = WatchedCanary("hung", hangs=True), WatchedCanary("after")
    monkeypatch.setattr(registry, "CANARIES", {"hung": hung, "after": after})
    assert main(["run", "--out", str(tmp_path)]) == 7
    assert after.calls, "the canary after the hung one ran"
    out = capsys.readouterr().out
    assert "a collective hung in canary hung (quick) (exit 7)" in out and "rank 1 never reached it" in out


@pytest.mark.parametrize("value", ["0", "-2", "nan", "soon"])
def test_a_hang_timeout_that_is_not_a_positive_number_is_a_usage_error(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as info:
        main(["run", "--hang-timeout", value, "--out", str(tmp_path)])
    assert info.value.code == 2 and "--hang-timeout" in capsys.readouterr().err


def test_rtv_canary_exits_7_on_a_hang_with_the_diagnosis_and_watches_with_its_flag(monkeypatch, tmp_path, capsys):
    hung = WatchedCanary("hung", hangs=True)
    monkeypatch.setitem(registry.CANARIES, "hung", hung)  # the command line reads the registry's own dict
    assert main(["canary", "hung", "--hang-timeout", "9", "--out", str(tmp_path)]) == 7
    assert hung.deadlines == [9.0]
    err = capsys.readouterr().err
    assert "rank 1 never reached it" in err and "fix: read" in err


@pytest.mark.slow  # the real canary and report: ~5 s; its fast sibling is the record_check test below
def test_a_hang_inside_the_derivative_canarys_own_check_makes_the_run_exit_7(smokes, monkeypatch, tmp_path, capsys):
    """The real derivative canary: its logical-rank check (a watched multi-process call) hangs, so ``rtv run``
    exits 7 rather than recording the hang as an ordinary failed check (exit 1)."""
    from canaries.derivative import canary as derivative
    from validation.hangs import HangDetected

    def hangs(config, processes):
        raise HangDetected([], {"text": "rank 1 never reached it", "folder": str(tmp_path / "hangs")})

    monkeypatch.setattr(derivative, "check_logical_ranks", hangs)
    after = WatchedCanary("after")
    monkeypatch.setattr(registry, "CANARIES", {"derivative": registry.CANARIES["derivative"], "after": after})
    assert main(["run", "--out", str(tmp_path)]) == 7
    assert after.calls, "the canary after the hung one ran"
    assert "a collective hung in canary derivative (quick) (exit 7)" in capsys.readouterr().out


def test_record_check_records_a_hang_as_the_checks_failure_and_raises_it():
    from canaries.derivative.canary import CanaryResult
    from validation.hangs import HangDetected

    result = CanaryResult()
    hang = HangDetected([], {"text": "rank 1 never reached it", "folder": "dumps"})
    with pytest.raises(HangDetected) as raised:
        result.record_check("logical", lambda: (_ for _ in ()).throw(hang))
    assert raised.value is hang
    assert not result.checks["logical"] and "rank 1 never reached it" in result.failures["logical"]
    assert result.record_check("other", lambda: 1 / 0) is None, "an ordinary crash is still a recorded failure"
    assert not result.checks["other"]
