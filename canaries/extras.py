"""What each extra of pyproject.toml provides, and the refusal when a command finds one missing.

A command of ``rtv`` that imports a package an extra provides
(:data:`EXTRA_PACKAGES`), run without it, exits 2 naming the extra and
its install command (``canaries.entry`` turns :func:`missing_extra` into
the refusal, wherever in the command the import happens: the harness
imports its packages where they are used). :func:`import_extra` imports a
whole extra up front, for a command (``rtv run``) that would otherwise
find the gap only halfway.

Imported by ``canaries.entry`` before anything else of the harness, so it
keeps to the standard library.
"""

import importlib
import sys

__all__ = ["EXTRA_PACKAGES", "import_extra", "missing_extra"]

# The import name of every package each extra of pyproject.toml provides (tests/canaries/test_entry.py checks them
# against pyproject.toml's distributions).
EXTRA_PACKAGES = {
    "harness": ("numpy", "pandas", "matplotlib", "scipy", "jinja2", "tqdm", "hypothesis", "ruptures"),
    "ci": ("sky",),
    "mutation": ("mutmut",),
    "conform-hf": ("transformers", "peft"),
}


def missing_extra(error):
    """``(reason, fix)`` when ``error`` (an ImportError) is the import of a package an extra provides, else None."""
    package = (getattr(error, "name", None) or "").partition(".")[0]
    for extra, packages in EXTRA_PACKAGES.items():
        if package in packages:
            return (
                "this command needs the {} extra, not installed in this Python ({}): {}".format(
                    extra, sys.executable, error
                ),
                "pip install -e '.[{}]' (make install installs harness, test and ci into .venv)".format(extra),
            )
    return None


def import_extra(extra):
    """Import every package of ``extra`` (:data:`EXTRA_PACKAGES`); the ImportError of the first missing one."""
    for package in EXTRA_PACKAGES[extra]:
        importlib.import_module(package)
