"""Whether the Secret that spec.apiKey names holds its key (pure): the `ApiKeyAvailable`
condition, and whether the rollout must wait for it.

A pod whose environment reads a Secret (or a key of it) that does not exist never starts: the
kubelet holds it in `CreateContainerConfigError`. So before a pod template that reads the key
rolls out, the reconcile reads the Secret (`get` only; its values are never kept, logged or
written anywhere) and, where the Secret or its key is missing, holds the rollout as a memory plan
that does not fit does (`fit.hold_rollout`): the running pods keep serving, a server without pods
gets none, `Stalled` is True with reason `SecretMissing`, and a Warning Event names the Secret
and the key. The resync reads it again; once the key is there the rollout goes on by itself.

| status  | reason           | when                                                            |
|---------|------------------|-----------------------------------------------------------------|
| True    | SecretFound      | the Secret exists and holds the key                             |
| False   | SecretMissing    | no Secret of that name in the server's namespace                |
| False   | SecretKeyMissing | the Secret exists without that key                              |
| False   | SecretKeyUnusable| the key's value is empty (the endpoint would be open) or begins |
|         |                  | or ends with whitespace (a file's trailing newline, say: no HTTP |
|         |                  | header can carry it, so every request would be refused)          |
| Unknown | SecretUnreadable | the operator may not read it (RBAC) or the API server failed; the |
|         |                  | rollout is not held, as before the check existed                |
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.status import Condition, ConditionStatus

API_KEY_AVAILABLE = "ApiKeyAvailable"
# The Stalled reason (`progress`) for both False reasons: kstatus and Argo CD read one.
SECRET_MISSING = "SecretMissing"


@dataclass(frozen=True)
class ApiKeyCheck:
    """The verdict on spec.apiKey's Secret, as the `ApiKeyAvailable` condition says it."""

    status: ConditionStatus
    reason: str
    message: str

    @property
    def holds_rollout(self) -> bool:
        return self.status == "False"


def check_api_key(
    server: LLMServer, secret: Mapping[str, Any] | None, *, unreadable: str | None = None
) -> ApiKeyCheck | None:
    """The verdict on the Secret as read (None: not found), or `unreadable`'s reason why it
    could not be; None where spec.apiKey is unset."""
    ref = server.spec.api_key
    if ref is None:
        return None
    where = f"Secret {server.metadata.namespace}/{ref.secret_name}"
    if unreadable is not None:
        return ApiKeyCheck(
            "Unknown",
            "SecretUnreadable",
            f"{where} could not be read ({unreadable}); the rollout is not held for it, and a "
            "missing key shows only on the pods (CreateContainerConfigError)",
        )
    held = "pods that read spec.apiKey cannot start, so the rollout is held until it exists"
    held_unusable = "no pod should serve with it, so the rollout is held until it changes"
    if secret is None:
        return ApiKeyCheck(
            "False", SECRET_MISSING, f"{where} does not exist (key {ref.key!r}): {held}"
        )
    data: Mapping[str, Any] = secret.get("data") or {}
    if ref.key not in data:
        keys = ", ".join(sorted(data)) or "none"
        return ApiKeyCheck(
            "False", "SecretKeyMissing", f"{where} has no key {ref.key!r} (keys: {keys}): {held}"
        )
    problem = _unusable(data[ref.key])
    if problem is not None:
        return ApiKeyCheck(
            "False", "SecretKeyUnusable", f"{where} key {ref.key!r} {problem}: {held_unusable}"
        )
    return ApiKeyCheck("True", "SecretFound", f"{where} holds key {ref.key!r}")


def _unusable(encoded: object) -> str | None:
    """Why a key's value (base64, as the API serves a Secret's data) cannot lock an endpoint,
    or None; the value itself is never returned, kept or logged."""
    try:
        value = base64.b64decode(str(encoded), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return "is not UTF-8 text"
    if not value:
        return "is empty, which would leave /v1/* open"
    if value.strip() != value:
        return (
            "begins or ends with whitespace (a trailing newline from a file, say), which no "
            "HTTP header can carry, so every request would be refused"
        )
    return None


ApiKeyEvent = tuple[Literal["Normal", "Warning"], str, str]  # (type, reason, message)


def api_key_event(previous: Condition | None, check: ApiKeyCheck | None) -> ApiKeyEvent | None:
    """A Warning when the Secret goes missing (or missing differently) after the `previous`
    condition, a Normal Event when it comes back and the held rollout goes on."""
    if check is None or (previous is not None and previous.reason == check.reason):
        return None
    if check.holds_rollout:
        return "Warning", check.reason, check.message
    if previous is not None and previous.status == "False" and check.status == "True":
        return "Normal", check.reason, f"{check.message}: the rollout goes on"
    return None
