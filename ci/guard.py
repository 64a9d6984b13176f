"""Whether a GitHub event may start GPU CI: the first steps of ``gpu-launch.yml``, done in seconds.

    python3 ci/guard.py event      the guard job (no environment, no secrets): GITHUB_EVENT_NAME,
                                   GITHUB_EVENT_PATH, GITHUB_REPOSITORY -> launch=true|false in GITHUB_OUTPUT
    python3 ci/guard.py endpoint   the launch job's first step, inside the protected environment whose
                                   secrets it checks: RTV_ENDPOINT_SET=true|false

The rules, in order (rules 1-2: :func:`decide_event`; rule 3: :func:`check_endpoint`):

1. A pull request from a fork never launches: GitHub withholds the secrets
   from it (the endpoint would be empty) and its code would run on the
   team's GPUs. One line says so; the workflow passes.
2. A pull request from this repository launches only with the
   :data:`PR_LABEL` label (added, or already there on a new push), so an open
   PR does not hold 2×H200 on every push.
3. Anything that would launch with ``SKYPILOT_API_SERVER_ENDPOINT`` unset
   or empty fails at once with the fix, instead of SkyPilot polling the URL
   ``''`` for ten minutes.
4. Otherwise (push to main, schedule, by hand, a labelled PR) it launches.

The event rules run in a job of their own, outside the protected
environment: a fork's PR must be skipped before anything waits for a
reviewer's approval, and the endpoint can only be checked where the
environment's secrets are.

Standard library only, run as a script before anything is installed: it is
the one step a fork PR runs.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Decision", "PR_LABEL", "check_endpoint", "decide_event", "main"]

PR_LABEL = "gpu-ci"
PULL_REQUEST_EVENTS = ("pull_request", "pull_request_target")


@dataclass(frozen=True)
class Decision:
    """``launch``: start the GPU jobs; ``failed``: a misconfiguration the run must fail on; ``reason``: one line."""

    launch: bool
    reason: str
    failed: bool = False


def decide_event(event_name: str, payload: dict[str, Any], repository: str) -> Decision:
    """Rules 1-2 of the module docstring for one event (``payload``: the event's JSON, as GitHub wrote it)."""
    if event_name in PULL_REQUEST_EVENTS:
        pull = payload.get("pull_request") or {}
        head = ((pull.get("head") or {}).get("repo") or {}).get("full_name")
        if head != repository:
            return Decision(
                False,
                f"skipped: pull request #{pull.get('number')} comes from {head or 'a deleted fork'}, "
                f"not {repository}; GPU CI never runs a fork's code (a maintainer can push the "
                f"branch here and add the {PR_LABEL} label)",
            )
        labels = {label.get("name") for label in pull.get("labels") or []}
        if PR_LABEL not in labels:
            return Decision(
                False,
                f"skipped: pull request #{pull.get('number')} has no {PR_LABEL} label; add it to run the GPU gate",
            )
    return Decision(True, f"launching: {event_name or 'an event'} on {repository}")


def check_endpoint(endpoint_set: bool) -> Decision:
    """Rule 3: a launch needs the API server's endpoint."""
    if endpoint_set:
        return Decision(True, "the SkyPilot API server endpoint is set")
    return Decision(
        False,
        "failed: the SKYPILOT_API_SERVER_ENDPOINT secret is empty or unset, so SkyPilot has no "
        "API server to launch through; set it in the repository's trainer-rank-gpu-validation "
        "environment (README, GPU CI)",
        failed=True,
    )


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    """``event`` or ``endpoint`` (module docstring): print the reason, write ``launch=`` and the job summary line.

    Exit 1 for a misconfiguration (rule 3), 2 for an unknown check, else 0 (a skip passes).
    """
    argv = sys.argv[1:] if argv is None else argv
    environ = dict(os.environ if environ is None else environ)
    if argv == ["event"]:
        event_path = environ.get("GITHUB_EVENT_PATH")
        payload = json.loads(Path(event_path).read_text()) if event_path else {}
        decision = decide_event(environ.get("GITHUB_EVENT_NAME", ""), payload, environ.get("GITHUB_REPOSITORY", ""))
    elif argv == ["endpoint"]:
        decision = check_endpoint(environ.get("RTV_ENDPOINT_SET") == "true")
    else:
        print(f"usage: python3 ci/guard.py event|endpoint (found {argv})", file=sys.stderr)
        return 2
    print(f"gpu guard: {decision.reason}")
    for name, text in (
        ("GITHUB_OUTPUT", f"launch={'true' if decision.launch else 'false'}\n"),
        ("GITHUB_STEP_SUMMARY", f"**GPU CI** {decision.reason}\n"),
    ):
        if environ.get(name):
            with open(environ[name], "a", encoding="utf-8") as out:
                out.write(text)
    return 1 if decision.failed else 0


if __name__ == "__main__":
    sys.exit(main())
