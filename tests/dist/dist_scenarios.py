"""Training scenarios the distributed tests run: in spawned gloo processes (W=2) and in the test process (W=1).

Every scenario builds its own trainer from the same seed, so results are
comparable across processes. One spawn runs them all (:func:`two_process_suite`)
because process start-up dominates the cost; failure scenarios come last, the
one that kills a process very last.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import reference_trainer as rt
from reference_trainer.ranks import logical_gradients, run_logical, spread
from reference_trainer.testing import inject_fault
from validation.spawn import to_plain
from validation.trainers import POLICY, trainer_with_policy

STEPS = 5  # staleness-2 schedule: the backward at step 4 sees a forward two revisions old
TIMEOUT_S = 20.0
HANG_S, HANG_TIMEOUT_S = 2.0, 0.5  # a stalled peer, and the timeout that must name it first


# --- building blocks ---------------------------------------------------------------------


def make_trainer(kind: str = "full", *, dropout: float = 0.0) -> rt.Trainer:
    """Tiny model, default options (a ``when_available`` correction); ``kind`` "full" or "lora" (B moved off zero)."""
    torch.manual_seed(0)  # the dropout masks: every process draws the same
    lora = rt.LoRAConfig(rank=4) if kind == "lora" else None
    trainer = trainer_with_policy(rt.ModelConfig.tiny(dropout=dropout), lora=lora, optimizer=rt.AdamWConfig(lr=1e-2))
    if lora is None:
        return trainer
    state = trainer.checkpoint(POLICY).state_dict()
    generator = torch.Generator().manual_seed(1)
    for name, value in state["parameters"].items():
        if "lora_B" in name:  # a zero B would make every A gradient zero
            value.normal_(0.0, 0.05, generator=generator)
    trainer.load_checkpoint(POLICY, state)
    return trainer


def micro_batch(step: int, logical_rank: int, size: int = 2) -> tuple[list[rt.ForwardInput], list[torch.Tensor]]:
    """Deterministic inputs of varied lengths (so batches pad) and per-token advantages.

    The last sequence's tokens depend on the step's parity only: a staleness-2
    backward finds them scored at the current revision by its own logical
    rank's forward of that step, so the default ``when_available`` correction
    applies. Tokens never repeat across logical ranks.
    """
    generator = torch.Generator().manual_seed(10_000 * step + logical_rank)
    repeated = torch.Generator().manual_seed(10_000 * (step % 2) + logical_rank + 5_000)
    items, advantages = [], []
    for index in range(size):
        tokens = repeated if index == size - 1 else generator
        length = int(torch.randint(4, 11, (1,), generator=tokens))
        items.append(rt.ForwardInput(torch.randint(0, 64, (length,), generator=tokens)))
        advantages.append(torch.randn(length, generator=generator))
    return items, advantages


def token_count(items: list[rt.ForwardInput]) -> int:
    return sum(int((item.targets() >= 0).sum()) for item in items)


def rank_loss(outputs: list[Any], advantages: list[torch.Tensor], count: int) -> torch.Tensor:
    """One logical rank's policy-gradient loss, normalised by the global token count."""
    total = None
    for output, advantage in zip(outputs, advantages):
        term = (output.target_logprobs * advantage).sum()
        total = term if total is None else total + term
    return -total / count


def global_loss(per_rank: list[list[Any]], advantages: list[list[torch.Tensor]], count: int) -> torch.Tensor:
    """Sum of the per-rank losses, left to right in logical order."""
    total = None
    for outputs, advantage in zip(per_rank, advantages):
        loss = rank_loss(outputs, advantage, count)
        total = loss if total is None else total + loss
    return total


def params(trainer: rt.Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.checkpoint(POLICY).named_parameters()}


def snapshot(trainer: rt.Trainer) -> dict[str, Any]:
    """Parameters, ``.grad`` and this process's pending logical-rank sums, to prove a failure changed nothing."""
    checkpoint = trainer.checkpoint(POLICY)
    return {
        "params": params(trainer),
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in checkpoint.named_parameters()},
        "buffers": {"/".join(k): v for k, v in logical_gradients(trainer).items()},
        "revision": checkpoint.revision,
    }


