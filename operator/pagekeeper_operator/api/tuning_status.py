"""`status.recommendations` and `status.tuning`: what the tuner recommends, the layer it adds
to the effective policy, and Apply mode's trials (`tuning.decide`). Spec is `api.tuning`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagekeeper_operator.api.types import ApiModel, Quantity, Timestamp

ChangeSource = Literal["Accepted", "Promoted"]
TrialOutcome = Literal["Promoted", "RolledBack", "Inconclusive", "Skipped"]
MAX_RECOMMENDATIONS = 16
MAX_OUTCOMES = 20
MAX_HOLD_OFFS = 32
# A trial is judged after its window and, when that window cannot decide, once more over twice
# the window (`tuning.compare`): the looks share the trial's error rate.
MAX_LOOKS = 2


class Evidence(ApiModel):
    """One number from the metric window a recommendation rests on."""

    name: str = Field(max_length=64, description="What was measured (e.g. prefixHitRate).")
    value: float = Field(description="Its value over the window.")


class Recommendation(ApiModel):
    """A proposed change of one memory-policy field, with the numbers behind it."""

    field: str = Field(
        max_length=64,
        description="The memoryPolicy field (camelCase, allocator.* for allocator options).",
    )
    current: str = Field(max_length=64, description="Its value in the effective policy.")
    proposed: str = Field(max_length=64, description="The value proposed.")
    rule: str = Field(max_length=64, description="The rule that proposed it.")
    evidence: list[Evidence] = Field(
        default_factory=list, max_length=16, description="Numbers from the window."
    )
    expected_effect: str = Field(max_length=512, description="What the change should do.")
    confidence: float = Field(
        ge=0.0, le=1.0, description="How sure the rule is, from its sample counts and margin."
    )
    since: Timestamp = Field(description="When first recommended (RFC 3339).")


class DroppedRecommendation(ApiModel):
    """A recommendation left out of status.recommendations: its candidate does not fit."""

    field: str = Field(max_length=64, description="The memoryPolicy field.")
    current: str = Field(max_length=64, description="Its value in the effective policy.")
    proposed: str = Field(max_length=64, description="The value the rule proposed.")
    rule: str = Field(max_length=64, description="The rule that proposed it.")
    reason: str = Field(
        max_length=512,
        description=(
            "Why the effective policy with this change would not fit its GPUs, from the memory "
            "plan: accepted, its rollout would be held (PolicyFits False)."
        ),
    )


class TunedChange(ApiModel):
    """One change in the tuning layer of the effective policy (never in spec)."""

    field: str = Field(max_length=64, description="The memoryPolicy field.")
    value: str = Field(max_length=64, description="The value the pods run with.")
    spec_value: str = Field(
        max_length=64,
        description=(
            "spec.memoryPolicy's value when it was made; the change lapses when spec's value "
            "changes (for instance once it is carried into Git)."
        ),
    )
    source: ChangeSource = Field(
        description="Accepted (by annotation) or Promoted (a canary measured a win)."
    )
    rule: str = Field(default="", max_length=64, description="The rule that proposed it.")
    time: Timestamp = Field(description="When it entered the layer (RFC 3339).")


class TuningTrial(ApiModel):
    """The change a canary is trying now (Apply mode)."""

    field: str = Field(max_length=64, description="The memoryPolicy field under trial.")
    current: str = Field(max_length=64, description="Its value on the baseline pods.")
    proposed: str = Field(max_length=64, description="Its value on the canary pods.")
    rule: str = Field(max_length=64, description="The rule that proposed it.")
    started_at: Timestamp = Field(description="When the canary started (RFC 3339).")
    baseline_policy_hash: str | None = Field(
        default=None,
        max_length=64,
        description=(
            "Hash of the effective policy the other pods ran when the trial started; once it "
            "differs (a step-down after an OOM, a spec change, an accepted recommendation) the "
            "trial is rolled back, since its canary and baseline no longer differ by its change "
            "alone."
        ),
    )
    looks: int = Field(
        default=0,
        ge=0,
        le=MAX_LOOKS - 1,
        description=(
            "Windows judged so far that could not decide (too few samples, too noisy): the "
            "trial runs on and is judged again over (looks + 1) windows, at most "
            f"{MAX_LOOKS}, then ends Inconclusive."
        ),
    )
    extended_because: str | None = Field(
        default=None,
        max_length=1024,
        description="Why the last window could not decide, once the trial was extended.",
    )


class TrialRecord(ApiModel):
    """The outcome of one trial, with the numbers it was decided on."""

    field: str = Field(max_length=64, description="The memoryPolicy field tried.")
    current: str = Field(max_length=64, description="Its value before.")
    proposed: str = Field(max_length=64, description="The value tried.")
    outcome: TrialOutcome = Field(
        description=(
            "Promoted (a measured win), RolledBack (a measured loss or tie, a failed canary, or "
            "a candidate that stopped fitting), Inconclusive (the extended trial still could not "
            "tell: rolled back, held off for a quarter of holdOffSeconds), or Skipped (the "
            "candidate does not fit its GPUs: no canary ran)."
        )
    )
    time: Timestamp = Field(description="When it was decided (RFC 3339).")
    evidence: list[Evidence] = Field(
        default_factory=list,
        max_length=16,
        description=(
            "Canary and baseline means, improvement, noise (the spread: evidence, not a "
            "threshold), p-value, sample counts, and the secondary figures' medians."
        ),
    )
    message: str = Field(default="", max_length=1024, description="Why, in words.")


class HoldOff(ApiModel):
    """A field the tuner does not propose to change until a time."""

    field: str = Field(max_length=64, description="The memoryPolicy field.")
    value: str = Field(max_length=64, description="The value that was rolled back or left.")
    until: Timestamp = Field(description="End of the hold-off (RFC 3339).")


class StepDownCaps(ApiModel):
    """The adaptive step-down layer: caps the effective policy keeps after OOM crashes."""

    gpu_memory_utilization: float | None = Field(
        default=None, description="Cap on gpuMemoryUtilization."
    )
    max_num_batched_tokens: int | None = Field(
        default=None, description="Cap on maxNumBatchedTokens."
    )
    kv_offload_size: Quantity | None = Field(
        default=None,
        description=(
            "Cap on memoryPolicy.kvOffload.size after host out-of-memory kills (OOMKilled); "
            "0: the host KV tier is off."
        ),
    )
    spec_memory_policy_hash: str = Field(
        max_length=64, description="The spec.memoryPolicy the caps were made under."
    )


class TuningStatus(ApiModel):
    """The tuner's state: the layers it adds to the policy and, in Apply mode, its trials."""

    changes: list[TunedChange] = Field(
        default_factory=list,
        max_length=MAX_RECOMMENDATIONS,
        description="The tuning layer of the effective policy: accepted and promoted changes.",
    )
    step_down: StepDownCaps | None = Field(
        default=None,
        description="The adaptive step-down layer on top of it (spec.remediation.adaptive).",
    )
    trial: TuningTrial | None = Field(
        default=None, description="The change a canary is trying now (Apply mode)."
    )
    history: list[TrialRecord] = Field(
        default_factory=list,
        max_length=MAX_OUTCOMES,
        description="Outcomes of the latest trials, oldest first.",
    )
    day: str | None = Field(
        default=None, max_length=16, description="UTC day (YYYY-MM-DD) changesToday counts."
    )
    changes_today: int = Field(default=0, ge=0, description="Trials started on that day.")
    hold_offs: list[HoldOff] = Field(
        default_factory=list,
        max_length=MAX_HOLD_OFFS,
        description="Fields not proposed again until their time (spec.tuning.holdOffSeconds).",
    )
    dropped: list[DroppedRecommendation] = Field(
        default_factory=list,
        max_length=MAX_RECOMMENDATIONS,
        description=(
            "Recommendations the rules made whose candidate does not fit its GPUs, with the "
            "plan's reason: left out of status.recommendations (Apply mode records them Skipped)."
        ),
    )
    message: str = Field(
        default="", max_length=1024, description="Why there is no recommendation, if none."
    )
