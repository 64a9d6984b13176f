"""``validation.allocations``: the CPU tally against byte counts worked out by hand."""

from __future__ import annotations

import torch

from validation.allocations import AllocationPeak, peak_bytes


def test_the_tally_counts_storages_alive_at_once() -> None:
    with AllocationPeak() as tally:
        a = torch.ones(1000)  # 4000 bytes
        b = torch.ones(2000)  # + 8000 = 12000 alive: the peak
        del a
        c = torch.ones(500)  # a is gone: 8000 + 2000 = 10000 alive
        c.add_(1)  # in place: no new storage
    assert (tally.peak, tally.live) == (12000, 10000)
    del b, c  # alive to here, so the tally's live count at exit holds them


def test_the_tally_sees_backward_and_not_what_existed_before() -> None:
    weight = torch.ones(1000, requires_grad=True)
    with AllocationPeak() as tally:
        (weight * 2).sum().backward()  # the product is freed; the gradient (4000 bytes) stays alive
    assert weight.grad is not None and tally.live >= weight.grad.nbytes == 4000
    assert tally.peak < 3 * 4000 + 64  # neither the weight nor anything before the block is counted


def test_peak_bytes_on_cpu_uses_the_tally() -> None:
    assert peak_bytes(lambda: torch.zeros(256, dtype=torch.float64), "cpu") == 2048
