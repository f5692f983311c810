"""How the operator classifies a failure, once: permanent (no retry can fix it) or retryable.

- **permanent**: the API server refused the request for what it is (a 4xx such as 400 bad
  request, 403 the operator's RBAC forbids it, 404 a resource kind the cluster lacks, 422
  invalid), or data from outside the operator's code that it cannot read
  (`UnreadableDataError`: a malformed time stamp, a stored LLMServer its models refuse, a body
  that is not an Alertmanager notification). The same request or data gives the same answer:
  say why (a status condition, a 4xx to Alertmanager) and stop.
- **retryable**: everything else. A 4xx the same request can pass later (401: an expired
  service-account token, which the client reads again; 408, 409, 410, 429), a 5xx, a connection
  that dropped, and every exception the operator did not foresee: a bug in its own code (a
  `ValueError`, a `KeyError`) is no property of the alert, so it is logged with its traceback
  and retried (bounded retries, or a 5xx to Alertmanager, which re-sends), never dropped as
  if no retry could pass.
"""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

# A 4xx the same request can pass later: credentials the client refreshes (a projected
# service-account token expires and is read again), a request timeout, a write conflict, an
# expired watch or list (410), throttling. Every other 4xx needs a changed request or cluster
# (404 included: a resource kind the cluster does not serve).
RETRYABLE_CLIENT_STATUSES = frozenset({401, 408, 409, 410, 429})


class UnreadableDataError(ValueError):
    """Data from outside the operator's code that it cannot read (a stored object or time
    stamp, a notification's body): the same data gives the same error, so no retry passes.
    Raise it (or a subclass) only where the data is at fault, never for a bug."""


def is_permanent_status(status: int | None) -> bool:
    """Whether an API answer with this HTTP status will not pass on a retry."""
    return status is not None and 400 <= status < 500 and status not in RETRYABLE_CLIENT_STATUSES


def is_permanent(error: BaseException) -> bool:
    """Whether retrying what raised `error` can never succeed: an API refusal
    (`is_permanent_status`) or `UnreadableDataError`; anything else may pass on a retry."""
    if isinstance(error, ApiException):
        return is_permanent_status(error.status)
    return isinstance(error, UnreadableDataError)


def describe(error: BaseException) -> str:
    """One line for logs, conditions and HTTP answers."""
    if isinstance(error, ApiException):
        return f"the API server answered {error.status} {error.reason}"
    return f"{type(error).__name__}: {error}"
