"""One tuning step of one server (pure): accepted recommendations, new recommendations, the
Apply-mode decision, and the Events to post.

- An accepted recommendation (annotation `pagekeeper.dev/accept-recommendation: <field>[,...]`
  naming a field of `status.recommendations`) enters the tuning layer as source Accepted: the
  pods run it, spec is untouched, and the annotation may stay (accepting again is a no-op).
- Recommendations come from `rules.recommend` on the composed effective policy, without held
  fields. A recommendation whose field and proposed value are unchanged keeps its `since` and
  the evidence of the window that first made it, so a steady state writes no status and posts
  no Event; a new or changed one posts a `TuningRecommendation` Event.
- Without a window (Prometheus away) the previous recommendations stay as they were.
- Each recommendation is planned on the server's GPUs (`does_not_fit`, the memory plan's
  gate): one whose candidate (the effective policy with it) does not fit is left out of
  `status.recommendations` in every mode, since accepting it would only hold the rollout, and
  listed in `status.tuning.dropped` with the plan's reason (a `TuningRecommendationDropped`
  Event when it is new, outside Apply mode, whose skip posts its own).
- In Apply mode `decide` starts, judges and ends trials. A candidate (with a recommendation,
  or with the change under trial) that does not fit starts no canary: the gate would hold its
  rollout, so the trial is skipped, or ended, at once instead of waiting out its window.
- The baseline is the composed policy without the trial (`Baseline`): a trial records its hash,
  and `baseline_change` says what moved it (the spec, a step-down and the OOM behind it, or
  the tuning layer) for the trial's roll-back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.tuning import (
    DroppedRecommendation,
    Evidence,
    Recommendation,
    StepDownCaps,
    TunedChange,
    TuningStatus,
    TuningTrial,
)
from pagekeeper_operator.api.types import quantity_value
from pagekeeper_operator.policy import effective
from pagekeeper_operator.policy.effective import EffectivePolicy, memory_policy_hash
from pagekeeper_operator.policy.fields import (
    TUNABLE,
    change_text,
    fields_fixed_by,
    read_field,
    within_bounds,
)
from pagekeeper_operator.tuning.decide import (
    Baseline,
    TrialEvidence,
    TuningEvent,
    decide,
    held_fields,
)
from pagekeeper_operator.tuning.proposal import Proposal
from pagekeeper_operator.tuning.rules import recommend
from pagekeeper_operator.tuning.window import MetricWindow

ACCEPT_ANNOTATION = "pagekeeper.dev/accept-recommendation"
NO_CHANGE_MESSAGE = "the window supports no change"
NO_FIT_MESSAGE = "no recommended change fits the GPUs (status.tuning.dropped says why)"
# The candidate server and its effective policy -> why that policy does not fit its GPUs, or
# None (fits, or unknown).
FitCheck = Callable[[LLMServer, MemoryPolicy], str | None]


@dataclass(frozen=True)
class Observation:
    """What the edge observed: the server's window, the trial's evidence, or why neither."""

    window: MetricWindow | None
    trial: TrialEvidence | None = None
    error: str | None = None


@dataclass
class TuneResult:
    recommendations: list[Recommendation]
    tuning: TuningStatus | None
    events: list[TuningEvent] = field(default_factory=list)
    promoted: TunedChange | None = None  # a trial won: its canary template rolls everywhere


def accepted_fields(server: LLMServer) -> list[str]:
    text = server.metadata.annotations.get(ACCEPT_ANNOTATION, "")
    return [name.strip() for name in text.split(",") if name.strip()]


def _accept(
    server: LLMServer, status: TuningStatus, now: datetime
) -> tuple[TuningStatus, list[TuningEvent]]:
    spec = server.spec
    changes, events = list(status.changes), []
    for rec in server.status.recommendations:
        if rec.field not in accepted_fields(server) or rec.field not in TUNABLE:
            continue
        if any(c.field == rec.field and c.value == rec.proposed for c in changes):
            continue
        if not within_bounds(rec.field, rec.proposed, spec.tuning.bounds, spec.runtime):
            continue
        change = TunedChange(
            field=rec.field,
            value=rec.proposed,
            spec_value=read_field(spec.memory_policy, rec.field),
            source="Accepted",
            rule=rec.rule,
            time=now,
        )
        changes = [c for c in changes if c.field != rec.field] + [change]
        message = (
            f"{change_text(rec.field, rec.current, rec.proposed)} ({rec.rule}) accepted by "
            f"annotation {ACCEPT_ANNOTATION}: the pods run it; spec is unchanged"
        )
        events.append(TuningEvent("Normal", "RecommendationAccepted", message))
    return status.model_copy(update={"changes": changes}), events


def _recommendation(
    proposal: Proposal, previous: list[Recommendation], now: datetime
) -> Recommendation:
    for rec in previous:
        if (rec.field, rec.proposed, rec.current) == (
            proposal.field,
            proposal.proposed,
            proposal.current,
        ):
            return rec
    return Recommendation(
        field=proposal.field,
        current=proposal.current,
        proposed=proposal.proposed,
        rule=proposal.rule,
        evidence=[Evidence(name=k, value=v) for k, v in proposal.evidence],
        expected_effect=proposal.expected_effect,
        confidence=proposal.confidence,
        since=now,
    )


def describe(rec: Recommendation) -> str:
    numbers = ", ".join(f"{e.name}={e.value:g}" for e in rec.evidence)
    return (
        f"{change_text(rec.field, rec.current, rec.proposed)} ({rec.rule}, confidence "
        f"{rec.confidence:g}): {rec.expected_effect} [{numbers}]"
    )


def _dropped(rec: Recommendation, reason: str) -> DroppedRecommendation:
    return DroppedRecommendation(
        field=rec.field, current=rec.current, proposed=rec.proposed, rule=rec.rule, reason=reason
    )


def describe_dropped(dropped: DroppedRecommendation) -> str:
    return (
        f"{change_text(dropped.field, dropped.current, dropped.proposed)} ({dropped.rule}) is not "
        f"recommended: the candidate does not fit ({dropped.reason})"
    )


def with_trial(server: LLMServer, trial: TuningTrial) -> LLMServer:
    """`server` with `trial`'s change in its tuning layer: the server whose rendering is the
    trial's canary (in memory only; status records the trial, not this layer)."""
    tuning = server.status.tuning or TuningStatus()
    changes = effective.changes_with_trial(server, trial)
    status = server.status.model_copy(
        update={"tuning": tuning.model_copy(update={"changes": changes})}
    )
    return server.model_copy(update={"status": status})


