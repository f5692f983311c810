"""How the operator classifies a failure, once: permanent (no retry can fix it) or retryable.

- **permanent**: the API server refused the request for what it is (400 bad request, 403 the
  operator's RBAC forbids it, 404 a resource kind the cluster lacks, 422 invalid), or stored
  data the operator cannot read (a malformed time stamp, say). Retrying gives the same answer:
  say why (a status condition, a 4xx to Alertmanager) and stop.
- **retryable**: everything else (conflicts, throttling, 5xx, a connection that dropped):
  bounded retries, or a 5xx to Alertmanager, which re-sends.
"""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

PERMANENT_API_STATUSES = frozenset({400, 403, 404, 422})


def is_permanent(error: BaseException) -> bool:
    """Whether retrying what raised `error` can never succeed."""
    if isinstance(error, ApiException):
        return error.status in PERMANENT_API_STATUSES
    return isinstance(error, ValueError)


def describe(error: BaseException) -> str:
    """One line for logs, conditions and HTTP answers."""
    if isinstance(error, ApiException):
        return f"the API server answered {error.status} {error.reason}"
    return f"{type(error).__name__}: {error}"
