"""Logical data parallelism under torchrun: the same parameters whatever the number of processes.

    torchrun --nproc-per-node=2 examples/torchrun_logical.py --logical-dp 4
    torchrun --nproc-per-node=1 examples/torchrun_logical.py --logical-dp 4   # same digests
    python examples/torchrun_logical.py --logical-dp 4                        # one process, same again

Trains a tiny model for a few steps twice, in rank mode (every logical rank
computes its own loss, normalised by the global token count) and in zero mode
(rank 0 computes one loss over every logical rank's outputs), each with
backwards two optimizer steps stale, and prints a digest of the parameters.
On CPU in FP32 the digests do not depend on ``--nproc-per-node``, as long as
it divides ``--logical-dp``.
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
    trainer = rt.Trainer(model, options=rt.ForwardOptions(corrections=()))
    trainer.add_checkpoint("policy", full=True, optimizer=rt.AdamWConfig(lr=1e-2))
    return trainer


def micro_batch(step: int, logical_rank: int) -> tuple[list[rt.ForwardInput], list[torch.Tensor]]:
    """Two sequences and their per-token advantages; a pure function of (step, logical rank)."""
    generator = torch.Generator().manual_seed(10_000 * step + logical_rank)
    items, advantages = [], []
    for _ in range(2):
        length = int(torch.randint(4, 11, (1,), generator=generator))
        items.append(rt.ForwardInput(torch.randint(0, 64, (length,), generator=generator)))
        advantages.append(torch.randn(length, generator=generator))
    return items, advantages


def loss_of(outputs: list, advantages: list[torch.Tensor], tokens: int) -> torch.Tensor:
    total = sum((out.target_logprobs * adv).sum() for out, adv in zip(outputs, advantages))
    return -total / tokens


def train_rank_mode(logical_dp: int, steps: int) -> rt.Trainer:
    trainer = build_trainer()
    pending: dict[tuple[int, int], tuple] = {}
    for step in range(steps):

        def body(view) -> None:
            items, advantages = micro_batch(step, view.logical_rank)
            outputs = view.forward(items)
            tokens = view.global_token_count([item.targets() >= 0 for item in items])
            pending[(step, view.logical_rank)] = (outputs, advantages, tokens)
            stale = pending.pop((step - 2, view.logical_rank), None)  # forward two steps ago
            if stale is not None:
                view.backward(loss_of(*stale))

        run_logical(body, trainer, logical_dp=logical_dp)
        trainer.optim_step()  # on every process: sums the logical ranks' gradients in logical order
        trainer.zero_grad()
    return trainer


def train_zero_mode(logical_dp: int, steps: int) -> rt.Trainer:
    trainer = build_trainer()

    def fn(zero) -> None:  # runs on global rank 0 only; it drives every process
        pending: dict[int, tuple] = {}
        for step in range(steps):
            batches = [micro_batch(step, rank) for rank in range(logical_dp)]
            items = [item for batch, _ in batches for item in batch]
            outputs = zero.forward(items)  # spread over logical ranks, back in source order
            tokens = sum(int((item.targets() >= 0).sum()) for item in items)
            pending[step] = (outputs, [adv for _, advs in batches for adv in advs], tokens)
            stale = pending.pop(step - 2, None)
            if stale is not None:
                zero.backward(loss_of(*stale))
            zero.optim_step()
            zero.zero_grad()

    run_logical(fn, trainer, mode="zero", logical_dp=logical_dp)
    return trainer


def digest(trainer: rt.Trainer) -> str:
    sha = hashlib.sha256()
    for name, param in trainer.checkpoint("policy").named_parameters():
        sha.update(name.encode())
        sha.update(param.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logical-dp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # bitwise comparisons across launches want one kernel schedule
    rank, world_size = init_distributed(device="cpu")  # the model is on the CPU: gloo even where CUDA exists
    digests = {
        "rank": digest(train_rank_mode(args.logical_dp, args.steps)),
        "zero": digest(train_zero_mode(args.logical_dp, args.steps)),
    }
    if rank == 0:
        print(f"processes={world_size} logical_dp={args.logical_dp}")
        for mode, value in digests.items():
            print(f"{mode}-mode digest {value}")
    return digests


if __name__ == "__main__":
    main()
