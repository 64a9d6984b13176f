"""From the runs of every arm and seed of one workload to curves, verdicts and checks.

Pure functions of :class:`canaries.learning.arms.ArmRun` lists: nothing here
trains. :func:`summarize_workload` returns the workload's part of the
evidence and records its checks, each with the values it judged, in the
run's ``validation.evidence.Checks`` collector (NOTE [Learning checks]).

NOTE [Learning checks]
  1. Exactness (enforced where owed: FP32 on CPU): an arm with ``exact_with``
     has, per seed, the same curve and the same final-weight digest as that
     arm, bit for bit.
  2. Success: every enforced arm that is not a sensitivity arm meets the
     workload's criterion on every seed (shown arms, NOTE [Arms] Rule 6:
     reported only).
  3. Records: a stale arm's records had staleness ``min(t, k)`` at step t
     (k the arm's delay); the fraction of records corrected is > 0 for the
     corrected arms and 0 for every other arm.
  4. Verdicts: every arm with a baseline gets a paired TOST verdict
     (``validation.equivalence``) on the final metric and on the area under
     the curve (the curve's mean over the steps, in metric units). They are
     reported; with ``gate`` the enforced non-sensitivity arms must be
     equivalent.
  5. Sensitivity: a sensitivity arm is caught when it misses the criterion on
     some seed or is judged worse on either metric. Every one must be caught,
     and (across workloads) at least one must meet its criterion and still
     be judged worse.
  6. Ratios: each corrected arm's evidence shows the distribution of its
     records' raw (pre-clip) and clipped importance ratios
     (:func:`ratio_distribution`); ``None`` for an arm that corrected nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.integrate import trapezoid

from canaries.learning.arms import Arm, ArmRun
from canaries.learning.workloads import Workload
from validation.equivalence import paired_equivalence
from validation.evidence import Checks

__all__ = ["area_under_curve", "expected_staleness", "ratio_distribution", "summarize_workload"]

METRICS = ("final", "auc")


def area_under_curve(steps: Sequence[int], values: Sequence[float]) -> float:
    """Trapezoid area under the metric curve divided by the steps it spans: the curve's mean, in metric units."""
    return float(trapezoid(values, steps) / (steps[-1] - steps[0]))


def expected_staleness(arm: Arm, steps: int) -> list[int]:
    """The staleness each record must have had (NOTE [Arms] rule 2): ``min(t, delay)``."""
    return [min(t, arm.delay) for t in range(steps)]


def ratio_distribution(stats: Sequence[dict]) -> dict | None:
    """Records' ratio statistics (``RatioStats`` as dicts) pooled: the smallest minimum, the largest maximum,
    the mean of the means and, per quantile, the median over records of that quantile; ``None`` for none."""
    if not stats:
        return None
    return {
        "records": len(stats),
        "min": min(s["min"] for s in stats),
        "max": max(s["max"] for s in stats),
        "mean": float(np.mean([s["mean"] for s in stats])),
        "quantiles": {str(q): float(np.median([s["quantiles"][q] for s in stats])) for q in stats[0]["quantiles"]},
    }


def _arm_summary(workload: Workload, arm: Arm, runs: Sequence[ArmRun]) -> dict:
    finals = [r.values[-1] for r in runs]
    staleness = Counter(s for r in runs for s in r.staleness)
    return {
        "summary": arm.summary,
        "group": arm.group,
        "baseline": arm.baseline,
        "exact_with": arm.exact_with,
        "sensitivity": arm.sensitivity,
        "seeds": [r.seed for r in runs],
        "steps": runs[0].steps,
        "curves": [r.values for r in runs],
        "final": finals,
        "auc": [area_under_curve(r.steps, r.values) for r in runs],
        "meets": [workload.meets(v) for v in finals],
        "meets_all": all(workload.meets(v) for v in finals),
        "staleness": [r.staleness for r in runs],
        "staleness_counts": {str(k): staleness[k] for k in sorted(staleness)},
        "fraction_corrected": [r.fraction_corrected for r in runs],
        "correction_weight_mean": [sum(r.weights) / len(r.weights) if r.weights else None for r in runs],
        "level": arm.level if arm.corrected else None,
        "enforced": arm.enforced,
        "raw_ratio": ratio_distribution([s for r in runs for s in r.raw_ratios]),
        "clipped_ratio": ratio_distribution([s for r in runs for s in r.clipped_ratios]),
        "digests": [r.digest for r in runs],
        "wall_s": [r.wall_s for r in runs],
    }


def _verdicts(workload: Workload, arms: Sequence[Arm], summaries: Mapping[str, dict]) -> list[dict]:
    out = []
    for arm in arms:
        if arm.baseline is None or arm.baseline not in summaries:
            continue
        for metric in METRICS:
            floor = workload.floor_final if metric == "final" else workload.floor_auc
            result = paired_equivalence(
                summaries[arm.name][metric],
                summaries[arm.baseline][metric],
                floor=floor,
                higher_is_better=workload.higher_is_better,
            )
            out.append({"arm": arm.name, "baseline": arm.baseline, "metric": metric, **result.as_dict()})
    return out


