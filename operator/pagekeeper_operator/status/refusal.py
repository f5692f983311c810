"""What a failed write of a child object says, in one sentence (pure).

The API server answers a refused write with a `Status` body whose `details.causes` name each
invalid field. A condition message is read in `kubectl describe`, `kubectl wait` output, the
Argo CD UI and a Flux Kustomization's failure, so it carries the first cause (field and reason)
in one sentence; the raw body goes to the operator's log and an Event.

A refusal (`failures.is_permanent_status`: a 4xx other than expired credentials, a timeout, a
conflict, an expired list or throttling) will not pass on retry: the spec must change, so it
stalls the server (`progress`). Other failures are retried.
"""

from __future__ import annotations

import json
from typing import Any

from pagekeeper_operator.failures import is_permanent_status

REFUSED_PREFIX = "the API server refused the "
MAX_MESSAGE_LENGTH = 1024


def _parse_status(body: str | bytes | None) -> dict[str, Any]:
    if not body:
        return {}
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}
    return parsed if isinstance(parsed, dict) and parsed.get("kind") == "Status" else {}


def is_refusal(status: int | None) -> bool:
    """Whether a write answered with this HTTP status needs a changed request to pass
    (`failures.is_permanent_status`, the operator's one rule)."""
    return is_permanent_status(status)


def write_failure(kind: str, status: int | None, reason: str | None, body: str | None) -> str:
    """One sentence on a failed write of a `kind` object, from the API server's answer."""
    parsed = _parse_status(body)
    causes = [c for c in (parsed.get("details") or {}).get("causes") or [] if isinstance(c, dict)]
    if causes:
        first = causes[0]
        field, cause = str(first.get("field") or ""), str(first.get("message") or "")
        detail = f"{field}: {cause}" if field else cause
        if len(causes) > 1:
            detail += f" (and {len(causes) - 1} more)"
    else:
        detail = str(parsed.get("message") or "")
    answer = f"{status} {reason}" if reason else str(status)
    if is_refusal(status):
        text = f"{REFUSED_PREFIX}{kind}: {detail or answer}"
    else:
        text = f"the API server could not apply the {kind} ({answer})"
        text += f": {detail}" if detail else ""
    return text[:MAX_MESSAGE_LENGTH]


def is_refused(message: str | None) -> bool:
    """Whether a condition message written by `write_failure` reports a refusal."""
    return message is not None and message.startswith(REFUSED_PREFIX)