def error_facts(exc: BaseException) -> dict[str, Any]:
    facts = {"type": type(exc).__name__, "message": str(exc)}
    for name in ("checkpoint", "staleness", "bound", "forward_revision", "current_revision", "peer", "command"):
        if hasattr(exc, name):
            facts[name] = getattr(exc, name)
    return facts


def tree_oracle(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """NOTE [Logical ranks] Rule 4 written again, per tensor: ``tree(parts)`` is ``tree(left) + tree(right)``,
    ``left`` the first largest power of two below ``len(parts)``; a part without the tensor is skipped."""
    if len(parts) == 1:
        return dict(parts[0])
    half = 1 << ((len(parts) - 1).bit_length() - 1)
    left, right = tree_oracle(parts[:half]), tree_oracle(parts[half:])
    return {n: left[n] + right[n] if n in left and n in right else left.get(n, right.get(n)) for n in {*left, *right}}


def rank_gradients(logical_rank: int, step: int = 0, count: int = 10, kind: str = "full") -> dict[str, torch.Tensor]:
    """One logical rank's gradient of ``rank_loss`` on its micro-batch, by a plain trainer (no logical ranks)."""
    trainer = make_trainer(kind)
    items, advantages = micro_batch(step, logical_rank)
    trainer.backward(rank_loss(trainer.forward(items), advantages, count))
    return {n: p.grad for n, p in trainer.checkpoint(POLICY).named_parameters() if p.grad is not None}


# --- training schedules --------------------------------------------------------------------


def train_rank(trainer: rt.Trainer, logical_dp: int, steps: int = STEPS) -> dict[str, Any]:
    """Rank mode: each logical rank forwards its micro-batch and backpropagates the one from two steps ago.

    Returns ``{"params": ..., "corrected": records this process's logical ranks corrected}``.
    """
    pending: dict[tuple[int, int], tuple] = {}
    corrected = []
    for step in range(steps):

        def body(view: Any) -> None:
            items, advantages = micro_batch(step, view.logical_rank)
            outputs = view.forward(items)
            count = view.global_token_count([item.targets() >= 0 for item in items])
            pending[(step, view.logical_rank)] = (outputs, advantages, count)
            old = pending.pop((step - 2, view.logical_rank), None)
            if old is not None:
                corrected.extend(view.backward(rank_loss(*old)).corrected)

        run_logical(body, trainer, logical_dp=logical_dp, timeout_s=TIMEOUT_S)
        trainer.optim_step()
        trainer.zero_grad()
    return {"params": params(trainer), "corrected": len(corrected)}


def train_zero(trainer: rt.Trainer, logical_dp: int, steps: int = STEPS) -> dict[str, Any]:
    """Zero mode: rank 0 spreads every logical rank's micro-batch and backpropagates one global loss.

    ``"corrected"``: the records the backwards corrected (rank 0 sees them all; 0 elsewhere).
    """
    corrected = []

    def fn(zero: Any) -> None:
        pending: dict[int, tuple] = {}
        for step in range(steps):
            batches = [micro_batch(step, rank) for rank in range(logical_dp)]
            items = [item for batch in batches for item in batch[0]]
            outputs = zero.forward(items)
            per_rank = [outputs[2 * rank : 2 * rank + 2] for rank in range(logical_dp)]
            pending[step] = (per_rank, [batch[1] for batch in batches], token_count(items))
            old = pending.pop(step - 2, None)
            if old is not None:
                corrected.extend(zero.backward(global_loss(*old)).corrected)
            zero.optim_step()
            zero.zero_grad()

    run_logical(fn, trainer, mode="zero", logical_dp=logical_dp, timeout_s=TIMEOUT_S)
    return {"params": params(trainer), "corrected": len(corrected)}


def train_plain(trainer: rt.Trainer, logical_dp: int, steps: int = STEPS) -> dict[str, Any]:
    """No logical ranks: one forward per logical rank's micro-batch, one backward of the global loss."""
    pending: dict[int, tuple] = {}
    corrected = []
    for step in range(steps):
        batches = [micro_batch(step, rank) for rank in range(logical_dp)]
        per_rank = [trainer.forward(batch[0]) for batch in batches]
        pending[step] = (per_rank, [batch[1] for batch in batches], token_count([i for b in batches for i in b[0]]))
        old = pending.pop(step - 2, None)
        if old is not None:
            corrected.extend(trainer.backward(global_loss(*old)).corrected)
        trainer.optim_step()
        trainer.zero_grad()
    return {"params": params(trainer), "corrected": len(corrected)}


INVARIANCE_CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "rank-L2-full": lambda: train_rank(make_trainer("full"), 2),
    "rank-L4-full": lambda: train_rank(make_trainer("full"), 4),
    "rank-L4-lora": lambda: train_rank(make_trainer("lora"), 4),
    "rank-L4-dropout": lambda: train_rank(make_trainer("full", dropout=0.1), 4),
    "zero-L2-full": lambda: train_zero(make_trainer("full"), 2),
    "zero-L4-full": lambda: train_zero(make_trainer("full"), 4),
    "zero-L4-lora": lambda: train_zero(make_trainer("lora"), 4),
    "rank-L16-full": lambda: train_rank(make_trainer("full"), 16),
}


