"""The exact unbiasedness oracle at trainer level (docs/semantics.md#importance-correction; second half of
``test_importance_oracle.py``).

An FP64 policy over a 3-token vocabulary: ``DecoderLM(vocab_size=3)`` after one
fixed prompt token, so every completion ``y`` of length ``L`` (3 or 9 of them)
is enumerated in ONE record and ``pi(y) = exp(sum_t target_logprobs[y, t])``
sums to 1. With a fixed FP64 reward ``A(y)`` the loss
``-sum_y pi_old(y).detach() * A(y) * sum_t lp[y, t]`` is the exact expectation
under ``pi_old`` of the REINFORCE loss, so the committed gradient ``G`` of a
record that became stale is the trainer's estimator in expectation, with no
sampling noise. It is compared with

- the on-policy target ``-grad_theta sum_y pi_cur(y) A(y)`` at the CURRENT
  weights (``bias``), and
- the same-Jacobian target ``-sum_y pi_cur(y) A(y) grad log pi(y)`` at the
  FORWARD's weights (``gap to T_J``): what importance weighting alone can reach,
  since the trainer differentiates the forward's weights (NOTE [Importance correction] Rule 5).

Both are plain autograd on a fresh FP64 model (``validation.oracle``). What we
found (the table is printed with ``pytest -s`` and written as JSON):

1. Fresh (staleness 0): ``G`` is the on-policy gradient, bitwise in practice.
2. Stale by one step: the bias is > 0 and proportional to the step size
   (AdamW's first step moves every weight by about ``lr``); for lr >= 1e-2 the
   bias saturates near 100% and is not monotone.
3. One-token completions: the corrected ``G`` is exactly ``T_J`` (1e-16); the
   uncorrected one is not. The whole remaining bias is the Jacobian change.
4. Two-token completions: token ratios are not sequence ratios, so ``G`` is not
   ``T_J`` at level ``"token"`` (at level ``"sequence"`` it is, to 1e-10); the
   token-corrected and uncorrected biases differ by a few percent of each
   other, in either direction depending on the reward (the Jacobian term
   dominates both). "Corrected beats uncorrected" is therefore NOT asserted.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

import reference_trainer as rt
from validation.oracle import WeightsAt, plain_gradients, relative_error, snapshot_weights
from validation.trainers import trainer_with_policy

F64 = torch.float64
PROMPT = 1
EXACT = 1e-10
ALWAYS = (rt.ImportanceCorrection(clip_low=0.0, clip_high=1e30, policy="always"),)
LINEAR_LRS = (1e-3, 1e-4, 1e-5)  # where the bias is first order in the step
TABLE_LRS = (1e-1, 1e-2) + LINEAR_LRS


def _outcomes(length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every completion of ``length`` tokens: (input_tokens, target_tokens) pairs."""
    if length == 1:
        return [(torch.tensor([PROMPT]), torch.tensor([a])) for a in range(3)]
    return [(torch.tensor([PROMPT, a]), torch.tensor([a, b])) for a in range(3) for b in range(3)]


