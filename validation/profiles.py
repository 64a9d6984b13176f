"""The one home of hypothesis settings: the test suite's profiles and the canaries' exploration depths.

Tests: :func:`load_test_profile` registers ``ci`` (seconds; the default) and
``nightly`` (minutes) and loads the one named by ``RTV_HYPOTHESIS_PROFILE``
(``tests/conftest.py`` calls it). Canaries: :data:`EXPLORATION` maps a
canary profile (``quick`` | ``default`` | ``nightly``, ``canaries.registry``)
to the settings of its stateful exploration. Both sets are derandomized
except nightly ones, so a CI failure reproduces; none keeps an example
database (runs are independent evidence).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

from .errors import SetupError

__all__ = ["PROFILE_ENV", "TEST_PROFILES", "EXPLORATION", "load_test_profile"]

PROFILE_ENV = "RTV_HYPOTHESIS_PROFILE"

TEST_PROFILES = {
    "ci": settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]),
    "nightly": settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]),
}

# No "explain" phase: it re-runs the shrunk failure many times to list covered lines (slow, and noise here).
_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)


def _exploration(examples: int, steps: int, *, derandomize: bool) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        derandomize=derandomize,
        database=None,
        phases=_PHASES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


EXPLORATION = {
    "quick": _exploration(3, 6, derandomize=True),
    "default": _exploration(40, 15, derandomize=True),
    "nightly": _exploration(300, 30, derandomize=False),
}


def load_test_profile() -> str:
    """Register :data:`TEST_PROFILES` and load the one ``RTV_HYPOTHESIS_PROFILE`` names (default ``ci``)."""
    name = os.environ.get(PROFILE_ENV, "ci")
    if name not in TEST_PROFILES:
        raise SetupError(
            f"{PROFILE_ENV}={name!r} is not a hypothesis profile", fix=f"use one of {', '.join(TEST_PROFILES)}"
        )
    for profile, values in TEST_PROFILES.items():
        settings.register_profile(profile, values)
    settings.load_profile(name)
    return name
