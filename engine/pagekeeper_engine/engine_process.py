"""The engine core's process: load the model, size the KV cache, serve `loop.engine_core`.

Started by `cli` (multiprocessing, spawn) before the front ends take traffic. Torch is imported
here, never in the front end's process. Out of memory, the process says why in
`--termination-log-path` (the operator reads it) before it exits 1: at start-up when the memory
budget cannot hold one max-model-len request, the GPU has less free memory than asked for, or
the profile itself ran out of memory; at run time when out-of-memory errors repeat past
`--max-consecutive-ooms`. Any other fatal error at run time (`faults.FatalEngineError`) exits 1
with `engine core failed: <reason>` there, unless a tensor-parallel rank that failed wrote its
own. Any other failure to load exits 1 with the reason in the log.

Under tensor parallelism a worker rank that ends unasked is reported on the watchdog's thread
(`RankFailureHandler`): the loop gives up at its next turn. Rank 0 inside a collective that the
dead rank never joins cannot get there (NCCL waits out its timeout), so after a grace period
that thread tells the front ends, writes the termination message and ends the process itself.

With `--stuck-timeout` > 0 a progress watchdog (`progress_watch`) watches the loop from its
first turn after the load to its end. A loop that completes no turn for that long is stuck
(`StuckLoopHandler`, on the watchdog's thread): the loop's stack goes to the log, the
termination message becomes `pagekeeper-stuck ...` (`stuck`), the front ends hear `Fatal`
(readiness fails at once, and they exit 1), the worker ranks are killed and the process exits 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.faults import FatalEngineError, RankFailedError
from pagekeeper_engine.heap import freeze_startup_heap
from pagekeeper_engine.kv_events_wire import Encoding
from pagekeeper_engine.kv_publisher import ZmqKVEventPublisher
from pagekeeper_engine.memory.oom import (
    OOMKind,
    OOMPhase,
    write_termination_log,
    write_termination_text,
)
from pagekeeper_engine.messages import PROTOCOL_VERSION, CoreAddresses, Ready
from pagekeeper_engine.process_watch import watch_parent
from pagekeeper_engine.progress_watch import ProgressWatchdog
from pagekeeper_engine.stuck import StuckReport, write_stuck_message

if TYPE_CHECKING:
    from pagekeeper_engine.loop.engine_core import EngineCore

logger = logging.getLogger("pagekeeper_engine.core")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# How long the loop may take to give up after a rank died before the process is ended around
# it: a step in flight on gloo fails at once, and the core's sockets linger at most 2 s.
RANK_FAILURE_GRACE_S = 5.0


def report_oom_exit(config: EngineConfig, phase: OOMPhase, detail: str) -> None:
    """Log the reason and write it where the operator reads it."""
    logger.critical("exiting: out of memory at %s: %s", phase, detail)
    kind: OOMKind = "gpu" if config.device == "cuda" else "host"
    write_termination_log(kind, phase, detail, Path(config.termination_log_path))


def report_fatal(config: EngineConfig, error: FatalEngineError) -> None:
    """Log why the engine ends at run time and write it where the operator reads it."""
    if error.is_out_of_memory:
        report_oom_exit(config, "runtime", str(error))
        return
    logger.critical("exiting: %s", error)
    if isinstance(error, RankFailedError) and error.wrote_termination_message:
        return  # the rank that failed said why; its message stays
    write_termination_text(f"engine core failed: {error}", Path(config.termination_log_path))


def _end_process(code: int) -> None:
    """End the process from any thread, whatever the main thread is waiting in."""
    logging.shutdown()
    os._exit(code)


class RankFailureHandler:
    """What the core's process does when a tensor-parallel rank ends unasked (see the module
    docstring); called on the rank watchdog's thread (`executor.watchdog`). `exit` ends
    the process."""

    def __init__(
        self,
        config: EngineConfig,
        addresses: CoreAddresses,
        num_clients: int,
        *,
        grace_s: float = RANK_FAILURE_GRACE_S,
        exit: Callable[[int], object] = _end_process,
    ) -> None:
        self.core: EngineCore | None = None  # none yet while the model loads
        self.finished = threading.Event()  # the process's own path has ended
        self._failure: RankFailedError | None = None
        self._config = config
        self._addresses = addresses
        self._num_clients = num_clients
        self._grace_s = grace_s
        self._exit = exit

    def attach(self, core: EngineCore) -> None:
        """The loop is built: it hears of a rank's failure from now on (or at once)."""
        self.core = core
        if self._failure is not None:
            core.fail(self._failure)

    def __call__(self, failure: RankFailedError) -> None:
        self._failure = failure
        core = self.core
        if core is not None:
            core.fail(failure)
        if self.finished.wait(self._grace_s):
            return
        from pagekeeper_engine.loop.engine_core import announce_fatal  # noqa: PLC0415

        logger.critical("rank 0 is still in a collective %.0f s later; ending it", self._grace_s)
        announce_fatal(self._addresses, self._num_clients, str(failure))
        report_fatal(self._config, failure)
        self._exit(1)