def _sequence_logprobs(outs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([o.sum() for o in outs])  # (N,)


def _plain_sequence_logprobs(config, weights: WeightsAt, seqs) -> torch.Tensor:
    seen: list[torch.Tensor] = []

    def loss(outs):
        logprobs = _sequence_logprobs(outs)
        seen.append(logprobs.detach())
        return logprobs.sum()

    plain_gradients(config, weights, seqs, loss, torch.get_rng_state(), dtype=F64)
    return seen[0]


def _global(found: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    names = list(reference)
    return relative_error(
        torch.cat([found[n].flatten() for n in names]), torch.cat([reference[n].flatten() for n in names])
    )


def _per_parameter(found, reference) -> dict[str, float | None]:
    return {n: (relative_error(found[n], r) if bool(r.any()) else None) for n, r in reference.items()}


def _estimate(kind: str, length: int, lr: float | None, corrections, reward_seed: int = 0) -> dict:
    """Run the trainer once; returns the committed gradient and both targets.

    ``lr=None``: no step between forward and backward (staleness 0); otherwise
    one AdamW step at ``lr`` on another loss (staleness 1).
    """
    config = rt.ModelConfig.tiny(vocab_size=3, dtype=F64, dropout=0.0)
    trainer = trainer_with_policy(config, lora=None if kind == "full" else rt.LoRAConfig(rank=2))
    seqs = _outcomes(length)
    rewards = torch.randn(len(seqs), generator=torch.Generator().manual_seed(reward_seed), dtype=F64)
    options = rt.ForwardOptions(corrections=corrections, backward_state="retain")

    old_weights = snapshot_weights(trainer, "policy")
    outs = trainer.forward([rt.ForwardInput(ids, tgt) for ids, tgt in seqs], options=options)
    assert len({o.record_id for o in outs}) == 1, "the outcomes must form one record"
    logprobs = _sequence_logprobs([o.target_logprobs for o in outs])  # (N,)
    pi_old = logprobs.detach().exp()
    assert abs(float(pi_old.sum()) - 1.0) < 1e-12, "vocab_size=3: the outcomes are every completion"
    if lr is not None:
        other = trainer.forward(rt.ForwardInput(torch.tensor([0, 2, 1, 0]), torch.tensor([2, 1, 0, 1])))
        trainer.backward(-(other.target_logprobs * torch.tensor([1.0, -0.5, 0.7, 0.3], dtype=F64)).sum())
        trainer.optim_step(lr=lr)
        trainer.zero_grad()
    report = trainer.backward(-(pi_old * rewards * logprobs).sum())
    committed = {n: p.grad.clone() for n, p in trainer.checkpoint("policy").named_parameters()}

    cur_weights = snapshot_weights(trainer, "policy")
    rng = torch.get_rng_state()  # no dropout: irrelevant
    on_policy = plain_gradients(
        config, cur_weights, seqs, lambda o: -(_sequence_logprobs(o).exp() * rewards).sum(), rng, dtype=F64
    )
    pi_cur = _plain_sequence_logprobs(config, cur_weights, seqs).exp()
    same_jacobian = plain_gradients(
        config, old_weights, seqs, lambda o: -(pi_cur * rewards * _sequence_logprobs(o)).sum(), rng, dtype=F64
    )
    assert any(bool(g.any()) for g in on_policy.values()), "vacuous: the on-policy gradient is zero"
    return {
        "committed": committed,
        "report": report,
        "bias": _global(committed, on_policy),
        "bias_per_parameter": _per_parameter(committed, on_policy),
        "gap_to_same_jacobian": _global(committed, same_jacobian),
        "jacobian_bias": _global(same_jacobian, on_policy),
    }


def _row(kind, length, lr, corrected, uncorrected) -> dict:
    return {
        "kind": kind,
        "length": length,
        "lr": lr,
        "staleness": 0 if lr is None else 1,
        "bias_corrected": corrected["bias"],
        "bias_uncorrected": uncorrected["bias"],
        "gap_to_same_jacobian_corrected": corrected["gap_to_same_jacobian"],
        "gap_to_same_jacobian_uncorrected": uncorrected["gap_to_same_jacobian"],
        "jacobian_bias": corrected["jacobian_bias"],
        "bias_per_parameter_corrected": corrected["bias_per_parameter"],
    }


def _publish(rows: list[dict], tmp_path, name: str) -> None:
    (tmp_path / f"{name}.json").write_text(json.dumps({"version": 1, "rows": rows}, indent=1))
    print(f"\n{name}: relative error of the committed gradient (FP64, exact expectations)")
    print(f"{'kind':5} {'L':>2} {'lr':>8} {'bias corr':>10} {'bias unc':>10} {'gap T_J corr':>12} {'gap T_J unc':>12}")
    for r in rows:
        lr = "-" if r["lr"] is None else f"{r['lr']:.0e}"
        print(
            f"{r['kind']:5} {r['length']:>2} {lr:>8} {r['bias_corrected']:10.3e} {r['bias_uncorrected']:10.3e} "
            f"{r['gap_to_same_jacobian_corrected']:12.3e} {r['gap_to_same_jacobian_uncorrected']:12.3e}"
        )


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_fresh_gradient_is_exactly_the_on_policy_gradient(kind: str, tmp_path) -> None:
    corrected = _estimate(kind, 2, None, ALWAYS)
    assert corrected["report"].corrected == []  # fresh: "always" does nothing
    assert corrected["bias"] <= EXACT
    assert all(e is None or e <= EXACT for e in corrected["bias_per_parameter"].values())
    _publish([_row(kind, 2, None, corrected, _estimate(kind, 2, None, ()))], tmp_path, f"fresh_{kind}")


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_stale_bias_is_positive_and_shrinks_in_proportion_to_the_step(kind: str, tmp_path) -> None:
    rows = []
    for lr in TABLE_LRS:
        corrected, uncorrected = _estimate(kind, 2, lr, ALWAYS), _estimate(kind, 2, lr, ())
        (record,) = corrected["report"].corrected
        assert record.staleness == 1 and record.correction.tokens == 18
        rows.append(_row(kind, 2, lr, corrected, uncorrected))
    _publish(rows, tmp_path, f"stale_{kind}")

    linear = [r for r in rows if r["lr"] in LINEAR_LRS]
    biases = [r["bias_corrected"] for r in linear]
    assert all(b > 1e3 * EXACT for b in biases), biases  # far beyond FP64 noise
    assert biases == sorted(biases, reverse=True) and len(set(biases)) == len(biases), biases
    per_lr = [r["bias_corrected"] / r["lr"] for r in linear]
    assert max(per_lr) <= 10 * min(per_lr), per_lr


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_one_token_correction_removes_exactly_the_sampling_mismatch(kind: str, tmp_path) -> None:
    rows = []
    for lr in (1e-2, 1e-3):
        corrected, uncorrected = _estimate(kind, 1, lr, ALWAYS), _estimate(kind, 1, lr, ())
        rows.append(_row(kind, 1, lr, corrected, uncorrected))
        # One token: the token ratio is the sequence ratio, and G is exactly T_J.
        assert corrected["gap_to_same_jacobian"] <= EXACT
        assert uncorrected["gap_to_same_jacobian"] > 1e-4  # the control: without weights it is not
        # What is left is the Jacobian change, which importance weights cannot see.
        assert math.isclose(corrected["bias"], corrected["jacobian_bias"], rel_tol=1e-6)
    _publish(rows, tmp_path, f"one_token_{kind}")


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_sequence_level_removes_exactly_the_sampling_mismatch_of_two_token_completions(kind: str, tmp_path) -> None:
    # Two tokens: the token level is not T_J (finding 4), the sequence level is: its weight is the sequence
    # ratio, so what is left is again only the Jacobian change.
    sequence = tuple(replace(c, level="sequence") for c in ALWAYS)
    rows = []
    for lr in (1e-2, 1e-3):
        by_sequence, by_token = _estimate(kind, 2, lr, sequence), _estimate(kind, 2, lr, ALWAYS)
        rows.append(_row(kind, 2, lr, by_sequence, by_token))
        assert by_sequence["gap_to_same_jacobian"] <= EXACT
        assert by_token["gap_to_same_jacobian"] > 1e-4  # the control: per-token ratios are not
        assert math.isclose(by_sequence["bias"], by_sequence["jacobian_bias"], rel_tol=1e-6)
        (record,) = by_sequence["report"].corrected
        assert (record.correction.level, record.correction.units, record.correction.tokens) == ("sequence", 9, 18)
    _publish(rows, tmp_path, f"sequence_level_{kind}")
