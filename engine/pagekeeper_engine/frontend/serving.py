"""From a validated request to engine work, and the engine's outputs back to choices.

A request becomes `num_prompts x n` sequences (choices), each its own engine request; their
outputs are merged in arrival order. Leaving the merge early (a client that disconnects, a
handler cancelled) aborts every choice still running, so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.frontend.client import EngineClient, RequestOutput
from pagekeeper_engine.frontend.errors import bad_request


@dataclass(frozen=True)
class Job:
    """One HTTP request's engine work: choice i runs `prompt_ids[i // n]` with `params[i]`."""

    request_id: str
    prompt_ids: list[list[int]]
    params: list[SamplingParams]
    n: int

    @property
    def num_choices(self) -> int:
        return len(self.params)

    def choice_request_id(self, index: int) -> str:
        return f"{self.request_id}-{index}"


def check_prompt(token_ids: list[int], max_model_len: int, vocab_size: int, param: str) -> None:
    """400 for a prompt that leaves no room to generate or names tokens the model lacks."""
    if len(token_ids) >= max_model_len:
        raise bad_request(
            f"the prompt is {len(token_ids)} tokens; this model's maximum context length is "
            f"{max_model_len} tokens, which leaves no room for a completion",
            param,
        )
    if max(token_ids) >= vocab_size:
        raise bad_request(
            f"token id {max(token_ids)} is out of range for a vocabulary of {vocab_size}", param
        )


def resolve_max_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    param: str = "max_tokens",
) -> int:
    """Tokens to generate: as requested in `param` (400 if the context cannot hold them) or all
    that fit."""
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; the prompt is "
            f"{num_prompt_tokens} tokens and {param} asks for {requested} more",
            param,
        )
    return requested


async def _pump(
    engine: EngineClient,
    job: Job,
    index: int,
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]],
) -> None:
    try:
        stream = engine.generate(
            job.choice_request_id(index), job.prompt_ids[index // job.n], job.params[index]
        )
        async for output in stream:
            await queue.put((index, output))
    except Exception as exc:  # handed to the consumer, which raises it in the handler
        await queue.put((index, exc))
        return
    await queue.put((index, None))


async def run_job(engine: EngineClient, job: Job) -> AsyncGenerator[tuple[int, RequestOutput]]:
    """Every choice's outputs as (choice index, output), in the order the engine emits them."""
    if job.num_choices == 1:  # the common case: no task and no queue between engine and handler
        stream = engine.generate(job.choice_request_id(0), job.prompt_ids[0], job.params[0])
        async with contextlib.aclosing(stream) as outputs:
            async for output in outputs:
                yield 0, output
        return
    num_unfinished = job.num_choices
    finished = [False] * job.num_choices
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
    tasks = [
        asyncio.create_task(_pump(engine, job, index, queue)) for index in range(job.num_choices)
    ]
    try:
        while num_unfinished:
            index, item = await queue.get()
            if item is None:
                num_unfinished -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            finished[index] = item.finished
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        # Not awaited: this may run inside a cancelled handler, which must not block here.
        for index, is_finished in enumerate(finished):
            if not is_finished:
                engine.abort(job.choice_request_id(index))
