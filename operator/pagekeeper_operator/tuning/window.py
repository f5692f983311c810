"""A metric window: what one server's pods did over the last `seconds`, as plain numbers.

`observe` builds one from Prometheus; the GPU benchmark builds one from the engine's /metrics
and saves it as JSON (`to_json`), which the rule tests load back (`from_json`). A series the
runtime does not export is None, never 0, so a rule that needs it can say so and stay silent.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class MetricWindow:
    """Averages, peaks, counts and quantiles over one window; None: not exported or no data."""

    seconds: float
    num_requests: float  # requests finished in the window
    output_tokens_per_s: float
    prompt_tokens: float  # prompt tokens admitted in the window
    kv_usage_avg: float | None = None  # fraction of KV blocks in use
    kv_usage_peak: float | None = None
    num_preemptions: float = 0.0
    waiting_avg: float | None = None
    waiting_peak: float | None = None
    running_avg: float | None = None
    running_peak: float | None = None
    seq_cap_fraction: float | None = None  # share of samples with running >= maxNumSeqs
    prefix_queries: float = 0.0  # prompt tokens looked up in the prefix cache
    prefix_hits: float = 0.0  # of those, tokens found cached
    # tokens whose full blocks repeated an earlier prompt's while prefix caching was off
    prefix_shadow_hits: float | None = None
    # unused slots of partly filled blocks / allocated slots, while any block is in use
    kv_waste_avg: float | None = None
    reserved_peak_bytes: float | None = None
    fragmentation_peak_bytes: float | None = None  # allocator reserved - allocated, peak
    num_fragmentation_alerts: int = 0
    num_oom_step: float = 0.0  # recovered out-of-memory events inside a step
    num_oom_swap: float = 0.0
    num_oom_startup: float = 0.0
    num_oom_terminations: int = 0  # containers that ended out of memory
    ttft_p99: float | None = None  # seconds
    itl_p99: float | None = None
    gpu_total_bytes: float | None = None  # budget terms of the start-up profile
    budget_allowed_bytes: float | None = None
    fragmentation_buffer_bytes: float | None = None
    kv_cache_bytes: float | None = None  # a pod's GPU KV cache, over its ranks (the budget's)
    # prompt tokens of full blocks no tier held any more when asked for again (runtime pagekeeper)
    prefix_evicted_misses: float | None = None
    host_memory_ratio_peak: float | None = None  # engine container working set / memory limit
    memory_limit_bytes: float | None = None  # the engine container's; None: no limit
    is_stepped_down: bool = False  # adaptive step-down caps the effective policy

    @property
    def num_ooms(self) -> float:
        return (
            self.num_oom_step + self.num_oom_swap + self.num_oom_startup + self.num_oom_terminations
        )

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries > 0 else None

    @property
    def evicted_miss_share(self) -> float | None:
        """Of the prompt tokens looked up, the share evicted earlier and asked for again."""
        misses = self.prefix_evicted_misses
        return misses / self.prefix_queries if misses is not None and self.prefix_queries else None

    @property
    def preemptions_per_request(self) -> float:
        return self.num_preemptions / self.num_requests if self.num_requests > 0 else 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MetricWindow:
        """A window from its dict; unknown keys (a fixture's notes) are left out."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_json(cls, text: str) -> MetricWindow:
        return cls.from_dict(json.loads(text))
