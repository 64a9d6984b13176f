"""Saves made while forwards are pending, stale ones included, continue bitwise (NOTE [Resume] Rule 2).

A plain async job (forwards kept pending across optimizer steps, staleness
bound 2) is saved at every call boundary; each save is loaded into a fresh
trainer, the forwards pending at the save are made again at their versions
(``checkpoint=output.version``) and the job continues. The oracle is the job
that never stopped: its parameters and AdamW state must be bitwise the
resumed ones'. No dropout: a forward made again draws after the saved RNG.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference_trainer as rt
from tests.support import advantages, assert_nested_equal, sequence
from validation.trainers import trainer_with_policy

BOUND = 2
LENGTH = 5
POLICIES = {  # the default correction ("when_available") and one that runs its own forward
    "when_available": rt.ForwardOptions(max_gradient_staleness=BOUND),
    "always": rt.ForwardOptions(max_gradient_staleness=BOUND, corrections=(rt.ImportanceCorrection(policy="always"),)),
}
Call = tuple[str, int]


def _model(dtype: torch.dtype) -> rt.DecoderLM:
    return rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.0, dtype=dtype, num_hidden_layers=1), seed=0)


def _trainer(dtype: torch.dtype, policy: str) -> rt.Trainer:
    trainer = trainer_with_policy(
        _model(dtype), lora=rt.LoRAConfig(rank=2), optimizer=rt.AdamWConfig(lr=5e-2), options=POLICIES[policy]
    )
    return trainer


def plan(codes: str) -> list[Call]:
    """A valid job from op codes: ``F`` a new forward, ``B`` backward of the oldest pending one, ``N`` of the newest,
    ``S`` optim_step then zero_grad. Before a step that would age the oldest pending forward past the bound, it is backpropagated;
    at the end every pending forward is, and a last step taken."""
    calls: list[Call] = []
    pending: list[tuple[int, int]] = []  # (forward index, revision it ran at)
    revision, made, committed = 0, 0, False
    for code in codes:
        if code == "F":
            calls.append(("forward", made))
            pending.append((made, revision))
            made += 1
        elif code in "BN" and pending:
            calls.append(("backward", pending.pop(0 if code == "B" else -1)[0]))
            committed = True
        elif code == "S":
            while pending and revision + 1 - pending[0][1] > BOUND:
                calls.append(("backward", pending.pop(0)[0]))
                committed = True
            calls += [("optim_step", 0), ("zero_grad", 0)]
            revision, committed = revision + committed, False
    calls += [("backward", index) for index, _ in pending]
    return calls + [("optim_step", 0)]


def _tokens(index: int) -> rt.ForwardInput:
    """Forward ``index``'s tokens: forwards 1 and 2, 3 and 4, ... share theirs, so a fresher forward of a stale one's
    tokens can leave current log-probs for its correction (``"when_available"``)."""
    return rt.ForwardInput(*sequence((index + 1) // 2, LENGTH))


def _call(trainer: rt.Trainer, call: Call, outputs: dict[int, rt.ForwardOutput]) -> int:
    """Make ``call``; the number of records a backward corrected."""
    kind, index = call
    if kind == "forward":
        outputs[index] = trainer.forward(_tokens(index))
    elif kind == "backward":
        return len(trainer.backward(-(outputs.pop(index).target_logprobs * advantages(index, LENGTH)).sum()).corrected)
    elif kind == "optim_step":
        trainer.optim_step(max_grad_norm=1.0)
    else:
        trainer.zero_grad()
    return 0


def _state(trainer: rt.Trainer) -> dict[str, object]:
    return {name: (c.revision, c.generation, c.state_dict()) for name, c in trainer.checkpoints.items()}


def _saved_at_every_boundary(
    calls: list[Call], dtype: torch.dtype, folder: Path, policy: str = "always"
) -> tuple[dict, list[tuple[dict, int]]]:
    """The uninterrupted job's final state with the number of records it corrected, and at each boundary the pending
    forwards' versions and the revision."""
    torch.manual_seed(0)
    trainer, outputs, pending, corrected = _trainer(dtype, policy), {}, [], 0
    for boundary, call in enumerate(calls):
        trainer.save(folder / str(boundary))
        pending.append(({i: out.version for i, out in outputs.items()}, trainer.checkpoint("policy").revision))
        corrected += _call(trainer, call, outputs)
    return {"state": _state(trainer), "corrected": corrected}, pending


def _resumed(
    calls: list[Call], boundary: int, pending: dict, dtype: torch.dtype, folder: Path, *, at_version: bool
) -> tuple[dict, int]:
    """Load the save at ``boundary``, make its pending forwards again (at their versions, or at the current one), go on."""
    torch.manual_seed(99)  # the restarted process's RNG: the load replaces it
    trainer = rt.Trainer.load(folder / str(boundary), _model(dtype))
    outputs = {
        i: trainer.forward(_tokens(i), checkpoint=version if at_version else "policy") for i, version in pending.items()
    }
    corrected = sum(_call(trainer, call, outputs) for call in calls[boundary:])
    return _state(trainer), corrected