def _unfit(
    layered: LLMServer, trials: Sequence[TuningTrial], does_not_fit: FitCheck | None
) -> dict[str, str]:
    """Field -> why the candidate with that trial's change does not fit its GPUs."""
    if does_not_fit is None:
        return {}
    unfit: dict[str, str] = {}
    for trial in trials:
        trying = with_trial(layered, trial)
        why = does_not_fit(trying, effective.compose(trying).policy)
        if why is not None:
            unfit[trial.field] = why
    return unfit


def caps_text(caps: StepDownCaps) -> str:
    """The step-down's caps in words: each GPU term at its value, the host tier at its size
    (or off)."""
    capped = [
        f"{name} at {value:g}"
        for name, value in (
            ("gpuMemoryUtilization", caps.gpu_memory_utilization),
            ("maxNumBatchedTokens", caps.max_num_batched_tokens),
        )
        if value is not None
    ]
    tier = caps.kv_offload_size
    if tier is not None:
        capped.append("kvOffload off" if quantity_value(tier) <= 0 else f"kvOffload.size at {tier}")
    return " and ".join(capped)


def _oom_text(label: str) -> str:
    """The OOM a step-down record's label names (`adaptive.OOMClassification.label`): a
    run-time GPU OOM lowers the GPU terms, a host one (OOMKilled) the tier."""
    return "host OOM kill (OOMKilled)" if label.startswith("host") else "run-time GPU OOM"


def baseline_change(server: LLMServer, composed: EffectivePolicy) -> str:
    """What moved the baseline since status last recorded it (said only when a trial's
    baseline hash differs): spec.memoryPolicy, a step-down (with the OOM behind it), or else
    the tuning layer."""
    status = server.status
    recorded_spec = status.spec_memory_policy_hash
    if recorded_spec is not None and recorded_spec != memory_policy_hash(server.spec.memory_policy):
        return "spec.memoryPolicy changed"
    recorded = status.tuning.step_down if status.tuning is not None else None
    if composed.step_down is not None and composed.step_down != recorded:
        steps = [
            r for r in status.remediation_history
            if r.action == "step-down" and r.outcome == "applied"
        ]  # fmt: skip
        after = f" after pod {steps[-1].pod}'s {_oom_text(steps[-1].alert)}" if steps else ""
        return f"a step-down{after} capped {caps_text(composed.step_down)}"
    return "the tuning layer changed (a change was accepted, or lapsed)"


