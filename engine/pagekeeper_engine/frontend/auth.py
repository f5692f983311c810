"""The OpenAI endpoints' API key (`--api-key`, as vLLM spells it): a bearer token on `/v1/*`.

Every request under `/v1/` must carry `Authorization: Bearer <key>`, compared in constant time;
anything else gets 401 with a JSON error naming the header and `WWW-Authenticate: Bearer`.
`/health`, `/ready` and `/metrics` stay open (the kubelet's probes and Prometheus carry no key),
and `/admin/*` keeps its own token (`admin.py`).
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pagekeeper_engine.frontend.errors import APIError

PROTECTED_PREFIX = "/v1/"


def check_api_key(header: str | None, key: str) -> None:
    """Raise the 401 a request with this Authorization header gets; return when it passes."""
    scheme, _, token = (header or "").partition(" ")
    if not header:
        message = "missing API key: send the header Authorization: Bearer <key>"
    elif scheme.lower() != "bearer" or not token.strip():
        message = "malformed Authorization header: expected Authorization: Bearer <key>"
    elif not hmac.compare_digest(token.strip().encode(), key.encode()):
        message = "wrong API key in the Authorization header"
    else:
        return
    raise APIError(401, message, code="invalid_api_key", param="Authorization")


def api_key_middleware(key: str) -> Middleware:
    """The middleware that enforces `key` on `/v1/*` (inside the JSON error middleware)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(PROTECTED_PREFIX):
            try:
                check_api_key(request.headers.get("Authorization"), key)
            except APIError as exc:
                response = exc.response()
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        return await handler(request)

    return middleware