def wide_cases(cases: list[tuple[int, str]]) -> dict[str, dict[str, Any]]:
    """Parameters after three rank-mode steps for each ``(L, kind)``, on this process (spawned for W > 1)."""
    return {f"L{logical_dp}-{kind}": train_rank(make_trainer(kind), logical_dp, steps=3)["params"]
            for logical_dp, kind in cases}


def shared_tokens() -> dict[str, Any]:
    """Logical ranks 0 and 1 (L=2) forward the same tokens; after a step only logical rank 0 scores them again.

    Each backpropagates its stale record of them: by NOTE [Importance correction] Rule 7 only
    logical rank 0's is corrected, on one process as on two. Returns whether each hosted
    logical rank's stale record was corrected, and the parameters after a second step.
    """
    trainer = make_trainer("full")
    shared, advantages = micro_batch(0, 0)
    kept: dict[int, list[Any]] = {}

    def first(view: Any) -> None:
        kept[view.logical_rank] = view.forward(shared)  # pending across the step
        items, fresh_advantages = micro_batch(1, view.logical_rank)
        view.backward(rank_loss(view.forward(items), fresh_advantages, 100))

    def second(view: Any) -> dict[int, bool]:
        loss = rank_loss(kept[view.logical_rank], advantages, 100)
        if view.logical_rank == 0:
            loss = loss + rank_loss(view.forward(shared), advantages, 100)
        report = view.backward(loss)
        return {view.logical_rank: any(r.staleness == 1 for r in report.corrected)}

    run_logical(first, trainer, logical_dp=2, timeout_s=TIMEOUT_S)
    trainer.optim_step()
    trainer.zero_grad()
    flags = run_logical(second, trainer, logical_dp=2, timeout_s=TIMEOUT_S)
    trainer.optim_step()
    return {"corrected": {rank: flag for hosted in flags for rank, flag in hosted.items()}, "params": params(trainer)}


# --- more zero mode ------------------------------------------------------------------------


def build_trainer() -> rt.Trainer:
    """The factory the 8-logical-rank scenario uses."""
    return make_trainer("lora")


