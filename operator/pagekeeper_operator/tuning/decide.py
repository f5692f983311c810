"""Apply mode's decision (pure, `now` passed in): start a trial, wait, promote or roll back.

One trial at a time, on the existing canary (`canary.py`): the canary pods run the effective
policy plus the top recommendation, the other pods the effective policy. Each reconcile:

- a new UTC day resets `changesToday`; hold-offs whose time has passed are dropped;
- a trial whose mode is no longer Apply, or whose canary failed (a `failOn` signal, as
  `status.canary` records it), is rolled back;
- a trial whose baseline moved (the effective policy without the trial is no longer the one
  it started over: a step-down after an OOM, a spec change, an accepted recommendation) is
  rolled back at once: its canary would run the new policy plus its change against pods on
  the old one, so the window would measure more than its change. Its field is held like any
  other's; the new policy then rolls as any change does, and the next trial starts over it;
- a trial `windowSeconds` old is compared (`compare`): a win is promoted into the tuning layer
  of the effective policy, a loss or a tie is rolled back. A window that cannot decide (too
  few samples, or an observed gain not yet significant) extends the trial (`looks`): it is
  judged once more over its whole run, MAX_LOOKS windows, at once and not at each reconcile,
  since every look spends its share of the error rate. The last look that cannot decide ends
  it Inconclusive: rolled back, never counted a loss, and held off for a quarter as long;
- with no trial, under the daily cap, the top recommendation starts one;
- a trial whose field the spec now fixes (`fixed`: prefix caching once KV events are on) is
  rolled back at once: compose drops its change, so its canary runs the other pods' policy;
- a candidate that does not fit its GPUs (`unfit`: the memory plan's gate would hold its
  rollout, so no canary would ever run) is never waited on: a trial under way ends RolledBack,
  and a recommendation about to start one is Skipped (not counted against the daily cap) and
  the next one that fits starts instead.

Every decided (or skipped) trial puts its field on hold for `holdOffSeconds` (a quarter of it
when inconclusive: the change may yet win under a steadier load), whatever the outcome: a
rolled back value is not tried again, and a promoted one is not undone by the next window's
noise (no A -> B -> A). The rules never propose a held field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from pagekeeper_operator.api.tuning import (
    MAX_HOLD_OFFS,
    MAX_LOOKS,
    MAX_OUTCOMES,
    Evidence,
    HoldOff,
    Recommendation,
    TrialOutcome,
    TrialRecord,
    TunedChange,
    TuningSpec,
    TuningStatus,
    TuningTrial,
)
from pagekeeper_operator.policy.fields import change_text
from pagekeeper_operator.tuning.compare import Comparison

EventType = Literal["Normal", "Warning"]
INCONCLUSIVE_HOLD_OFF_FRACTION = 0.25


@dataclass(frozen=True)
class TuningEvent:
    type: EventType
    reason: str
    message: str


@dataclass(frozen=True)
class TrialEvidence:
    """What a reconcile observed of the trial under way."""

    comparison: Comparison | None  # None: too few samples yet
    canary_failure: str | None = None  # the failOn signal's message, if the canary failed


@dataclass(frozen=True)
class Baseline:
    """The policy the baseline (non-canary) pods run this reconcile: a trial records its hash
    when it starts, and is rolled back once the hash differs (`change` says why)."""

    policy_hash: str
    change: str = "the baseline pods' effective policy changed"


@dataclass
class Decision:
    status: TuningStatus
    events: list[TuningEvent] = field(default_factory=list)
    promoted: TunedChange | None = None  # the change that just entered the tuning layer


def held_fields(status: TuningStatus | None, now: datetime) -> set[str]:
    """Fields the rules must not propose now: on hold, or under trial."""
    if status is None:
        return set()
    held = {h.field for h in status.hold_offs if h.until > now}
    if status.trial is not None:
        held.add(status.trial.field)
    return held


def _hold(
    status: TuningStatus, spec: TuningSpec, trial: TuningTrial, now: datetime, fraction: float
) -> list[HoldOff]:
    until = now + timedelta(seconds=spec.hold_off_seconds * fraction)
    kept = [h for h in status.hold_offs if h.field != trial.field]
    return [*kept, HoldOff(field=trial.field, value=trial.current, until=until)][-MAX_HOLD_OFFS:]


def _has_moved(trial: TuningTrial, baseline: Baseline | None) -> bool:
    """Whether the baseline is no longer the policy `trial` started over (a trial recorded
    before baselines were can only be judged)."""
    recorded = trial.baseline_policy_hash
    return baseline is not None and recorded is not None and recorded != baseline.policy_hash


def _finish(
    status: TuningStatus,
    spec: TuningSpec,
    trial: TuningTrial,
    outcome: TrialOutcome,
    message: str,
    evidence: dict[str, float],
    now: datetime,
) -> TuningStatus:
    fraction = INCONCLUSIVE_HOLD_OFF_FRACTION if outcome == "Inconclusive" else 1.0
    record = TrialRecord(
        field=trial.field,
        current=trial.current,
        proposed=trial.proposed,
        outcome=outcome,
        time=now,
        evidence=[Evidence(name=k, value=v) for k, v in evidence.items()],
        message=message[:1024],
    )
    return status.model_copy(
        update={
            "trial": None,
            "history": [*status.history, record][-MAX_OUTCOMES:],
            "hold_offs": _hold(status, spec, trial, now, fraction),
        }
    )


def _judge(
    status: TuningStatus,
    spec: TuningSpec,
    trial: TuningTrial,
    evidence: TrialEvidence | None,
    spec_value: str,
    now: datetime,
) -> Decision:
    change = change_text(trial.field, trial.current, trial.proposed)
    if evidence is not None and evidence.canary_failure is not None:
        message = f"{change} rolled back: the canary failed ({evidence.canary_failure})"
        rolled = _finish(status, spec, trial, "RolledBack", message, {}, now)
        return Decision(rolled, [TuningEvent("Warning", "TuningRolledBack", message)])
    age = (now - trial.started_at).total_seconds()
    if age < (trial.looks + 1) * spec.window_seconds:
        return Decision(status)
    comparison = evidence.comparison if evidence is not None else None
    if comparison is None or comparison.verdict == "Inconclusive":
        why = f"too few samples after {int(age)}s" if comparison is None else comparison.reason
        numbers = {} if comparison is None else comparison.evidence()
        if trial.looks + 1 < MAX_LOOKS:
            windows = trial.looks + 2
            extended = trial.model_copy(update={"looks": trial.looks + 1,
                                                "extended_because": why[:1024]})  # fmt: skip
            message = (
                f"{change} runs on: the window could not decide ({why}); it is judged again "
                f"over {windows} windows ({windows * spec.window_seconds}s)"
            )
            waiting = status.model_copy(update={"trial": extended})
            return Decision(waiting, [TuningEvent("Normal", "TuningTrialExtended", message)])
        message = f"{change} inconclusive, rolled back: {why}"
        ended = _finish(status, spec, trial, "Inconclusive", message, numbers, now)
        return Decision(ended, [TuningEvent("Warning", "TuningTrialInconclusive", message)])
    numbers = comparison.evidence()
    if not comparison.is_win:
        message = f"{change} rolled back ({comparison.verdict.lower()}): {comparison.reason}"
        rolled = _finish(status, spec, trial, "RolledBack", message, numbers, now)
        return Decision(rolled, [TuningEvent("Warning", "TuningRolledBack", message)])
    message = f"{change} promoted: {comparison.reason}"
    promoted = TunedChange(
        field=trial.field,
        value=trial.proposed,
        spec_value=spec_value,
        source="Promoted",
        rule=trial.rule,
        time=now,
    )
    done = _finish(status, spec, trial, "Promoted", message, numbers, now)
    changes = [c for c in done.changes if c.field != trial.field] + [promoted]
    done = done.model_copy(update={"changes": changes})
    return Decision(done, [TuningEvent("Normal", "TuningPromoted", message)], promoted)


def _ends_at_once(
    trial: TuningTrial,
    spec: TuningSpec,
    baseline: Baseline | None,
    fixed: Mapping[str, str],
    unfit: Mapping[str, str],
) -> str | None:
    """Why a trial under way is rolled back without waiting for its window, or None: Apply mode
    left, its baseline moved, the spec now fixes its field, or its candidate stopped fitting."""
    if spec.mode != "Apply":
        return f"spec.tuning.mode is {spec.mode}"
    if _has_moved(trial, baseline):
        assert baseline is not None, "a baseline that moved is known"
        return f"{baseline.change} while it ran, so the window would measure more than its change"
    if trial.field in fixed:
        return (
            f"{fixed[trial.field]} now fixes {trial.field} at the spec's value, so the canary "
            "would run the same policy as the other pods"
        )
    if trial.field in unfit:
        return f"the candidate does not fit ({unfit[trial.field]})"
    return None


def decide(
    spec: TuningSpec,
    status: TuningStatus,
    recommendations: Sequence[Recommendation],
    evidence: TrialEvidence | None,
    spec_value_of: dict[str, str],
    now: datetime,
    unfit: Mapping[str, str] | None = None,
    baseline: Baseline | None = None,
    fixed: Mapping[str, str] | None = None,
) -> Decision:
    """The next tuning status (see the module docstring). `recommendations` are the current
    ones, best first, held fields already left out; `spec_value_of`: field -> spec's value;
    `unfit`: field -> why the candidate with its proposed value (the trial's, or a
    recommendation's) does not fit its GPUs; `baseline`: what the other pods run now (None:
    unknown, so a trial is not checked against it); `fixed`: field -> the spec field that now
    fixes it at the spec's value (`fields.fields_fixed_by`)."""
    unfit, fixed = unfit or {}, fixed or {}
    today = now.strftime("%Y-%m-%d")
    if status.day != today:
        status = status.model_copy(update={"day": today, "changes_today": 0})
    live = [h for h in status.hold_offs if h.until > now]
    status = status.model_copy(update={"hold_offs": live})
    trial = status.trial
    why = None if trial is None else _ends_at_once(trial, spec, baseline, fixed, unfit)
    if trial is not None and why is not None:
        change = change_text(trial.field, trial.current, trial.proposed)
        message = f"{change} rolled back: {why}"
        rolled = _finish(status, spec, trial, "RolledBack", message, {}, now)
        return Decision(rolled, [TuningEvent("Warning", "TuningRolledBack", message)])
    if trial is not None:
        return _judge(status, spec, trial, evidence, spec_value_of.get(trial.field, ""), now)
    if spec.mode != "Apply" or status.changes_today >= spec.max_changes_per_day:
        return Decision(status)
    events: list[TuningEvent] = []
    for top in recommendations:
        trial = TuningTrial(
            field=top.field,
            current=top.current,
            proposed=top.proposed,
            rule=top.rule,
            started_at=now,
            baseline_policy_hash=None if baseline is None else baseline.policy_hash,
        )
        change = f"{change_text(top.field, top.current, top.proposed)} ({top.rule})"
        if top.field in unfit:
            message = f"{change} skipped: the candidate does not fit ({unfit[top.field]})"
            status = _finish(status, spec, trial, "Skipped", message, {}, now)
            events.append(TuningEvent("Warning", "TuningTrialSkipped", message))
            continue
        started = status.model_copy(
            update={"trial": trial, "changes_today": status.changes_today + 1}
        )
        message = f"{change} runs on the canary for {spec.window_seconds}s against the other pods"
        return Decision(started, [*events, TuningEvent("Normal", "TuningTrialStarted", message)])
    return Decision(status, events)