class StuckLoopHandler:
    """What the core's process does when the progress watchdog finds the loop stuck (see the
    module docstring); called on the watchdog's thread. `loop_thread_id` is the thread that runs
    the loop (its stack is logged), `kill_workers` ends the tensor-parallel ranks, `exit` ends
    the process."""

    def __init__(
        self,
        config: EngineConfig,
        addresses: CoreAddresses,
        num_clients: int,
        loop_thread_id: int,
        *,
        kill_workers: Callable[[], None] = lambda: None,
        exit: Callable[[int], object] = _end_process,
    ) -> None:
        self._config = config
        self._addresses = addresses
        self._num_clients = num_clients
        self._loop_thread_id = loop_thread_id
        self._kill_workers = kill_workers
        self._exit = exit

    def __call__(self, report: StuckReport) -> None:
        from pagekeeper_engine.loop.engine_core import announce_fatal  # noqa: PLC0415

        logger.critical("the engine is stuck: %s", report.detail)
        frame = sys._current_frames().get(self._loop_thread_id)
        if frame is not None:
            stack = "".join(traceback.format_stack(frame))
            logger.critical("the step loop's thread is here:\n%s", stack.rstrip())
        # the message first: whatever happens next, the operator reads why the pod ended
        write_stuck_message(report, Path(self._config.termination_log_path))
        announce_fatal(self._addresses, self._num_clients, f"stuck: {report.detail}")
        self._kill_workers()
        self._exit(1)


def start_kv_event_publisher(config: EngineConfig) -> ZmqKVEventPublisher | None:
    """The publisher `--kv-events-config` asks for (None: events off or the null publisher)."""
    events = config.kv_events_config
    if events is None or not events.is_publishing:
        return None
    encoding: Encoding = "map" if config.kv_events_encoding == "map" else "array"
    publisher = ZmqKVEventPublisher(events, encoding)
    logger.info(
        "publishing KV events (%s encoding) on %s, replay on %s, topic %r",
        encoding,
        publisher.endpoint,
        publisher.replay_endpoint,
        events.topic,
    )
    return publisher


