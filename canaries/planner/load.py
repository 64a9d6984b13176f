"""How the planner canary says its clock could not decide: ``inconclusive (loaded: <measured load>)``.

The load itself is measured by ``validation.abba``'s probe (NOTE [Alternating
blocks] Rule 4); this module only words the verdict, one way for the
certificate, the calibration and the mutation suite that reads their skips.
"""

from __future__ import annotations

__all__ = ["INCONCLUSIVE", "inconclusive", "is_inconclusive"]

INCONCLUSIVE = "inconclusive (loaded: "


def inconclusive(load: str) -> str:
    """The detail of a timing check the load left undecided."""
    return f"{INCONCLUSIVE}{load})"


def is_inconclusive(detail: str) -> bool:
    """Whether ``detail`` is a timing check the load left undecided (not a pass, not a failure)."""
    return detail.startswith(INCONCLUSIVE)
