"""The tuner's step inside a reconcile: observe (Prometheus), tune (pure), and the canary's
spec and outcome during a trial.

The canary Deployment runs the effective policy plus the change under trial (the composition's
`rendered` policy, `policy.effective`); the canary's own
analysis keeps failing it on its `failOn` signals, but it never promotes a trial by the clock:
only `decide`'s measured win does (`trial_canary_spec`, `promote_canary`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from pagekeeper_operator.adapters.prometheus import PrometheusError, query_samples
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.rollout import CanarySpec, CanaryStatus
from pagekeeper_operator.policy import effective
from pagekeeper_operator.rollout.canary import CANARY_SUFFIX
from pagekeeper_operator.timestamps import format_time
from pagekeeper_operator.tuning.compare import compare
from pagekeeper_operator.tuning.decide import TrialEvidence
from pagekeeper_operator.tuning.observe import (
    Scope,
    num_samples,
    observe_server,
    records_since,
    sample_step,
    scope_p99,
)
from pagekeeper_operator.tuning.trial_queries import (
    pooled,
    secondary_samples,
    throughput_samples_query,
)
from pagekeeper_operator.tuning.tuner import Observation
from pagekeeper_operator.tuning.window import MetricWindow

NO_PROMETHEUS = "PAGEKEEPER_PROMETHEUS_URL is not set: the tuner has no metric window"
# The canary's own clock never promotes a trial; `decide` ends it within MAX_LOOKS windows.
TRIAL_ANALYSIS_SECONDS = 7 * 24 * 3600
FULL_COVERAGE = 0.75  # of a window's samples, for each canary pod
MIN_REFRESH_SECONDS = 5


def is_covered(
    by_pod: Mapping[str, Sequence[float]], seconds: int, step: int | None = None
) -> bool:
    """Whether every canary pod with samples in the window served (nearly) all of it.

    A pod that started serving within the window would be judged on its start, so the trial
    waits (`decide` up to twice the window). A canary pod replaced mid-trial (evicted by
    remediation, deleted) leaves two short series, its own and its successor's: the verdict
    waits until the replaced pod's series has left the window (a window after it went) and
    the successor has FULL_COVERAGE of it, so an eviction in a trial's first window still gets
    a verdict within twice the window, and no pod is judged on part of one.
    """
    expected = num_samples(seconds) if step is None else seconds // step
    full = FULL_COVERAGE * expected
    return bool(by_pod) and min(len(s) for s in by_pod.values()) >= full


def canary_failure(server: LLMServer, now: datetime) -> str | None:
    """Why the trial's canary failed since the trial started, else None: its failOn message
    (an eviction of a canary pod counts only through a failOn alert behind it, `canary`), or,
    whatever failOn lists, a canary pod that ended out of memory or stuck (remediation records
    each termination; a tuning change must never cost one)."""
    tuning, canary = server.status.tuning, server.status.canary
    if tuning is None or tuning.trial is None:
        return None
    started = tuning.trial.started_at
    if canary is not None and canary.phase == "Failed" and canary.started_at >= started:
        return canary.message
    prefix = f"{server.metadata.name}{CANARY_SUFFIX}-"
    for record in server.status.remediation_history:
        if (
            record.action == "step-down"
            and record.pod.startswith(prefix)
            and record.time >= started
        ):
            return f"canary pod {record.pod} ended ({record.alert}) at {format_time(record.time)}"
    return None


def _trial_evidence(server: LLMServer, url: str, now: datetime) -> TrialEvidence | None:
    status, spec = server.status, server.spec.tuning
    trial = status.tuning.trial if status.tuning is not None else None
    if trial is None:
        return None
    failure = canary_failure(server, now)
    if failure is not None:
        return TrialEvidence(None, canary_failure=failure)
    # The look due: the trial's whole run so far, `looks + 1` windows (`decide`).
    seconds = (trial.looks + 1) * spec.window_seconds
    if (now - trial.started_at).total_seconds() < seconds:
        return TrialEvidence(None)  # `decide` waits for the whole window
    step = sample_step(spec.window_seconds)
    name, namespace = server.metadata.name, server.metadata.namespace
    # Canary pods are <name>-canary-<hash>-<id>; the others <name>-<hash>-<id>.
    canary_scope = Scope(namespace, name, f"{name}{CANARY_SUFFIX}-.*")
    baseline_scope = Scope(namespace, name, f"{name}-[a-z0-9]+-[a-z0-9]+")

    def query(promql: str, label: str) -> dict[str, list[float]]:
        return query_samples(url, promql, label)

    by_pod = query(throughput_samples_query(canary_scope, seconds, step), "pod")
    if not is_covered(by_pod, seconds, step):
        return TrialEvidence(None)
    baseline = pooled(query(throughput_samples_query(baseline_scope, seconds, step), "pod"))
    secondary = secondary_samples(
        query, spec.secondaries, canary_scope, baseline_scope, seconds, step
    )
    histogram, bound = {
        "ThroughputUnderTTFT": ("vllm:time_to_first_token_seconds", spec.ttft_p99_seconds),
        "ThroughputUnderITL": ("vllm:inter_token_latency_seconds", spec.itl_p99_seconds),
    }.get(spec.objective, (None, None))
    p99s = [
        None if histogram is None else scope_p99(url, scope, seconds, histogram)
        for scope in (canary_scope, baseline_scope)
    ]
    verdict = compare(
        pooled(by_pod), baseline, secondary=secondary,
        canary_p99=p99s[0], p99_bound=bound, baseline_p99=p99s[1],
    )  # fmt: skip
    return TrialEvidence(verdict)


class WindowCache:
    """Each server's last window, so Prometheus is asked for it at most every eighth of the
    window (at least MIN_REFRESH_SECONDS) however often the server is reconciled; a change of
    what the window is made from (the window's length, the cap it measures, an alert, an OOM,
    a step-down) asks again at once."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, str], tuple[datetime, str, MetricWindow]] = {}

    def get(
        self, key: tuple[str, str], inputs: str, seconds: int, now: datetime
    ) -> MetricWindow | None:
        entry = self._windows.get(key)
        if entry is None or entry[1] != inputs:
            return None
        refresh = max(MIN_REFRESH_SECONDS, seconds // 8)
        return entry[2] if now < entry[0] + timedelta(seconds=refresh) else None

    def put(self, key: tuple[str, str], inputs: str, now: datetime, window: MetricWindow) -> None:
        self._windows[key] = (now, inputs, window)


WINDOWS = WindowCache()


def observe(
    server: LLMServer, url: str | None, now: datetime, cache: WindowCache = WINDOWS
) -> Observation:
    """The server's window and its trial's evidence; never raises for Prometheus."""
    spec, status = server.spec.tuning, server.status
    is_trial = status.tuning is not None and status.tuning.trial is not None
    if spec.mode == "Off" and not is_trial:
        return Observation(None)
    if url is None:
        return Observation(None, error=NO_PROMETHEUS)
    composed = effective.compose(server)
    alerts, ooms = records_since(status.remediation_history, now, spec.window_seconds)
    extra = {
        "num_fragmentation_alerts": alerts,
        "num_oom_terminations": ooms,
        "is_stepped_down": composed.step_down is not None,
    }
    meta = server.metadata
    key, max_num_seqs = (meta.namespace, meta.name), composed.policy.max_num_seqs
    inputs = repr((spec.window_seconds, max_num_seqs, sorted(extra.items())))
    try:
        window = cache.get(key, inputs, spec.window_seconds, now)
        if window is None:
            window = observe_server(
                url, meta.namespace, meta.name, spec.window_seconds, max_num_seqs, extra
            )
            cache.put(key, inputs, now, window)
        trial = _trial_evidence(server, url, now)
    except PrometheusError as exc:
        return Observation(None, error=f"no metric window: {exc}"[:1024])
    return Observation(window, trial)


def trial_canary_spec(server: LLMServer) -> CanarySpec:
    """spec.rollout.canary, without its clock while a trial runs (see the module docstring)."""
    canary = server.spec.rollout.canary
    tuning = server.status.tuning
    if tuning is None or tuning.trial is None:
        return canary
    return canary.model_copy(update={"analysis_seconds": TRIAL_ANALYSIS_SECONDS})


def promote_canary(canary: CanaryStatus | None, now: datetime) -> CanaryStatus | None:
    """The canary record once a trial won: Promoted, so the Deployment takes its template."""
    if canary is None or canary.phase != "Analyzing":
        return canary
    return canary.model_copy(
        update={
            "phase": "Promoted",
            "finished_at": now,
            "message": "the tuning trial measured a win: the new template rolls to every replica",
        }
    )