def _exact_pairs(arms: Sequence[Arm], runs: Mapping[str, Sequence[ArmRun]]) -> list[dict]:
    out = []
    for arm in arms:
        if arm.exact_with is None or arm.exact_with not in runs:
            continue
        equal = [
            a.values == b.values and a.digest == b.digest
            for a, b in zip(runs[arm.name], runs[arm.exact_with], strict=True)
        ]
        out.append({"arm": arm.name, "with": arm.exact_with, "per_seed": equal, "equal": all(equal)})
    return out


def _sensitivity(arms: Sequence[Arm], summaries: Mapping[str, dict], verdicts: Sequence[dict]) -> list[dict]:
    out = []
    for arm in arms:
        if not arm.sensitivity:
            continue
        judged = {v["metric"]: v["verdict"] for v in verdicts if v["arm"] == arm.name}
        worse = "worse" in judged.values()
        meets = summaries[arm.name]["meets_all"]
        out.append(
            {
                "arm": arm.name,
                "baseline": arm.baseline,
                "verdicts": judged,
                "meets_all": meets,
                "caught": worse or not meets,
                "meets_and_worse": meets and worse,
            }
        )
    return out


def _checks(
    workload: Workload,
    arms: Sequence[Arm],
    evidence: dict,
    runs: Mapping[str, Sequence[ArmRun]],
    *,
    exact_enforced: bool,
    gate: bool,
    checks: Checks,
) -> None:
    """Record the workload's checks (NOTE [Learning checks]) in ``checks``, each with the values it judged."""
    name, summaries = workload.name, evidence["arms"]
    if exact_enforced:
        for pair in evidence["exact"]:
            checks.check(
                f"{name}: {pair['arm']} bitwise equal to {pair['with']} on every seed",
                pair["equal"],
                "equal digests" if pair["equal"] else "the digests differ on some seed",
            )
    for arm in arms:
        summary = summaries[arm.name]
        if arm.enforced and not arm.sensitivity:
            checks.check(
                f"{name}: {arm.name} meets {workload.criterion()} on every seed",
                summary["meets_all"],
                f"final {workload.metric} per seed {summary['final']}",
            )
        if arm.delay:
            expected = expected_staleness(arm, workload.schedule.steps)
            wrong = [r.seed for r in runs[arm.name] if r.staleness != expected]
            checks.check(
                f"{name}: {arm.name} records had staleness min(t, {arm.delay})",
                not wrong,
                f"other staleness on seeds {wrong}" if wrong else "as expected on every seed",
            )
        fractions = summary["fraction_corrected"]
        if arm.corrected:
            checks.check(
                f"{name}: {arm.name} corrected a fraction > 0 of its records",
                all(f > 0 for f in fractions),
                f"fractions corrected per seed {fractions}",
            )
        elif arm.delay:
            checks.check(
                f"{name}: {arm.name} corrected no record",
                all(f == 0 for f in fractions),
                f"fractions corrected per seed {fractions}",
            )
    for entry in evidence["sensitivity"]:
        checks.check(
            f"{name}: sensitivity arm {entry['arm']} caught (judged worse or misses the criterion)",
            entry["caught"],
            "caught" if entry["caught"] else "neither judged worse nor missing the criterion",
        )
    if gate:
        for verdict in evidence["verdicts"]:
            if summaries[verdict["arm"]]["enforced"] and not summaries[verdict["arm"]]["sensitivity"]:
                label = f"{name}: {verdict['arm']} equivalent to {verdict['baseline']} ({verdict['metric']}, gated)"
                checks.check(
                    label,
                    verdict["verdict"] == "equivalent",
                    f"{verdict['verdict']}: mean difference {verdict['mean_difference']:+.4f}, 90% CI "
                    f"[{verdict['ci_low']:+.4f}, {verdict['ci_high']:+.4f}], margin {verdict['margin']:.4f}",
                )


def summarize_workload(
    workload: Workload,
    arms: Sequence[Arm],
    runs: Mapping[str, Sequence[ArmRun]],
    *,
    exact_enforced: bool,
    checks: Checks,
    gate: bool = False,
) -> dict:
    """The evidence of one workload whose arms all ran; its checks go to ``checks`` (NOTE [Learning checks])."""
    summaries = {arm.name: _arm_summary(workload, arm, runs[arm.name]) for arm in arms}
    verdicts = _verdicts(workload, arms, summaries)
    evidence = {
        "arms": summaries,
        "verdicts": verdicts,
        "exact": _exact_pairs(arms, runs),
        "exact_enforced": exact_enforced,
        "sensitivity": _sensitivity(arms, summaries, verdicts),
    }
    _checks(workload, arms, evidence, runs, exact_enforced=exact_enforced, gate=gate, checks=checks)
    return evidence
