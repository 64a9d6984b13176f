"""Every GPU test runs with deterministic kernels, where the docs promise bitwise results.

``CUBLAS_WORKSPACE_CONFIG`` must be set before cuBLAS starts, so it is set
when this file is imported (before any test touches CUDA);
``torch.use_deterministic_algorithms(True)`` is on for each test and restored
after it. ``warn_only``: an op without a deterministic kernel warns instead of
raising, so a test that needs bitwise gradients through such an op must pin a
deterministic backend itself (as ``test_cuda_placements`` pins SDPA's math
backend for its gradient comparison).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def deterministic_kernels() -> Iterator[None]:
    before, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