def zero_eight_ranks() -> dict[str, Any]:
    """8 logical ranks on every process count: uneven and empty chunks, outputs in source order, a real step."""
    trainer = build_trainer()
    before = params(trainer)
    lengths = [4 + (i % 5) for i in range(13)]
    generator = torch.Generator().manual_seed(7)
    items = [rt.ForwardInput(torch.randint(0, 64, (n,), generator=generator)) for n in lengths]
    # What each logical rank's chunk gives in a plain forward, in source order (graphs dropped at once).
    reference = [
        out.target_logprobs.detach().clone()
        for chunk in spread(len(items), 8)
        if chunk
        for out in trainer.forward([items[i] for i in chunk])
    ]

    def fn(zero: Any) -> dict[str, Any]:
        outputs = zero.forward(items)  # 13 over 8: two each for logical ranks 0-4, one for 5-7
        few = zero.forward(items[:3])  # 3 over 8: logical ranks 3-7 get nothing
        loss = -sum(o.target_logprobs.sum() for o in outputs) / sum(lengths) - sum(o.target_logprobs.sum() for o in few)
        report = zero.backward(loss)
        step = zero.optim_step()
        zero.zero_grad()
        try:
            zero.reduce
            no_reduce = None
        except AttributeError as exc:
            no_reduce = str(exc)
        return {
            "lengths": [o.target_logprobs.numel() for o in outputs],
            "values": [o.target_logprobs.detach().clone() for o in outputs],
            "records": len(report.records),
            "stepped": step[POLICY].stepped,
            "no_reduce": no_reduce,
        }

    result = run_logical(fn, trainer, mode="zero", logical_dp=8, timeout_s=TIMEOUT_S)
    after = params(trainer)
    return {
        "result": result,
        "reference": reference,
        "changed": sum(int(not torch.equal(before[n], after[n])) for n in before),
        "finite": all(bool(torch.isfinite(p).all()) for p in after.values()),
        "params": after,
    }


# --- coordinated failures ------------------------------------------------------------------


def _prepare_rank(trainer: rt.Trainer, logical_dp: int, *, strict_rank: int | None = None) -> dict[int, tuple]:
    """Leave ``.grad`` set, logical buffers non-empty and one forward per logical rank pending (1 stale).

    ``strict_rank``'s pending forward allows no staleness at all.
    """
    kept: dict[int, tuple] = {}

    def first(view: Any) -> None:
        items, advantages = micro_batch(0, view.logical_rank)
        view.backward(rank_loss(view.forward(items), advantages, 100))
        items, advantages = micro_batch(1, view.logical_rank)
        options = rt.ForwardOptions(max_gradient_staleness=0) if view.logical_rank == strict_rank else None
        kept[view.logical_rank] = (view.forward(items, options=options), advantages, 100)

    def second(view: Any) -> None:
        items, advantages = micro_batch(2, view.logical_rank)
        view.backward(rank_loss(view.forward(items), advantages, 100))

    run_logical(first, trainer, logical_dp=logical_dp, timeout_s=TIMEOUT_S)
    trainer.optim_step()  # revision 1; .grad stays
    run_logical(second, trainer, logical_dp=logical_dp, timeout_s=TIMEOUT_S)  # buffers non-empty
    return kept


def _failing_call(trainer: rt.Trainer, call: Callable[[], Any], fault_here: bool) -> dict[str, Any]:
    before = snapshot(trainer)
    error = None
    with inject_fault("model_backward") if fault_here else nullcontext():
        try:
            call()
        except Exception as exc:
            error = error_facts(exc)
    return {"error": error, "before": before, "after": snapshot(trainer)}


def rank_fault(rank: int) -> dict[str, Any]:
    """An injected model-backward fault on physical rank 1 only (logical rank 2 of 4)."""
    trainer = make_trainer("full")
    kept = _prepare_rank(trainer, 4)
    call = lambda: run_logical(  # noqa: E731
        lambda view: view.backward(rank_loss(*kept[view.logical_rank])), trainer, logical_dp=4, timeout_s=TIMEOUT_S
    )
    return _failing_call(trainer, call, fault_here=rank == 1)


