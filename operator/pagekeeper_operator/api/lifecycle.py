"""`LLMServer.spec.lifecycle` and `status.lifecycle`: a maximum pod age, and what the operator
did about it (`pod_age` decides, `pod_age_loop` acts).

The age is a duration as Kubernetes and Go write one (`24h`, `90m`, `1h30m`, `45s`; hours are
the largest unit, so a week is `168h`), refused by the API server with a message naming the
field when it is not one, or is shorter than `MIN_MAX_POD_AGE` or longer than `MAX_MAX_POD_AGE`.
"""

from __future__ import annotations

import re
from datetime import timedelta

from pydantic import ConfigDict, Field, model_validator

from pagekeeper_operator.api.types import ApiModel, Timestamp, cel, validations

DURATION_PATTERN = r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"
# A replacement costs the pod's warm state (its prefix cache, a GPU engine's minutes of start-up),
# so a production age is hours; the floor only keeps the loop from replacing pods faster than
# they start, and is low enough for a test on the local control plane.
MIN_MAX_POD_AGE = "1m"
MAX_MAX_POD_AGE = "8760h"  # a year
_UNITS = {"h": 3600, "m": 60, "s": 1}

FORMAT_RULE = cel(
    "!has(self.maxPodAge) || self.maxPodAge.matches('" + DURATION_PATTERN + "')",
    "spec.lifecycle.maxPodAge must be a duration in hours, minutes and seconds such as 24h, "
    "90m or 1h30m (a week is 168h)",
    ".maxPodAge",
)
BOUNDS_RULE = cel(
    "!has(self.maxPodAge) || !self.maxPodAge.matches('" + DURATION_PATTERN + "')"
    f" || (duration(self.maxPodAge) >= duration('{MIN_MAX_POD_AGE}')"
    f" && duration(self.maxPodAge) <= duration('{MAX_MAX_POD_AGE}'))",
    f"spec.lifecycle.maxPodAge must be at least {MIN_MAX_POD_AGE} and at most "
    f"{MAX_MAX_POD_AGE} (a shorter age would replace pods about as fast as they start)",
    ".maxPodAge",
)


def parse_duration(text: str) -> timedelta | None:
    """The duration `text` stands for (`1h30m` -> 90 minutes); None when it is not one."""
    if not text or re.fullmatch(DURATION_PATTERN, text) is None:
        return None
    seconds = sum(
        int(amount) * _UNITS[unit] for amount, unit in re.findall(r"([0-9]+)([hms])", text)
    )
    return timedelta(seconds=seconds)


def format_age(age: timedelta) -> str:
    """An age as a duration of the same form, to the second (`1h2m3s`, `45s`)."""
    seconds = max(0, int(age.total_seconds()))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    text = "".join(f"{n}{u}" for n, u in ((hours, "h"), (minutes, "m"), (seconds, "s")) if n)
    return text or "0s"


class LifecycleSpec(ApiModel):
    """How long a pod may serve before the operator replaces it."""

    model_config = ConfigDict(json_schema_extra=validations(FORMAT_RULE, BOUNDS_RULE))

    max_pod_age: str | None = Field(
        default=None,
        min_length=2,
        max_length=32,
        description=(
            "Replace each pod once it is about this old (a duration: 24h, 90m, 1h30m; "
            f"{MIN_MAX_POD_AGE} to {MAX_MAX_POD_AGE}): evicted through the Eviction API one at "
            "a time, within the PodDisruptionBudget, spec.remediation.cooldownSeconds and "
            "maxUnavailable, never while a canary or a rollout is under way. Each pod is due "
            "at a point between 90% and 100% of the age fixed by its uid, so pods created "
            "together are not due together. Unset (the default): pods are never replaced for "
            "their age. status.lifecycle says what was replaced and why, and what waits."
        ),
    )

    @property
    def max_age(self) -> timedelta | None:
        """The maximum age as a duration; None when unset."""
        if self.max_pod_age is None:
            return None
        age = parse_duration(self.max_pod_age)
        assert age is not None, "the model validator refuses any other text"
        return age

    @model_validator(mode="after")
    def _check_age(self) -> LifecycleSpec:
        if self.max_pod_age is None:
            return self
        age = parse_duration(self.max_pod_age)
        if age is None:
            raise ValueError(FORMAT_RULE["message"])
        low, high = parse_duration(MIN_MAX_POD_AGE), parse_duration(MAX_MAX_POD_AGE)
        assert low is not None and high is not None, "the bounds are durations"
        if not low <= age <= high:
            raise ValueError(BOUNDS_RULE["message"])
        return self


class LifecycleStatus(ApiModel):
    """What spec.lifecycle.maxPodAge did: the oldest pod, the last replacement, what waits."""

    oldest_pod_created_at: Timestamp | None = Field(
        default=None,
        description=(
            "Creation time of the oldest pod that serves (not a canary pod, not one going "
            "away), RFC 3339; `kubectl get llms` shows its age."
        ),
    )
    next_due_at: Timestamp | None = Field(
        default=None, description="When the next pod is due for replacement (RFC 3339)."
    )
    last_replaced_pod: str | None = Field(
        default=None, max_length=253, description="The pod last evicted for its age."
    )
    last_replaced_at: Timestamp | None = Field(
        default=None, description="When it was evicted (RFC 3339)."
    )
    waiting_pod: str | None = Field(
        default=None,
        max_length=253,
        description="A pod past its due time that is not replaced yet (see reason).",
    )
    reason: str = Field(
        default="",
        max_length=64,
        description=(
            "Why waitingPod waits: canary (a canary is under way), rollout (the Deployment's "
            "rollout is not complete), cooldown (spec.remediation.cooldownSeconds since the "
            "last eviction), max-unavailable (spec.remediation.maxUnavailable pods are already "
            "down) or pdb-blocked (a PodDisruptionBudget refused the eviction); empty when no "
            "pod waits."
        ),
    )
    message: str = Field(
        default="", max_length=1024, description="The last decision in one sentence."
    )
