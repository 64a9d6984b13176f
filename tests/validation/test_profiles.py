"""One home for hypothesis settings: the test profile is chosen by RTV_HYPOTHESIS_PROFILE; canary depths grow."""

from __future__ import annotations

import pytest
from hypothesis import settings

from canaries.registry import PROFILES
from validation.errors import SetupError
from validation.profiles import EXPLORATION, PROFILE_ENV, TEST_PROFILES, load_test_profile


@pytest.fixture
def restore_profile():
    before = settings.get_current_profile_name() if hasattr(settings, "get_current_profile_name") else None
    yield
    settings.load_profile(before or "ci")


@pytest.mark.parametrize("name", ["ci", "nightly"])
def test_the_environment_variable_chooses_the_test_profile(name, monkeypatch, restore_profile) -> None:
    monkeypatch.setenv(PROFILE_ENV, name)
    assert load_test_profile() == name
    assert settings.default.max_examples == TEST_PROFILES[name].max_examples


def test_an_unknown_profile_is_refused_with_the_known_ones(monkeypatch, restore_profile) -> None:
    monkeypatch.setenv(PROFILE_ENV, "weekly")
    with pytest.raises(SetupError, match="weekly") as info:
        load_test_profile()
    assert "ci" in info.value.fix and "nightly" in info.value.fix


def test_every_canary_profile_has_an_exploration_depth_and_they_grow() -> None:
    assert list(EXPLORATION) == list(PROFILES)
    examples = [EXPLORATION[p].max_examples for p in PROFILES]
    assert examples == sorted(examples) and examples[0] < examples[-1]
