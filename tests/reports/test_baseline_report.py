"""The ``rtv bench --baseline`` view: HEAD / REV per arm plotted with its interval, and which scope it is for."""

from __future__ import annotations

from pathlib import Path

from reports.baseline import section


def _comparison(arm: str, ratio: float, low: float, high: float, verdict: str) -> dict:
    return {
        "arm": arm,
        "baseline": "v1",
        "blocks": 16,
        "ratio": ratio,
        "ci95": [low, high],
        "verdict": verdict,
        "loaded": [],
        "drift": {"rho": 0.1, "significant": False},
    }


def _record() -> dict:
    return {
        "kind": "benchmark-baseline",
        "digest": "ab" * 32,
        "passed": False,
        "schema_version": 2,
        "checks": {"retain@s0 v1 → HEAD: not a regression (±5% gate)": False},
        "details": {},
        "skips": {},
        "config": {
            "workload": "small 4x64 full",
            "gate": 0.05,
            "scope": "v1 → HEAD",
            "control": "plain",
            "source_scope": "reference_trainer/ (the harness is HEAD's on both sides)",
        },
        "measurements": {
            "comparisons": [
                _comparison("plain", 1.0, 0.98, 1.02, "tie"),
                _comparison("retain@s0", 1.10, 1.08, 1.12, "regression"),
            ],
            "sources": {},
            "first_losses": {},
        },
    }


def test_the_baseline_section_plots_head_over_rev_per_arm_and_names_the_scope(tmp_path: Path) -> None:
    built = section(_record(), tmp_path)
    (figure,) = built.figures
    assert figure.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.headline and "v1 → HEAD" in figure.caption
    table = built.tables["HEAD against its base"]
    assert list(table["arm"]) == ["plain", "retain@s0"] and list(table["verdict"]) == ["tie", "regression"]
    assert any("retain@s0 vs v1" in line and "→ regression" in line for line in built.lines)
    assert any("for reference_trainer/" in line and "v1's" in line for line in built.lines)
    assert not built.passed and "checks" in built.tables
