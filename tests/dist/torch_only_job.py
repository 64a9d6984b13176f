"""A job that must run with nothing but torch and the standard library importable.

Run as a script (``python torch_only_job.py``) with a stub ``numpy`` that
raises ``ImportError`` first on ``PYTHONPATH``. It is physical rank 0 of a
two-process gloo group: it starts rank 1 itself (the same script, the same
environment, a plain ``subprocess``, not the harness's spawn helper), runs
the single-process checks (a save and load among them), then both ranks run
a logical-rank job whose logical rank 1 fails. Each rank prints one JSON line; rank 0 prints both.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

import reference_trainer as rt
from reference_trainer.testing import inject_fault


def numpy_is_importable() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


def stale_backward(policy: str) -> dict:
    """A one-step-stale backward with ``policy``; ``when_available`` gets a later forward of the same tokens."""
    torch.manual_seed(0)
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(), seed=0))
    trainer.add_checkpoint("p", full=True, optimizer=rt.AdamWConfig(lr=1e-2))
    options = rt.ForwardOptions(corrections=(rt.ImportanceCorrection(policy=policy),))
    tokens = torch.arange(1, 9)
    old = trainer.forward(rt.ForwardInput(tokens), options=options)
    trainer.backward(-old.target_logprobs.sum(), retain_graph=True)
    trainer.optim_step()
    trainer.zero_grad()
    later = trainer.forward(rt.ForwardInput(tokens), options=options) if policy == "when_available" else None
    report = trainer.backward(-old.target_logprobs.sum())
    del later
    return {
        "records": [r.record_id for r in report.records],
        "corrected": [r.record_id for r in report.corrected],
        "staleness": [r.staleness for r in report.records],
    }


def save_and_load() -> dict:
    """A BF16 job saved with a forward pending one revision stale, loaded, the forward made again at its version and
    backpropagated: the loaded trainer must end bitwise where the saving one does."""
    trainers = []
    with tempfile.TemporaryDirectory() as folder:
        for resume in (False, True):
            torch.manual_seed(0)
            model = rt.DecoderLM(rt.ModelConfig.tiny(dtype=torch.bfloat16), seed=0)
            trainer = rt.Trainer(model, options=rt.ForwardOptions(corrections=()))
            trainer.add_checkpoint("p", lora=rt.LoRAConfig(rank=2), seed=1)
            tokens = torch.arange(1, 9)
            stale, fresh = (trainer.forward(rt.ForwardInput(tokens + k)) for k in (0, 1))
            trainer.backward(-fresh.target_logprobs.sum())
            trainer.optim_step()
            trainer.zero_grad()
            if resume:
                trainer.save(folder)
                trainer = rt.Trainer.load(folder, rt.DecoderLM(rt.ModelConfig.tiny(dtype=torch.bfloat16), seed=0))
                stale = trainer.forward(rt.ForwardInput(tokens), checkpoint=stale.version)
            trainer.backward(-stale.target_logprobs.sum())
            trainer.optim_step()
            trainers.append(trainer.checkpoint("p").state_dict())
    equal = all(torch.equal(a, b) for a, b in zip(trainers[0]["parameters"].values(), trainers[1]["parameters"].values()))
    return {"equal": equal, "revision": trainers[1]["revision"]}


def failing_logical_job() -> dict:
    """Logical rank 1 (hosted by physical rank 1) raises inside its backward's model backward."""
    torch.manual_seed(0)
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(), seed=0))
    trainer.add_checkpoint("p", full=True)

    def fn(view: rt.LogicalRank) -> None:
        out = view.forward(rt.ForwardInput(torch.arange(1, 7) + view.logical_rank))
        if view.logical_rank == 1:
            with inject_fault("model_backward"):
                view.backward(-out.target_logprobs.sum())
        else:
            view.backward(-out.target_logprobs.sum())

    try:
        rt.run_logical(fn, trainer, logical_dp=2, timeout_s=60.0)
    except rt.TrainerError as exc:
        grads = [p.grad is None for p in trainer.checkpoint("p").parameters()]
        return {"error": type(exc).__name__, "message": str(exc), "all_grads_none": all(grads),
                "pending": len(rt.logical_gradients(trainer))}
    return {"error": None}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    if "RANK" not in os.environ:  # the launcher: become rank 0, start rank 1
        env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        peer = subprocess.Popen([sys.executable, __file__], env=env, stdout=subprocess.PIPE, text=True)
        os.environ.update(env, RANK="0")
    else:
        peer = None
    torch.set_num_threads(1)
    result: dict = {"rank": int(os.environ["RANK"]), "numpy_importable": numpy_is_importable()}
    try:
        if peer is not None:
            result["always"] = stale_backward("always")
            result["when_available"] = stale_backward("when_available")
            result["resume"] = save_and_load()
        rt.init_distributed("gloo", timeout_s=60.0)
        result["logical_failure"] = failing_logical_job()
        dist.destroy_process_group()
    except BaseException:
        result["crash"] = traceback.format_exc()
    if peer is None:
        print(json.dumps(result), flush=True)
        return
    out, _ = peer.communicate(timeout=120)
    print(json.dumps({"ranks": [result, json.loads(out.strip().splitlines()[-1])]}), flush=True)


if __name__ == "__main__":
    main()
