"""The canary spine: every registered canary is one module with the one entry point; names are checked."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from canaries.registry import CANARIES, canary
from validation.errors import SetupError


@pytest.mark.parametrize("name", list(CANARIES))
def test_each_registered_canary_has_the_registry_entry_point(name: str) -> None:
    entry = CANARIES[name]
    run = importlib.import_module(entry.module).run
    parameters = list(inspect.signature(run).parameters.values())
    assert [p.name for p in parameters[:3]] == ["preset", "profile", "out_dir"]
    assert all(p.default is not inspect.Parameter.empty for p in parameters[3:]), "extras must be optional"
    assert inspect.signature(run).return_annotation in (Path, "Path")
    assert entry.summary and canary(name) is entry


def test_an_unknown_canary_is_refused_with_the_registered_names() -> None:
    with pytest.raises(SetupError, match="unknown canary 'learnin'") as info:
        canary("learnin")
    assert all(name in info.value.fix for name in CANARIES)
