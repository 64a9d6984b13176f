"""The oracle harness: a real trainer and the FP64 oracle driven side by side, checked op by op.

:class:`DerivativeHarness` owns one ``Trainer`` (built from a canary
preset) and one :class:`~validation.oracle.OracleTrainer`; each public method
is one op (forward, backward, step, zero_grad, save, load, drop) that runs on
both and raises :class:`CanaryFailure` the moment they disagree, naming what
was expected, what was found and the ops that led there. ``check`` is the
invariant run after every op. It is built from ``canaries.derivative.oracle_pair``
and judges each outcome with ``canaries.derivative.oracle_checks``; the
drivers are ``canaries.derivative.scenarios`` and ``canaries.derivative.machine``.

What it checks is NOTE [Derivative canary] (``canaries.derivative.canary``), Rules 1-6.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

import reference_trainer as rt
from reference_trainer.testing import inject_fault

from ..presets import Preset
from .oracle_checks import OracleChecks, caught
from .oracle_pair import (
    CORRECTION,
    NAME,
    TOLERANCES,
    Measurements,
    build_trainer,
    sequences,
)

__all__ = ["OutputRef", "SavedRef", "DerivativeHarness"]

# --- building blocks -----------------------------------------------------------------


class OutputRef:
    """A handle on one pending output (what the bundles hold; never the tensor itself)."""

    def __init__(self, number: int) -> None:
        self.number = number

    def __repr__(self) -> str:
        return f"out{self.number}"


class SavedRef:
    def __init__(self, number: int) -> None:
        self.number = number

    def __repr__(self) -> str:
        return f"saved{self.number}"


@dataclass
class _Output:
    leaf: torch.Tensor
    advantages: torch.Tensor  # on the trainer's device, FP32
    trainer_record: int
    oracle_record: int
    row: int
    placement: str
    level: str  # the correction's level, if the record is corrected


class DerivativeHarness(OracleChecks):
    """One trainer and its oracle, driven op by op; every op is checked (NOTE [Derivative canary]).

    Each public method is one op; it raises :class:`CanaryFailure` (with the
    ops so far in ``log``) when the trainer and the oracle disagree.
    """

    def __init__(self, config: Preset, *, kind: str = "lora", bound_cap: int = 2) -> None:
        self.config = config
        self.kind = kind
        self.bound_cap = bound_cap
        self.tol = TOLERANCES[config.model.dtype]
        self.trainer, self.oracle = build_trainer(config, kind)
        self.checkpoint = self.trainer.checkpoint(NAME)
        self.device = torch.device(config.device)
        self.outputs: dict[int, _Output] = {}
        self.saved: dict[int, tuple[dict, Any]] = {}
        self.generations: dict[int, int] = {}  # oracle generation -> trainer generation
        self.log: list[str] = []
        self.measured = Measurements()
        self.failed = False
        self._counter = 0
        self.check()

    # --- ops ---------------------------------------------------------------------------

    def forward(
        self, placement: str, bound: int, correct: bool, lengths: Sequence[int], seed: int, level: str = "token"
    ) -> list[OutputRef]:
        self._note(
            f"forward(placement={placement!r}, bound={bound}, correct={correct}, lengths={list(lengths)}, "
            f"seed={seed}, level={level!r})"
        )
        bound, correction = min(bound, self.bound_cap), replace(CORRECTION, level=level) if correct else None
        options = rt.ForwardOptions(
            backward_state=placement, max_gradient_staleness=bound, corrections=(correction,) if correct else ()
        )
        data = sequences(seed, lengths, self.config.model.vocab_size)
        inputs = [rt.ForwardInput(ids.clone(), targets.clone()) for ids, targets, _ in data]
        torch.manual_seed(seed)
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        outs = self.trainer.forward(inputs, checkpoint=NAME, options=options)
        for item in inputs:  # the caller reuses its buffers (Rule 1)
            item.input_tokens.fill_(0)
            item.target_tokens.fill_(1)
        record = self.oracle.forward(
            NAME,
            [(ids, t) for ids, t, _ in data],
            rng_state=rng,
            cuda_rng_state=cuda_rng,
            bound=bound,
            correction=correction,
        )
        expected_version = rt.CheckpointVersion(NAME, self._generation(), self.oracle.revision(NAME))
        refs = []
        for row, (out, reference) in enumerate(zip(outs, self.oracle.logprobs(record))):
            self._expect(out.version == expected_version, "forward version", expected_version, out.version)
            self._expect(placement == "auto" or out.placement == placement, "placement", placement, out.placement)
            leaf = out.target_logprobs
            # FP64 log-probs for an FP64 model, FP32 otherwise (docs/semantics.md#precision)
            dtype = torch.float64 if self.config.model.dtype == torch.float64 else torch.float32
            self._expect(
                leaf.dtype == dtype and leaf.requires_grad and leaf.is_leaf,
                "output",
                f"a {dtype} leaf that requires grad",
                f"{leaf.dtype}, requires_grad={leaf.requires_grad}",
            )
            error = self._relative("log-probs", leaf, reference)
            self.measured.worst_logprob_error = max(self.measured.worst_logprob_error, error)
            self._expect(error <= self.tol.logprobs, "log-prob relative L2", f"<= {self.tol.logprobs}", error)
            self._counter += 1
            advantages = data[row][2].to(self.device)
            self.outputs[self._counter] = _Output(leaf, advantages, out.record_id, record, row, out.placement, level)
            refs.append(OutputRef(self._counter))
        return refs

    def backward(self, chosen: Sequence[OutputRef], *, retain_graph: bool = False, fault: str | None = None) -> None:
        chosen = list(dict.fromkeys(r.number for r in chosen))
        self._note(f"backward(outputs={chosen}, retain_graph={retain_graph}, fault={fault!r})")
        self.measured.backwards += 1
        outs = [self.outputs[n] for n in chosen]
        stage, index = self._fault(fault)
        before = self._grads()
        totals_before = {n: None if g is None else g.detach().clone() for n, g in before.items()}
        with caught() as predicted:
            expected = self.oracle.backward(
                [(o.oracle_record, o.row, o.advantages) for o in outs],
                retain_graph=retain_graph,
                fault=None if stage is None else (stage, index),
            )
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.config.cuda_checks else None
        loss = sum((o.leaf * o.advantages).sum() for o in outs)
        with caught() as raised:
            with inject_fault(stage, index=index) if stage is not None else nullcontext():
                report = self.trainer.backward(loss, retain_graph=retain_graph)
        del loss
        self._expect(torch.equal(torch.get_rng_state(), rng), "caller's CPU RNG after backward", "unchanged", "changed")
        if cuda_rng is not None:
            self._expect(
                torch.equal(torch.cuda.get_rng_state(self.device), cuda_rng),
                "CUDA RNG after backward",
                "unchanged",
                "changed",
            )
        self._same_outcome("backward", predicted, raised)
        if predicted:
            self.measured.errors_predicted += 1
            self._unchanged(before, totals_before, "a failed backward")
            return
        self._check_reports(report, expected.records)
        after = self._grads()
        found = {
            n: after[n].double() - (0.0 if totals_before[n] is None else totals_before[n].double())
            for n in after
            if after[n] is not None
        }
        self._compare("gradient added by the backward", found, expected.increments[NAME], expected.baselines[NAME])

    def non_finite_backward(self, chosen: Sequence[OutputRef]) -> None:
        """A NaN loss: ``GradientCommitError`` at validation, every ``.grad`` as it was (NOTE [Gradient commit] Rule 4)."""
        self._note(f"non_finite_backward(outputs={[r.number for r in chosen]})")
        before = self._grads()
        snapshot = {n: None if g is None else g.detach().clone() for n, g in before.items()}
        with caught() as raised:
            self.trainer.backward(sum((self.outputs[r.number].leaf * float("nan")).sum() for r in chosen))
        self._expect(
            bool(raised) and isinstance(raised[0], rt.GradientCommitError),
            "backward of a NaN loss",
            "GradientCommitError",
            type(raised[0]).__name__ if raised else "no error (committed)",
        )
        self._unchanged(before, snapshot, "a refused non-finite backward")
        for ref in chosen:  # its model backward ran, so the record is released (NOTE [Forward records])
            self.oracle.drop(self.outputs.pop(ref.number).oracle_record)

    def train_step(self, seed: int) -> None:
        """Move the weights on with other data (forward, backward, step, zero_grad), all checked."""
        refs = self.forward("retain", 0, False, [4], seed)
        self.backward(refs)
        self.step()
        self.zero_grad()
        for ref in refs:
            self.drop(ref)

    def step(self, lr: float | None = None, max_grad_norm: float | None = None) -> None:
        self._note(f"step(lr={lr}, max_grad_norm={max_grad_norm})")
        self.measured.steps += 1
        start = self.checkpoint.state_dict()
        grads = self._grads()
        snapshot = {n: None if g is None else g.detach().clone() for n, g in grads.items()}
        with caught() as predicted:
            expected = self.oracle.optim_step(lr=lr, max_grad_norm=max_grad_norm, grads={NAME: snapshot})[NAME]
        with caught() as raised:
            report = self.trainer.optim_step(lr=lr, max_grad_norm=max_grad_norm)[NAME]
        self._same_outcome("optim_step", predicted, raised)
        if predicted:
            self.measured.errors_predicted += 1
            self._unchanged(grads, snapshot, "a refused optim_step")
            self._weights_equal(self.oracle.weights(NAME), "weights after a refused optim_step")
            return
        self._expect(report.stepped == expected.stepped, "stepped", expected.stepped, report.stepped)
        self._expect(
            report.revision == self.oracle.revision(NAME),
            "revision after optim_step",
            self.oracle.revision(NAME),
            report.revision,
        )
        if not expected.stepped:
            self._weights_equal(self.oracle.weights(NAME), "weights after a skipped optim_step")
            return
        # The norm of the very gradients stepped (their values were judged at each backward), in FP32 (FP64 for FP64).
        norm_error = abs(report.grad_norm - expected.grad_norm) / expected.grad_norm
        self._expect(
            norm_error <= self.tol.grad_norm, "grad norm of the stepped gradients", expected.grad_norm, report.grad_norm
        )
        if max_grad_norm is not None and abs(expected.grad_norm - max_grad_norm) > 1e-3 * max_grad_norm:
            self._expect(report.clipped == expected.clipped, "clipped", expected.clipped, report.clipped)
        after = self.checkpoint.state_dict()
        masters_before = start.get("master_parameters", start["parameters"])
        masters_after = after.get("master_parameters", after["parameters"])
        self._check_update(masters_before, masters_after, expected.masters)
        for n, value in after["parameters"].items():
            self._expect(
                torch.equal(value, masters_after[n].to(value.dtype)),
                f"live {n!r}",
                "its master weight rounded to the parameter dtype",
                "something else",
            )
        self.oracle.sync(NAME, after)

    def zero_grad(self) -> None:
        self._note("zero_grad()")
        self.trainer.zero_grad()
        self.oracle.zero_grad()

    def save(self) -> SavedRef:
        self._note("save()")
        state = self.checkpoint.state_dict()
        self._counter += 1
        self.saved[self._counter] = (state, self.oracle.save(NAME))
        return SavedRef(self._counter)

    def load(self, saved: SavedRef, *, discard_graphs: bool) -> None:
        self._note(f"load({saved!r}, discard_graphs={discard_graphs})")
        state, oracle_state = self.saved[saved.number]
        grads = self._grads()
        snapshot = {n: None if g is None else g.detach().clone() for n, g in grads.items()}
        with caught() as predicted:
            self.oracle.load(NAME, oracle_state, discard_graphs=discard_graphs)
        with caught() as raised:
            self.trainer.load_checkpoint(NAME, state, discard_graphs=discard_graphs)
        self._same_outcome("load_checkpoint", predicted, raised)
        if predicted:
            self.measured.errors_predicted += 1
            self._unchanged(grads, snapshot, "a refused load_checkpoint")
        self._weights_equal(self.oracle.weights(NAME), "weights after load_checkpoint")

    def drop(self, ref: OutputRef) -> None:
        self._note(f"drop({ref!r})")
        out = self.outputs.pop(ref.number)
        self.oracle.drop(out.oracle_record)
        del out  # the last reference to the leaf: the trainer sees it dropped now

    # --- the invariant (Rule 4) ------------------------------------------------------------

    def check(self) -> None:
        """Revision, generation, live records, gradients and weights agree with the oracle."""
        ckpt = self.checkpoint
        self._expect(ckpt.revision == self.oracle.revision(NAME), "revision", self.oracle.revision(NAME), ckpt.revision)
        self._generation()
        self._expect(
            self.trainer.live_records(NAME) == self.oracle.live_records(NAME),
            "live records",
            self.oracle.live_records(NAME),
            self.trainer.live_records(NAME),
        )
        found, expected = self._grads(), self.oracle.grads(NAME)
        holding = sorted(n for n, g in found.items() if g is not None)
        self._expect(
            holding == sorted(n for n, g in expected.items() if g is not None),
            "parameters holding .grad",
            f"{sum(g is not None for g in expected.values())}",
            f"{len(holding)}",
        )
        if holding:
            dtypes = {n: p.dtype for n, p in ckpt.named_parameters()}
            self._compare("accumulated .grad", found, expected, self.oracle.grads(NAME, baseline=True), dtypes)
        self._weights_equal(self.oracle.weights(NAME), "live weights")

    # --- helpers -----------------------------------------------------------------------------

    def has_gradients(self) -> bool:
        return self.checkpoint.has_gradients()

    def pending_outputs(self) -> int:
        """Outputs whose record is still alive (in the oracle's view)."""
        return sum(1 for o in self.outputs.values() if self.oracle.is_live(o.oracle_record))

    def _note(self, op: str) -> None:
        self.measured.ops += 1
        self.log.append(op)

    def _generation(self) -> int:
        """The trainer's current generation, checked against the oracle's (renumbered one to one)."""
        oracle_generation, trainer_generation = self.oracle.generation(NAME), self.checkpoint.generation
        known = self.generations.setdefault(oracle_generation, trainer_generation)
        self._expect(known == trainer_generation, "generation", f"{known} (no load since)", trainer_generation)
        reused = [o for o, t in self.generations.items() if t == trainer_generation and o != oracle_generation]
        self._expect(not reused, "generation", "a new generation after each load", f"{trainer_generation} reused")
        return trainer_generation

    def _fault(self, fault: str | None) -> tuple[str | None, int | None]:
        if fault is None or not fault.startswith("publish@"):
            return fault, None
        index = fault.split("@")[1]
        return "publish", len(list(self.checkpoint.parameters())) - 1 if index == "last" else int(index)

    def _grads(self) -> dict[str, torch.Tensor | None]:
        return {n: p.grad for n, p in self.checkpoint.named_parameters()}

    def _check_reports(self, report: rt.BackwardReport, expected: Sequence) -> None:
        by_trainer = {o.trainer_record: o for o in self.outputs.values()}
        self._expect(len(report.records) == len(expected), "records in the report", len(expected), len(report.records))
        for found, predicted in zip(report.records, expected):
            out = by_trainer.get(found.record_id)
            self._expect(
                out is not None and out.oracle_record == predicted.record,
                "reported record",
                f"the oracle's record {predicted.record}",
                f"trainer record {found.record_id}",
            )
            self._expect(found.staleness == predicted.staleness, "staleness", predicted.staleness, found.staleness)
            self.measured.stale_records += found.staleness > 0
            self._expect(found.placement == out.placement, "report placement", out.placement, found.placement)
            corrected = found.correction is not None
            level = found.correction.level if corrected else None
            self.measured.cells[(found.staleness, found.placement, corrected, self.kind, level)] += 1
            self._expect(
                corrected == predicted.corrected,
                f"record {found.record_id} corrected (staleness {predicted.staleness})",
                predicted.corrected,
                corrected,
            )
            if corrected:
                self.measured.corrected_records += 1
                stats = found.correction
                self._expect(level == out.level, "correction level", out.level, level)
                self._expect(stats.tokens == predicted.tokens, "corrected tokens", predicted.tokens, stats.tokens)
                self._expect(
                    stats.staleness == predicted.staleness, "correction staleness", predicted.staleness, stats.staleness
                )
                self._expect(
                    abs(stats.mean - predicted.weight_mean) <= self.tol.weight_mean,
                    "mean weight",
                    predicted.weight_mean,
                    stats.mean,
                )
