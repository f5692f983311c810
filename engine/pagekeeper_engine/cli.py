"""`pagekeeper-engine serve MODEL [flags]`: the engine core and its front ends, as processes.

This process starts the engine core's process (`engine_process`: model, KV cache, step loop),
starts `--api-server-count` - 1 more front-end processes that share the port, and serves as the
first front end itself (`frontend.lifecycle`), so the HTTP server answers /health and /ready
(503) while the core loads. It imports no torch.

SIGTERM (or SIGINT) drains every front end: readiness fails at once, running requests finish
within `--shutdown-timeout`; then the core is told to stop and the process exits 0. If the core
dies, /health fails and the process exits 1; if another front end dies, the rest stop and the
process exits 1; if this process dies, the core and the other front ends notice and exit.
Out-of-memory exits write their reason to `--termination-log-path` from the core's process.
Exit codes: 0 after a drain, 1 when the model cannot be loaded or served, 2 for bad flags or
allocator settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Coroutine
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from pagekeeper_engine.config import EngineConfig, parse_args
from pagekeeper_engine.engine_process import LOG_FORMAT, run_engine_core
from pagekeeper_engine.memory.allocator import AllocatorSettings, read_alloc_settings
from pagekeeper_engine.messages import CoreAddresses
from pagekeeper_engine.process_watch import exit_code, watch_parent, watch_processes

logger = logging.getLogger("pagekeeper_engine")
T = TypeVar("T")

USAGE = "usage: pagekeeper-engine serve MODEL [flags]   (pagekeeper-engine serve --help)"
CORE_STOP_TIMEOUT_S = 30.0  # the core aborts what is left and exits well within this


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run a front end's event loop: uvloop's where it is installed (a faster loop and
    transports for thousands of streamed tokens a second), else asyncio's."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _watch(process: BaseProcess, gone: asyncio.Event, what: str) -> None:
    """Set `gone` when `process` exits, and log how it did."""
    loop = asyncio.get_running_loop()

    def on_exit(process: BaseProcess) -> None:
        code = exit_code(process)  # the shutdown's own join reaps it
        if code == 0:  # a clean stop, as after a drain
            logger.info("%s exited with code 0", what)
        elif code is None:  # reaped that moment by the shutdown, which reports a failure
            logger.info("%s exited", what)
        else:
            logger.error("%s exited with code %s", what, code)
        with contextlib.suppress(RuntimeError):  # the loop already ended: nobody waits
            loop.call_soon_threadsafe(gone.set)

    watch_processes([process], on_exit, name=f"watch-{process.name}")


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def _join(process: BaseProcess, timeout_s: float) -> None:
    await asyncio.to_thread(process.join, timeout_s)
    if process.is_alive():
        logger.error("%s did not stop within %.0f s; killing it", process.name, timeout_s)
        process.kill()
        await asyncio.to_thread(process.join, 5.0)


async def serve(config: EngineConfig, allocator_settings: AllocatorSettings, run_dir: str) -> int:
    """Start the core and the other front ends, serve as front end 0; the exit code."""
    from pagekeeper_engine.frontend.lifecycle import FrontendOptions, serve_frontend  # noqa: PLC0415

    addresses = CoreAddresses(run_dir)
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    context = multiprocessing.get_context("spawn")
    core = context.Process(
        target=run_engine_core,
        args=(config, addresses, config.api_server_count),
        name="engine-core",
    )
    core.start()
    others = [
        context.Process(
            target=run_frontend,
            args=(config, addresses, index, allocator_settings, metrics_dir),
            name=f"front-end-{index}",
        )
        for index in range(1, config.api_server_count)
    ]
    for process in others:
        process.start()

    stop, core_gone, other_gone = asyncio.Event(), asyncio.Event(), asyncio.Event()
    _stop_on_signals(stop)
    _watch(core, core_gone, "the engine core")
    for process in others:
        _watch(process, other_gone, process.name or "a front end")

    async def stop_others_first() -> None:
        for process in others:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        for process in others:
            await _join(process, config.shutdown_timeout + CORE_STOP_TIMEOUT_S)

    async def forward_stop() -> None:
        await stop.wait()
        for process in others:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)

    forwarding = asyncio.ensure_future(forward_stop())
    options = FrontendOptions(
        client_index=0,
        addresses=addresses,
        allocator_settings=allocator_settings,
        metrics_multiprocess_dir=metrics_dir,
        is_core_running=core.is_alive,
        stop_core_after=stop_others_first,
    )
    # another front end's death ends this one as the core's would: the pod restarts whole
    gone = asyncio.Event()

    async def either_gone() -> None:
        await asyncio.wait(
            [asyncio.ensure_future(core_gone.wait()), asyncio.ensure_future(other_gone.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )
        gone.set()

    watching = asyncio.ensure_future(either_gone())
    try:
        code = await serve_frontend(config, options, stop, gone)
    finally:
        forwarding.cancel()
        watching.cancel()
    if code != 0:
        for process in others:
            if process.is_alive():
                process.terminate()
    for process in others:
        await _join(process, CORE_STOP_TIMEOUT_S)
    if core.is_alive() and code != 0:
        core.terminate()
    await _join(core, CORE_STOP_TIMEOUT_S)
    if code == 0 and core.exitcode != 0:
        logger.error("the engine core exited with code %s", core.exitcode)
        code = 1
    logger.info("stopped")
    return code


def run_frontend(
    config: EngineConfig,
    addresses: CoreAddresses,
    client_index: int,
    allocator_settings: AllocatorSettings,
    metrics_dir: str | None,
) -> None:
    """The target of front-end processes 1..N-1: serve until SIGTERM or the parent is gone."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    from pagekeeper_engine.frontend.lifecycle import FrontendOptions, serve_frontend  # noqa: PLC0415

    async def main() -> int:
        stop, gone = asyncio.Event(), asyncio.Event()
        _stop_on_signals(stop)
        loop = asyncio.get_running_loop()

        def on_parent_exit() -> None:
            logger.error("the supervising front end is gone; exiting")
            with contextlib.suppress(RuntimeError):  # the loop already ended: nobody waits
                loop.call_soon_threadsafe(gone.set)

        watch_parent(on_parent_exit)
        options = FrontendOptions(client_index, addresses, allocator_settings, metrics_dir)
        return await serve_frontend(config, options, stop, gone)

    sys.exit(run_event_loop(main()))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 2
    config = parse_args(args[1:])  # exits 2 with a message naming the flag
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        allocator_settings = read_alloc_settings(os.environ)
    except ValueError as exc:
        logger.error("bad allocator settings: %s", exc)
        return 2
    logger.info("CUDA caching allocator: %s", allocator_settings.describe())
    run_dir = tempfile.mkdtemp(prefix="pagekeeper-")
    if config.api_server_count > 1:
        # read by prometheus-client when it is first imported, here and in each front end
        metrics_dir = os.path.join(run_dir, "metrics")
        os.mkdir(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        return run_event_loop(serve(config, allocator_settings, run_dir))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
