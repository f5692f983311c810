"""Which of a server's alert triggers are active, and why the others are not (pure).

A trigger is active when its alert is rendered: the runtime exports every series the alert reads
(`api.runtime`) and the spec does not switch it off. The alerts, the remediation webhook's
decisions and `status.triggers` all ask here, so they never disagree.
"""

from __future__ import annotations

from pagekeeper_operator.api.remediation import RemediationSpec
from pagekeeper_operator.api.runtime import (
    TRIGGERS,
    Runtime,
    Trigger,
    missing_series,
    unfed_message,
)
from pagekeeper_operator.api.status import TriggerStatus

REASON_ACTIVE = "Active"
REASON_DISABLED = "DisabledInSpec"
REASON_UNFED = "SeriesNotExported"


def is_active(
    runtime: Runtime, remediation: RemediationSpec, trigger: Trigger, *, has_plugin: bool = True
) -> bool:
    """Whether `trigger`'s alert is rendered for a server of `runtime` (`has_plugin`: under
    vllm, whether VLLM_PLUGINS lets pagekeeper's plugin load)."""
    can_feed = not missing_series(runtime, trigger, has_plugin=has_plugin)
    return remediation.triggers.by_key(trigger.key).is_on_for(can_feed)


def trigger_status(
    runtime: Runtime, remediation: RemediationSpec, *, has_plugin: bool = True
) -> list[TriggerStatus]:
    """One entry per trigger, in alert order: active or not, and the reason."""
    entries = []
    for trigger in TRIGGERS:
        if missing_series(runtime, trigger, has_plugin=has_plugin):
            reason = REASON_UNFED
            message = unfed_message(runtime, trigger, has_plugin=has_plugin)
        elif not is_active(runtime, remediation, trigger, has_plugin=has_plugin):
            reason = REASON_DISABLED
            message = f"spec.remediation.triggers.{trigger.key}.enabled is false"
        else:
            reason = REASON_ACTIVE
            message = f"reads {', '.join(trigger.series)}"
        entries.append(
            TriggerStatus(
                name=trigger.key,
                alert=trigger.alert,
                active=reason == REASON_ACTIVE,
                reason=reason,
                message=message,
            )
        )
    return entries
