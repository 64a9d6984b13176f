"""The harness's one root error: what went wrong, the fix, and the exit code ``rtv`` maps it to.

Every error the harness raises on purpose (bad arguments, a missing
dependency, no GPU for a GPU-only preset, invalid evidence) subclasses
:class:`HarnessError`. ``rtv`` prints ``str(error)`` (the cause, then
``fix: ...``) on one line per part and exits with ``error.exit_code``:
2 for usage and setup errors, 1 when the error means a check failed
(docs/harness.md#exit-codes).
"""

from __future__ import annotations

__all__ = ["HarnessError", "SetupError", "OutOfSpace", "CheckFailed"]


class HarnessError(Exception):
    """Root of the harness's errors. ``cause`` says what was expected and found; ``fix`` what to do."""

    exit_code = 2

    def __init__(self, cause: str, *, fix: str) -> None:
        super().__init__(cause, fix)
        self.cause = cause
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.cause}\nfix: {self.fix}"


class SetupError(HarnessError):
    """Usage or setup problem (bad arguments, missing package, no GPU): exit code 2."""

    exit_code = 2


class OutOfSpace(SetupError):
    """The disk is full where evidence is written (exit code 2): nothing later can be written either."""


class CheckFailed(HarnessError):
    """An enforced check could not pass (e.g. evidence that does not verify): exit code 1."""

    exit_code = 1
