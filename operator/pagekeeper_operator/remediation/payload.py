"""The Alertmanager webhook payload (version 4), as pydantic models, and `parse_notification`:
a body read into them, or a `MalformedNotificationError` naming the fields.

Only what remediation reads is required; anything Alertmanager adds later is ignored.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from pagekeeper_operator.failures import UnreadableDataError
from pagekeeper_operator.timestamps import to_second

AlertStatus = Literal["firing", "resolved"]
# Alertmanager caps a group at its `max_alerts`; a body far past this is not from Alertmanager.
MAX_ALERTS = 1000


class _Payload(BaseModel):
    model_config = ConfigDict(populate_by_name=True, frozen=True)


class WebhookAlert(_Payload):
    """One alert of a notification; `fingerprint` + `startsAt` identify one firing episode."""

    status: AlertStatus
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    # Aware times only: they are compared with the operator's clock.
    starts_at: AwareDatetime = Field(alias="startsAt")
    # Alertmanager sends the zero time (0001-01-01T00:00:00Z) while an alert is firing.
    ends_at: AwareDatetime | None = Field(default=None, alias="endsAt")
    generator_url: str = Field(default="", alias="generatorURL")
    fingerprint: str = Field(min_length=1, max_length=64)

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def key(self) -> tuple[str, datetime]:
        """Identity of this firing episode, stable across repeated deliveries: the start to the
        second, as a remediation record keeps it (alertStartsAt)."""
        return (self.fingerprint, to_second(self.starts_at))


class WebhookMessage(_Payload):
    """A notification as Alertmanager's webhook receiver posts it."""

    version: Literal["4"]
    group_key: str = Field(alias="groupKey")
    truncated_alerts: int = Field(default=0, ge=0, alias="truncatedAlerts")
    status: AlertStatus
    receiver: str
    group_labels: dict[str, str] = Field(default_factory=dict, alias="groupLabels")
    common_labels: dict[str, str] = Field(default_factory=dict, alias="commonLabels")
    common_annotations: dict[str, str] = Field(default_factory=dict, alias="commonAnnotations")
    external_url: str = Field(default="", alias="externalURL")
    alerts: list[WebhookAlert] = Field(max_length=MAX_ALERTS)


class MalformedNotificationError(UnreadableDataError):
    """A body that is not JSON, or not an Alertmanager notification (`fields`: each field its
    models refuse, with why): a retry sends the same body, so none passes."""

    def __init__(self, message: str, fields: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields


def _field_errors(error: ValidationError) -> list[dict[str, str]]:
    return [
        {"field": ".".join(str(part) for part in item["loc"]), "message": item["msg"]}
        for item in error.errors(include_url=False, include_input=False)
    ]


def parse_notification(body: bytes) -> WebhookMessage:
    """The notification in `body`; MalformedNotificationError for one that is not JSON or not a
    notification."""
    try:
        data: Any = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MalformedNotificationError(f"body is not JSON: {error}") from error
    try:
        return WebhookMessage.model_validate(data)
    except ValidationError as error:
        raise MalformedNotificationError(
            "not an Alertmanager notification", _field_errors(error)
        ) from error
