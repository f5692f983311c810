"""What every recommender rule shares (pure): the proposal it returns, the context it reads,
and the helpers that turn a window's numbers into a proposal (`propose`, `sample_confidence`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.runtime import Runtime
from pagekeeper_operator.api.tuning import TuningSpec
from pagekeeper_operator.policy.fields import read_field, value_text
from pagekeeper_operator.tuning.window import MetricWindow

# Requests a window must have finished before a rule that reads per-request signals proposes.
MIN_REQUESTS = 100
# Prompt tokens looked up in the prefix cache before a rule that reads its counts proposes.
MIN_PREFIX_TOKENS = 50_000
# spec.remediation.triggers.hostMemory.threshold's default.
DEFAULT_HOST_MEMORY_THRESHOLD = 0.9


@dataclass(frozen=True)
class Proposal:
    """One field's proposed value and the numbers it rests on."""

    field: str
    current: str
    proposed: str
    rule: str
    evidence: tuple[tuple[str, float], ...]
    expected_effect: str
    confidence: float


@dataclass(frozen=True)
class Context:
    """What a rule reads: the window, the effective policy, spec.tuning, the runtime, and of
    the pod's host memory the alert's threshold and whether the spec sets its limit."""

    window: MetricWindow
    policy: MemoryPolicy
    tuning: TuningSpec
    runtime: Runtime
    host_memory_threshold: float = DEFAULT_HOST_MEMORY_THRESHOLD
    is_memory_limit_fixed: bool = False  # spec.resources.limits.memory set, not the plan's


Rule = Callable[[Context], Proposal | None]


def sample_confidence(count: float, minimum: float) -> float:
    """0.5 at the minimum sample count, rising to 1 at four times it."""
    return min(1.0, 0.5 + 0.5 * (count - minimum) / (3 * minimum))


def propose(
    ctx: Context,
    field: str,
    value: object,
    rule: str,
    evidence: dict[str, float],
    effect: str,
    confidence: float,
) -> Proposal:
    return Proposal(
        field=field,
        current=read_field(ctx.policy, field),
        proposed=value_text(value),
        rule=rule,
        evidence=tuple((k, round(v, 6)) for k, v in evidence.items()),
        expected_effect=effect,
        confidence=round(max(0.0, min(1.0, confidence)), 3),
    )


def is_kv_bound(w: MetricWindow, peak: float = 0.9) -> bool:
    return (w.kv_usage_peak or 0.0) >= peak and (
        w.num_preemptions > 0 or (w.waiting_avg or 0.0) >= 1.0
    )


def clip_int(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))