def rank_stale(rank: int) -> dict[str, Any]:
    """Logical rank 3's forward allows staleness 0 and is 1 stale: every rank must raise StaleGradientError."""
    trainer = make_trainer("full")
    kept = _prepare_rank(trainer, 4, strict_rank=3)
    call = lambda: run_logical(  # noqa: E731
        lambda view: view.backward(rank_loss(*kept[view.logical_rank])), trainer, logical_dp=4, timeout_s=TIMEOUT_S
    )
    return _failing_call(trainer, call, fault_here=False)


def rank_user_error(rank: int) -> dict[str, Any]:
    """Logical rank 1 raises in its own code while the others wait in reduce."""

    def body(view: Any) -> None:
        if view.logical_rank == 1:
            raise ValueError("boom on logical rank 1")
        view.reduce(torch.ones(3))

    trainer = make_trainer("full")
    return _failing_call(trainer, lambda: run_logical(body, trainer, logical_dp=4, timeout_s=TIMEOUT_S), False)


def zero_fault(rank: int) -> dict[str, Any]:
    """Zero mode, a fault on physical rank 1: rank 0's fn does not catch it, so every process raises."""
    trainer = make_trainer("full")
    kept: dict[str, Any] = {}

    def prepare(zero: Any) -> None:
        batches = [micro_batch(0, rank) for rank in range(4)]
        outputs = zero.forward([i for b in batches for i in b[0]])
        zero.backward(global_loss([outputs[2 * rank : 2 * rank + 2] for rank in range(4)], [b[1] for b in batches], 100))
        zero.optim_step()
        pending = [micro_batch(1, rank) for rank in range(4)]
        outputs = zero.forward([i for b in pending for i in b[0]])
        kept["loss"] = lambda: global_loss(
            [outputs[2 * rank : 2 * rank + 2] for rank in range(4)], [b[1] for b in pending], 100
        )
        batches = [micro_batch(2, rank) for rank in range(4)]
        fresh = zero.forward([i for b in batches for i in b[0]])
        zero.backward(global_loss([fresh[2 * rank : 2 * rank + 2] for rank in range(4)], [b[1] for b in batches], 100))

    run_logical(prepare, trainer, mode="zero", logical_dp=4, timeout_s=TIMEOUT_S)
    call = lambda: run_logical(  # noqa: E731
        lambda zero: zero.backward(kept["loss"]()), trainer, mode="zero", logical_dp=4, timeout_s=TIMEOUT_S
    )
    result = _failing_call(trainer, call, fault_here=rank == 1)

    def retry(zero: Any) -> None:  # a failed backward committed nothing: training goes on, in step
        batches = [micro_batch(3, rank) for rank in range(4)]
        outputs = zero.forward([i for b in batches for i in b[0]])
        zero.backward(global_loss([outputs[2 * rank : 2 * rank + 2] for rank in range(4)], [b[1] for b in batches], 100))
        zero.optim_step()

    run_logical(retry, trainer, mode="zero", logical_dp=4, timeout_s=TIMEOUT_S)
    result["after_retry"] = params(trainer)
    return result


