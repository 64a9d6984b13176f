"""Without root or apt-get the local-Slurm stage skips with one line and exit 0; nothing else runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

STAGE = Path(__file__).resolve().parents[2] / ".ci" / "local_slurm_stage"


def run_stage(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=30, check=False)


def test_without_apt_get_the_stage_skips(tmp_path: Path) -> None:
    for tool in ("bash", "id", "dirname"):  # what the stage needs before it decides
        (tmp_path / tool).symlink_to(shutil.which(tool))
    result = run_stage([str(tmp_path / "bash"), str(STAGE)], {"PATH": str(tmp_path)})
    if os.getuid() == 0:
        assert "needs apt-get" in result.stdout
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and result.stdout.startswith("local_slurm stage: SKIPPED: ")
    assert result.stderr == ""


def _stage_nobody_can_run(scratch: Path) -> Path:
    """The stage as ``nobody`` can reach it: in place, or copied (with the script it runs) into a folder
    that others may enter, when the checkout lies under one they may not (a 0700 temporary folder)."""
    if subprocess.run(["runuser", "-u", "nobody", "--", "test", "-x", str(STAGE)], check=False).returncode == 0:
        return STAGE
    scratch.chmod(0o755)
    for relative in (".ci/local_slurm_stage", "ci/local_slurm/stage.sh"):
        copy = scratch / relative
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(STAGE.parents[1] / relative, copy)
        for folder in (copy.parent, *copy.parent.parents):
            if folder == scratch.parent:
                break
            folder.chmod(0o755)
    return scratch / ".ci" / "local_slurm_stage"


def test_without_root_the_stage_skips() -> None:
    if os.getuid() == 0:
        if not shutil.which("runuser"):
            pytest.skip("runuser missing: cannot drop root to test the non-root path")
        scratch = Path(tempfile.mkdtemp(prefix="rtv-stage-", dir="/tmp"))
        try:
            command = ["runuser", "-u", "nobody", "--", str(_stage_nobody_can_run(scratch))]
            result = run_stage(command, {"PATH": os.environ["PATH"]})
        finally:
            shutil.rmtree(scratch)
    else:
        result = run_stage([str(STAGE)], {"PATH": os.environ["PATH"]})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("local_slurm stage: SKIPPED: needs root") and result.stdout.count("\n") == 1
    assert result.stderr == ""
