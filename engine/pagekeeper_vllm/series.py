"""The series a vLLM pod exports through the launcher, in Prometheus's text format (pure).

The names and kinds are the paged engine's (`frontend.metric_names`), so the same alert rules
read both runtimes; under vLLM every allocator series also carries `rank`, one per GPU process.
`pagekeeper_oom_events_total` counts the CUDA out-of-memory errors the caching allocators raised
(their `num_ooms`), as `kind="startup"` until vLLM answered its first readiness and `kind="step"`
after; a process that ends keeps its count, so the counter never goes back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pagekeeper_engine.frontend.metric_names import METRICS
from pagekeeper_vllm.reports import ProcessReport

# (name, AllocatorStats field, help): the allocator series, one sample per GPU process.
ALLOCATOR_SERIES: tuple[tuple[str, str, str], ...] = (
    (
        "pagekeeper_allocator_reserved_bytes",
        "reserved",
        "Bytes the CUDA caching allocator holds from the device.",
    ),
    (
        "pagekeeper_allocator_allocated_bytes",
        "allocated",
        "Bytes of the reserved memory that live tensors use.",
    ),
    (
        "pagekeeper_allocator_fragmentation_bytes",
        "fragmentation",
        "Reserved minus allocated: held by the allocator, used by no tensor.",
    ),
    (
        "pagekeeper_allocator_largest_free_segment_bytes",
        "largest_free_block",
        "Largest free block inside reserved segments (sampled).",
    ),
    (
        "pagekeeper_allocator_alloc_retries_total",
        "num_alloc_retries",
        "cudaMalloc calls retried after the allocator freed its cache.",
    ),
)
OOM_SERIES = "pagekeeper_oom_events_total"
OOM_HELP = "CUDA out-of-memory errors raised by the caching allocators of the pod's GPU processes."
# Every pagekeeper_ series a vLLM pod exports; the operator's runtime table is pinned to it.
EXPORTED_SERIES: tuple[str, ...] = (*(name for name, _, _ in ALLOCATOR_SERIES), OOM_SERIES)
assert all(name in METRICS for name in EXPORTED_SERIES), "series outside the metric contract"


@dataclass
class OOMTally:
    """Allocator OOM counts per (pid, device), kept after a process ends, split at readiness."""

    counts: dict[tuple[int, int], int] = field(default_factory=dict)
    total_at_ready: int | None = None

    def update(self, reports: Iterable[ProcessReport]) -> None:
        for report in reports:
            key = (report.pid, report.device)
            self.counts[key] = max(self.counts.get(key, 0), report.stats.num_ooms)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def mark_ready(self) -> None:
        if self.total_at_ready is None:
            self.total_at_ready = self.total

    def by_kind(self) -> dict[str, int]:
        startup = self.total if self.total_at_ready is None else self.total_at_ready
        return {"startup": startup, "step": self.total - startup}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items()) + "}"


def _family_header(name: str, help_text: str) -> list[str]:
    kind, _ = METRICS[name]
    family = name.removesuffix("_total") if kind == "counter" else name
    return [f"# HELP {family} {help_text}", f"# TYPE {family} {kind}"]


def render_metrics(reports: Iterable[ProcessReport], tally: OOMTally, model_name: str) -> str:
    """The exposition for one scrape: allocator series per report, then the OOM counter."""
    reports = list(reports)
    lines: list[str] = []
    for name, attribute, help_text in ALLOCATOR_SERIES:
        if not reports:
            break
        lines += _family_header(name, help_text)
        for report in reports:
            value = getattr(report.stats, attribute)
            labels = _labels({"model_name": model_name, "rank": report.rank})
            lines.append(f"{name}{labels} {int(value)}")
    if reports or tally.counts:
        lines += _family_header(OOM_SERIES, OOM_HELP)
        for kind, count in tally.by_kind().items():
            lines.append(f"{OOM_SERIES}{_labels({'model_name': model_name, 'kind': kind})} {count}")
    return "\n".join(lines) + "\n" if lines else ""
