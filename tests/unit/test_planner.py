"""The planner's attention term follows the backend in use; its measured scale is kept per shape class."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import reference_trainer as rt
from reference_trainer.planner import (
    SavedTerms,
    analytic_saved_bytes,
    attention_saves_scores,
    fused_attention_enabled,
    shape_class,
)


def _saves_a_square(dtype: torch.dtype, dropout: float) -> bool:
    """Oracle: run attention on the CPU and look for a saved ``(T, T)`` tensor."""
    q = torch.randn(1, 2, 32, 8, dtype=dtype, requires_grad=True)
    shapes: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=dropout)
    return any(s[-2:] == (32, 32) for s in shapes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_cpu_rule_matches_what_attention_saves(dtype: torch.dtype, dropout: float) -> None:
    predicted = attention_saves_scores(dtype, "cpu", dropout, fused_attention_enabled("cpu"))
    assert predicted == _saves_a_square(dtype, dropout)


def test_fused_cuda_attention_saves_no_scores_except_in_fp64_or_when_disabled() -> None:
    assert not attention_saves_scores(torch.bfloat16, "cuda", 0.1, fused_enabled=True)
    assert attention_saves_scores(torch.float64, "cuda", 0.0, fused_enabled=True)
    assert attention_saves_scores(torch.bfloat16, "cuda", 0.0, fused_enabled=False)


def test_the_square_term_is_dropped_only_where_scores_are_not_saved() -> None:
    config = rt.ModelConfig.tiny()
    extra = [
        analytic_saved_bytes(config, 2, t) - analytic_saved_bytes(config, 2, t, scores_saved=False) for t in (16, 32)
    ]
    assert extra[0] > 0 and extra[1] == 4 * extra[0], "the saved scores grow with T squared"


def test_shape_classes_bucket_lengths_by_powers_of_two() -> None:
    assert shape_class(2, 33) == shape_class(2, 64) != shape_class(2, 65)
    assert shape_class(2, 64) != shape_class(4, 64)


def test_a_decision_carries_the_price_of_every_placement() -> None:
    """``predicted_seconds``: retain 0, offload both transfers, replay one forward; every placement, fitting or not."""
    from reference_trainer.planner import ForwardCost, PendingUsage, PlanRequest, plan_placement

    cost = ForwardCost(
        saved_bytes=1000,
        transient_bytes=10,
        snapshot_bytes=0,
        input_bytes=0,
        staging_bytes=0,
        forward_seconds=0.3,
        transfer_seconds=0.5,
    )
    request = PlanRequest(
        cost=cost,
        pending=PendingUsage(),
        requested="auto",
        allow_offload=True,
        allow_replay=True,
        device_limit=None,
        host_limit=None,
    )
    decision = plan_placement(request)
    assert decision.placement == "retain"
    assert decision.predicted_seconds == {"retain": 0.0, "offload": 1.0, "replay": 0.3}


@pytest.mark.parametrize(
    ("seen_bytes", "seq_len", "most"),
    [
        (200, 20, 600.0),  # the analytic count itself scales as the analytic count: 10·20 + 20²
        (150, 20, 500.0),  # longer: the square term fills first (100 B at 10, x4), the rest is per length (50 B, x2)
        (150, 5, 62.5),  # shorter: the per-length term fills first (100 B, x1/2), the rest is the square (50 B, x1/4)
        (300, 20, 1000.0),  # above the analytic count (200 B): the analytic 600 B plus the excess grown like the square
    ],
)
def test_the_worst_case_fills_the_terms_that_grow_most_first(seen_bytes: int, seq_len: int, most: float) -> None:
    terms = SavedTerms(constant=0, per_length=10, per_square=1)  # seen at length 10: 100 B per length, 100 B square
    assert terms.worst_case(10, seen_bytes, seq_len) == most
