"""Microbenchmark: step time per placement (as a ratio to retain) and bytes held.

For each preset (``tiny``, ``small``) and placement (retain, offload, replay)
one step is: a forced-placement forward of a batch, its backward, an
optimizer step and ``zero_grad``. Arms are interleaved in mirrored blocks
(``validation.abba``); ratios are per block against retain. Also reports the
bytes each placement holds between forward and backward (device and host).
Not a test: timings are measurements. Run ``python -m canaries.placements``.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path

import torch

import reference_trainer as rt
from validation.abba import run_abba, summarize_ratios
from validation.evidence import make_record, write_once

PLACEMENTS = ("retain", "offload", "replay")
PRESETS = {"tiny": (rt.ModelConfig.tiny, 4, 16), "small": (rt.ModelConfig.small, 4, 64)}


def _step_fn(config: rt.ModelConfig, batch: int, seq_len: int, placement: str):
    trainer = rt.Trainer(rt.DecoderLM(config, seed=0))
    trainer.add_checkpoint("policy", full=True)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=g)
    inputs = [rt.ForwardInput(row[:-1], row[1:]) for row in tokens]
    options = rt.ForwardOptions(backward_state=placement, corrections=())
    held = {}

    def step() -> None:
        outs = trainer.forward(inputs, options=options)
        held.update(device=outs[0].usage.device_bytes, host=outs[0].usage.host_bytes)
        trainer.backward(-sum(o.target_logprobs.sum() for o in outs))
        trainer.optim_step()
        trainer.zero_grad()

    return step, held


def run(presets: list[str], blocks: int, out_dir: Path) -> Path:
    results = {}
    for preset in presets:
        factory, batch, seq_len = PRESETS[preset]
        config = factory()
        arms, held = {}, {}
        for placement in PLACEMENTS:
            arms[placement], held[placement] = _step_fn(config, batch, seq_len, placement)

        def progress(block: int, times: dict[str, float], preset: str = preset) -> None:
            line = "  ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in times.items())
            print(f"[{preset}] block {block + 1}/{blocks}: {line}", flush=True)

        seconds = run_abba(arms, blocks=blocks, on_block=progress)
        summaries = summarize_ratios(seconds, "retain")
        results[preset] = {
            "batch": [batch, seq_len],
            "ratios_to_retain": {s.arm: s.as_dict() for s in summaries},
            "median_retain_ms": summaries[0].median_baseline_seconds * 1e3,
            "bytes_held": held,
        }
        print(f"\n{preset} ({batch}x{seq_len}): step time / retain, and bytes held until backward")
        print(f"  {'placement':9} {'ratio':>7} {'95% CI':>17} {'device bytes':>13} {'host bytes':>11}")
        print(f"  {'retain':9} {1.0:7.3f} {'':>17} {held['retain']['device']:13d} {held['retain']['host']:11d}")
        for s in summaries:
            ci = f"[{s.ci95[0]:.3f}, {s.ci95[1]:.3f}]"
            print(f"  {s.arm:9} {s.median_ratio:7.3f} {ci:>17} {held[s.arm]['device']:13d} {held[s.arm]['host']:11d}")
    record = make_record(
        "placements-benchmark",
        config={"presets": presets, "blocks": blocks, "threads": torch.get_num_threads()},
        checks={f"{p}:ran": True for p in presets},
        measurements=results,
    )
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    path = write_once(out_dir / f"placements-{stamp}.json", record)
    print(f"\nresults: {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("rtv-out/bench"))
    args = parser.parse_args(argv)
    run(args.presets, args.blocks, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
