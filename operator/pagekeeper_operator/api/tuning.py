"""`spec.tuning` and `status.recommendations` / `status.tuning`: the memory policy tunes itself.

The tuner reads each server's metric window, recommends changes of its memory policy
(`tuning.rules`), and in Apply mode tries the top one on a canary and keeps it only when it
measurably wins (`tuning.decide`). Nothing here is ever written to spec: an accepted or promoted
change is a layer of the effective policy in status (`effective.compose`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from pagekeeper_operator.api.policy import DEFAULT_GPU_MEMORY_UTILIZATION, BlockSize, MemoryPolicy
from pagekeeper_operator.api.types import ApiModel, Timestamp, cel, validations

TuningMode = Literal["Off", "Recommend", "Apply"]
Objective = Literal["Throughput", "ThroughputUnderTTFT", "ThroughputUnderITL"]
ChangeSource = Literal["Accepted", "Promoted"]
TrialOutcome = Literal["Promoted", "RolledBack", "Skipped"]
MAX_RECOMMENDATIONS = 16
MAX_OUTCOMES = 20
MAX_HOLD_OFFS = 32

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


class FloatRange(ApiModel):
    """Closed interval [min, max] of a fractional field."""

    min: float = Field(gt=0.0, le=0.99, description="Lowest value the tuner may set.")
    max: float = Field(gt=0.0, le=0.99, description="Highest value the tuner may set.")


class IntRange(ApiModel):
    """Closed interval [min, max] of an integer field."""

    min: int = Field(ge=1, le=1_048_576, description="Lowest value the tuner may set.")
    max: int = Field(ge=1, le=1_048_576, description="Highest value the tuner may set.")


class TuningBounds(ApiModel):
    """Where the tuner may move each memory-policy field; it never leaves these bounds.

    An unset range leaves the field free within its own schema limits; each range must contain
    the field's spec.memoryPolicy value.
    """

    gpu_memory_utilization: FloatRange | None = Field(
        default=None,
        description=(
            "Range of gpuMemoryUtilization; unset: up to 0.95. The tuner only raises it, into "
            "measured slack (spec.remediation.adaptive steps it down after an OOM)."
        ),
    )
    max_num_seqs: IntRange | None = Field(
        default=None, description="Range of maxNumSeqs; unset: any value the schema allows."
    )
    max_num_batched_tokens: IntRange | None = Field(
        default=None,
        description="Range of maxNumBatchedTokens; unset: any value the schema allows.",
    )
    block_sizes: list[BlockSize] | None = Field(
        default=None,
        min_length=1,
        max_length=3,
        description=(
            "Block sizes the tuner may choose; must include spec.memoryPolicy.blockSize. Unset: "
            "every size the runtime accepts (16 and 32 under vllm)."
        ),
    )
    allow_fp8_kv: bool = Field(
        default=False,
        description=(
            "Whether the tuner may propose kvCacheDtype fp8 (about twice the KV tokens, at a "
            "small cost in accuracy). Off unless you opt in."
        ),
    )
    allow_prefix_caching_change: bool = Field(
        default=True, description="Whether the tuner may turn enablePrefixCaching on or off."
    )
    allow_allocator_change: bool = Field(
        default=True,
        description="Whether the tuner may change allocator options (expandableSegments).",
    )
    allow_fragmentation_buffer_change: bool = Field(
        default=True,
        description=(
            "Whether the tuner may set fragmentationBuffer from the observed reserved minus "
            "allocated peak (runtime pagekeeper only)."
        ),
    )


class TuningSpec(ApiModel):
    """Let the operator recommend, or try and keep, better memory-policy values."""

    model_config = ConfigDict(json_schema_extra=validations(TTFT_RULE, ITL_RULE))

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
        return self


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
    does_not_fit: str | None = Field(
        default=None,
        max_length=512,
        description=(
            "Why the effective policy with this change would not fit its GPUs, from the memory "
            "plan: accepted, its rollout would be held (PolicyFits False); Apply mode skips it. "
            "Unset when it fits or the GPU is not known."
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


class TrialRecord(ApiModel):
    """The outcome of one trial, with the numbers it was decided on."""

    field: str = Field(max_length=64, description="The memoryPolicy field tried.")
    current: str = Field(max_length=64, description="Its value before.")
    proposed: str = Field(max_length=64, description="The value tried.")
    outcome: TrialOutcome = Field(
        description=(
            "Promoted (a measured win), RolledBack (a loss, a tie, a failed canary, or a "
            "candidate that stopped fitting), or Skipped (the candidate does not fit its GPUs: "
            "no canary ran)."
        )
    )
    time: Timestamp = Field(description="When it was decided (RFC 3339).")
    evidence: list[Evidence] = Field(
        default_factory=list,
        max_length=16,
        description="Canary and baseline means, improvement, noise, p-value, sample counts.",
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
    message: str = Field(
        default="", max_length=1024, description="Why there is no recommendation, if none."
    )


def _order_rule(field: str) -> dict[str, str]:
    path = f"self.tuning.bounds.{field}"
    return cel(
        f"!has({path}) || {path}.min <= {path}.max",
        f"spec.tuning.bounds.{field}.min must be <= spec.tuning.bounds.{field}.max",
        f".tuning.bounds.{field}.min",
    )


def _range_rule(field: str) -> dict[str, str]:
    path = f"self.tuning.bounds.{field}"
    value = f"self.memoryPolicy.{field}"
    unbound = ""
    if field == "gpuMemoryUtilization":
        # Unset, it means 0.9; under a KV byte budget there is no utilization to bound.
        unbound = " || has(self.memoryPolicy.kvCacheMemory)"
        value = f"(has({value}) ? {value} : {DEFAULT_GPU_MEMORY_UTILIZATION})"
    return cel(
        f"!has({path}) || {path}.min > {path}.max{unbound}"
        f" || ({path}.min <= {value} && {value} <= {path}.max)",
        f"spec.tuning.bounds.{field} must contain spec.memoryPolicy.{field} (the tuner starts "
        "from the spec's value, so it must lie inside the bounds)",
        f".tuning.bounds.{field}",
    )


RANGE_FIELDS = ("gpuMemoryUtilization", "maxNumSeqs", "maxNumBatchedTokens")
APPLY_RULE = cel(
    "self.tuning.mode != 'Apply' || self.rollout.canary.enabled",
    "spec.tuning.mode Apply needs spec.rollout.canary.enabled (a change is tried on canary pods "
    "against the others before it is kept)",
    ".tuning.mode",
)
BOUNDS_RULES: tuple[dict[str, str], ...] = (
    *(_order_rule(field) for field in RANGE_FIELDS),
    *(_range_rule(field) for field in RANGE_FIELDS),
    cel(
        "!has(self.tuning.bounds.blockSizes)"
        " || self.memoryPolicy.blockSize in self.tuning.bounds.blockSizes",
        "spec.tuning.bounds.blockSizes must include spec.memoryPolicy.blockSize (the tuner "
        "starts from the spec's value, so it must lie inside the bounds)",
        ".tuning.bounds.blockSizes",
    ),
)


def bounds_violation(bounds: TuningBounds, policy: MemoryPolicy) -> str | None:
    """The message of the first BOUNDS_RULES rule `policy` breaks, or None."""
    ranges: tuple[tuple[FloatRange | IntRange | None, float | None], ...] = (
        (bounds.gpu_memory_utilization, policy.effective_utilization),
        (bounds.max_num_seqs, policy.max_num_seqs),
        (bounds.max_num_batched_tokens, policy.max_num_batched_tokens),
    )
    for order, (bound, _) in zip(BOUNDS_RULES, ranges, strict=False):
        if bound is not None and bound.min > bound.max:
            return order["message"]
    for contains, (bound, value) in zip(BOUNDS_RULES[len(ranges) :], ranges, strict=False):
        if bound is not None and value is not None and not bound.min <= value <= bound.max:
            return contains["message"]
    if bounds.block_sizes is not None and policy.block_size not in bounds.block_sizes:
        return BOUNDS_RULES[-1]["message"]
    return None
