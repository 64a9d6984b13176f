"""Which evidence kinds the report knows: the measurements each declares, and the module that builds its section.

One :class:`Kind` line per evidence kind in :data:`KINDS`. ``measurements``
are the keys of ``record["measurements"]`` the page shows (declared here,
never guessed from the record); ``key_figure`` the one shown beside the
verdict; ``canary`` the name the board shows, the command line's
(``rtv canary NAME``, ``rtv run``'s summary; the kind's own name when
empty; a builder may name it per record, ``Section.canary``: a
:data:`RAISED_KIND` record is shown under the canary that raised). ``builder`` names a module with ``section(record, folder) -> Section``
(``reports.context``), imported only when a record of that kind is shown;
without one, :func:`reports.generic.section` renders the checks and the
declared measurements. A kind missing here is shown with its checks only,
and the page says it is not registered.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RAISED_KIND", "RECEIPT_KIND", "Kind", "KINDS", "kind"]

RECEIPT_KIND = "gpu-receipt"  # written by ci.receipts, shown by reports.receipts
RAISED_KIND = "canary-raised"  # written by canaries.registry.Canary.record_raised, shown by reports.raised


@dataclass(frozen=True, kw_only=True)
class Kind:
    name: str
    title: str
    measurements: tuple[str, ...] = ()
    key_figure: str | None = None
    builder: str | None = None
    canary: str = ""

    @property
    def label(self) -> str:
        """The name the board shows (``canary``, else the kind's name)."""
        return self.canary or self.name


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(name="smoke", title="CPU smoke: one LoRA training step"),
        Kind(
            name="derivative-canary",
            canary="derivative",
            title="Derivative canary: stale gradients against the FP64 oracle",
            measurements=(
                "examples",
                "examples_backpropagated",
                "records_checked",
                "stale_share_of_checked",
                "corrected_records",
                "errors_predicted_and_matched",
                "worst_gradient_relative_l2",
                "worst_gradient_error_over_threshold",
                "worst_logprob_relative_l2",
                "worst_step_relative_l2",
                "worst_logical_relative_l2",
                "seconds",
            ),
            key_figure="worst_gradient_error_over_threshold",
            builder="reports.canaries",
        ),
        Kind(
            name="memory-canary",
            canary="memory",
            title="Memory canary: what a forward holds, and when it is gone",
            measurements=("offload", "admission"),
            builder="reports.canaries",
        ),
        Kind(
            name="resume-canary",
            canary="resume",
            title="Resume canary: jobs killed by SIGKILL resume bitwise from their last save",
            measurements=("kills", "kills_inside_a_save", "resumed_from_a_save", "negative_control_differs", "seconds"),
            builder="reports.canaries",
        ),
        Kind(
            name="liveness-canary",
            canary="liveness",
            title="Liveness canary: injected hangs reported in time, naming the rank and the collective",
            measurements=("deadline_s", "margin_s", "lag", "kill", "skip"),
        ),
        Kind(
            name="planner-canary",
            canary="planner",
            title="Planner canary: auto's choices and estimates against measured placements",
            measurements=("certificate", "seconds"),
            builder="reports.planner",
        ),
        Kind(
            name="planner-miss",  # no canary: written by validation.misses.MissLog, shown by its kind's name
            title="Planner miss: an estimate exceeded or a refusal, replayable on a CPU",
            measurements=("kind", "estimate", "measured", "raised", "inputs"),
        ),
        Kind(
            name="rollout-canary",
            canary="rollout",
            title="Rollout canary: engine against trainer log-probs, publication faults, per-token versions and lag",
            measurements=("publication", "lags", "seconds"),
            builder="reports.rollout",
        ),
        Kind(
            name="mutation-suite",
            canary="mutations",
            title="Mutation suite: every injected bug is caught",
            measurements=("run", "caught", "inapplicable"),
            builder="reports.canaries",
        ),
        Kind(
            name="learning",
            title="Learning comparison: matched-schedule arms across seeds",
            measurements=("seconds",),
            builder="reports.learning",
        ),
        Kind(
            name="benchmark",
            title="Benchmark: versioned-trainer arms against a plain PyTorch step (ABBA)",
            measurements=("seconds",),
            builder="reports.benchmark",
        ),
        Kind(
            name="benchmark-baseline",
            canary="benchmark --baseline",
            title="Benchmark against a base: one arm on two source trees, REV → HEAD (ABBA, two worker processes)",
            measurements=("sources", "first_losses"),
            builder="reports.baseline",
        ),
        Kind(
            name="benchmark-sweep",
            canary="benchmark --sweep",
            title="Cost growth: arms against plain over sequence length x batch, with a fit",
            builder="reports.sweep",
        ),
        Kind(
            name="mutation-score",
            title="Mutation score: the suite's strength, measured with mutmut",
            builder="reports.mutation",
        ),
        Kind(
            name="conform",
            title="Conformance: adapters x checks against the suite's FP64 oracle",
            measurements=("seconds",),
            builder="reports.conform",
        ),
        Kind(name=RECEIPT_KIND, title="GPU CI termination receipt", builder="reports.receipts"),
        Kind(
            name=RAISED_KIND,  # shown under the name of the canary that raised (its config's, reports.raised)
            title="A canary that raised: no verdict of its own, so recorded as failed",
            measurements=("error", "message"),
            builder="reports.raised",
        ),
    )
}


def kind(name: str) -> Kind | None:
    """The registered kind ``name``, or None."""
    return KINDS.get(name)
