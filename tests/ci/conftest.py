"""The ``slurm`` marker: tests that need the local one-node Slurm cluster.

They run only inside ``.ci/local_slurm_stage`` (which sets ``RTV_LOCAL_SLURM=1``
after ``ci/local_slurm/setup.sh``); everywhere else, ``pytest -n auto``
included, they are skipped with that reason.
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: needs the local Slurm cluster; runs only in .ci/local_slurm_stage")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("RTV_LOCAL_SLURM") == "1":
        return
    skip = pytest.mark.skip(reason="slurm: runs only in .ci/local_slurm_stage (root, apt, RTV_LOCAL_SLURM=1)")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)
