"""The aiohttp application: OpenAI-compatible routes, probes and /metrics.

`create_app` builds the application before the model is loaded; `ServerState.attach` hands it
the engine and tokenizer once they exist. /health answers 200 only while the engine loop runs;
/ready only while serving (not loading, not draining); once the core gave up or was found
stuck, its 503 says why (`reason`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.frontend import admin, token_routes
from pagekeeper_engine.frontend import responses as r
from pagekeeper_engine.frontend.auth import api_key_middleware
from pagekeeper_engine.frontend.chat_protocol import ChatCompletionRequest
from pagekeeper_engine.frontend.errors import (
    APIError,
    bad_request,
    error_middleware,
    from_validation_error,
    read_json_object,
)
from pagekeeper_engine.frontend.metrics import EngineCollector, ServerMetrics
from pagekeeper_engine.frontend.prompt_encoder import PromptEncoder
from pagekeeper_engine.frontend.protocol import CompletionRequest, SamplingRequest
from pagekeeper_engine.frontend.serving import Job, check_prompt, resolve_max_tokens
from pagekeeper_engine.frontend.state import Phase, ServerState
from pagekeeper_engine.frontend.streaming import ChatRenderer, CompletionRenderer, respond
from pagekeeper_engine.frontend.tokenizer import ChatTemplateError
from pagekeeper_engine.memory.allocator import AllocatorSettings
from pagekeeper_engine.messages import LoopStats, Ready

logger = logging.getLogger(__name__)

STATE = web.AppKey("state", ServerState)
RequestT = TypeVar("RequestT", bound=SamplingRequest)
MAX_BODY_BYTES = 16 * 2**20  # a 1M-token prompt as JSON ids is ~8 MiB


def _validate(model: type[RequestT], body: dict[str, Any], state: ServerState) -> RequestT:
    try:
        context = {"max_model_len": state.max_model_len, "vocab_size": state.vocab_size}
        request = model.model_validate(body, context=context)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
    if request.model != state.model_name:
        raise APIError(
            404,
            f"the model {request.model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )
    return request


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival_s = time.monotonic()
    state.require_serving()  # refuse before reading the body while loading or draining
    body = await read_json_object(request)
    req = _validate(CompletionRequest, body, state)
    engine, tokenizer, encoder = state.require_serving()
    # a batch's texts are pending together, so they go to the tokenizer in one call
    encoded = await asyncio.gather(*(_prompt_ids(encoder, p) for p in req.prompt))
    prompt_ids = []
    for i, ids in enumerate(encoded):
        param = "prompt" if len(req.prompt) == 1 else f"prompt[{i}]"
        if not ids:
            raise bad_request("the prompt encodes to no tokens", param)
        check_prompt(ids, state.max_model_len, tokenizer.vocab_size, param)
        prompt_ids.append(ids)
    # OpenAI's default of 16 tokens is shortened to fit; an explicit value must fit.
    explicit = req.max_tokens if "max_tokens" in req.model_fields_set else None
    jobs_params = _params(req, prompt_ids, explicit, state, req.want_logprobs, default=16)
    job = Job(f"cmpl-{uuid.uuid4().hex}", prompt_ids, jobs_params, req.n)
    # echo: each choice's text starts with its prompt's (token id prompts are decoded)
    echoed = (
        [p if isinstance(p, str) else tokenizer.decode(p) for p in req.prompt] if req.echo else None
    )
    renderer = CompletionRenderer(
        job.request_id,
        int(time.time()),
        state.model_name,
        tokenizer,
        want_logprobs=req.want_logprobs,
        num_top_logprobs=req.num_top_logprobs,
        echoed=echoed,
        n=req.n,
    )
    return await respond(
        request, state, engine, job, renderer, req.stream, req.include_usage, arrival_s
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival_s = time.monotonic()
    state.require_serving()
    body = await read_json_object(request)
    req = _validate(ChatCompletionRequest, body, state)
    engine, tokenizer, encoder = state.require_serving()
    try:
        text = tokenizer.apply_chat_template(
            req.template_messages(), add_generation_prompt=req.add_generation_prompt
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc
    # The template already wrote any BOS token.
    ids = await encoder.encode(text, add_special_tokens=False)
    if not ids:
        raise bad_request("the messages render to no tokens", "messages")
    check_prompt(ids, state.max_model_len, tokenizer.vocab_size, "messages")
    want_logprobs = req.logprobs
    limit, limit_param = req.token_limit
    params = _params(req, [ids], limit, state, want_logprobs, default=None, limit_param=limit_param)
    job = Job(f"chatcmpl-{uuid.uuid4().hex}", [ids], params, req.n)
    renderer = ChatRenderer(
        job.request_id,
        int(time.time()),
        state.model_name,
        tokenizer,
        want_logprobs=want_logprobs,
        num_top_logprobs=req.num_top_logprobs,
    )
    return await respond(
        request, state, engine, job, renderer, req.stream, req.include_usage, arrival_s
    )


async def _prompt_ids(encoder: PromptEncoder, prompt: str | list[int]) -> list[int]:
    return await encoder.encode(prompt) if isinstance(prompt, str) else list(prompt)


def _params(
    req: SamplingRequest,
    prompt_ids: list[list[int]],
    explicit_max_tokens: int | None,
    state: ServerState,
    want_logprobs: bool,
    *,
    default: int | None,
    limit_param: str = "max_tokens",
) -> list[SamplingParams]:
    params: list[SamplingParams] = []
    for ids in prompt_ids:
        if explicit_max_tokens is None and default is not None:
            max_tokens = min(default, state.max_model_len - len(ids))
        else:
            max_tokens = resolve_max_tokens(
                explicit_max_tokens, len(ids), state.max_model_len, limit_param
            )
        params += [
            req.sampling_params(max_tokens, want_logprobs=want_logprobs, index=j)
            for j in range(req.n)
        ]
    return params


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        r.model_list(state.model_name, state.created, state.max_model_len or None)
    )


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.is_alive:
        return web.json_response({"status": "ok"})
    status = "loading" if state.engine is None else "engine loop is not running"
    return web.json_response({"status": status}, status=503)


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.is_serving:
        return web.json_response({"status": "ready"})
    body = {"status": state.phase.value}
    if state.phase is Phase.SERVING and state.engine is not None:  # the core died or is stuck
        body = {"status": "engine loop is not running", "reason": state.engine.dead_reason or ""}
    return web.json_response(body, status=503, headers={"Retry-After": "5"})


async def defragment(request: web.Request) -> web.Response:
    return await admin.defragment(request, request.app[STATE])


async def tokenize(request: web.Request) -> web.Response:
    return await token_routes.tokenize(request, request.app[STATE])


async def detokenize(request: web.Request) -> web.Response:
    return await token_routes.detokenize(request, request.app[STATE])


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(
    config: EngineConfig,
    *,
    allocator_settings: AllocatorSettings | None = None,
    metrics_multiprocess_dir: str | None = None,
) -> web.Application:
    """The application, loading until `app[STATE].attach(...)`. With several front ends,
    `metrics_multiprocess_dir` is where their latency histograms and counters meet."""
    middlewares: list[Middleware] = [error_middleware]
    if config.api_key:
        middlewares.append(api_key_middleware(config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    state: ServerState | None = None

    def read_stats() -> LoopStats | None:
        return state.read_stats() if state is not None else None

    def is_draining() -> bool:
        return state is not None and state.is_draining

    def read_ready() -> Ready | None:
        return state.engine.ready if state is not None and state.engine is not None else None

    collector = EngineCollector(
        config.model_name, read_stats, is_draining, read_ready, allocator_settings
    )
    server_metrics = ServerMetrics(config.model_name, collector, metrics_multiprocess_dir)
    state = ServerState(config, server_metrics)
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", token_routes.version)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/admin/defragment", defragment)
    return app
