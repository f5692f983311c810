"""The engine core's process: load the model, size the KV cache, serve `core.engine_core`.

Started by `cli` (multiprocessing, spawn) before the front ends take traffic. Torch is imported
here, never in the front end's process. Out of memory, the process says why in
`--termination-log-path` (the operator reads it) before it exits 1: at start-up when the memory
budget cannot hold one max-model-len request, the GPU has less free memory than asked for, or
the profile itself ran out of memory; at run time when out-of-memory errors repeat past
`--max-consecutive-ooms`. Any other failure to load exits 1 with the reason in the log.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.memory.oom import (
    OOMKind,
    OOMPhase,
    write_termination_log,
    write_termination_text,
)
from pagekeeper_engine.messages import PROTOCOL_VERSION, CoreAddresses, Ready

logger = logging.getLogger("pagekeeper_engine.core")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def report_oom_exit(config: EngineConfig, phase: OOMPhase, detail: str) -> None:
    """Log the reason and write it where the operator reads it."""
    logger.critical("exiting: out of memory at %s: %s", phase, detail)
    kind: OOMKind = "gpu" if config.device == "cuda" else "host"
    write_termination_log(kind, phase, detail, Path(config.termination_log_path))


def run_engine_core(config: EngineConfig, addresses: CoreAddresses, num_clients: int) -> None:
    """The process's target: exits 0 after a shutdown, 1 when it cannot load or serve."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    # The front end coordinates shutdown: a Ctrl-C reaches the whole process group, and this
    # process must keep stepping until the front end has drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent_pid = os.getppid()
    sys.exit(_serve(config, addresses, num_clients, lambda: os.getppid() == parent_pid))


def _serve(
    config: EngineConfig,
    addresses: CoreAddresses,
    num_clients: int,
    is_parent_alive: Callable[[], bool],
) -> int:
    import torch  # noqa: PLC0415  (the front end's process never imports torch)

    from pagekeeper_engine.core.engine import LLMEngine  # noqa: PLC0415
    from pagekeeper_engine.core.engine_core import EngineCore  # noqa: PLC0415
    from pagekeeper_engine.memory.budget import MemoryBudgetError  # noqa: PLC0415
    from pagekeeper_engine.memory.oom import DeviceOutOfMemoryError  # noqa: PLC0415
    from pagekeeper_engine.runner.parallel import WorkerRanks, start_tensor_parallel  # noqa: PLC0415
    from pagekeeper_engine.runner.runner import ModelRunner  # noqa: PLC0415

    workers: WorkerRanks | None = None
    try:
        try:
            if config.tensor_parallel_size > 1:
                runner, workers = start_tensor_parallel(config, addresses.directory)
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
    engine = LLMEngine(config, runner, runner.eos_token_ids)
    core = EngineCore(engine, addresses, num_clients, is_parent_alive=is_parent_alive)
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
        code = core.run()
    finally:
        core.close()
        if workers is not None:
            workers.stop(graceful=core.fatal_error is None)
    if core.fatal_error is not None and core.is_fatal_out_of_memory:
        report_oom_exit(config, "runtime", core.fatal_error)
    elif core.fatal_error is not None:
        logger.critical("exiting: %s", core.fatal_error)
        write_termination_text(
            f"engine core failed: {core.fatal_error}", Path(config.termination_log_path)
        )
    return code