def stale_pending_save(rank: int, mode: str) -> dict[str, Any]:
    """A forward of logical rank 1 (``mode`` "rank" or "zero"; "plain": of physical rank 1's own code) pends at
    revision 0 across a step, then the job saves: the kept versions and every file's digest, and, made again after a
    load at its version (not in zero mode), the forward's log-probs then and now (NOTE [Resume] Rules 2 and 5)."""
    trainer, held = make_trainer("lora"), []

    def body(view: Any) -> None:
        if view.logical_rank == 1:
            held.append(view.forward(micro_batch(0, 1)[0]))  # stays pending past run_logical
        items, advantages = micro_batch(0, view.logical_rank)
        view.backward(rank_loss(view.forward(items), advantages, 10))

    def fn(zero: Any) -> None:
        batches = [micro_batch(0, rank) for rank in range(2)]
        outputs = zero.forward(batches[0][0] + batches[1][0])
        zero.backward(rank_loss(outputs[:2], batches[0][1], 10))
        held_zero.extend(outputs[2:])  # logical rank 1's forward (one record) stays pending on the process hosting it

    held_zero: list[Any] = []
    if mode == "rank":
        run_logical(body, trainer, logical_dp=2, timeout_s=TIMEOUT_S)
    elif mode == "zero":
        run_logical(fn, trainer, mode="zero", logical_dp=2, timeout_s=TIMEOUT_S)
    else:
        if not dist.is_initialized() or rank == 1:
            held.append(trainer.forward(micro_batch(0, 1)[0]))
        items, advantages = micro_batch(0, 0)
        trainer.backward(rank_loss(trainer.forward(items), advantages, 10))
    trainer.optim_step()
    trainer.zero_grad()
    if mode == "rank":  # a fresher forward of the pending one's tokens leaves log-probs for its correction

        def fresher(view: Any) -> None:  # every logical rank backpropagates (logical rank 0 new tokens)
            items, advantages = micro_batch(1 - view.logical_rank, view.logical_rank)
            view.backward(rank_loss(view.forward(items), advantages, 10))

        run_logical(fresher, trainer, logical_dp=2, timeout_s=TIMEOUT_S)
        trainer.zero_grad()
    folder = [tempfile.mkdtemp(prefix="rt-stale-save-") if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(folder, src=0)
    trainer.save(folder[0])
    root = Path(folder[0])
    saved = root / (root / "LATEST").read_text().split()[0]
    facts: dict[str, Any] = {
        "kept": [c["kept"] for c in json.loads((saved / "trainer.json").read_text())["checkpoints"]],
        "logprob_rows": len(torch.load(saved / "checkpoint-0.pt", weights_only=True)["logprobs"]),
        "digests": {n: e["sha256"] for n, e in json.loads((saved / "manifest.json").read_text())["files"].items()
                    if n != "trainer.json"},  # it holds the saver's identity (NOTE [Resume] Rule 2)
    }
    facts["remade"] = []  # (made, made again) log-probs of each forward pending here
    try:  # an error here must not leave the peer waiting at the barrier
        loaded = rt.Trainer.load(folder[0], rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.0), seed=0))  # make_trainer's base
        for outputs in held:
            again = loaded.forward(micro_batch(0, 1)[0], checkpoint=outputs[0].version)
            facts["remade"] += [(o.target_logprobs.detach(), a.target_logprobs.detach()) for o, a in zip(outputs, again)]
    except Exception as exc:
        facts["remade"] = error_facts(exc)
    if dist.is_initialized():
        dist.barrier()  # every process has loaded
    if rank == 0:
        shutil.rmtree(folder[0])
    return facts


# --- dead and silent peers -----------------------------------------------------------------


def pending_then_load(rank: int) -> dict[str, Any]:
    """Logical-rank gradients pending (W=2, L=2): load refuses, discard drops them, training goes on."""
    trainer = make_trainer("full")
    state = trainer.checkpoint(POLICY).state_dict()

    def body(view: Any) -> None:
        items, advantages = micro_batch(0, view.logical_rank)
        view.backward(rank_loss(view.forward(items), advantages, 10))

    run_logical(body, trainer, logical_dp=2, timeout_s=TIMEOUT_S)
    facts: dict[str, Any] = {"pending": len(logical_gradients(trainer))}
    try:
        trainer.load_checkpoint(POLICY, state)
        facts["busy"] = None
    except Exception as exc:
        facts["busy"] = error_facts(exc)
    trainer.load_checkpoint(POLICY, state, discard_graphs=True)
    facts["after_discard"] = len(logical_gradients(trainer))
    step = trainer.optim_step()[POLICY]
    facts["discarded_step"] = (step.stepped, step.reason, step.revision)
    run_logical(body, trainer, logical_dp=2, timeout_s=TIMEOUT_S)
    step = trainer.optim_step(checkpoints=[POLICY, POLICY])[POLICY]
    facts["next_step"] = (step.stepped, step.reason, step.revision)
    facts["params"] = params(trainer)
    return facts


