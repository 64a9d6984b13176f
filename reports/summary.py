"""A CI summary of a folder's records: short Markdown for ``$GITHUB_STEP_SUMMARY``, a PR comment on a finding.

Every record that failed or does not verify comes first, in both files: the
canary (its board name), what failed (the failed checks; a canary that
raised, a ``reports.kinds.RAISED_KIND`` record, what it raised and a hang's
diagnosis; an invalid file, why it does not verify), the mutation or failure
injected into its run, if any, and a link. A failed record alone is reason
enough for the comment: a summary that lists only comparisons would read
clean beside a failed correctness canary.

``write_summary(in_dir, folder, report)`` reads every ``benchmark`` and
``benchmark-baseline`` record under ``in_dir`` and writes ``summary.md`` in
``folder``: one table row per comparison (workload, arm against its
baseline, median ratio with its interval, verdict), the overall verdict and
links to the report and each record. ``pr-comment.md`` is written beside it
only when some verdict is ``regression`` or some record failed (a comment is
noise otherwise); it holds those alone. A regression counts only where it is a
finding: an enforced comparison of a benchmark (a gated workload's
retain@s0 vs plain and replay@s0 vs its floor, ``reports.benchmark.enforced``)
and a baseline's arm other than the ``plain`` A/A control; a reported-only
arm slower than plain by design reads ``regression (reported)`` in the table
and is counted nowhere. ``rtv report --summary`` fronts it; a workflow
appends the summary with ``cat summary.md >> "$GITHUB_STEP_SUMMARY"`` and
posts the comment when the file exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .baseline import short_revisions
from .benchmark import enforced
from .kinds import RAISED_KIND, kind
from .numbers import interval, number
from .records import LoadedRecord, load_records

__all__ = ["SummaryPaths", "failed_rows", "summary_rows", "write_summary", "SUMMARY_FILE", "COMMENT_FILE"]

SUMMARY_FILE = "summary.md"
COMMENT_FILE = "pr-comment.md"
BENCHMARK_KINDS = ("benchmark", "benchmark-baseline")


@dataclass(frozen=True)
class SummaryPaths:
    """What :func:`write_summary` wrote: the summary, the PR comment (None when nothing regressed or failed), the
    regressions, the records that failed or do not verify, and how many of those are canaries that raised."""

    summary: Path
    comment: Path | None
    regressions: int
    failed: int = 0
    raised: int = 0


def _comparisons(loaded: LoadedRecord) -> list[tuple[str, dict, bool]]:
    """``(workload, comparison, counted)`` of one record: a benchmark's groups (replay floors too), or a baseline's
    arms; ``counted``: its regression is a finding (module docstring)."""
    measurements = loaded.record["measurements"]
    if loaded.kind == "benchmark-baseline":
        scope = short_revisions(loaded.record["config"]["scope"])
        return [
            (f"{loaded.record['config']['workload']} ({scope})", c, c["arm"] != loaded.record["config"]["control"])
            for c in measurements["comparisons"]
        ]
    return [
        (g["label"], c, g["gated"] and enforced(c))
        for g in measurements["groups"]
        for c in g["comparisons"] + ([g["replay_floor"]] if g["replay_floor"] else [])
    ]


def summary_rows(in_dir: Path, folder: Path) -> list[dict]:
    """One row per comparison of the folder's benchmark records: workload, arm, baseline, ratio, interval, verdict,
    whether a regression there is counted (module docstring), link."""
    rows = []
    for loaded in load_records(in_dir):
        if loaded.kind not in BENCHMARK_KINDS or loaded.status == "invalid":
            continue
        link = Path(os.path.relpath(loaded.path, folder)).as_posix()
        for workload, c, counted in _comparisons(loaded):
            low, high = c["ci95"]
            rows.append(
                {
                    "workload": workload,
                    "arm": c["arm"],
                    "baseline": short_revisions(c["baseline"]),
                    "ratio": c["ratio"],
                    "interval": interval(low, high),
                    "verdict": c["verdict"],
                    "counted": counted,
                    "blocks": c["blocks"],
                    "record": link,
                }
            )
    return rows


def _what_failed(loaded: LoadedRecord) -> str:
    """One line: why an invalid file does not verify, what a canary raised, or the checks a record failed."""
    if loaded.status == "invalid":
        return f"invalid: {loaded.integrity}"
    measurements = loaded.record["measurements"]
    if loaded.kind == RAISED_KIND:
        return f"raised {measurements['error']}: {(measurements['message'].splitlines() or [''])[0]}"
    failed = [name for name, ok in loaded.record["checks"].items() if not ok]
    shown = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
    return f"failed {len(failed)} check(s): {shown}" if failed else "failed: no check ran"


def _label(loaded: LoadedRecord) -> str:
    """The board's name for the record's canary (its kind's label), or the file's name when it has no known kind."""
    known = kind(loaded.kind) if loaded.record else None
    return known.label if known is not None else loaded.name


def failed_rows(in_dir: Path, folder: Path) -> list[dict]:
    """One row per record under ``in_dir`` that failed or does not verify (module docstring): canary, what failed,
    what was injected into its run, the hang's diagnosis text (empty unless it hung), link."""
    rows = []
    for loaded in load_records(in_dir):
        if loaded.status == "passed":
            continue
        config, measurements = loaded.record.get("config", {}), loaded.record.get("measurements", {})
        raised = loaded.kind == RAISED_KIND
        rows.append(
            {
                "canary": config["canary"] if raised else _label(loaded),
                "failed": _what_failed(loaded),
                "raised": raised,
                "injected": ", ".join(f"{k}: {v}" for k, v in (config.get("injected") or {}).items()),
                "diagnosis": (measurements.get("diagnosis") or {}).get("text", "") if raised else "",
                "record": Path(os.path.relpath(loaded.path, folder)).as_posix(),
            }
        )
    return rows


def _failed_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    cell = lambda text: str(text).replace("|", "\\|") or "-"  # noqa: E731 - a message may hold a table's bar
    return [
        f"**FAILED: {len(rows)} record(s)**",
        "",
        "| canary | what failed | injected | hang diagnosis | record |",
        "|---|---|---|---|---|",
        *(
            f"| {r['canary']} | **{cell(r['failed'])}** | {cell(r['injected'])} | {cell(r['diagnosis'])} | "
            f"[record]({r['record']}) |"
            for r in rows
        ),
        "",
    ]


def _verdict(row: dict) -> str:
    return f"{row['verdict']} (reported)" if row["verdict"] == "regression" and not row["counted"] else row["verdict"]


def _table(rows: list[dict]) -> list[str]:
    lines = ["| workload | arm vs baseline | ratio (95% CI) | verdict | blocks | record |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {r['workload']} | {r['arm']} vs {r['baseline']} | {number(r['ratio'], '.3f')} {r['interval']} | "
        f"**{_verdict(r)}** | {r['blocks']} | [record]({r['record']}) |"
        for r in rows
    ]
    return lines


def write_summary(in_dir: Path, folder: Path, report: Path | None = None) -> SummaryPaths:
    """Write the summary (and the PR comment on a regression or a failed record) into ``folder``; ``report``: the
    page to link."""
    folder.mkdir(parents=True, exist_ok=True)
    rows, failed = summary_rows(in_dir, folder), failed_rows(in_dir, folder)
    regressions = [r for r in rows if r["verdict"] == "regression" and r["counted"]]
    verdict = (f"{len(regressions)} regression(s)" if regressions else "no regression") + f" in {len(rows)} comparisons"
    link = [f"[full report]({Path(os.path.relpath(report, folder)).as_posix()})"] if report is not None else []
    ratio = "ratio = arm seconds / baseline seconds per ABBA block (above 1: slower)"
    summary = folder / SUMMARY_FILE
    summary.write_text(
        "\n".join([*_failed_table(failed), "### rtv bench: " + verdict, "", *_table(rows), "", ratio, *link, ""])
    )
    comment = None
    if regressions or failed:
        found = [f"**rtv bench found {len(regressions)} regression(s)**", "", *_table(regressions), "", ratio]
        comment = folder / COMMENT_FILE
        comment.write_text("\n".join([*_failed_table(failed), *(found if regressions else []), *link, ""]))
    else:
        (folder / COMMENT_FILE).unlink(missing_ok=True)  # a stale comment from an earlier run must not be posted
    raised = sum(r["raised"] for r in failed)
    return SummaryPaths(
        summary=summary, comment=comment, regressions=len(regressions), failed=len(failed), raised=raised
    )
