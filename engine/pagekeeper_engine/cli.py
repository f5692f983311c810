"""`pagekeeper-engine serve MODEL [flags]`: load a checkpoint and serve it over HTTP.

The HTTP server starts first and the model loads after, in a thread, so /health and /ready
answer (503) during a slow load. SIGTERM (or SIGINT) drains: readiness fails at once, running
requests finish within `--shutdown-timeout`, and the process exits 0.

Out of memory, the process says why in `--termination-log-path` (the operator reads it) before
it exits 1: at start-up when the memory budget cannot hold one max-model-len request, the GPU
has less free memory than asked for, or the profile itself ran out of memory; at run time when
out-of-memory errors repeat past `--max-consecutive-ooms`.
Exit codes: 0 after a drain, 1 when the model cannot be loaded or served, 2 for bad flags or
allocator settings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from pagekeeper_engine.config import EngineConfig, parse_args
from pagekeeper_engine.memory.allocator import read_alloc_settings
from pagekeeper_engine.memory.budget import MemoryBudgetError
from pagekeeper_engine.memory.oom import (
    DeviceOutOfMemoryError,
    OOMKind,
    OOMPhase,
    write_termination_log,
)
from pagekeeper_engine.server.app import STATE, create_app
from pagekeeper_engine.server.drain import drain

if TYPE_CHECKING:
    from pagekeeper_engine.async_engine import AsyncLLMEngine
    from pagekeeper_engine.tokenizer import Tokenizer

logger = logging.getLogger("pagekeeper_engine")

USAGE = "usage: pagekeeper-engine serve MODEL [flags]   (pagekeeper-engine serve --help)"


@dataclass
class Loaded:
    """What the loading thread built."""

    engine: AsyncLLMEngine
    tokenizer: Tokenizer
    max_model_len: int
    read_budget: Callable[[], Mapping[str, int] | None]


def _load(config: EngineConfig, on_fatal: Callable[[str], None]) -> Loaded:
    # Imported here: torch's import alone takes seconds, and the HTTP server is already up.
    import torch  # noqa: PLC0415

    from pagekeeper_engine.async_engine import AsyncLLMEngine  # noqa: PLC0415
    from pagekeeper_engine.engine import LLMEngine  # noqa: PLC0415
    from pagekeeper_engine.runner import ModelRunner  # noqa: PLC0415
    from pagekeeper_engine.tokenizer import Tokenizer  # noqa: PLC0415

    tokenizer = Tokenizer.from_dir(config.model)
    try:
        runner = ModelRunner(config)
    except torch.OutOfMemoryError as exc:
        detail = f"out of memory while loading and profiling the model: {exc}"
        raise DeviceOutOfMemoryError("startup", detail) from None
    engine = AsyncLLMEngine(LLMEngine(config, runner, tokenizer), on_fatal=on_fatal)
    engine.start()
    return Loaded(engine, tokenizer, runner.max_model_len, lambda: runner.memory_budget_bytes)


def _load_in_thread(
    config: EngineConfig, on_fatal: Callable[[str], None]
) -> asyncio.Future[Loaded]:
    """Load on a daemon thread: a SIGTERM during a load must not wait for the load to end."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Loaded] = loop.create_future()

    def run() -> None:
        try:
            loaded = _load(config, on_fatal)
        except BaseException as exc:  # handed to the event loop, which reports it
            loop.call_soon_threadsafe(future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(future.set_result, loaded)

    threading.Thread(target=run, name="model-load", daemon=True).start()
    return future


def report_oom_exit(config: EngineConfig, phase: OOMPhase, detail: str) -> None:
    """Log the reason and write it where the operator reads it."""
    logger.critical("exiting: out of memory at %s: %s", phase, detail)
    kind: OOMKind = "gpu" if config.device == "cuda" else "host"
    write_termination_log(kind, phase, detail, Path(config.termination_log_path))


async def serve(config: EngineConfig) -> int:
    """Serve until SIGTERM/SIGINT; the process's exit code."""
    try:
        allocator_settings = read_alloc_settings(os.environ)
    except ValueError as exc:
        logger.error("bad allocator settings: %s", exc)
        return 2
    logger.info("CUDA caching allocator: %s", allocator_settings.describe())
    budget_hook: list[Callable[[], Mapping[str, int] | None]] = []

    def read_budget() -> Mapping[str, int] | None:
        return budget_hook[0]() if budget_hook else None

    app = create_app(config, read_budget=read_budget, allocator_settings=allocator_settings)
    state = app[STATE]
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # requests in the engine and frees their blocks.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    logger.info("listening on http://%s:%d; loading %s", config.host, config.port, config.model)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    fatal: asyncio.Future[str] = loop.create_future()

    def set_fatal(reason: str) -> None:
        if not fatal.done():
            fatal.set_result(reason)

    def on_fatal(reason: str) -> None:  # called on the engine's thread
        loop.call_soon_threadsafe(set_fatal, reason)

    loading = _load_in_thread(config, on_fatal)
    stopping = asyncio.ensure_future(stop.wait())
    pending: set[asyncio.Future[Any]] = {loading, stopping}
    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        logger.info("signalled during the model load; exiting without serving")
        state.begin_drain()
        await runner.cleanup()
        return 0
    try:
        loaded = loading.result()
    except (MemoryBudgetError, DeviceOutOfMemoryError) as exc:
        report_oom_exit(config, "startup", str(exc))
        await runner.cleanup()
        return 1
    except Exception:
        logger.exception("could not load %s", config.model)
        await runner.cleanup()
        return 1
    budget_hook.append(loaded.read_budget)
    state.attach(loaded.engine, loaded.tokenizer, loaded.max_model_len)
    logger.info("serving %s as %r", config.model, config.model_name)

    ending: set[asyncio.Future[Any]] = {stopping, fatal}
    await asyncio.wait(ending, return_when=asyncio.FIRST_COMPLETED)
    if fatal.done():
        report_oom_exit(config, "runtime", fatal.result())
        state.begin_drain()
        await runner.cleanup()
        loaded.engine.shutdown()
        return 1
    await drain(state, config.shutdown_timeout)
    await runner.cleanup()
    if state.engine is not None:
        state.engine.shutdown()
    logger.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 2
    config = parse_args(args[1:])  # exits 2 with a message naming the flag
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
