"""The Alertmanager webhook receiver (aiohttp): authenticate, bound, parse, hand over.

`POST /alertmanager` takes Alertmanager's webhook payload (version 4) with
`Authorization: Bearer <token>` (Alertmanager's `http_config.authorization.credentials_file`).
Responses: 401 without the right token, 413 past the size bound, 400 for a body that is not
JSON or not a notification (`payload.MalformedNotificationError`, naming the fields), 422 when
handling failed in a way no retry can fix (`failures.is_permanent`: the API server refused an
action for what it is, such as the operator's RBAC forbidding it; stored data the operator
cannot read, such as a malformed time stamp), 500 for every other failure (the cluster could
not be read, an expired token, a bug: Alertmanager retries a 5xx, and handling is idempotent),
each logged with its traceback; else 200 with the decisions taken.
`GET /healthz` answers 200 without authentication.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pagekeeper_operator.failures import describe, is_permanent
from pagekeeper_operator.remediation.payload import (
    MalformedNotificationError,
    WebhookMessage,
    parse_notification,
)

logger = logging.getLogger(__name__)
# A full Alertmanager group of a few hundred alerts stays well under this.
DEFAULT_MAX_BODY_BYTES = 1 << 20
WEBHOOK_PATH = "/alertmanager"
HEALTH_PATH = "/healthz"

NotificationHandler = Callable[[WebhookMessage], Awaitable[dict[str, Any]]]
TokenSource = Callable[[], str]
"""Returns the current token (read per request, so a rotated Secret takes effect)."""


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def is_authorized(header: str | None, token: str) -> bool:
    """Constant-time bearer token check; an empty configured token authorizes nothing."""
    scheme, _, provided = (header or "").partition(" ")
    if not token or scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(provided.strip().encode(), token.encode())


def make_app(
    token_source: TokenSource,
    on_message: NotificationHandler,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> web.Application:
    """The receiver application; `on_message` acts on each valid notification."""

    async def alertmanager(request: web.Request) -> web.Response:
        try:
            token = token_source()
        except OSError as error:
            logger.error("webhook token unreadable: %s", error)
            return _error(503, "the webhook token is not available")
        if not is_authorized(request.headers.get("Authorization"), token):
            return _error(401, "missing or wrong bearer token")
        if request.content_length is not None and request.content_length > max_body_bytes:
            return _error(413, f"body larger than {max_body_bytes} bytes")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body larger than {max_body_bytes} bytes")
        try:
            message = parse_notification(body)
        except MalformedNotificationError as error:
            fields = {} if error.fields is None else {"fields": error.fields}
            return _error(400, error.message, **fields)
        try:
            summary = await on_message(message)
        except Exception as error:
            if is_permanent(error):
                # A 4xx: Alertmanager does not re-send what can never pass.
                logger.exception("could not handle notification %s (permanent)", message.group_key)
                return _error(
                    422, f"the notification cannot be handled: {describe(error)}", retry=False
                )
            # Anything else may pass later (a bug included): Alertmanager retries a 5xx, and
            # handling a notification twice is safe.
            logger.exception("could not handle notification %s (retryable)", message.group_key)
            return _error(500, "could not handle the notification; it will be retried")
        return web.json_response(summary)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_post(WEBHOOK_PATH, alertmanager)
    app.router.add_get(HEALTH_PATH, healthz)
    return app