def _check_every_boundary(codes: str, dtype: torch.dtype, policy: str = "always") -> int:
    """Every boundary's resumed job against the uninterrupted one; the number of records that one corrected."""
    calls = plan(codes)
    with tempfile.TemporaryDirectory() as folder:
        expected, pending = _saved_at_every_boundary(calls, dtype, Path(folder), policy)
        for boundary, (versions, _) in enumerate(pending):
            state, _ = _resumed(calls, boundary, versions, dtype, Path(folder), at_version=True)
            where = f"resumed at call {boundary} {calls[boundary]} of {calls} ({policy})"
            assert_nested_equal(state, expected["state"], where=where)
    return expected["corrected"]


# forward, forward, backward, step: the second forward stays pending across the step.
ASYNC = "FFBSBS"
LONG_ASYNC = "FFBSFBSFBSBS"  # and across the next forward too


def test_a_job_saved_at_every_call_boundary_with_a_stale_forward_pending_continues_bitwise():
    calls = plan(ASYNC)
    assert calls.index(("optim_step", 0)) < calls.index(("backward", 1)), "forward 1 is made stale"
    _check_every_boundary(ASYNC, torch.float32)


FRESHER = "FFBSFNBS"  # forward 2 (forward 1's tokens) is backpropagated at revision 1 before stale forward 1


def test_a_save_after_a_fresher_forward_of_a_stale_ones_tokens_continues_bitwise_under_the_default_policy():
    """The current log-probs forward 2 left for forward 1's correction are saved and restored (NOTE [Resume] Rule 2):
    the uninterrupted job corrects forward 1 with them, and so does the job resumed at any boundary."""
    assert plan(FRESHER).index(("backward", 2)) < plan(FRESHER).index(("backward", 1))
    assert _check_every_boundary(FRESHER, torch.float32, "when_available") == 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_longer_job_saved_at_every_call_boundary_continues_bitwise(dtype):
    _check_every_boundary(LONG_ASYNC, dtype)


def test_the_oracle_sees_forwards_made_again_at_the_current_revision(tmp_path):
    """Negative control: made again on the loaded (newer) weights instead of their own, the job ends elsewhere."""
    calls = plan(ASYNC)
    expected, pending = _saved_at_every_boundary(calls, torch.float32, tmp_path)
    stale = [
        b for b, (versions, revision) in enumerate(pending) if any(v.revision < revision for v in versions.values())
    ]
    assert stale, "the schedule saves with a stale forward pending"
    for boundary in stale:
        with pytest.raises(AssertionError):
            assert_nested_equal(
                _resumed(calls, boundary, pending[boundary][0], torch.float32, tmp_path, at_version=False)[0],
                expected["state"],
            )


@pytest.mark.slow
@given(st.text(alphabet="FBNS", min_size=1, max_size=10), st.sampled_from(sorted(POLICIES)))
def test_any_async_job_saved_anywhere_continues_bitwise(codes, policy):
    _check_every_boundary(codes, torch.float32, policy)


def test_a_kept_version_is_held_until_no_forward_at_it_could_step_and_others_are_refused(tmp_path):
    """Forward 0 pending one revision stale at the save: its weights are held until the revision passes its bound."""
    trainer = _trainer(torch.float32, "always")
    stale = trainer.forward(rt.ForwardInput(*sequence(0, LENGTH)))
    for index in (1, 2):  # two steps: forward 0 is two revisions old, still within BOUND
        trainer.backward(trainer.forward(rt.ForwardInput(*sequence(index, LENGTH))).target_logprobs.sum())
        trainer.optim_step()
        trainer.zero_grad()
    with pytest.raises(rt.ConfigError, match="holds"):  # the saving trainer holds no older version for a new forward
        trainer.forward(rt.ForwardInput(*sequence(0, LENGTH)), checkpoint=rt.CheckpointVersion("policy", 0, 1))
    trainer.save(tmp_path)
    loaded = rt.Trainer.load(tmp_path, _model(torch.float32))
    assert sorted(loaded.checkpoint("policy").kept) == [stale.version.revision] == [0]
    saver, held = trainer.checkpoint("policy"), loaded.checkpoint("policy")
    assert held.held_nbytes() == saver.held_nbytes() + saver.trainable_nbytes(), "admission counts the kept weights"
    with pytest.raises(rt.ConfigError, match="holds"):  # revision 1 had no pending forward: not kept
        loaded.forward(rt.ForwardInput(*sequence(0, LENGTH)), checkpoint=rt.CheckpointVersion("policy", 0, 1))
    assert loaded.live_records() == 0
    again = loaded.forward(rt.ForwardInput(*sequence(0, LENGTH)), checkpoint=stale.version)
    assert again.version == stale.version
    assert torch.equal(again.target_logprobs, stale.target_logprobs)  # its own weights, bitwise
    loaded.backward(again.target_logprobs.sum())  # age 2 <= BOUND
    loaded.optim_step()
    assert loaded.checkpoint("policy").kept == {}, "revision 3: no forward at revision 0 could step any more"
