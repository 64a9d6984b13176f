"""The trainer's runtime needs only torch and the standard library (docs/semantics.md#runtime-dependencies).

``slow`` (two fresh interpreters, about 7 s of CPU): a stub ``numpy`` that raises ``ModuleNotFoundError``
(an ``ImportError``) goes first on ``PYTHONPATH`` of a job (``torch_only_job.py``) that starts its second
rank with a plain ``subprocess``; the stub never reaches this test process. The fast siblings run the
job's own single-process steps in this process with numpy hidden for the test (``numpy_hidden``): a
trainer path that imports numpy or calls ``Tensor.numpy`` fails them too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch_only_job

pytestmark = pytest.mark.dist

JOB = Path(__file__).with_name("torch_only_job.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    stub = tmp_path_factory.mktemp("no_numpy") / "numpy"
    stub.mkdir()
    # What a missing package raises (an ImportError); torch itself tolerates exactly this.
    (stub / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'numpy\' (test stub)", name="numpy")\n')
    path = os.pathsep.join([str(stub.parent), str(ROOT)])
    env = dict(os.environ, PYTHONPATH=path)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(JOB)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    ranks = json.loads(done.stdout.strip().splitlines()[-1])["ranks"]
    for rank in ranks:
        assert "crash" not in rank, rank["crash"]
    return {"ranks": ranks}


@pytest.fixture
def numpy_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the test, ``import numpy`` raises ``ImportError`` and ``Tensor.numpy`` raises, as without numpy."""

    def no_numpy(self: torch.Tensor, *args: object, **kwargs: object) -> None:
        raise RuntimeError("Numpy is not available (hidden by the test)")

    monkeypatch.setitem(sys.modules, "numpy", None)
    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)


@pytest.mark.parametrize("policy", ["always", "when_available"])
def test_with_numpy_hidden_a_stale_backward_is_corrected_in_process(numpy_hidden: None, policy: str) -> None:
    assert not torch_only_job.numpy_is_importable()
    result = torch_only_job.stale_backward(policy)
    assert result["staleness"] == [1]
    assert result["corrected"] == result["records"], f"{policy}: the stale record was not corrected"


def test_with_numpy_hidden_a_logical_rank_failure_commits_nothing_in_process(numpy_hidden: None) -> None:
    failure = torch_only_job.failing_logical_job()
    assert failure["error"] == "GradientCommitError" and "injected fault" in failure["message"], failure
    assert failure["all_grads_none"] and failure["pending"] == 0


@pytest.mark.slow
def test_the_stub_hides_numpy_from_every_rank(job: dict) -> None:
    assert [r["numpy_importable"] for r in job["ranks"]] == [False, False]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["always", "when_available"])
def test_a_stale_backward_is_corrected_without_numpy(job: dict, policy: str) -> None:
    result = job["ranks"][0][policy]
    assert result["staleness"] == [1]
    assert result["corrected"] == result["records"], f"{policy}: the stale record was not corrected"


@pytest.mark.slow
def test_a_logical_rank_failure_crosses_processes_without_numpy(job: dict) -> None:
    failures = [r["logical_failure"] for r in job["ranks"]]
    assert failures[0]["error"] == failures[1]["error"] == "GradientCommitError", failures
    assert failures[0]["message"] == failures[1]["message"]
    assert "injected fault" in failures[0]["message"]
    for failure in failures:
        assert failure["all_grads_none"] and failure["pending"] == 0


def test_with_numpy_hidden_a_save_with_a_stale_forward_pending_loads_and_continues_in_process(numpy_hidden: None) -> None:
    assert torch_only_job.save_and_load() == {"equal": True, "revision": 2}


@pytest.mark.slow
def test_a_save_made_with_a_stale_forward_pending_loads_and_continues_without_numpy(job: dict) -> None:
    assert job["ranks"][0]["resume"] == {"equal": True, "revision": 2}
