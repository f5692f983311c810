"""The memory-policy fields the tuner may change: their text form in status, and applying one.

Status carries values as text (`"true"`, `"0.92"`, `"512Mi"`, `"fp8"`) so one schema fits every
field; `value_text` and `with_change` are the only two conversions. `kvOffload.size` reads ""
while the host KV tier is off; setting it turns the tier on (backend native unless the spec
names one).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationError

from pagekeeper_operator.api.gateway import GatewaySpec
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.runtime import Runtime
from pagekeeper_operator.api.tuning import FloatRange, IntRange, TuningBounds
from pagekeeper_operator.api.types import quantity_value

Kind = Literal["bool", "int", "float", "text"]
# The ceiling of gpuMemoryUtilization when spec.tuning.bounds leaves it unset.
DEFAULT_MAX_UTILIZATION = 0.95

# camelCase field -> kind; "allocator." fields live in memoryPolicy.allocator, "kvOffload." ones
# in memoryPolicy.kvOffload.
TUNABLE: dict[str, Kind] = {
    "gpuMemoryUtilization": "float",
    "maxNumSeqs": "int",
    "maxNumBatchedTokens": "int",
    "blockSize": "int",
    "enablePrefixCaching": "bool",
    "kvCacheDtype": "text",
    "fragmentationBuffer": "text",
    "allocator.expandableSegments": "bool",
    "allocator.garbageCollectionThreshold": "float",
    "kvOffload.size": "text",
}
# What the tuner changes on a vLLM pod: vLLM has no --fragmentation-buffer (docs/memory-policy.md,
# "Fields"), and the tier's evidence (the evicted-then-requested-again count) is the paged
# engine's alone, as is the tier on every version (vLLM's flags start at 0.11.1).
VLLM_TUNABLE: frozenset[str] = frozenset(TUNABLE) - {"fragmentationBuffer", "kvOffload.size"}


def is_tunable(field: str, runtime: Runtime) -> bool:
    return field in (VLLM_TUNABLE if runtime == "vllm" else TUNABLE)


def fields_fixed_by(gateway: GatewaySpec) -> dict[str, str]:
    """Field -> the spec field that fixes it, for fields the tuning layer leaves at the spec's
    value on this server: enablePrefixCaching while its pods publish KV events
    (spec.gateway.kvEvents), since a KV-aware router reads the prefix cache's blocks from them
    (the API server refuses the cache off beside them)."""
    return {"enablePrefixCaching": "spec.gateway.kvEvents"} if gateway.kv_events.enabled else {}


def value_text(value: object) -> str:
    """The status text of a field's value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def change_text(field: str, current: str, proposed: str) -> str:
    """`field current -> proposed` for messages; an unset field (a tier off) reads "unset"."""
    return f"{field} {current or 'unset'} -> {proposed or 'unset'}"


def _typed(field: str, text: str) -> object:
    kind = TUNABLE[field]
    if kind == "bool":
        if text not in ("true", "false"):
            raise ValueError(f"{field}: {text!r} is not true or false")
        return text == "true"
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    return text


def read_field(policy: MemoryPolicy, field: str) -> str:
    """`field`'s value in `policy`, as status text ("" for an unset optional); the budget as
    it is in force (an unset gpuMemoryUtilization reads 0.9)."""
    body = policy.with_budget_resolved().to_api()
    for part in field.split("."):
        body = body.get(part, {}) if isinstance(body, dict) else {}
    return "" if body == {} else value_text(body)


def with_change(policy: MemoryPolicy, field: str, text: str) -> MemoryPolicy:
    """`policy` with `field` set to `text`; ValueError when the result is not a valid policy
    (the same checks the CRD makes). Turning expandable segments on drops maxSplitSizeMb, which
    has no effect on them."""
    if field not in TUNABLE:
        raise ValueError(f"{field} is not a field the tuner changes")
    body: dict[str, Any] = policy.to_api()
    value = _typed(field, text)
    if field == "kvOffload.size":
        body["kvOffload"] = {**(body.get("kvOffload") or {}), "size": value}
    elif field.startswith("allocator."):
        allocator = dict(body.get("allocator") or {})
        allocator[field.removeprefix("allocator.")] = value
        if field == "allocator.expandableSegments" and value is True:
            allocator.pop("maxSplitSizeMb", None)
        body["allocator"] = allocator
    else:
        body[field] = value
    try:
        return MemoryPolicy.model_validate(body)
    except ValidationError as error:
        raise ValueError(f"{field}={text} makes an invalid policy: {error}") from error


def within_bounds(field: str, text: str, bounds: TuningBounds, runtime: Runtime) -> bool:
    """Whether `field` = `text` lies inside spec.tuning.bounds and what the runtime honours."""
    if not is_tunable(field, runtime):
        return False
    value = _typed(field, text)
    ranges: dict[str, FloatRange | IntRange | None] = {
        "gpuMemoryUtilization": bounds.gpu_memory_utilization,
        "maxNumSeqs": bounds.max_num_seqs,
        "maxNumBatchedTokens": bounds.max_num_batched_tokens,
    }
    if field in ranges:
        bound = ranges[field]
        assert isinstance(value, int | float), (field, value)
        if field == "gpuMemoryUtilization" and bound is None:
            return value <= DEFAULT_MAX_UTILIZATION
        return bound is None or bound.min <= value <= bound.max
    if field == "blockSize":
        allowed = set(bounds.block_sizes or (8, 16, 32)) - ({8} if runtime == "vllm" else set())
        return value in allowed
    if field == "kvCacheDtype":
        return value == "auto" or bounds.allow_fp8_kv
    if field == "enablePrefixCaching":
        return bounds.allow_prefix_caching_change
    if field == "fragmentationBuffer":
        return bounds.allow_fragmentation_buffer_change
    if field == "kvOffload.size":
        tier = bounds.kv_offload_size
        assert isinstance(value, str), (field, value)
        return tier is None or tier.min_bytes <= quantity_value(value) <= tier.max_bytes
    return bounds.allow_allocator_change
