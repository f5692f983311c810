"""Answering a job: one JSON body, or server-sent events as tokens arrive.

Renderers turn accumulated `ChoiceState`s into the endpoint's shapes (completions or chat);
`respond` drives the engine, observes latencies, and owns the in-flight accounting. An error
before the first event is an ordinary JSON error; after it, an `error` event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from aiohttp import web

from pagekeeper_engine.core.limits import RequestRejectedError
from pagekeeper_engine.frontend import responses as r
from pagekeeper_engine.frontend.client import (
    EngineClient,
    EngineDeadError,
    EngineDrainingError,
    RequestFailedError,
    RequestOutput,
)
from pagekeeper_engine.frontend.errors import APIError, bad_request
from pagekeeper_engine.frontend.metrics import RequestTimer
from pagekeeper_engine.frontend.responses import ChoiceState, Json
from pagekeeper_engine.frontend.serving import Job, run_job
from pagekeeper_engine.frontend.state import RETRY_AFTER_DRAINING_S, ServerState
from pagekeeper_engine.frontend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Renderer(Protocol):
    prompt_param: str

    def chunks(self, choice: ChoiceState, output: RequestOutput, text_offset: int) -> list[Json]:
        """Stream chunks for one engine output that was just applied to `choice`."""

    def final(self, choices: list[ChoiceState], usage: Json) -> Json:
        """The whole (non-streaming) response body."""

    def usage_chunk(self, usage: Json) -> Json:
        """The last chunk of a stream when `stream_options.include_usage` is set."""


class _BaseRenderer:
    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        tokenizer: Tokenizer,
        *,
        want_logprobs: bool,
        num_top_logprobs: int = 0,
    ) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.num_top_logprobs = num_top_logprobs

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    def alternatives(self, tops: list[list[tuple[int, float]]]) -> list[r.TopAlternatives] | None:
        """Each token's asked-for alternatives as text (None where none were asked)."""
        if self.num_top_logprobs == 0:
            return None
        return [
            [
                (self.tokenizer.decode([t], skip_special_tokens=False), value)
                for t, value in alternatives[: self.num_top_logprobs]
            ]
            for alternatives in tops
        ]


class CompletionRenderer(_BaseRenderer):
    """Completions' shapes; with `echoed` (the prompts' texts, for `echo`), each choice's text
    starts with its prompt's: in the whole body, and in a stream's first chunk of the choice."""

    prompt_param = "prompt"

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        tokenizer: Tokenizer,
        *,
        want_logprobs: bool,
        num_top_logprobs: int = 0,
        echoed: list[str] | None = None,
        n: int = 1,
    ) -> None:
        super().__init__(
            request_id,
            created,
            model,
            tokenizer,
            want_logprobs=want_logprobs,
            num_top_logprobs=num_top_logprobs,
        )
        self._echoed = echoed
        self._n = n
        self._unechoed = set(range(len(echoed) * n)) if echoed is not None else set()

    def _echo(self, index: int) -> str:
        return "" if self._echoed is None else self._echoed[index // self._n]

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[float | None],
        offset: int,
        tops: list[list[tuple[int, float]]],
    ) -> Json | None:
        if not self.want_logprobs:
            return None
        return r.completion_logprobs(
            self.token_strings(token_ids), logprobs, offset, self.alternatives(tops)
        )

    def chunks(self, choice: ChoiceState, output: RequestOutput, text_offset: int) -> list[Json]:
        has_logprobs = self.want_logprobs and bool(output.new_token_ids)
        text = output.new_text
        if choice.index in self._unechoed:
            self._unechoed.discard(choice.index)
            text = self._echo(choice.index) + text
        if not (text or output.finished or has_logprobs):
            return []
        logprobs = self._logprobs(
            list(output.new_token_ids),
            list(output.logprobs or []),
            text_offset,
            list(output.top_logprobs),
        )
        body = r.completion_choice(choice.index, text, choice.finish_reason, logprobs)
        return [r.completion_chunk(self.request_id, self.created, self.model, [body])]

    def final(self, choices: list[ChoiceState], usage: Json) -> Json:
        bodies = [
            r.completion_choice(
                c.index,
                self._echo(c.index) + c.text,
                c.finish_reason,
                self._logprobs(c.token_ids, c.logprobs, 0, c.top_logprobs),
            )
            for c in choices
        ]
        return r.completion_response(self.request_id, self.created, self.model, bodies, usage)

    def usage_chunk(self, usage: Json) -> Json:
        return r.completion_chunk(self.request_id, self.created, self.model, [], usage)


