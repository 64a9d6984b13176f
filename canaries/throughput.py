"""ABBA throughput check: one versioned trainer step against one plain PyTorch step.

Both arms train the same ``ModelConfig.small()`` weights on the same 4 x 64
batch on CPU with AdamW:

- ``versioned``: ``trainer.forward`` of 4 ``ForwardInput`` in one call (full
  checkpoint, ``retain`` placement, default staleness bound 2, actual staleness
  0), a loss on ``target_logprobs``, ``trainer.backward``, ``optim_step``,
  ``zero_grad``.
- ``plain``: ``model(ids)``, the same ``token_logprobs`` loss, ``loss.backward()``,
  ``torch.optim.AdamW.step``, ``zero_grad(set_to_none=True)``.

Blocks are mirrored (``validation.abba``) so drift cancels within a block;
warm-up blocks are discarded. The target is a median ratio of at most 1.10.
Prints a line per block, the median ratio with IQR and bootstrap CI, and the
path of the write-once evidence record. Run ``python -m canaries.throughput``
(``--threads 1`` gives stable numbers on a busy machine).
"""

from __future__ import annotations

import argparse
import os
from datetime import datetime, timezone
from pathlib import Path

import torch

import reference_trainer as rt
from validation.abba import run_abba, summarize_ratios
from validation.evidence import make_record, write_once

BATCH, SEQ = 4, 64
LR = 1e-5  # small: many steps on a fixed batch must stay finite in both arms
TARGET_RATIO = 1.10


def _batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.randn(BATCH, SEQ, generator=g)


def _loss(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """The same policy-gradient loss in both arms: ``logprobs`` is ``(B, T)``."""
    return -(logprobs * advantages).sum() / advantages.numel()


def versioned_step(config: rt.ModelConfig, seed: int, ids, targets, advantages):
    trainer = rt.Trainer(rt.DecoderLM(config, seed=seed))
    trainer.add_checkpoint("policy", full=True, optimizer=rt.AdamWConfig(lr=LR))
    inputs = [rt.ForwardInput(ids[row], targets[row]) for row in range(BATCH)]
    options = rt.ForwardOptions(backward_state="retain")  # bound left at its default, 2

    def step() -> float:
        outputs = trainer.forward(inputs, options=options)
        loss = _loss(torch.stack([o.target_logprobs for o in outputs]), advantages)
        trainer.backward(loss)
        if not trainer.optim_step()["policy"].stepped:
            raise RuntimeError("a versioned optimizer step was skipped; the timing would not be comparable")
        trainer.zero_grad()
        return float(loss)

    return step


def plain_step(config: rt.ModelConfig, seed: int, ids, targets, advantages):
    model = rt.DecoderLM(config, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step() -> float:
        loss = _loss(rt.token_logprobs(model(ids), targets), advantages)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return step


def run(*, blocks: int, warmup: int, threads: int, seed: int, out_dir: Path) -> Path:
    torch.set_num_threads(threads)
    config = rt.ModelConfig.small()
    batch = _batch(config.vocab_size, seed)
    arms = {"versioned": versioned_step(config, seed, *batch), "plain": plain_step(config, seed, *batch)}
    first = {name: step() for name, step in arms.items()}  # like with like: same weights, same batch
    if abs(first["versioned"] - first["plain"]) > 1e-5 * abs(first["plain"]) + 1e-6:
        raise SystemExit(f"arms disagree before timing: {first}")
    print(f"ModelConfig.small(), batch {BATCH}x{SEQ}, CPU, {threads} thread(s); {warmup} warm-up + {blocks} blocks")

    def progress(block: int, times: dict[str, float]) -> None:
        print(
            f"block {block + 1:>3}/{blocks}: versioned {times['versioned'] * 1e3:8.2f} ms  "
            f"plain {times['plain'] * 1e3:8.2f} ms  ratio {times['versioned'] / times['plain']:.3f}",
            flush=True,
        )

    seconds = run_abba(arms, blocks=blocks, warmup_blocks=warmup, on_block=progress)
    (summary,) = summarize_ratios(seconds, "plain", seed=seed)
    record = make_record(
        "throughput-versioned-step",
        config={"model": "small", "batch": [BATCH, SEQ], "device": "cpu", "checkpoint": "full", "placement": "retain",
                "lr": LR, "blocks": blocks, "warmup_blocks": warmup, "threads": threads, "seed": seed},
        checks={f"median ratio <= {TARGET_RATIO}": summary.median_ratio <= TARGET_RATIO},
        measurements={"summary": summary.as_dict(), "seconds": seconds,
                      "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
    )
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    path = write_once(out_dir / f"throughput-{stamp}.json", record)
    low, high = summary.ci95
    print(
        f"\nmedian ratio versioned/plain {summary.median_ratio:.3f} "
        f"(IQR {summary.iqr[0]:.3f}-{summary.iqr[1]:.3f}, 95% CI {low:.3f}-{high:.3f}, {summary.verdict})\n"
        f"median per step: versioned {summary.median_arm_seconds * 1e3:.2f} ms, "
        f"plain {summary.median_baseline_seconds * 1e3:.2f} ms\nresults: {path}"
    )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=30, help="measured blocks (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="discarded warm-up blocks (default 3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("rtv-out/bench"))
    args = parser.parse_args(argv)
    if args.blocks < 3 or args.warmup < 0 or args.threads < 1:
        parser.error("expected --blocks >= 3, --warmup >= 0, --threads >= 1")
    run(blocks=args.blocks, warmup=args.warmup, threads=args.threads, seed=args.seed, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
