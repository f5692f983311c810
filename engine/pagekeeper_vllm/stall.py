"""Whether a vLLM child is stuck, from what its probes saw (pure; `probe` does the I/O).

Two signs, each over `--stuck-timeout` seconds:
- work without progress: requests running or waiting (`vllm:num_requests_running`,
  `vllm:num_requests_waiting`) while the tokens vLLM counts (`vllm:generation_tokens_total`,
  and `vllm:prompt_tokens_total`, so a long prefill that finishes counts) do not grow;
- no health: `/health` has not answered 200 (it hung past the probe's timeout, refused, or
  answered an error) since the last time it did.
The clock of each starts when probing starts (after vLLM said it is ready), so start-up never
counts; an idle vLLM (nothing running or waiting) is making all the progress it can.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagekeeper_engine.stuck import StuckReport

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
TOKEN_COUNTERS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total")


@dataclass(frozen=True)
class VllmProgress:
    """vLLM's progress counters at one scrape, summed over its engines' label sets."""

    num_running: int
    num_waiting: int
    num_tokens: float  # generated and prompt tokens counted so far

    @property
    def has_work(self) -> bool:
        return self.num_running + self.num_waiting > 0


def parse_progress(text: str) -> VllmProgress | None:
    """The counters in a `/metrics` page (Prometheus text format); None where any is absent."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, brace, rest = line.partition("{")
        if brace:
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if name not in (RUNNING, WAITING, *TOKEN_COUNTERS) or not fields:
            continue
        try:
            sums[name] = sums.get(name, 0.0) + float(fields[0])
        except ValueError:
            continue
    if RUNNING not in sums or WAITING not in sums or TOKEN_COUNTERS[0] not in sums:
        return None
    return VllmProgress(
        int(sums[RUNNING]), int(sums[WAITING]), sum(sums.get(name, 0.0) for name in TOKEN_COUNTERS)
    )


class StallTracker:
    """What the probes saw so far, and whether it adds up to stuck (`check`). Times are
    `time.monotonic()` seconds, passed in."""

    def __init__(self, timeout_s: float, now_s: float) -> None:
        assert timeout_s > 0, timeout_s
        self.timeout_s = timeout_s
        self.last_healthy_s = now_s
        self.last_progress_s = now_s  # the newest scrape with more tokens, or with no work
        self.progress: VllmProgress | None = None

    def saw_health(self, now_s: float, *, is_healthy: bool) -> None:
        if is_healthy:
            self.last_healthy_s = now_s

    def saw_progress(self, now_s: float, progress: VllmProgress | None) -> None:
        """One scrape's counters (None: unreadable, which leaves the judgement to /health)."""
        if progress is None:
            return
        previous = self.progress
        if not progress.has_work or previous is None or progress.num_tokens != previous.num_tokens:
            self.last_progress_s = now_s
        self.progress = progress

    def check(self, now_s: float) -> StuckReport | None:
        """The report of a stuck child, or None."""
        progress = self.progress or VllmProgress(0, 0, 0.0)
        held = f"{progress.num_running} running and {progress.num_waiting} waiting"
        limit = f"(--stuck-timeout {self.timeout_s:g})"
        unhealthy_s = now_s - self.last_healthy_s
        if unhealthy_s >= self.timeout_s:
            detail = f"vLLM's /health has not answered 200 for {unhealthy_s:.1f} s, with {held}"
            return StuckReport(
                unhealthy_s, progress.num_running, progress.num_waiting, f"{detail} {limit}"
            )
        stalled_s = now_s - self.last_progress_s
        if progress.has_work and stalled_s >= self.timeout_s:
            detail = f"vLLM counted no new token for {stalled_s:.1f} s with {held}"
            return StuckReport(
                stalled_s, progress.num_running, progress.num_waiting, f"{detail} {limit}"
            )
        return None
