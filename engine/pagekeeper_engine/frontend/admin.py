"""`POST /admin/defragment`: hand the CUDA caching allocator's unused segments back to the device.

Authenticated by a bearer token read from the environment variable named by
`--admin-token-env` (compared in constant time): 401 without a token, 403 with a wrong one, 403
when the server has no token configured (the endpoint is off). The release runs on the engine
thread between steps and only when at most `max_running` sequences run (JSON body, default 0);
otherwise 409 with Retry-After. On the CPU there is no caching allocator: 501 says so.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from pagekeeper_engine.frontend.errors import APIError, read_json_object
from pagekeeper_engine.frontend.state import ServerState
from pagekeeper_engine.memory.allocator import AllocatorStats
from pagekeeper_engine.messages import DefragmentResult

RETRY_AFTER_BUSY_S = 5.0
DEFRAGMENT_TIMEOUT_S = 30.0  # a step in flight finishes well within this


def check_admin_token(headers: Mapping[str, str], env_var: str, env: Mapping[str, str]) -> None:
    """Raise the APIError an admin request without the right bearer token gets."""
    expected = env.get(env_var, "")
    if not expected:
        raise APIError(
            403,
            f"admin endpoints are disabled: set the environment variable {env_var} "
            "(named by --admin-token-env) to a token to enable them",
            code="admin_disabled",
        )
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise APIError(
            401, "missing bearer token (Authorization: Bearer <token>)", code="unauthorized"
        )
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(403, "wrong admin token", code="forbidden")


def _allocator_json(stats: AllocatorStats | None) -> dict[str, int] | None:
    return None if stats is None else stats.as_dict()


def defragment_body(result: DefragmentResult) -> dict[str, Any]:
    return {
        "defragmented": result.is_done,
        "num_running": result.num_running,
        "bytes_freed": result.bytes_freed,
        "before": _allocator_json(result.before),
        "after": _allocator_json(result.after),
        "seconds": round(result.seconds, 6),
    }


async def defragment(request: web.Request, state: ServerState) -> web.Response:
    check_admin_token(request.headers, state.config.admin_token_env, os.environ)
    max_running = 0
    if request.can_read_body:
        body = await read_json_object(request)
        value = body.get("max_running", 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise APIError(
                400,
                "max_running must be a non-negative integer",
                param="max_running",
                code="invalid_value",
            )
        max_running = value
    engine = state.engine
    if engine is None:
        raise APIError(503, "model is still loading", code="loading", retry_after_s=10.0)
    if not engine.ready.has_allocator:
        raise APIError(
            501,
            "this engine runs on the CPU: there is no CUDA caching allocator to defragment",
            code="no_cuda_allocator",
        )
    try:
        result = await asyncio.wait_for(engine.defragment(max_running), DEFRAGMENT_TIMEOUT_S)
    except TimeoutError as exc:
        raise APIError(503, "the engine core did not answer in time", code="timeout") from exc
    if not result.is_done:
        raise APIError(
            409,
            f"{result.num_running} sequences are running (at most {max_running} allowed); "
            "retry when the engine is idler",
            code="busy",
            retry_after_s=RETRY_AFTER_BUSY_S,
        )
    return web.json_response(defragment_body(result))
