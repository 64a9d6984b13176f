"""Suite-wide settings: thread caps per xdist worker, markers, hypothesis profiles.

Markers: ``gpu`` (needs CUDA; skipped without it), ``dist`` (spawns
torch.distributed processes), ``slow`` (deep variants; run with ``--runslow`` or
``RTV_SLOW=1``, as the nightly job does), ``bench`` (times real work; deselected by
pyproject's ``-m 'not bench'``, run alone with ``pytest -m bench -p no:xdist``). Hypothesis profile: ``ci``
(default, seconds) or ``nightly`` (minutes), chosen by ``RTV_HYPOTHESIS_PROFILE``
(``validation.profiles``, the one home of hypothesis settings).
"""

from __future__ import annotations

import gc
import os

import pytest


def _runs_tests(config: pytest.Config) -> bool:
    """False only in pytest-xdist's controller, which hands tests to its workers and runs none.

    The controller starts the workers only after its own start-up, so it
    imports neither torch nor hypothesis (about 2.5 s here before any worker
    existed); each process that runs tests does, in :func:`pytest_configure`.
    """
    return hasattr(config, "workerinput") or not config.getoption("numprocesses", default=None)


def _cap_threads() -> None:
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    # RTV_TORCH_THREADS: an exact count; mutmut forks its test process, and a child forked after torch's
    # thread pool ran hangs in its first parallel op (validation.mutation_score sets 1).
    torch.set_num_threads(int(os.environ.get("RTV_TORCH_THREADS", "0")) or max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(autouse=True)
def _older_objects_frozen() -> None:
    """Each test's garbage collections and censuses walk only what it made.

    A worker's heap grows with every library its earlier tests imported
    (SkyPilot, pandas, matplotlib); ``gc.collect`` and the tensor censuses
    (``validation.lifetime``) walk all of it, which doubled the cost of the
    lifetime tests. Collecting once, then moving every surviving object to
    the permanent generation (``gc.freeze``, constant time) keeps them out of
    later walks. Objects a test creates are still seen, so its census and
    its negative controls are unchanged.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_learning_record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The learning canary's verified record of its tiny configuration (every arm kind, every panel group), made
    once per test run: the canary's tests judge it, the report's tests draw it."""
    from canaries.learning.canary import judge_plan, tiny_plan
    from canaries.registry import canary
    from tests.once import once_per_run
    from validation.evidence import verify

    return once_per_run(
        tmp_path_factory,
        "tiny-learning-record",
        lambda folder: verify(canary("learning").record("cpu", judge_plan(tiny_plan()), folder)),
    )


# Tests that share a costly import, a run-wide fixture or a forkserver (``validation.spawn``: torch imported afresh,
# about 4 s of CPU) go to one worker whole: path prefix -> the unit of work it belongs to.
GROUPED_SCOPES = {
    "tests/ci/": "tests/ci/",
    "tests/reports/": "tests/reports/",
    "tests/dist/": "spawned ranks",
    "tests/validation/test_world.py": "spawned ranks",
}


def xdist_scope(nodeid: str) -> str:
    """The unit of work ``-n auto`` hands one worker: a group of :data:`GROUPED_SCOPES`, else the test's module."""
    return next((g for prefix, g in GROUPED_SCOPES.items() if nodeid.startswith(prefix)), nodeid.split("::", 1)[0])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``-n auto`` hands each test module to one worker (xdist's ``loadscope``), not its tests one by one (``load``).

    Module fixtures and caches (a rendered report, a browser, a W=1 run to compare with, the import graph) are
    then made once, not once per worker: about a seventh of the CPU of the tests that have them. The groups of
    :data:`GROUPED_SCOPES` go to one worker whole: ``tests/ci`` imports SkyPilot (about 2.5 s of CPU a worker),
    ``tests/reports`` shares run-wide fixtures (``tests.once``) a second worker would otherwise wait for, and the
    tests that spawn ranks share one forkserver. An explicit ``--dist`` other than ``load`` is kept.
    """
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FolderOrModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return FolderOrModuleScheduling(config, log)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


def runs_slow(config: pytest.Config) -> bool:
    """Whether this run runs the ``slow`` tests (``--runslow`` or ``RTV_SLOW=1``)."""
    return bool(config.getoption("--runslow")) or os.environ.get("RTV_SLOW") == "1"


# What ``make test`` selects: pyproject.toml's ``addopts`` (tests/test_budget.py keeps the two equal).
DEFAULT_MARKEXPR = "not bench and not slurm"


def is_default_run(config: pytest.Config) -> bool:
    """Whether this is ``make test``'s run: no slow tests and the default ``-m`` selection (not ``-m bench``, not the
    local Slurm stage, which clears ``addopts``)."""
    return not runs_slow(config) and config.getoption("markexpr", default="") == DEFAULT_MARKEXPR


class DefaultRunStartedAProcess(RuntimeError):
    """A test of the default run (``make test``) started a ``multiprocessing`` process."""


def refuse_process_starts() -> None:
    """``make test`` starts no process of its own (tests/README.md#the-time-budget): a forkserver or a fresh
    interpreter imports torch anew, about 4 s of CPU of the suite's 60 s. Every ``multiprocessing`` start in a
    default run raises :class:`DefaultRunStartedAProcess`, whatever path reached it (a fixture, a canary's ranks).
    Subprocesses that import nothing (``subprocess``: a shell, a hog) are not refused."""
    from multiprocessing.process import BaseProcess

    def refuse(process: BaseProcess) -> None:
        raise DefaultRunStartedAProcess(
            f"expected no process started in the default run (make test), found multiprocessing starting "
            f"{process.name} ({getattr(process, '_target', None)!r}): a rank or a fresh interpreter imports torch "
            "anew, about 4 s of CPU; mark the test slow, with a fast sibling in the default run"
        )

    BaseProcess.start = refuse  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    if _runs_tests(config):
        from validation.profiles import load_test_profile

        load_test_profile()
        _cap_threads()
        if is_default_run(config):
            refuse_process_starts()
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "dist: spawns torch.distributed processes")
    config.addinivalue_line("markers", "slow: deep variant, run nightly (--runslow)")
    config.addinivalue_line(
        "markers", "bench: times real work; deselected by default, run alone: pytest -m bench -p no:xdist"
    )
    config.addinivalue_line("markers", "slurm: needs the local Slurm cluster; runs only in .ci/local_slurm_stage")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = runs_slow(config)
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow or RTV_SLOW=1 (nightly)")
    skip_gpu = pytest.mark.skip(reason="gpu: no CUDA device on this machine")
    import torch

    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