def run_engine_core(config: EngineConfig, addresses: CoreAddresses, num_clients: int) -> None:
    """The process's target: exits 0 after a shutdown, 1 when it cannot load or serve."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    # The front end coordinates shutdown: a Ctrl-C reaches the whole process group, and this
    # process must keep stepping until the front end has drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent_gone = threading.Event()
    watch_parent(parent_gone.set)
    sys.exit(_serve(config, addresses, num_clients, lambda: not parent_gone.is_set()))


def _serve(
    config: EngineConfig,
    addresses: CoreAddresses,
    num_clients: int,
    is_parent_alive: Callable[[], bool],
) -> int:
    on_rank_failure = RankFailureHandler(config, addresses, num_clients)
    try:
        kv_events = start_kv_event_publisher(config)
    except zmq.ZMQError as exc:  # before the model loads: a taken port fails at once
        logger.error("cannot publish KV events (%s): %s", config.kv_events_config, exc)
        return 1
    try:
        return _load_and_serve(
            config, addresses, num_clients, is_parent_alive, on_rank_failure, kv_events
        )
    finally:
        on_rank_failure.finished.set()
        if kv_events is not None:
            kv_events.close()


def _load_and_serve(
    config: EngineConfig,
    addresses: CoreAddresses,
    num_clients: int,
    is_parent_alive: Callable[[], bool],
    on_rank_failure: RankFailureHandler,
    kv_events: ZmqKVEventPublisher | None,
) -> int:
    import torch  # noqa: PLC0415  (the front end's process never imports torch)

    from pagekeeper_engine.executor.workers import WorkerRanks, start_tensor_parallel  # noqa: PLC0415
    from pagekeeper_engine.loop.engine import LLMEngine  # noqa: PLC0415
    from pagekeeper_engine.loop.engine_core import EngineCore  # noqa: PLC0415
    from pagekeeper_engine.memory.budget import MemoryBudgetError  # noqa: PLC0415
    from pagekeeper_engine.memory.oom import DeviceOutOfMemoryError  # noqa: PLC0415
    from pagekeeper_engine.runner.runner import ModelRunner  # noqa: PLC0415

    workers: WorkerRanks | None = None
    try:
        try:
            if config.tensor_parallel_size > 1:
                runner, workers = start_tensor_parallel(
                    config, addresses.directory, on_rank_failure
                )
            else:
                runner = ModelRunner(config)
        except torch.OutOfMemoryError as exc:
            detail = f"out of memory while loading and profiling the model: {exc}"
            raise DeviceOutOfMemoryError("startup", detail) from None
    except (MemoryBudgetError, DeviceOutOfMemoryError) as exc:
        report_oom_exit(config, "startup", str(exc))
        return 1
    except ValueError as exc:  # a setting this model or device cannot run
        logger.error("cannot serve %s: %s", config.model, exc)
        return 1
    except Exception:
        logger.exception("could not load %s", config.model)
        return 1
    engine = LLMEngine(config, runner, runner.eos_token_ids, check_sampling=runner.check_sampling)
    core = EngineCore(
        engine, addresses, num_clients, is_parent_alive=is_parent_alive, kv_events=kv_events
    )
    on_rank_failure.attach(core)
    freeze_startup_heap("engine core")
    try:
        core.send_ready(
            Ready(
                protocol_version=PROTOCOL_VERSION,
                limits=runner.limits,
                block_size=runner.block_size,
                num_gpu_blocks=runner.num_gpu_blocks,
                num_cpu_blocks=runner.num_cpu_blocks,
                kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
                memory_budget_bytes=runner.memory_budget_bytes,
                has_allocator=engine.has_allocator,
                is_async_scheduling=engine.is_async,
                stats=engine.stats(),
            )
        )
        logger.info(
            "engine core (pid %d) ready: %d KV blocks of %d tokens",
            os.getpid(),
            runner.num_gpu_blocks,
            runner.block_size,
        )
        watchdog = None
        if config.stuck_timeout > 0:
            on_stuck = StuckLoopHandler(
                config,
                addresses,
                num_clients,
                threading.get_ident(),
                kill_workers=workers.kill if workers is not None else lambda: None,
            )
            watchdog = ProgressWatchdog(config.stuck_timeout, core.progress, on_stuck)
        try:
            code = core.run()
        finally:
            if watchdog is not None:
                watchdog.stop()
    finally:
        core.close()
        if workers is not None:
            workers.stop(graceful=core.fatal is None)
    if core.fatal is not None:
        report_fatal(config, core.fatal)
    return code
