"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server answers, including aiohttp's own (unknown route, body too large), goes
out in this shape so clients can read `param` to find the field at fault.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A request the server answers with an error status and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return web.json_response(self.body(), status=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


# pydantic names the member of a union that failed by its type; those are not field names.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _loc_to_param(loc: tuple[int | str, ...]) -> str:
    """("messages", 0, "content") -> "messages[0].content"; union tags like "list[int]" dropped."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in _UNION_TAGS:
            param += f".{part}" if param else part
    return param


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first invalid field, with every problem in the message."""
    errors = exc.errors(include_url=False)
    problems = []
    for error in errors:
        where = _loc_to_param(error["loc"]) or "body"
        message = str(error["msg"]).removeprefix("Value error, ")
        problems.append(f"{where}: {message}")
    param = _loc_to_param(errors[0]["loc"]) if errors else ""
    return APIError(400, "; ".join(problems), param=param or None, code="invalid_value")


async def read_json_object(request: web.Request) -> dict[str, object]:
    """The request body as a JSON object, or a 400 (or 413) saying why it is not one."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise APIError(413, f"request body too large: {exc.text}", code="body_too_large") from exc
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return body


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn APIError, aiohttp's HTTP errors and unexpected exceptions into JSON bodies."""
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {413: "body_too_large", 404: "not_found", 405: "method_not_allowed"}
        message = exc.reason if exc.status != 404 else f"no route for {request.path}"
        return APIError(exc.status, message, code=code.get(exc.status)).response()
    except Exception:
        logger.exception("unhandled error serving %s %s", request.method, request.path)
        return APIError(500, "internal server error", code="internal_error").response()
