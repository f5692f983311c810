"""How the operator classifies a failure, once: permanent (no retry can fix it) or retryable.

- **permanent**: the API server refused the request for what it is (a 4xx such as 400 bad
  request, 403 the operator's RBAC forbids it, 404 a resource kind the cluster lacks, 422
  invalid; not 408, 409, 410 or 429, which a retry can pass), or stored
  data the operator cannot read (a malformed time stamp, say). Retrying gives the same answer:
  say why (a status condition, a 4xx to Alertmanager) and stop.
- **retryable**: everything else (conflicts, throttling, 5xx, a connection that dropped):
  bounded retries, or a 5xx to Alertmanager, which re-sends.
"""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

# A 4xx the same request can pass later: a request timeout, a write conflict, an expired watch
# or list (410), throttling. Every other 4xx needs a changed request or cluster (404 included:
# a resource kind the cluster does not serve).
RETRYABLE_CLIENT_STATUSES = frozenset({408, 409, 410, 429})


def is_permanent_status(status: int | None) -> bool:
    """Whether an API answer with this HTTP status will not pass on a retry."""
    return status is not None and 400 <= status < 500 and status not in RETRYABLE_CLIENT_STATUSES


def is_permanent(error: BaseException) -> bool:
    """Whether retrying what raised `error` can never succeed."""
    if isinstance(error, ApiException):
        return is_permanent_status(error.status)
    return isinstance(error, ValueError)


def describe(error: BaseException) -> str:
    """One line for logs, conditions and HTTP answers."""
    if isinstance(error, ApiException):
        return f"the API server answered {error.status} {error.reason}"
    return f"{type(error).__name__}: {error}"
