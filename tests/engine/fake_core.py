"""A real `EngineCore` over a fake runner, on a thread, and a real `CoreClient` talking to it.

The messages cross real ZMQ sockets in a private directory, so front-end tests exercise the
process boundary's code without a model: only the process is missing (the server tests start
the real processes).
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import zmq

from pagekeeper_engine.core.limits import resolve_limits
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.frontend.client import RequestOutput
from pagekeeper_engine.frontend.core_client import CoreClient
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.loop.engine_core import EngineCore
from pagekeeper_engine.messages import PROTOCOL_VERSION, CoreAddresses, Ready
from tests.engine.fakes import CharTokenizer, PagedFakeRunner, make_engine

JOIN_TIMEOUT_S = 30.0


@dataclass
class FakeCore:
    engine: LLMEngine
    core: EngineCore
    client: CoreClient
    thread: threading.Thread
    exit_codes: list[int]
    addresses: CoreAddresses

    def hold_step_until_a_message(self, call: int) -> None:
        """Hold the runner's `call`-th execute (0-based) until a message waits in the core's
        inbox, so the turn after that step reads it: what the front end sends in reply to the
        outputs before `call` cannot lose a race against the core's next steps, however busy
        the machine."""
        runner = self.engine.runner
        assert isinstance(runner, PagedFakeRunner)
        poller = zmq.Poller()
        poller.register(self.core._inbox, zmq.POLLIN)  # the core's own thread polls it

        def hold(index: int) -> None:
            if index == call and not poller.poll(int(JOIN_TIMEOUT_S * 1000)):
                raise AssertionError(f"no message reached the core while call {call} waited")

        runner.before_execute = hold

    def hold_steps_until_messages(self, first_call: int) -> None:
        """Hold every execute from the runner's `first_call`-th (0-based) on until a message
        waits in the core's inbox: the requests running then take one step per message the
        front end sends (an admin call, an abort), so they stay running across a test's calls
        however fast the core could step."""
        runner = self.engine.runner
        assert isinstance(runner, PagedFakeRunner)
        poller = zmq.Poller()
        poller.register(self.core._inbox, zmq.POLLIN)

        def hold(index: int) -> None:
            if index >= first_call and not poller.poll(int(JOIN_TIMEOUT_S * 1000)):
                raise AssertionError(f"no message reached the core while call {index} waited")

        runner.before_execute = hold

    def hold_step_until(self, call: int, condition: Callable[[], bool], what: str) -> None:
        """Hold the runner's `call`-th execute (0-based) until `condition()` (polled from the
        core's thread), so what runs in that step is still running when `what` happens."""
        runner = self.engine.runner
        assert isinstance(runner, PagedFakeRunner)

        def hold(index: int) -> None:
            if index != call:
                return
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while not condition():
                if time.monotonic() > deadline:
                    raise AssertionError(f"call {call} waited for {what} in vain")
                time.sleep(0.001)

        runner.before_execute = hold


def ready_for(engine: LLMEngine, max_num_in_flight: int | None = None) -> Ready:
    config = engine.config
    limits = resolve_limits(config, config.max_model_len or 128)
    if max_num_in_flight is not None:
        limits = replace(limits, max_num_in_flight=max_num_in_flight)
    return Ready(
        protocol_version=PROTOCOL_VERSION,
        limits=limits,
        block_size=config.block_size,
        num_gpu_blocks=engine.runner.num_gpu_blocks,
        num_cpu_blocks=engine.runner.num_cpu_blocks,
        kv_cache_dtype="float32",
        memory_budget_bytes=None,
        has_allocator=engine.has_allocator,
        is_async_scheduling=engine.is_async,
        stats=engine.stats(),
    )


@contextlib.asynccontextmanager
async def fake_core(
    engine: LLMEngine | None = None, max_num_in_flight: int | None = None, **engine_args: Any
) -> AsyncIterator[FakeCore]:
    """Serve `engine` (default: `make_engine(**engine_args)`) from a core thread; the client
    has its handshake (with `max_num_in_flight` in its limits, if given). On exit the core is
    told to stop and its thread joined."""
    if engine is None:
        engine, _ = make_engine(**engine_args)
    with tempfile.TemporaryDirectory(prefix="pk-core-") as directory:
        addresses = CoreAddresses(directory)
        core = EngineCore(engine, addresses, 1)
        exit_codes: list[int] = []
        thread = threading.Thread(
            target=lambda: exit_codes.append(core.run()), name="fake-core", daemon=True
        )
        client = CoreClient(addresses, 0, CharTokenizer().decode_batch)
        core.send_ready(ready_for(engine, max_num_in_flight))
        thread.start()
        await client.wait_ready()
        try:
            yield FakeCore(engine, core, client, thread, exit_codes, addresses)
        finally:
            if thread.is_alive():
                client.shutdown_core()
                thread.join(JOIN_TIMEOUT_S)
            await client.close()
            core.close()


async def collect(
    client: CoreClient, request_id: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    return [out async for out in client.generate(request_id, prompt, params)]