def hung_peer(rank: int) -> dict[str, Any]:
    """Physical rank 1 stalls in its fn past the timeout: rank 0 must name it instead of waiting."""
    trainer = make_trainer("full")

    def body(view: Any) -> None:
        if view.logical_rank == 1:
            time.sleep(HANG_S)
        view.reduce(torch.ones(1))

    started = time.monotonic()
    try:
        run_logical(body, trainer, logical_dp=2, timeout_s=HANG_TIMEOUT_S)
        facts = None
    except Exception as exc:
        facts = error_facts(exc)
    return {"error": facts, "seconds": time.monotonic() - started}


def killed_peer(rank: int) -> dict[str, Any]:
    """Physical rank 1 dies while serving a zero-mode backward: rank 0 must raise naming it, promptly."""
    trainer = make_trainer("full")
    if rank == 1:
        trainer.backward = lambda *args, **kwargs: os._exit(17)  # dies mid-protocol

    def fn(zero: Any) -> None:
        outputs = zero.forward([item for rank in range(2) for item in micro_batch(0, rank)[0]])
        zero.backward(-sum(o.target_logprobs.sum() for o in outputs))

    started = time.monotonic()
    try:
        run_logical(fn, trainer, mode="zero", logical_dp=2, timeout_s=TIMEOUT_S)
        facts = None
    except Exception as exc:
        facts = error_facts(exc)
    return {"error": facts, "seconds": time.monotonic() - started}


# --- the spawned suite ---------------------------------------------------------------------


def _run(scenarios: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, scenario in scenarios.items():
        started = time.monotonic()
        try:
            results[name] = {"value": scenario()}
        except Exception:
            results[name] = {"crash": traceback.format_exc()}
        results[name]["seconds"] = time.monotonic() - started
    return results


def two_process_suite() -> dict[str, Any]:
    """Everything the W=2 tests need, from one spawn; a scenario's crash is recorded, not raised.

    Returns, on rank 0, ``{"ranks": [rank 0's results, rank 1's results], "peers": ...}``:
    rank 1's results travel to rank 0 before the last scenario kills rank 1.
    """
    rank = dist.get_rank()
    scenarios: dict[str, Callable[[], Any]] = {f"invariance/{k}": v for k, v in INVARIANCE_CASES.items()}
    scenarios.update(
        {
            "zero-eight-ranks": zero_eight_ranks,
            "shared-tokens": shared_tokens,
            "rank-fault": lambda: rank_fault(rank),
            "rank-stale": lambda: rank_stale(rank),
            "rank-user-error": lambda: rank_user_error(rank),
            "zero-fault": lambda: zero_fault(rank),
            "pending-then-load": lambda: pending_then_load(rank),
            **{f"stale-pending-save/{mode}": (lambda mode=mode: stale_pending_save(rank, mode))
               for mode in ("rank", "zero", "plain")},
        }
    )
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, to_plain(_run(scenarios)))
    peers = _run({"hung-peer": lambda: hung_peer(rank), "killed-peer": lambda: killed_peer(rank)})
    return {"ranks": everyone, "peers": peers}


def four_process_suite() -> dict[str, Any]:
    """W=4, L=8: both modes (for bitwise comparison with W=1), then physical rank 2 dies mid-round."""
    results = {
        "rank": to_plain(train_rank(make_trainer("full"), 8)),
        "zero": to_plain(train_zero(make_trainer("lora"), 8)),
    }

    def body(view: Any) -> None:
        if view.logical_rank == 4:  # hosted by physical rank 2
            os._exit(17)
        view.reduce(torch.ones(1))

    started = time.monotonic()
    try:
        run_logical(body, make_trainer("full"), logical_dp=8, timeout_s=TIMEOUT_S)
        results["death"] = None
    except Exception as exc:
        results["death"] = error_facts(exc)
    results["seconds"] = time.monotonic() - started
    return results
