"""`spec.rollout` with its canary, and `status.canary`: a policy change runs on a few pods first.

The pure decision is `canary.decide_canary`; these are its inputs and its record in status.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from pagekeeper_operator.api.types import ApiModel, Timestamp, cel, validations

CanarySignal = Literal[
    "oomEvents", "fragmentation", "kvCacheSaturation", "engineStalled", "restarts"
]
CANARY_SIGNALS: tuple[CanarySignal, ...] = (
    "oomEvents",
    "fragmentation",
    "kvCacheSaturation",
    "engineStalled",
    "restarts",
)
CanaryPhase = Literal["Analyzing", "Promoted", "Failed"]


class CanarySpec(ApiModel):
    """Run a changed pod template on a few pods before every replica gets it."""

    enabled: bool = Field(
        default=False,
        description=(
            "When true, a change of spec.memoryPolicy, spec.model or the image first runs on "
            "canary pods beside the current ones, is watched for analysisSeconds, then rolls to "
            "every replica (clean) or is taken back (failed). Other changes roll as usual."
        ),
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=100,
        description=(
            "Canary pods. They count against the same GPUs: with rollout.maxSurge 0 they "
            "replace that many current pods during the analysis; with maxSurge > 0 they are "
            "added beside them. Must be below spec.replicas, and at most "
            "rollout.maxUnavailable under maxSurge 0."
        ),
    )
    analysis_seconds: int = Field(
        default=1800,
        ge=1,
        le=7 * 24 * 3600,
        description="How long the canary pods must run clean before the change rolls on.",
    )
    fail_on: list[CanarySignal] = Field(
        default_factory=lambda: list(CANARY_SIGNALS),
        max_length=len(CANARY_SIGNALS),
        description=(
            "Signals that fail the canary: oomEvents (a container ended out of memory), "
            "restarts (any container restart), and the memory alerts fragmentation, "
            "kvCacheSaturation and engineStalled firing for a canary pod (as remediation "
            "records them)."
        ),
    )


class CanaryStatus(ApiModel):
    """The canary of the latest policy change, as the operator runs it."""

    phase: CanaryPhase = Field(
        description=(
            "Analyzing: canary pods run the new template; Promoted: it rolled to every replica; "
            "Failed: the canary was taken back, and this template is not tried again."
        )
    )
    template_hash: str = Field(
        max_length=64, description="Identity of the pod template under test (policy and image)."
    )
    stable_template_hash: str = Field(
        max_length=64, description="Identity of the template the other replicas keep running."
    )
    started_at: Timestamp = Field(description="When the analysis started (RFC 3339).")
    finished_at: Timestamp | None = Field(
        default=None, description="When it was promoted or failed (RFC 3339)."
    )
    failed_signal: str | None = Field(
        default=None,
        max_length=64,
        description=(
            "The spec.rollout.canary.failOn signal seen, or noData: Prometheus had no data for "
            "the canary pods for the operator's bound (PAGEKEEPER_CANARY_NO_DATA_SECONDS)."
        ),
    )
    data_since: Timestamp | None = Field(
        default=None,
        description=(
            "Since when Prometheus has had data for every ready canary pod without a gap "
            "(RFC 3339); the analysis counts from the later of this and startedAt. Unset "
            "without PAGEKEEPER_PROMETHEUS_URL."
        ),
    )
    data_missing_since: Timestamp | None = Field(
        default=None,
        description=(
            "Since when Prometheus has had no data for a ready canary pod (RFC 3339): the "
            "canary holds, and is taken back once this is older than the operator's bound."
        ),
    )
    message: str = Field(default="", max_length=1024, description="Human-readable detail.")


ROLLOUT_RULE = cel(
    "self.maxSurge > 0 || self.maxUnavailable > 0",
    "spec.rollout.maxUnavailable must be > 0 when maxSurge is 0 (a rollout must be able to "
    "replace a pod)",
    ".maxUnavailable",
)


class RolloutSpec(ApiModel):
    """How pods are replaced when the policy or image changes."""

    model_config = ConfigDict(json_schema_extra=validations(ROLLOUT_RULE))

    max_surge: int = Field(
        default=0,
        ge=0,
        le=100,
        description="Extra pods during a rollout; 0 needs no spare GPUs (the default).",
    )
    max_unavailable: int = Field(
        default=1, ge=0, le=100, description="Pods that may be down during a rollout."
    )
    canary: CanarySpec = Field(
        default_factory=CanarySpec,
        description=(
            "Run a memory-policy, model or image change on canary pods first, and take it back "
            "on its own if they fail (docs/memory-policy.md, Canaries)."
        ),
    )

    @model_validator(mode="after")
    def _check_progress(self) -> RolloutSpec:
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError(ROLLOUT_RULE["message"])
        return self
