"""`spec.tuning.bounds`: where the tuner may move each memory-policy field, and the rules that
keep the spec's own values inside them (CEL on the spec, the same checks in `bounds_violation`).
"""

from __future__ import annotations

from pydantic import Field

from pagekeeper_memplan.defaults import DEFAULT_GPU_MEMORY_UTILIZATION, MAX_GPU_MEMORY_UTILIZATION
from pagekeeper_operator.api.policy import BlockSize, MemoryPolicy
from pagekeeper_operator.api.types import ApiModel, Quantity, cel, quantity_value


class FloatRange(ApiModel):
    """Closed interval [min, max] of a fractional field."""

    min: float = Field(
        gt=0.0, le=MAX_GPU_MEMORY_UTILIZATION, description="Lowest value the tuner may set."
    )
    max: float = Field(
        gt=0.0, le=MAX_GPU_MEMORY_UTILIZATION, description="Highest value the tuner may set."
    )


class IntRange(ApiModel):
    """Closed interval [min, max] of an integer field."""

    min: int = Field(ge=1, le=1_048_576, description="Lowest value the tuner may set.")
    max: int = Field(ge=1, le=1_048_576, description="Highest value the tuner may set.")


class QuantityRange(ApiModel):
    """Closed interval [min, max] of a byte quantity."""

    min: Quantity = Field(description="Smallest value the tuner may set (e.g. 8Gi); above 0.")
    max: Quantity = Field(description="Largest value the tuner may set (e.g. 64Gi).")

    @property
    def min_bytes(self) -> int:
        return int(quantity_value(self.min))

    @property
    def max_bytes(self) -> int:
        return int(quantity_value(self.max))


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
    kv_offload_size: QuantityRange | None = Field(
        default=None,
        description=(
            "Range of memoryPolicy.kvOffload.size, the host KV tier per pod; the tuner may turn "
            "the tier on inside it and grow or shrink it (docs/memory-policy.md, The host KV "
            "tier). Unset: any size the memory plan lets the pod's host memory hold "
            "(PolicyFits), from 1Gi. Must contain spec.memoryPolicy.kvOffload.size when set."
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
        # Unset, it means the default; under a KV byte budget there is no utilization to bound.
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
_TIER = "self.tuning.bounds.kvOffloadSize"
_SIZE = "quantity(string(self.memoryPolicy.kvOffload.size))"
_LOW, _HIGH = f"quantity(string({_TIER}.min))", f"quantity(string({_TIER}.max))"
BLOCK_SIZES_RULE = cel(
    "!has(self.tuning.bounds.blockSizes)"
    " || self.memoryPolicy.blockSize in self.tuning.bounds.blockSizes",
    "spec.tuning.bounds.blockSizes must include spec.memoryPolicy.blockSize (the tuner "
    "starts from the spec's value, so it must lie inside the bounds)",
    ".tuning.bounds.blockSizes",
)
TIER_MIN_RULE = cel(
    f"!has({_TIER}) || {_LOW}.isGreaterThan(quantity('0'))",
    "spec.tuning.bounds.kvOffloadSize.min must be above 0 (the smallest host KV tier the tuner "
    "may set; it never turns the tier off)",
    ".tuning.bounds.kvOffloadSize.min",
)
TIER_ORDER_RULE = cel(
    f"!has({_TIER}) || !{_HIGH}.isLessThan({_LOW})",
    "spec.tuning.bounds.kvOffloadSize.min must be <= spec.tuning.bounds.kvOffloadSize.max",
    ".tuning.bounds.kvOffloadSize.min",
)
TIER_RANGE_RULE = cel(
    f"!has({_TIER}) || !has(self.memoryPolicy.kvOffload) || {_HIGH}.isLessThan({_LOW})"
    f" || (!{_SIZE}.isLessThan({_LOW}) && !{_HIGH}.isLessThan({_SIZE}))",
    "spec.tuning.bounds.kvOffloadSize must contain spec.memoryPolicy.kvOffload.size (the tuner "
    "starts from the spec's value, so it must lie inside the bounds)",
    ".tuning.bounds.kvOffloadSize",
)
# Appended in this order: tests and the API server's messages name the rules by position.
BOUNDS_RULES: tuple[dict[str, str], ...] = (
    *(_order_rule(field) for field in RANGE_FIELDS),
    *(_range_rule(field) for field in RANGE_FIELDS),
    BLOCK_SIZES_RULE,
    TIER_MIN_RULE,
    TIER_ORDER_RULE,
    TIER_RANGE_RULE,
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
        return BLOCK_SIZES_RULE["message"]
    tier, size = bounds.kv_offload_size, policy.kv_offload
    if tier is None:
        return None
    if tier.min_bytes <= 0:
        return TIER_MIN_RULE["message"]
    if tier.min_bytes > tier.max_bytes:
        return TIER_ORDER_RULE["message"]
    if size is not None and not tier.min_bytes <= size.size_bytes <= tier.max_bytes:
        return TIER_RANGE_RULE["message"]
    return None
