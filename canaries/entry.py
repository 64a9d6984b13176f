"""The ``rtv`` console script: checks what a fresh machine may lack, then hands over to ``canaries.cli``.

Before anything heavy is imported (``canaries.cli`` needs Python 3.10
syntax, tqdm and the packages), it refuses with one line of reason, one of
fix and exit code 2 (docs/harness.md#exit-codes) when:

- Python is older than :data:`MINIMUM_PYTHON` (``pyproject.toml``'s ``requires-python``);
- torch is not installed (looked up, not imported, so ``rtv --help`` stays fast).

Then it hands over; a command that imports a package one of pyproject.toml's
extras provides, run without it, is refused the same way, naming the extra
and its install command (``canaries.extras``).

This module keeps to syntax every Python 3 parses, so an old interpreter
reaches the message instead of a SyntaxError.
"""

import importlib.util
import sys

__all__ = ["MINIMUM_PYTHON", "main", "missing_requirement"]

MINIMUM_PYTHON = (3, 10)


def missing_requirement():
    """``(reason, fix)`` for the first missing requirement, or None when Python and torch are there."""
    found = ".".join(str(part) for part in sys.version_info[:3])
    if tuple(sys.version_info[:2]) < MINIMUM_PYTHON:
        return (
            "rtv needs Python {}.{} or newer, found {} ({})".format(*MINIMUM_PYTHON, found, sys.executable),
            "make a venv with a newer Python (python3.11 -m venv .venv) and run make run again",
        )
    if importlib.util.find_spec("torch") is None:
        return (
            "torch is not installed in this Python ({})".format(sys.executable),
            "run make install (or pip install torch, then pip install -e '.[harness]')",
        )
    return None


def _refuse(reason, fix):
    print("rtv: {}\nfix: {}".format(reason, fix), file=sys.stderr)
    return 2


def main(argv=None):
    """Refuse with exit 2 when a requirement or an extra's package is missing (module docstring), else run
    ``canaries.cli.main``; any other ImportError propagates."""
    missing = missing_requirement()
    if missing is not None:
        return _refuse(*missing)
    try:
        from canaries.cli import main as cli_main

        return cli_main(argv)
    except ImportError as error:
        from canaries.extras import missing_extra

        missing = missing_extra(error)
        if missing is None:
            raise
        return _refuse(*missing)


if __name__ == "__main__":
    sys.exit(main())
