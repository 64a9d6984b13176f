"""ABBA throughput check: one versioned trainer step against one plain PyTorch step.

Both arms train the same ``ModelConfig.small()`` weights on the same 4 x 64
batch on CPU with AdamW:

- A, versioned: ``trainer.forward`` of 4 ``ForwardInput`` in one call (full
  checkpoint, ``retain`` placement, default staleness bound 2, actual staleness
  0), a loss on ``target_logprobs``, ``trainer.backward``, ``trainer.optim_step``,
  ``trainer.zero_grad``.
- B, plain: ``model(ids)``, the same ``token_logprobs`` loss, ``loss.backward()``,
  ``torch.optim.AdamW.step``, ``zero_grad(set_to_none=True)``.

Blocks run A B B A, so slow drift of the machine cancels within a block; the
block's ratio is ``(A1 + A2) / (B1 + B2)``. Warm-up blocks are kept apart from
the values. The record (write-once JSON, schema below) goes to
``rtv-out/bench/`` and its path is printed.

Run:
    .venv/bin/python benchmarks/versioned_step.py                 # 30 blocks, all cores
    .venv/bin/python benchmarks/versioned_step.py --threads 1 --blocks 10
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's package, whatever is installed
import reference_trainer as rt  # noqa: E402

SCHEMA = "rtv.bench.versioned_step/1"
BATCH, SEQ = 4, 64
LR = 1e-5  # small: ~130 steps on a fixed batch must stay finite in both arms


def _batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    advantages = torch.randn(BATCH, SEQ, generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), advantages


def _loss(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """The same policy-gradient loss in both arms: ``logprobs`` is ``(B, T)``."""
    return -(logprobs * advantages).sum() / advantages.numel()


class Versioned:
    """Arm A: the reference trainer."""

    def __init__(self, config: rt.ModelConfig, seed: int, ids: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor) -> None:
        self.trainer = rt.Trainer(rt.DecoderLM(config, seed=seed))
        self.trainer.add_checkpoint("policy", full=True, optimizer=rt.AdamWConfig(lr=LR))
        self.inputs = [rt.ForwardInput(ids[row], targets[row]) for row in range(BATCH)]
        self.options = rt.ForwardOptions(backward_state="retain")  # bound left at its default, 2
        self.advantages = advantages
        self.skipped = 0

    def step(self) -> float:
        outputs = self.trainer.forward(self.inputs, options=self.options)
        logprobs = torch.stack([o.target_logprobs for o in outputs])  # (B, T)
        loss = _loss(logprobs, self.advantages)
        report = self.trainer.backward(loss)
        assert report.records[0].staleness == 0 and report.records[0].placement == "retain"
        step = self.trainer.optim_step()["policy"]
        self.skipped += not step.stepped
        self.trainer.zero_grad()
        return float(loss.detach())


class Plain:
    """Arm B: plain PyTorch on an identical copy of the model."""

    def __init__(self, config: rt.ModelConfig, seed: int, ids: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor) -> None:
        self.model = rt.DecoderLM(config, seed=seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.ids, self.targets, self.advantages = ids, targets, advantages

    def step(self) -> float:
        logprobs = rt.token_logprobs(self.model(self.ids), self.targets)  # (B, T)
        loss = _loss(logprobs, self.advantages)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def _timed(step: Callable[[], float]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def run_blocks(a: Callable[[], float], b: Callable[[], float], count: int, label: str) -> list[dict[str, float]]:
    """``count`` A B B A blocks of seconds, one progress line per block."""
    blocks = []
    for index in range(count):
        a1, b1, b2, a2 = _timed(a), _timed(b), _timed(b), _timed(a)
        block = {"A1": a1, "B1": b1, "B2": b2, "A2": a2}
        blocks.append(block)
        ratio = (a1 + a2) / (b1 + b2)
        print(
            f"{label} {index + 1:>3}/{count}: A {1e3 * (a1 + a2) / 2:8.2f} ms  "
            f"B {1e3 * (b1 + b2) / 2:8.2f} ms  ratio {ratio:.3f}",
            flush=True,
        )
    return blocks


def summarize(blocks: list[dict[str, float]], seed: int) -> dict[str, float]:
    ratios = np.array([(b["A1"] + b["A2"]) / (b["B1"] + b["B2"]) for b in blocks])
    a = np.array([t for b in blocks for t in (b["A1"], b["A2"])])
    b_ = np.array([t for b in blocks for t in (b["B1"], b["B2"])])
    ci = stats.bootstrap(
        (ratios,), np.median, confidence_level=0.95, n_resamples=10_000, method="percentile", random_state=seed
    ).confidence_interval
    q25, q75 = np.percentile(ratios, [25, 75])
    return {
        "median_ratio": float(np.median(ratios)),
        "ratio_q25": float(q25),
        "ratio_q75": float(q75),
        "ratio_iqr": float(q75 - q25),
        "ratio_ci95_low": float(ci.low),
        "ratio_ci95_high": float(ci.high),
        "median_versioned_ms": 1e3 * float(np.median(a)),
        "median_plain_ms": 1e3 * float(np.median(b_)),
    }


def _source() -> dict[str, object]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    script = Path(__file__).read_bytes()
    return {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain")),
        "script_sha256": hashlib.sha256(script).hexdigest(),
    }


def _environment(threads: int) -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=30, help="measured ABBA blocks (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="ABBA blocks run first and kept apart (default 3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "rtv-out" / "bench", help="folder for the JSON record")
    args = parser.parse_args(argv)
    if args.blocks < 2 or args.warmup < 0 or args.threads < 1:
        parser.error("expected --blocks >= 2, --warmup >= 0, --threads >= 1")
    torch.set_num_threads(args.threads)

    config = rt.ModelConfig.small()
    ids, targets, advantages = _batch(config.vocab_size, args.seed)
    versioned = Versioned(config, args.seed, ids, targets, advantages)
    plain = Plain(config, args.seed, ids, targets, advantages)
    # Like with like: the first step of each arm sees the same weights and batch.
    first_a, first_b = versioned.step(), plain.step()
    if not np.isclose(first_a, first_b, rtol=1e-5, atol=1e-6):
        raise SystemExit(f"arms disagree before timing: versioned loss {first_a!r}, plain loss {first_b!r}")

    print(f"ModelConfig.small(), batch {BATCH}x{SEQ}, CPU, {args.threads} thread(s); "
          f"{args.warmup} warm-up + {args.blocks} measured ABBA blocks", flush=True)
    warmup = run_blocks(versioned.step, plain.step, args.warmup, "warm-up")
    blocks = run_blocks(versioned.step, plain.step, args.blocks, "block")
    if versioned.skipped:
        raise SystemExit(f"{versioned.skipped} versioned optimizer step(s) were skipped; the timing is not comparable")
    summary = summarize(blocks, args.seed)

    record = {
        "schema": SCHEMA,
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
        "argv": sys.argv if argv is None else argv,
        "source": _source(),
        "environment": _environment(args.threads),
        "config": {
            "model": "ModelConfig.small()",
            "batch": BATCH,
            "seq_len": SEQ,
            "device": "cpu",
            "checkpoint": "full",
            "placement": "retain",
            "max_gradient_staleness": "default (2)",
            "staleness": 0,
            "lr": LR,
            "blocks": args.blocks,
            "warmup_blocks": args.warmup,
            "seed": args.seed,
        },
        "units": "seconds per step",
        "warmup": warmup,
        "blocks": blocks,
        "summary": summary,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    path = args.out / f"versioned_step-{stamp}-{os.getpid()}.json"
    with open(path, "x") as handle:  # write-once: never overwrite a record
        json.dump(record, handle, indent=2)

    s = summary
    print(
        f"\nmedian ratio versioned/plain {s['median_ratio']:.3f}  "
        f"(IQR {s['ratio_q25']:.3f}-{s['ratio_q75']:.3f}, 95% CI {s['ratio_ci95_low']:.3f}-{s['ratio_ci95_high']:.3f})\n"
        f"median per step: versioned {s['median_versioned_ms']:.2f} ms, plain {s['median_plain_ms']:.2f} ms\n"
        f"record: {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
