"""Logical ranks on CUDA, checked on the CPU: what a fiber thread inherits and how the transport picks its device.

A new thread starts with torch's defaults (no autocast, CUDA device 0); a
fiber must run inside the caller's autocast state and the trainer's device.
CPU autocast is real on the CPU, so its inheritance is observed directly; the
device is observed through ``testing.substitute_device_context``. Backend and
device selection take the device queries as arguments.
"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager

import dist_scenarios as ds
import pytest
import torch

import reference_trainer as rt
from reference_trainer.ranks import run_logical
from reference_trainer.peers import select_backend, transport_device, watchdog_timeout_s
from reference_trainer.ranks.zero import Backward, payload_buffer
from reference_trainer.testing import substitute_device_context


def _autocast_seen(view: object) -> tuple[bool, torch.dtype, torch.dtype]:
    product = torch.ones(2, 2) @ torch.ones(2, 2)  # float32 inputs: autocast decides the result's dtype
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), product.dtype


def test_a_plain_thread_drops_autocast_so_fibers_must_carry_it() -> None:
    seen = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        thread = threading.Thread(target=lambda: seen.append(torch.is_autocast_enabled("cpu")))
        thread.start()
        thread.join()
    assert seen == [False], "threads inherit autocast now: the fiber context may be redundant"


def test_fibers_run_in_the_callers_autocast_state() -> None:
    trainer = ds.make_trainer()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = run_logical(_autocast_seen, trainer, logical_dp=2)
    assert inside == [(True, torch.bfloat16, torch.bfloat16)] * 2
    outside = run_logical(_autocast_seen, trainer, logical_dp=2)
    assert [enabled for enabled, _, _ in outside] == [False, False]
    assert [dtype for _, _, dtype in outside] == [torch.float32] * 2


def test_fibers_enter_the_trainers_device_on_their_own_thread() -> None:
    entered: list[tuple[str, str]] = []

    @contextmanager
    def record(device: torch.device):
        entered.append((str(device), threading.current_thread().name))
        yield

    trainer = ds.make_trainer()
    with substitute_device_context(record):
        run_logical(lambda view: None, trainer, logical_dp=2)
    assert entered == [(str(trainer.device), "logical-rank-0"), (str(trainer.device), "logical-rank-1")]


@pytest.mark.parametrize(
    ("device", "cuda_available", "backend"),
    [("cpu", True, "gloo"), ("cpu", False, "gloo"), ("cuda:1", True, "nccl"), (None, True, "nccl"), (None, False, "gloo")],
)
def test_backend_follows_the_models_device(device: str | None, cuda_available: bool, backend: str) -> None:
    assert select_backend(device, cuda_available) == backend


def test_a_cuda_model_without_cuda_is_refused() -> None:
    with pytest.raises(rt.ConfigError, match="CUDA is not available"):
        select_backend("cuda:0", cuda_available=False)


def test_transport_uses_the_trainers_device_not_the_current_one() -> None:
    assert transport_device("nccl", torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert transport_device("gloo", torch.device("cuda", 3)) == torch.device("cpu")
    with pytest.raises(rt.ConfigError, match="NCCL job"):
        transport_device("nccl", torch.device("cpu"))


def test_the_group_outlives_every_transport_wait() -> None:
    assert watchdog_timeout_s(300.0, 3600.0) > 3600.0
    assert watchdog_timeout_s(5000.0, 10.0) > 5000.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_zero_mode_receivers_allocate_the_senders_dtype(dtype: torch.dtype) -> None:
    command = Backward(used=((0, 0, 3), (1, 1, 4)), retain_graph=False, dtype=str(dtype).removeprefix("torch."))
    buffer = payload_buffer(command)
    assert (buffer.dtype, buffer.numel()) == (dtype, 7)
    with pytest.raises(rt.ConfigError, match="torch dtype"):
        payload_buffer(dataclasses.replace(command, dtype="Tensor"))