class ChatRenderer(_BaseRenderer):
    prompt_param = "messages"

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        tokenizer: Tokenizer,
        *,
        want_logprobs: bool,
        num_top_logprobs: int = 0,
    ) -> None:
        super().__init__(
            request_id,
            created,
            model,
            tokenizer,
            want_logprobs=want_logprobs,
            num_top_logprobs=num_top_logprobs,
        )
        self._started: set[int] = set()

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[float | None],
        tops: list[list[tuple[int, float]]],
    ) -> Json | None:
        if not self.want_logprobs:
            return None
        return r.chat_logprobs(self.token_strings(token_ids), logprobs, self.alternatives(tops))

    def _chunk(self, choice: Json) -> Json:
        return r.chat_chunk(self.request_id, self.created, self.model, [choice])

    def chunks(self, choice: ChoiceState, output: RequestOutput, text_offset: int) -> list[Json]:
        out: list[Json] = []
        if choice.index not in self._started:
            self._started.add(choice.index)
            out.append(
                self._chunk(r.chat_delta(choice.index, {"role": "assistant", "content": ""}, None))
            )
        if output.new_text or (self.want_logprobs and output.new_token_ids):
            logprobs = self._logprobs(
                list(output.new_token_ids), list(output.logprobs or []), list(output.top_logprobs)
            )
            delta: Json = {"content": output.new_text}
            out.append(self._chunk(r.chat_delta(choice.index, delta, None, logprobs)))
        if output.finished:
            out.append(self._chunk(r.chat_delta(choice.index, {}, choice.finish_reason)))
        return out

    def final(self, choices: list[ChoiceState], usage: Json) -> Json:
        bodies = [
            r.chat_choice(
                c.index,
                c.text,
                c.finish_reason,
                self._logprobs(c.token_ids, c.logprobs, c.top_logprobs),
            )
            for c in choices
        ]
        return r.chat_response(self.request_id, self.created, self.model, bodies, usage)

    def usage_chunk(self, usage: Json) -> Json:
        return r.chat_chunk(self.request_id, self.created, self.model, [], usage)


def _apply(choice: ChoiceState, output: RequestOutput) -> None:
    choice.text += output.new_text
    choice.token_ids += output.new_token_ids
    if output.logprobs:
        choice.logprobs += output.logprobs
    if output.top_logprobs:
        choice.top_logprobs += output.top_logprobs
    choice.num_prompt_tokens = output.num_prompt_tokens
    choice.num_output_tokens = output.num_output_tokens
    choice.num_cached_tokens = output.num_cached_tokens
    if output.finished:
        choice.finish_reason = output.finish_reason


class _EventStream:
    """Prepares the SSE response on the first event, so earlier errors can still be JSON."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    async def send(self, *payloads: Json | str) -> None:
        """One write for all `payloads` (the events of one engine output)."""
        if self.response is None:
            self.response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self.response.prepare(self._request)
        await self.response.write(b"".join(r.sse_event(payload) for payload in payloads))


async def respond(
    request: web.Request,
    state: ServerState,
    engine: EngineClient,
    job: Job,
    renderer: Renderer,
    is_stream: bool,
    include_usage: bool,
    arrival_s: float,
) -> web.StreamResponse:
    """Run `job` on the engine and answer it; every choice still running on exit is aborted."""
    if job.num_choices > state.max_num_in_flight:
        raise bad_request(
            f"{job.num_choices} choices (prompts x n) can never fit this server, which runs at "
            f"most {state.max_num_in_flight} at once",
            "n",
        )
    state.reserve(job.num_choices)
    choices = [ChoiceState(i) for i in range(job.num_choices)]
    timers = [RequestTimer(state.metrics, arrival_s) for _ in choices]
    events = _EventStream(request)
    try:
        async with contextlib.aclosing(run_job(engine, job)) as outputs:
            async for index, output in outputs:
                choice = choices[index]
                text_offset = len(choice.text)
                _apply(choice, output)
                now_s = time.monotonic()
                timers[index].on_tokens(len(output.new_token_ids), now_s)
                if output.finished:
                    timers[index].on_finish(now_s)
                if is_stream and (chunks := renderer.chunks(choice, output, text_offset)):
                    await events.send(*chunks)
        usage = r.usage(choices, len(job.prompt_ids))
        if not is_stream:
            return web.json_response(renderer.final(choices, usage))
        if include_usage:
            await events.send(renderer.usage_chunk(usage))
        await events.send("[DONE]")
    except RequestRejectedError as exc:
        await _fail(events, bad_request(str(exc), exc.param or renderer.prompt_param))
    except EngineDrainingError as exc:
        state.metrics.count_rejected("draining")
        await _fail(
            events, APIError(503, str(exc), code="draining", retry_after_s=RETRY_AFTER_DRAINING_S)
        )
    except EngineDeadError as exc:
        await _fail(events, APIError(503, str(exc), code="engine_dead"))
    except RequestFailedError as exc:
        logger.error("request %s failed in the engine: %s", job.request_id, exc)
        await _fail(events, APIError(500, str(exc), code="engine_error"))
    except APIError as exc:
        await _fail(events, exc)
    except ConnectionResetError:
        # The client went away mid-stream; leaving run_job above aborted its choices.
        logger.info("client disconnected from %s; aborted its unfinished choices", job.request_id)
    except asyncio.CancelledError:
        # aiohttp cancels the handler of a client that disconnects (handler_cancellation).
        logger.info("client disconnected from %s; aborted its unfinished choices", job.request_id)
        raise
    finally:
        state.release(job.num_choices)
    assert events.response is not None, "a stream ends with at least [DONE] or an error event"
    return events.response


async def _fail(events: _EventStream, error: APIError) -> None:
    if events.response is None:
        raise error
    await events.send(error.body())
    await events.send("[DONE]")
