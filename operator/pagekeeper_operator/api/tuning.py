"""`spec.tuning` and `status.recommendations` / `status.tuning`: the memory policy tunes itself.

The tuner reads each server's metric window, recommends changes of its memory policy
(`tuning.rules`), and in Apply mode tries the top one on a canary and keeps it only when it
measurably wins (`tuning.decide`). Nothing here is ever written to spec: an accepted or promoted
change is a layer of the effective policy in status (`effective.compose`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from pagekeeper_operator.api.tuning_bounds import (
    BOUNDS_RULES,
    FloatRange,
    IntRange,
    QuantityRange,
    TuningBounds,
    bounds_violation,
)
from pagekeeper_operator.api.tuning_status import (
    MAX_HOLD_OFFS,
    MAX_LOOKS,
    MAX_OUTCOMES,
    MAX_RECOMMENDATIONS,
    ChangeSource,
    DroppedRecommendation,
    Evidence,
    HoldOff,
    Recommendation,
    StepDownCaps,
    TrialOutcome,
    TrialRecord,
    TunedChange,
    TuningStatus,
    TuningTrial,
)
from pagekeeper_operator.api.types import ApiModel, cel, validations

__all__ = [
    "BOUNDS_RULES", "MAX_HOLD_OFFS", "MAX_LOOKS", "MAX_OUTCOMES", "MAX_RECOMMENDATIONS",
    "ChangeSource", "DroppedRecommendation", "Evidence", "FloatRange", "HoldOff", "IntRange",
    "QuantityRange", "Recommendation", "StepDownCaps", "TrialOutcome", "TrialRecord",
    "TunedChange", "TuningBounds", "TuningStatus", "TuningTrial", "bounds_violation",
]  # fmt: skip

TuningMode = Literal["Off", "Recommend", "Apply"]
Objective = Literal["Throughput", "ThroughputUnderTTFT", "ThroughputUnderITL"]
SecondaryFigure = Literal["PreemptionsPer1000Requests", "TTFTP99", "ITLP99"]
SECONDARY_FIGURES: tuple[SecondaryFigure, ...] = ("PreemptionsPer1000Requests", "TTFTP99", "ITLP99")
# A figure an objective bounds is not also a secondary figure: under the bound it is met, and
# the objective says being further under it is worth nothing.
BOUNDED_FIGURE: dict[Objective, SecondaryFigure] = {
    "ThroughputUnderTTFT": "TTFTP99",
    "ThroughputUnderITL": "ITLP99",
}

TTFT_RULE = cel(
    "self.objective != 'ThroughputUnderTTFT' || has(self.ttftP99Seconds)",
    "spec.tuning.ttftP99Seconds is required when spec.tuning.objective is ThroughputUnderTTFT",
    ".ttftP99Seconds",
)
ITL_RULE = cel(
    "self.objective != 'ThroughputUnderITL' || has(self.itlP99Seconds)",
    "spec.tuning.itlP99Seconds is required when spec.tuning.objective is ThroughputUnderITL",
    ".itlP99Seconds",
)
SECONDARY_RULES = tuple(
    cel(
        f"self.objective != '{objective}' || !has(self.secondaryFigures)"
        f" || !('{figure}' in self.secondaryFigures)",
        f"spec.tuning.secondaryFigures must not name {figure} under objective {objective}: "
        "the objective bounds it, and being further under the bound is worth nothing to it",
        ".secondaryFigures",
    )
    for objective, figure in BOUNDED_FIGURE.items()
)


class TuningSpec(ApiModel):
    """Let the operator recommend, or try and keep, better memory-policy values."""

    model_config = ConfigDict(json_schema_extra=validations(TTFT_RULE, ITL_RULE, *SECONDARY_RULES))

    mode: TuningMode = Field(
        default="Recommend",
        description=(
            "Off: no observation. Recommend (the default): status.recommendations, Events and "
            "the pagekeeper_tuning_recommendation series; nothing running changes unless you "
            "accept one (annotation pagekeeper.dev/accept-recommendation). Apply: the top "
            "recommendation runs on a canary and is kept only when it measurably wins "
            "(docs/memory-policy.md, Tuning)."
        ),
    )
    objective: Objective = Field(
        default="Throughput",
        description=(
            "What a change must improve: Throughput (output tokens/s), ThroughputUnderTTFT "
            "(throughput while TTFT p99 stays under ttftP99Seconds) or ThroughputUnderITL "
            "(throughput while inter-token latency p99 stays under itlP99Seconds)."
        ),
    )
    ttft_p99_seconds: float | None = Field(
        default=None,
        gt=0.0,
        le=3600.0,
        alias="ttftP99Seconds",
        description="TTFT p99 bound in seconds; required by objective ThroughputUnderTTFT.",
    )
    itl_p99_seconds: float | None = Field(
        default=None,
        gt=0.0,
        le=60.0,
        alias="itlP99Seconds",
        description="Inter-token latency p99 bound in seconds; required by ThroughputUnderITL.",
    )
    secondary_figures: list[SecondaryFigure] | None = Field(
        default=None,
        max_length=len(SECONDARY_FIGURES),
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description=(
            "Figures a trial may also win on (docs/memory-policy.md, Tuning): the canary wins "
            "when its throughput is not worse beyond a 5% margin while one of these is "
            "significantly better by a fifth: PreemptionsPer1000Requests, TTFTP99, ITLP99 "
            "(lower is better). Unset: every figure the objective does not bound; []: "
            "throughput alone. An objective's bounded figure may not be named."
        ),
    )
    window_seconds: int = Field(
        default=900,
        ge=60,
        le=7 * 24 * 3600,
        description=(
            "Evidence window: recommendations read the last windowSeconds of metrics, and an "
            "Apply-mode trial compares canary and baseline pods over this long."
        ),
    )
    max_changes_per_day: int = Field(
        default=2,
        ge=0,
        le=48,
        description="Apply mode: most trials started per UTC day (0: recommend only).",
    )
    hold_off_seconds: int = Field(
        default=86_400,
        ge=0,
        le=30 * 86_400,
        description=(
            "How long a change that was rolled back (or a field that was changed) is not "
            "proposed again, so the tuner never oscillates."
        ),
    )
    bounds: TuningBounds = Field(
        default_factory=TuningBounds,
        description=(
            "Where the tuner may move each field; it never leaves them. Each range must contain "
            "the spec.memoryPolicy value (the API server refuses one that does not)."
        ),
    )

    @model_validator(mode="after")
    def _check_objective(self) -> TuningSpec:
        if self.objective == "ThroughputUnderTTFT" and self.ttft_p99_seconds is None:
            raise ValueError(TTFT_RULE["message"])
        if self.objective == "ThroughputUnderITL" and self.itl_p99_seconds is None:
            raise ValueError(ITL_RULE["message"])
        named = self.secondary_figures or []
        if len(set(named)) != len(named):
            raise ValueError("spec.tuning.secondaryFigures names a figure twice")
        for rule, (objective, figure) in zip(SECONDARY_RULES, BOUNDED_FIGURE.items(), strict=True):
            if self.objective == objective and figure in named:
                raise ValueError(rule["message"])
        return self

    @property
    def secondaries(self) -> tuple[SecondaryFigure, ...]:
        """The secondary figures in force: those named, else every one the objective does not
        bound."""
        if self.secondary_figures is not None:
            return tuple(self.secondary_figures)
        bounded = BOUNDED_FIGURE.get(self.objective)
        return tuple(f for f in SECONDARY_FIGURES if f != bounded)


APPLY_RULE = cel(
    "self.tuning.mode != 'Apply' || self.rollout.canary.enabled",
    "spec.tuning.mode Apply needs spec.rollout.canary.enabled (a change is tried on canary pods "
    "against the others before it is kept)",
    ".tuning.mode",
)
