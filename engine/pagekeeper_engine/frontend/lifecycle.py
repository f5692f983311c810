"""One front end's life: listen, wait for the engine core, serve, drain, stop.

The HTTP server starts before the core has loaded the model, so /health and /ready answer
(503) during a slow load. A stop signal drains: readiness fails at once, running requests
finish within `--shutdown-timeout`, and the front end returns 0. If the core dies or gives up,
/health fails, requests in flight fail, and the front end returns 1 (the pod restarts).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.frontend.app import STATE, create_app
from pagekeeper_engine.frontend.core_client import CoreClient
from pagekeeper_engine.frontend.drain import drain
from pagekeeper_engine.frontend.tokenizer import Tokenizer
from pagekeeper_engine.heap import freeze_startup_heap
from pagekeeper_engine.memory.allocator import AllocatorSettings
from pagekeeper_engine.messages import CoreAddresses

logger = logging.getLogger(__name__)


@dataclass
class FrontendOptions:
    """How one front end runs beside the others and the core."""

    client_index: int
    addresses: CoreAddresses
    allocator_settings: AllocatorSettings | None
    metrics_multiprocess_dir: str | None
    # whether the core's process still runs, where this process can tell
    is_core_running: Callable[[], bool] = lambda: True
    # awaited after this front end drained and before it tells the core to stop (the
    # supervising front end waits there for the others); None: it does not stop the core
    stop_core_after: Callable[[], Awaitable[None]] | None = None


async def serve_frontend(
    config: EngineConfig, options: FrontendOptions, stop: asyncio.Event, core_gone: asyncio.Event
) -> int:
    """Serve until `stop` or SIGTERM / SIGINT (exit code 0 after a drain) or `core_gone` (1)."""
    app = create_app(
        config,
        allocator_settings=options.allocator_settings,
        metrics_multiprocess_dir=options.metrics_multiprocess_dir,
    )
    state = app[STATE]

    def on_stop_signal() -> None:
        # Readiness fails in this very callback, before any request queued behind the signal
        # is answered; the drain itself follows from `stop`.
        state.begin_drain()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop_signal)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # requests in the engine and frees their blocks.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_port=config.api_server_count > 1)
    await site.start()
    logger.info(
        "front end %d listening on http://%s:%d; the engine core is loading %s",
        options.client_index,
        config.host,
        config.port,
        config.model,
    )
    try:
        tokenizer = await asyncio.to_thread(Tokenizer.from_dir, config.model)
    except Exception:
        logger.exception("could not load %s: its tokenizer failed", config.model)
        await runner.cleanup()
        return 1
    client = CoreClient(
        options.addresses,
        options.client_index,
        tokenizer.decode_batch,
        is_core_running=options.is_core_running,
    )
    try:
        return await _serve(config, options, state, client, tokenizer, stop, core_gone, runner)
    finally:
        await client.close()


async def _serve(
    config: EngineConfig,
    options: FrontendOptions,
    state: Any,
    client: CoreClient,
    tokenizer: Tokenizer,
    stop: asyncio.Event,
    core_gone: asyncio.Event,
    runner: web.AppRunner,
) -> int:
    gone = asyncio.ensure_future(_first(core_gone.wait(), client.died.wait()))
    stopping = asyncio.ensure_future(stop.wait())
    loading = asyncio.ensure_future(client.wait_ready())
    try:
        await asyncio.wait({loading, stopping, gone}, return_when=asyncio.FIRST_COMPLETED)
        if stopping.done() and not loading.done():
            logger.info("signalled during the model load; exiting without serving")
            state.begin_drain()
            await runner.cleanup()
            return 0
        if not loading.done() or loading.exception() is not None:
            if not client.died.is_set():
                client.on_core_death("the engine core exited before it was ready")
            logger.error("not serving: %s", client.dead_reason)
            await runner.cleanup()
            return 1
        state.attach(client, tokenizer)
        freeze_startup_heap(f"front end {options.client_index}")
        logger.info("serving %s as %r", config.model, config.model_name)
        await asyncio.wait({stopping, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gone.done():
            if not client.died.is_set():
                client.on_core_death("the engine core process exited")
            logger.error("exiting: %s", client.dead_reason)
            state.begin_drain()
            await runner.cleanup()
            return 1
        await drain(state, config.shutdown_timeout)
        await runner.cleanup()
        if options.stop_core_after is not None:
            await options.stop_core_after()
            client.shutdown_core()
        logger.info("front end %d stopped", options.client_index)
        return 0
    finally:
        for task in (gone, stopping, loading):
            task.cancel()


async def _first(*waits: Awaitable[Any]) -> None:
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
