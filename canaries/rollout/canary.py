"""Rollout canary: the engine agrees with the trainer, publications are all or nothing, per-token versions are exact.

On the tiny model (seconds on a CPU), against the trainer's own forward at the
same weights:

- *mismatch*: per completion token, engine log-prob - trainer log-prob for
  FP32 and BF16 engines, KV cache on and off, batch 1/4/8, prompts of equal
  or ragged lengths (the engine left-pads them, the trainer's batch
  right-pads the sequences). FP32 is a gate (``FP32_LOGPROB_TOLERANCE``);
  BF16 is measured: per setting the share of tokens whose ratio is outside
  [0.9, 1.1], the worst and the median gap, and every gap for the report's plot.
- *on-policy ratio*: at unchanged weights every behaviour ratio is 1 within
  the tolerance; after one step the ratios of the same kind of samples move
  off 1 (a detector). Negative control: behaviour log-probs filled with the
  trainer's own (what a stack does with missing ones) force the ratio to 1
  after a step, and the detector must fire.
- *publication*: a fault at every tensor of a publication leaves the served
  outputs bitwise unchanged with a typed error; ``inflight`` sequences
  spanning two updates carry exactly the versions that drew their tokens,
  checked against engines that re-decode each prefix at the recorded version.
- *lag*: a one-step-off-policy loop (sample at v, train at v + 1) reports
  behaviour lag 1 for every token; a "staleness 0" loop (publish after every
  step, before sampling) reports 0 and masks nothing under
  ``max_behaviour_staleness=0``. Negative control: the same loop with the
  publication skipped must show lag 1 and every token masked.

Every sample is drawn from a seeded generator (``scenarios.sampler``), never
from the process's global RNG, whose initial seed differs per process: two
runs of the same code give the same measurements (times aside).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict

import torch

import reference_trainer as rt
from reference_trainer.rollout.engine import FP32_LOGPROB_TOLERANCE
from validation.evidence import Checks

from ..registry import Judged
from ..request import CanaryRun
from . import scenarios
from .scenarios import Setting

__all__ = ["KIND", "TOKENS", "judge", "settings"]

KIND = "rollout-canary"
TOKENS = {"quick": 4, "default": 8, "nightly": 16}  # completion tokens per sample
RATIO_BAND = (0.9, 1.1)


def settings() -> list[Setting]:
    return [
        Setting(dtype, kv_cache, batch, padding)
        for dtype in ("fp32", "bf16")
        for kv_cache in (True, False)
        for batch in (1, 4, 8)
        for padding in ("none", "left+right")
    ]


def _mismatch(checks: Checks, tokens: int, device: torch.device) -> tuple[list[dict], dict[str, list[float]]]:
    rows, bf16 = [], {}
    for setting in settings():
        gaps = scenarios.mismatch(setting, tokens, device)
        outside = sum(not RATIO_BAND[0] <= math.exp(g) <= RATIO_BAND[1] for g in gaps) / len(gaps)
        absolute = [abs(g) for g in gaps]
        rows.append(
            {
                **asdict(setting),
                "tokens": len(gaps),
                "worst": max(absolute),
                "median": statistics.median(absolute),
                "share_outside_band": outside,
            }
        )
        if setting.dtype == "bf16":
            bf16[setting.label] = absolute
    fp32 = [r for r in rows if r["dtype"] == "fp32"]
    worst = max(r["worst"] for r in fp32)
    checks.check(
        "mismatch_fp32_within_tolerance",
        worst <= FP32_LOGPROB_TOLERANCE,
        f"worst |engine - trainer| log-prob {worst:.2g} over {len(fp32)} FP32 settings "
        f"(tolerance {FP32_LOGPROB_TOLERANCE:g})",
    )
    finite = all(math.isfinite(g) for gaps in bf16.values() for g in gaps)
    checks.check(
        "mismatch_bf16_measured",
        finite and len(bf16) == len(fp32),
        f"{len(bf16)} BF16 settings measured (shown, not gated)",
    )
    return rows, bf16


def _ratio_moves(stats: rt.BehaviourStats) -> bool:
    """The detector: some behaviour ratio is off 1 by more than the FP32 tolerance allows."""
    bound = math.exp(FP32_LOGPROB_TOLERANCE)
    return stats.ratio.max > bound or stats.ratio.min < 1 / bound


def _ratios(checks: Checks, tokens: int, device: torch.device) -> dict[str, object]:
    trainer = scenarios.policy_trainer(device)
    engine = scenarios.engine_for(trainer)
    batch, sampler = scenarios.prompts(4, "left+right", device), scenarios.sampler(device, 1)
    on_policy = scenarios.behaviour_report(trainer, engine.generate(batch, max_new_tokens=tokens, generator=sampler))
    checks.check(
        "on_policy_ratio_is_one",
        not _ratio_moves(on_policy),
        f"ratios in [{on_policy.ratio.min:.7f}, {on_policy.ratio.max:.7f}] at unchanged weights",
    )
    stale = engine.generate(batch, max_new_tokens=tokens, generator=sampler)  # a second draw at the same weights
    scenarios.step(trainer)
    honest = scenarios.behaviour_report(trainer, stale)
    filled = scenarios.behaviour_report(trainer, stale, fill_from_trainer=True)
    checks.check(
        "off_policy_ratio_moves",
        _ratio_moves(honest),
        f"after a step, ratios in [{honest.ratio.min:.4f}, {honest.ratio.max:.4f}]",
    )
    checks.check(
        "negative_control_filled_logprobs_caught",
        not _ratio_moves(filled),
        f"behaviour log-probs filled from the trainer: ratios in [{filled.ratio.min:.7f}, "
        f"{filled.ratio.max:.7f}], which the detector reads as on-policy although the lag is "
        f"{filled.lag_max}",
    )
    return {"on_policy": asdict(on_policy.ratio), "one_step": asdict(honest.ratio), "filled": asdict(filled.ratio)}


def _publication(checks: Checks, tokens: int, device: torch.device) -> dict[str, object]:
    faults = scenarios.publication_faults(device)
    checks.check(
        "publication_faults_leave_engine_bitwise",
        faults["unchanged"] == faults["typed_errors"] == faults["tensors"] and faults["clean_publication_moves"],
        f"{faults['unchanged']} of {faults['tensors']} faulted publications left the served outputs bitwise "
        f"unchanged, {faults['typed_errors']} raised PublicationError; the clean one "
        f"{'moved' if faults['clean_publication_moves'] else 'DID NOT move'} them",
    )
    flight = scenarios.inflight(device, tokens)
    expected = [0] + [1] * (tokens - 3) + [2, 2]
    exact = (
        flight["versions"] == expected
        and flight["worst_own_version_gap"] <= FP32_LOGPROB_TOLERANCE
        and flight["nearest_other_version_gap"] > FP32_LOGPROB_TOLERANCE
    )
    checks.check(
        "inflight_versions_exact",
        exact,
        f"versions {flight['versions']} (expected {expected}); re-decoded at the recorded version within "
        f"{flight['worst_own_version_gap']:.2g}, at any other no closer than "
        f"{flight['nearest_other_version_gap']:.2g}",
    )
    return {"faults": faults, "inflight": flight}


def _lags(checks: Checks, tokens: int, device: torch.device) -> dict[str, object]:
    batch = scenarios.prompts(4, "left+right", device)
    trainer = scenarios.policy_trainer(device)
    engine = scenarios.engine_for(trainer)
    samples = engine.generate(batch, max_new_tokens=tokens, generator=scenarios.sampler(device, 2))  # at v
    scenarios.step(trainer)  # train at v + 1
    one = scenarios.behaviour_report(trainer, samples)
    count = len(samples) * tokens
    checks.check(
        "lag_one_step_off_policy",
        one.lag_histogram == {1: count},
        f"behaviour lag histogram {one.lag_histogram} (expected {{1: {count}}})",
    )
    bound = rt.ForwardOptions(max_behaviour_staleness=0)
    loops = {}
    for name, publish in (("staleness_0", True), ("publication_skipped", False)):
        trainer = scenarios.policy_trainer(device)
        engine = scenarios.engine_for(trainer)
        scenarios.step(trainer)
        if publish:
            trainer.publish(engine, checkpoint="policy")
        samples = engine.generate(batch, max_new_tokens=tokens, generator=scenarios.sampler(device, 2))
        loops[name] = scenarios.behaviour_report(trainer, samples, options=bound)
    zero, skipped = loops["staleness_0"], loops["publication_skipped"]
    checks.check(
        "lag_zero_loop",
        zero.lag_histogram == {0: count} and zero.stale_tokens == 0,
        f"staleness-0 loop: lag histogram {zero.lag_histogram}, {zero.stale_tokens} tokens masked",
    )
    checks.check(
        "negative_control_skipped_publication_caught",
        skipped.lag_histogram == {1: count} and skipped.stale_tokens == count,
        f"the loop without its publication: lag histogram {skipped.lag_histogram}, "
        f"{skipped.stale_tokens} of {count} tokens masked by max_behaviour_staleness=0",
    )
    return {
        "one_step": one.lag_histogram,
        "staleness_0": zero.lag_histogram,
        "publication_skipped": skipped.lag_histogram,
    }


def judge(run: CanaryRun) -> Judged:
    """The registry's entry point: mismatch, ratios, publication and lag, each showing its checks."""
    run.runs_every_check("rollout")
    started, preset, profile = time.perf_counter(), run.preset.name, run.profile
    device, tokens = torch.device(run.preset.device), TOKENS[profile]  # on this machine
    checks = Checks(echo=run.echo)
    rows, bf16 = _mismatch(checks, tokens, device)
    ratios = _ratios(checks, tokens, device)
    publication = _publication(checks, tokens, device)
    lags = _lags(checks, tokens, device)
    config = {
        "preset": preset,
        "profile": profile,
        "device": device.type,
        "tokens": tokens,
        "fp32_tolerance": FP32_LOGPROB_TOLERANCE,
        "ratio_band": list(RATIO_BAND),
        "model": "tiny",
        "stand_in": preset != "cpu" and device.type == "cpu",
    }
    measurements = {
        "mismatch": rows,
        "bf16_gaps": bf16,
        "ratios": ratios,
        "publication": publication,
        "lags": lags,
        "seconds": time.perf_counter() - started,
    }
    return Judged(KIND, config, checks, measurements)
