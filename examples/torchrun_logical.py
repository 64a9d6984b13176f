"""Logical data parallelism under torchrun: the same parameters whatever the number of processes.

    torchrun --nproc-per-node=2 examples/torchrun_logical.py --logical-dp 4
    torchrun --nproc-per-node=1 examples/torchrun_logical.py --logical-dp 4   # same digests
    python examples/torchrun_logical.py --logical-dp 4                        # one process, same again

Trains a tiny model for a few steps twice, in rank mode (every logical rank
computes its own loss, normalised by the global token count) and in zero mode
(rank 0 computes one loss over every logical rank's outputs), each with
backwards two optimizer steps stale, and prints a digest of the parameters.
The trainer uses the default options: a ``when_available`` importance
correction, which reweights a stale record whose tokens its own logical rank
scored again at the current revision (every micro-batch repeats one sequence
of two steps before), so it prints how many records were corrected too.
On CPU in FP32 the digests and counts do not depend on ``--nproc-per-node``,
as long as it divides ``--logical-dp``.
"""

from __future__ import annotations

import argparse
import hashlib

import torch

import reference_trainer as rt
from reference_trainer.ranks import init_distributed, run_logical


def build_trainer() -> rt.Trainer:
    torch.manual_seed(0)  # every process builds the same weights
    model = rt.DecoderLM(rt.ModelConfig.tiny())
    trainer = rt.Trainer(model)  # default options: corrections on (when_available)
    trainer.add_checkpoint("policy", full=True, optimizer=rt.AdamWConfig(lr=1e-2))
    return trainer


def micro_batch(step: int, logical_rank: int) -> tuple[list[rt.ForwardInput], list[torch.Tensor]]:
    """Two sequences and their per-token advantages; a pure function of (step, logical rank).

    The second sequence depends on the step's parity only (a prompt sampled again two steps later).
    """
    generator = torch.Generator().manual_seed(10_000 * step + logical_rank)
    repeated = torch.Generator().manual_seed(10_000 * (step % 2) + logical_rank + 5_000)
    items, advantages = [], []
    for tokens in (generator, repeated):
        length = int(torch.randint(4, 11, (1,), generator=tokens))
        items.append(rt.ForwardInput(torch.randint(0, 64, (length,), generator=tokens)))
        advantages.append(torch.randn(length, generator=generator))
    return items, advantages


def loss_of(outputs: list, advantages: list[torch.Tensor], tokens: int) -> torch.Tensor:
    total = sum((out.target_logprobs * adv).sum() for out, adv in zip(outputs, advantages))
    return -total / tokens


def train_rank_mode(logical_dp: int, steps: int) -> tuple[rt.Trainer, int]:
    """The trained trainer and the number of records corrected over every logical rank."""
    trainer = build_trainer()
    pending: dict[tuple[int, int], tuple] = {}
    corrected = 0
    for step in range(steps):

        def body(view, step: int = step) -> int:
            items, advantages = micro_batch(step, view.logical_rank)
            outputs = view.forward(items)
            tokens = view.global_token_count([item.targets() >= 0 for item in items])
            pending[(step, view.logical_rank)] = (outputs, advantages, tokens)
            stale = pending.pop((step - 2, view.logical_rank), None)  # forward two steps ago
            mine = len(view.backward(loss_of(*stale)).corrected) if stale is not None else 0
            return int(view.reduce(torch.tensor(mine)))  # over every logical rank, whichever process

        corrected += run_logical(body, trainer, logical_dp=logical_dp)[0]
        trainer.optim_step()  # on every process: sums the logical ranks' gradients in logical order
        trainer.zero_grad()
    return trainer, corrected


def train_zero_mode(logical_dp: int, steps: int) -> tuple[rt.Trainer, int]:
    """The trained trainer and the number of records corrected (counted on rank 0, 0 elsewhere)."""
    trainer = build_trainer()

    def fn(zero) -> int:  # runs on global rank 0 only; it drives every process
        pending: dict[int, tuple] = {}
        corrected = 0
        for step in range(steps):
            batches = [micro_batch(step, rank) for rank in range(logical_dp)]
            items = [item for batch, _ in batches for item in batch]
            outputs = zero.forward(items)  # spread over logical ranks, back in source order
            tokens = sum(int((item.targets() >= 0).sum()) for item in items)
            pending[step] = (outputs, [adv for _, advs in batches for adv in advs], tokens)
            stale = pending.pop(step - 2, None)
            if stale is not None:
                corrected += len(zero.backward(loss_of(*stale)).corrected)
            zero.optim_step()
            zero.zero_grad()
        return corrected

    corrected = run_logical(fn, trainer, mode="zero", logical_dp=logical_dp)
    return trainer, corrected or 0


def digest(trainer: rt.Trainer) -> str:
    sha = hashlib.sha256()
    for name, param in trainer.checkpoint("policy").named_parameters():
        sha.update(name.encode())
        sha.update(param.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def main(argv: list[str] | None = None) -> dict[str, tuple[str, int]]:
    """``{mode: (parameter digest, records corrected)}``, printed on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logical-dp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # bitwise comparisons across launches want one kernel schedule
    rank, world_size = init_distributed(device="cpu")  # the model is on the CPU: gloo even where CUDA exists
    results = {}
    for mode, train in (("rank", train_rank_mode), ("zero", train_zero_mode)):
        trainer, corrected = train(args.logical_dp, args.steps)
        results[mode] = (digest(trainer), corrected)
    if rank == 0:
        print(f"processes={world_size} logical_dp={args.logical_dp}")
        for mode, (value, corrected) in results.items():
            print(f"{mode}-mode digest {value} corrected {corrected}")
    return results


if __name__ == "__main__":
    main()
