"""`LLMServer.spec.remediation` and `status.remediationHistory`: what the operator may do when a
memory alert fires, and the record of what it did.

These models are the single source of the CRD schema: every field carries a description (it
becomes `kubectl explain` text) and only constraints that OpenAPI can express (bounds, patterns,
enums), so the generated schema validates exactly what these models validate.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagekeeper_memplan.defaults import MAX_GPU_MEMORY_UTILIZATION
from pagekeeper_operator.api.triggers import QUANTITY_PATTERN, RemediationTriggers
from pagekeeper_operator.api.types import AliasedModel, Timestamp

RemediationAction = Literal["evict", "skip", "dry-run", "step-down"]


class AdaptiveSpec(AliasedModel):
    """How the effective memory policy steps down after out-of-memory crashes, each on its own
    side: a run-time GPU OOM lowers the GPU terms, a host OOM (OOMKilled) shrinks the host KV
    tier.

    The spec is never written; the stepped-down policy lives in status.effectiveMemoryPolicy.
    """

    enabled: bool = Field(
        default=True,
        description=(
            "Step the effective policy down after a run-time GPU OOM crash or a host OOM kill."
        ),
    )
    utilization_step: float = Field(
        default=0.05,
        gt=0.0,
        le=0.5,
        alias="utilizationStep",
        description="Subtract this from the effective gpuMemoryUtilization per step.",
    )
    min_gpu_memory_utilization: float = Field(
        default=0.7,
        gt=0.0,
        le=MAX_GPU_MEMORY_UTILIZATION,
        alias="minGpuMemoryUtilization",
        description="Floor for the effective gpuMemoryUtilization.",
    )
    max_num_batched_tokens_step: float = Field(
        default=0.5,
        gt=0.0,
        lt=1.0,
        alias="maxNumBatchedTokensStep",
        description=(
            "Once utilization is at its floor, multiply the effective maxNumBatchedTokens by "
            "this factor per step."
        ),
    )
    min_max_num_batched_tokens: int = Field(
        default=2048,
        ge=1,
        alias="minMaxNumBatchedTokens",
        description="Floor for the effective maxNumBatchedTokens.",
    )
    kv_offload_step: float = Field(
        default=0.5,
        gt=0.0,
        lt=1.0,
        alias="kvOffloadStep",
        description=(
            "After a host out-of-memory kill (OOMKilled), multiply the effective "
            "memoryPolicy.kvOffload.size by this factor (whole MiB). No tier: nothing to shrink, "
            "the kill is recorded only."
        ),
    )
    min_kv_offload_size: str = Field(
        default="1Gi",
        alias="minKvOffloadSize",
        pattern=QUANTITY_PATTERN,
        description=(
            "A host KV tier the next step would make smaller than this is switched off "
            "(kvOffload unset in the effective policy) instead."
        ),
    )


class RemediationSpec(AliasedModel):
    """What the operator may do when one of this server's memory alerts fires."""

    enabled: bool = Field(
        default=True, description="Act on this server's alerts; when false the alerts only notify."
    )
    dry_run: bool = Field(
        default=False,
        alias="dryRun",
        description="Record in status and Events what would be done, without evicting.",
    )
    cooldown_seconds: int = Field(
        default=600,
        ge=0,
        le=86400,
        alias="cooldownSeconds",
        description="After an action on this server, take no other for this many seconds.",
    )
    max_unavailable: int = Field(
        default=1,
        ge=1,
        le=100,
        alias="maxUnavailable",
        description=(
            "Evict only while at most this many of the server's pods would be unavailable "
            "(not ready, terminating, or being evicted)."
        ),
    )
    drain_timeout_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        alias="drainTimeoutSeconds",
        description=(
            "How long an evicted pod counts as being evicted (toward maxUnavailable) while it "
            "drains; past it, a pod still present is reported (EvictionStuck Event) and no "
            "longer counted. At most spec.shutdownGracePeriodSeconds, the time the engine gets "
            "to drain before the kubelet stops it."
        ),
    )
    hysteresis_seconds: int = Field(
        default=60,
        ge=0,
        le=86400,
        alias="hysteresisSeconds",
        description="Act only on alerts that have been firing (by startsAt) for this long.",
    )
    memory_healthy_after_seconds: int = Field(
        default=3600,
        ge=1,
        le=604800,
        alias="memoryHealthyAfterSeconds",
        description=(
            "The MemoryHealthy condition, set False by an out-of-memory termination, turns True "
            "again once no other has been seen for this many seconds (status.lastOutOfMemory). "
            "A stepped-down effective memory policy stays stepped down."
        ),
    )
    history_limit: int = Field(
        default=20,
        ge=1,
        le=100,
        alias="historyLimit",
        description="Keep this many most recent entries in status.remediationHistory.",
    )
    triggers: RemediationTriggers = Field(
        default_factory=RemediationTriggers,
        description="The alerts rendered for this server, with thresholds and durations.",
    )
    adaptive: AdaptiveSpec = Field(
        default_factory=AdaptiveSpec,
        description="Stepping the effective memory policy down after GPU OOM crashes.",
    )


class RemediationRecord(AliasedModel):
    """One entry of status.remediationHistory: an action taken, or one deliberately not taken."""

    time: Timestamp = Field(description="When it happened (RFC 3339, UTC).")
    pod: str = Field(max_length=253, description="The pod acted on.")
    alert: str = Field(
        max_length=128,
        description="The alert name (or the OOM classification for step-down).",
    )
    action: RemediationAction = Field(
        description=(
            "evict: evicted through the Eviction API; skip: deliberately not acted on; "
            "dry-run: would have evicted; step-down: lowered the effective memory policy."
        )
    )
    outcome: str = Field(
        max_length=64,
        description=(
            "What came of it. evict: evicted, pdb-blocked, pod-gone or failed (evicting while "
            "the Eviction API has not answered: written first, so an operator that dies "
            "meanwhile is followed by one that settles it); skip: "
            "skipped; dry-run: would-evict; step-down: applied, would-apply, at-floor, "
            "not-applicable or disabled."
        ),
    )
    message: str = Field(default="", max_length=1024, description="Human-readable detail.")
    fingerprint: str | None = Field(
        default=None,
        max_length=64,
        description=(
            "Alertmanager fingerprint of the alert (for step-down: of the termination), so a "
            "repeated delivery is not acted on twice."
        ),
    )
    alert_starts_at: Timestamp | None = Field(
        default=None,
        alias="alertStartsAt",
        description=(
            "startsAt of the alert (for step-down: finishedAt of the termination), RFC 3339; "
            "with fingerprint, the identity of what was acted on."
        ),
    )
