"""Fixtures of the distributed tests: one two-process spawn per test run, and one intra-op thread.

The spawn is the expensive part (about a second of start-up, then every
scenario in :mod:`dist_scenarios`), so it runs once per test run: under
pytest-xdist the first worker that needs it runs it and the others read its
pickled results (``tests.once``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dist_scenarios
import pytest
import torch

from tests.once import once_per_run
from validation.spawn import spawn_ranks


def _run_suite() -> dict[str, Any]:
    outcomes = spawn_ranks(dist_scenarios.two_process_suite, 2, timeout_s=240.0, check=False)
    rank0, rank1 = outcomes
    # Rank 1 is killed on purpose by the last scenario; rank 0 must report everything.
    if not rank0.ok or rank1.exitcode != 17:
        return {"failed": f"rank 0: exit {rank0.exitcode}\n{rank0.error}\nrank 1: exit {rank1.exitcode}\n{rank1.error}"}
    return rank0.value


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that reads the two-process suite is ``slow``: the suite's two ranks cost about 12 s of CPU, a fifth
    of ``make test``'s budget. CI runs them (its slow tier), with every other test that spawns ranks.

    The mark must come before the root conftest's hook, which skips the slow tests of a default run, and before
    pytest's ``-m`` selection (the slow tier's ``-m slow``). pluggy calls the plugin registered last first, and pytest
    registers a folder's conftest after its parents' and after its own plugins, so this order holds without
    ``tryfirst`` today; ``tryfirst`` keeps it wherever the hook is registered (a ``-p`` plugin or an entry point comes
    before every conftest). A test left unmarked would fail in the default run: ``conftest.refuse_process_starts``.
    """
    for item in items:
        if "two_process" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def two_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Rank 0's report of the two-process suite: ``{"ranks": [r0, r1], "peers": {...}}``."""
    results = once_per_run(tmp_path_factory, "two-process-suite", lambda folder: _run_suite())
    if "failed" in results:
        pytest.fail(f"the two-process suite did not complete:\n{results['failed']}")
    return results


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Bitwise comparisons with the spawned ranks need their kernel schedule: one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
