"""``rtv run --preset gpu``: refuses without CUDA (exit 2, with the reason), else runs every registered canary."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from canaries import registry
from canaries.cli import main
from validation.evidence import evidence_path, make_record, write_once


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("preset", ["gpu", "gpu-8b"], ids=["preset-gpu", "preset-gpu-8b"])  # "gpu" alone is a marker
def test_a_gpu_preset_without_cuda_exits_2_with_the_reason(preset, tmp_path, capsys):
    assert main(["run", "--preset", preset, "--nproc", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "fix:" in err and "--preset cpu" in err
    assert not any(tmp_path.iterdir()), "nothing may be written when the run is refused"


class FakeCanary:
    def __init__(self, name: str, *, passed: bool = True, enforced: bool = True, raises: bool = False) -> None:
        self.name, self.passed, self.enforced, self.raises = name, passed, enforced, raises
        self.calls: list[tuple] = []

    def run(self, preset: str, profile: str, out_dir: Path) -> Path:
        self.calls.append((preset, profile, Path(out_dir), os.environ.get("RTV_NPROC")))
        if self.raises:
            raise RuntimeError("the canary broke")
        record = make_record(f"canary-{self.name}", config={}, checks={"ok": self.passed}, measurements={})
        return write_once(evidence_path(out_dir, f"canary-{self.name}"), record)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake H200")  # evidence's fingerprint
    monkeypatch.delenv("RTV_NPROC", raising=False)


@pytest.mark.parametrize(
    ("canaries", "code"),
    [
        ([FakeCanary("a"), FakeCanary("b")], 0),
        ([FakeCanary("a"), FakeCanary("b", passed=False)], 1),
        ([FakeCanary("a"), FakeCanary("b", passed=False, enforced=False)], 0),
        ([FakeCanary("a", raises=True), FakeCanary("b")], 1),
    ],
)
def test_every_registered_canary_runs_on_the_gpu_preset(two_gpus, monkeypatch, tmp_path, canaries, code):
    monkeypatch.setattr(registry, "CANARIES", {c.name: c for c in canaries})
    assert main(["run", "--preset", "gpu", "--nproc", "2", "--out", str(tmp_path)]) == code
    for canary in canaries:
        ((preset, profile, out_dir, nproc),) = canary.calls
        assert (preset, profile, nproc) == ("gpu", "default", "2") and out_dir.parent == tmp_path
    assert list(tmp_path.rglob("report/index.md"))


def test_more_processes_than_gpus_exits_2(two_gpus, tmp_path, capsys):
    assert main(["run", "--preset", "gpu", "--nproc", "4", "--out", str(tmp_path)]) == 2
    assert "--nproc 2 or fewer" in capsys.readouterr().err


def test_the_cpu_preset_goes_on_to_the_cpu_run_with_its_process_count(monkeypatch):
    from ci.cli import run_with_preset

    monkeypatch.delenv("RTV_NPROC", raising=False)
    assert run_with_preset(argparse.Namespace(preset="cpu", nproc=3, out=Path("unused"))) is None
    assert os.environ["RTV_NPROC"] == "3"
