"""A tensor-parallel worker: rank r > 0 of one engine (`executor.workers` starts it).

It joins rank 0's rendezvous, builds its shard of the model and KV cache in lockstep with the
other ranks, then runs every step rank 0 sends, until told to stop. It ends with its parent: a
thread waits on the parent's sentinel and exits the process when the engine core is gone, even
from inside a collective. Before it exits 1 it writes the reason, naming its rank, to the
termination log (classified where it ran out of memory; a failure to load is only logged) and
sends it to rank 0 (`RankReport`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import zmq

from pagekeeper_engine.distributed.group import TensorParallelGroup, join_rendezvous
from pagekeeper_engine.executor.protocol import (
    EXIT_SHARED_REFUSAL,
    WorkerSpec,
    send_report,
    step_decoder,
)
from pagekeeper_engine.faults import FatalEngineError
from pagekeeper_engine.heap import freeze_startup_heap
from pagekeeper_engine.memory.budget import MemoryBudgetError
from pagekeeper_engine.memory.oom import (
    EngineOutOfMemoryError,
    OOMKind,
    OOMPhase,
    write_termination_log,
    write_termination_text,
)
from pagekeeper_engine.process_watch import watch_parent
from pagekeeper_engine.runner.runner import ModelRunner

logger = logging.getLogger("pagekeeper_engine.worker")


def run_worker(spec: WorkerSpec, reports: Connection) -> None:
    """The process's target: exit 0 when told to stop, non-zero when it cannot go on."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank {spec.rank} %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0's front end coordinates shutdown
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the core ignores it; a worker may be stopped
    _exit_with_parent()
    sys.exit(_serve(spec, reports))


def _exit_with_parent() -> None:
    def on_parent_exit() -> None:
        # the main thread may wait inside a collective for good: end the process from here
        logger.error("the engine core is gone; exiting")
        logging.shutdown()
        os._exit(1)

    watch_parent(on_parent_exit)


def _report_oom(spec: WorkerSpec, reports: Connection, phase: OOMPhase, reason: str) -> None:
    logger.critical("exiting: out of memory at %s: %s", phase, reason)
    kind: OOMKind = "gpu" if spec.config.device == "cuda" else "host"
    wrote = write_termination_log(kind, phase, reason, Path(spec.config.termination_log_path))
    send_report(reports, reason, wrote_termination_message=wrote)


def _report_fatal(spec: WorkerSpec, reports: Connection, reason: str) -> None:
    logger.critical("exiting: %s", reason)
    path = Path(spec.config.termination_log_path)
    wrote = write_termination_text(f"engine core failed: {reason}", path)
    send_report(reports, reason, wrote_termination_message=wrote)


def _serve(spec: WorkerSpec, reports: Connection) -> int:
    config = spec.config
    size = config.tensor_parallel_size
    device = torch.device("cpu")
    if config.device == "cuda":
        device = torch.device("cuda", spec.rank)
        torch.cuda.set_device(device)
    try:
        store = join_rendezvous(spec.store_port, size)
        group = TensorParallelGroup.initialize(spec.rank, size, store, device)
        runner = ModelRunner(config, progress=False, tp=group)
    except MemoryBudgetError:
        return EXIT_SHARED_REFUSAL
    except torch.OutOfMemoryError as exc:
        detail = f"out of memory while loading and profiling the model: {exc}"
        _report_oom(spec, reports, "startup", f"tensor-parallel rank {spec.rank}: {detail}")
        return 1
    except Exception as exc:
        logger.exception("could not load the shard of %s", config.model)
        reason = f"could not load its shard: {type(exc).__name__}: {exc}"
        send_report(reports, reason, wrote_termination_message=False)
        return 1
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.connect(spec.step_address)
    decode = step_decoder().decode
    freeze_startup_heap(f"tensor-parallel rank {spec.rank}")
    logger.info("ready (pid %d): %d KV blocks", os.getpid(), runner.num_gpu_blocks)
    try:
        while True:
            step = decode(inbox.recv())
            if step is None:
                return 0
            runner.follow(step)
    except EngineOutOfMemoryError as exc:
        _report_oom(spec, reports, "runtime", str(exc))
        return 1
    except FatalEngineError as exc:
        _report_fatal(spec, reports, str(exc))
        return 1
    finally:
        inbox.close(linger=0)
        context.term()
        group.destroy()