def _as_trial(rec: Recommendation, now: datetime) -> TuningTrial:
    return TuningTrial(
        field=rec.field,
        current=rec.current,
        proposed=rec.proposed,
        rule=rec.rule,
        started_at=now,
    )


def tune(
    server: LLMServer,
    observation: Observation,
    now: datetime,
    does_not_fit: FitCheck | None = None,
) -> TuneResult:
    """The server's next recommendations and tuning status (see the module docstring)."""
    spec = server.spec.tuning
    previous = server.status.recommendations
    status = server.status.tuning or TuningStatus()
    if spec.mode == "Off" and status.trial is None:
        return TuneResult([], server.status.tuning)
    status, events = _accept(server, status, now)
    layered = server.model_copy(
        update={"status": server.status.model_copy(update={"tuning": status})}
    )
    composed = effective.compose(layered)
    policy = composed.policy
    # never proposed or kept: on hold, under trial, or fixed by the spec (KV events)
    fixed = fields_fixed_by(server.spec.gateway)
    held = held_fields(status, now) | fixed.keys()
    proposals: list[Proposal] = []
    if observation.window is not None and spec.mode != "Off":
        proposals = recommend(
            observation.window, policy, spec, server.spec.runtime, held,
            host_memory_threshold=server.spec.remediation.triggers.host_memory.threshold,
            is_memory_limit_fixed=server.spec.resources.limits.memory is not None,
        )  # fmt: skip
    recommendations = [_recommendation(p, previous, now) for p in proposals]
    if observation.window is None and spec.mode != "Off":
        # No window this time (Prometheus away): keep what the last one showed, so a blip
        # neither clears the recommendations nor posts their Events again when it is back.
        recommendations = [
            r for r in previous
            if r.field not in held and r.current == read_field(policy, r.field)
        ]  # fmt: skip
    unfit = _unfit(layered, [_as_trial(r, now) for r in recommendations], does_not_fit)
    dropped = [_dropped(r, unfit[r.field]) for r in recommendations if r.field in unfit]
    if observation.window is None and spec.mode != "Off":
        # what the last window dropped stays, as its recommendations do
        named = {d.field for d in dropped}
        dropped += [
            d for d in status.dropped
            if d.field not in held | named and d.current == read_field(policy, d.field)
        ]  # fmt: skip
    # Apply mode still sees the dropped ones, to record them Skipped and hold their fields.
    candidates, recommendations = (
        recommendations,
        [r for r in recommendations if r.field not in unfit],
    )
    seen = {(r.field, r.proposed) for r in previous}
    events += [
        TuningEvent("Normal", "TuningRecommendation", describe(r))
        for r in recommendations
        if (r.field, r.proposed) not in seen
    ]
    # Apply mode's TuningTrialSkipped says it for the ones it would have tried.
    told = {(d.field, d.proposed, d.reason) for d in status.dropped}
    events += [
        TuningEvent("Warning", "TuningRecommendationDropped", describe_dropped(d))
        for d in dropped
        if (d.field, d.proposed, d.reason) not in told and spec.mode != "Apply"
    ]
    status = status.model_copy(update={"dropped": dropped})
    spec_values = {name: read_field(server.spec.memory_policy, name) for name in TUNABLE}
    if status.trial is not None:
        unfit = _unfit(layered, [status.trial], does_not_fit)
    baseline = Baseline(memory_policy_hash(policy), baseline_change(server, composed))
    decision = decide(
        spec, status, candidates, observation.trial, spec_values, now, unfit, baseline, fixed
    )
    status = decision.status
    if decision.promoted is not None:
        recommendations = [r for r in recommendations if r.field != decision.promoted.field]
    message = observation.error or (
        "" if recommendations else NO_FIT_MESSAGE if dropped else NO_CHANGE_MESSAGE
    )
    if message == NO_CHANGE_MESSAGE and fixed:  # what the rules were not free to change
        message += "; " + ", ".join(f"{by} fixes {name}" for name, by in sorted(fixed.items()))
    status = status.model_copy(update={"message": message[:1024]})
    return TuneResult(recommendations, status, events + decision.events, decision.promoted)
