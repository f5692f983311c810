"""Rank 0's side of tensor parallelism: start the other ranks, hand them each step, watch them.

The engine core runs rank 0 (its runner samples and answers the loop); ranks 1..N-1 are worker
processes (`runner/worker.py`), one GPU each, started here with `spawn`. They meet through a
TCP store on rank 0's host, then build their shards of the model in lockstep with rank 0: the
start-up profile, the block count and the CUDA graphs all run collectives, so every rank takes
the same steps in the same order.

Each step travels to every worker as MessagePack over its own ZMQ PUSH socket (IPC, no
high-water mark), decoded into `SchedulerOutput` and nothing else; `None` tells a worker to
stop. Rank 0 sends before it runs, so the workers' forward passes meet its collectives.

A worker rank that ends unasked ends the engine: a watchdog thread waits on the workers' process
sentinels, reads the reason the rank sent before it exited (`RankReport`, over a pipe; none when
it was killed), kills the other workers and hands a `RankFailedError` to the engine core's
process (`on_failure`), which gives up (a collective with a dead peer would otherwise wait for
its timeout). A step that fails on rank 0 because a worker died names that worker's reason
(`failure`), not its own echo of it. A worker that refused the same start-up budget as rank 0
exits with `EXIT_SHARED_REFUSAL`; rank 0 reports that refusal itself.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import msgspec
import torch
import zmq

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.distributed.group import TensorParallelGroup, serve_rendezvous
from pagekeeper_engine.faults import RankFailedError
from pagekeeper_engine.model.hf_config import load_model_config
from pagekeeper_engine.model.shard import check_divisible
from pagekeeper_engine.process_watch import watch_processes
from pagekeeper_engine.runner.runner import ModelRunner

logger = logging.getLogger(__name__)

EXIT_SHARED_REFUSAL = 3  # a worker refused what rank 0 refused too (the combined budget)
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class WorkerSpec:
    """What worker `rank` needs to join: the flags, the rendezvous and its step socket."""

    config: EngineConfig
    rank: int
    store_port: int
    step_address: str


class RankReport(msgspec.Struct, array_like=True):
    """Why a worker ends: sent to rank 0 before it exits non-zero."""

    reason: str
    wrote_termination_message: bool


def send_report(reports: Connection, reason: str, *, wrote_termination_message: bool) -> None:
    """The worker's side: hand rank 0 the reason it is about to exit for."""
    report = RankReport(reason, wrote_termination_message)
    with contextlib.suppress(OSError):  # rank 0 gone: it has nothing left to tell
        reports.send_bytes(msgspec.msgpack.encode(report))


def _read_report(reports: Connection) -> RankReport | None:
    with contextlib.suppress(EOFError, OSError, msgspec.DecodeError):
        if reports.poll():
            return msgspec.msgpack.decode(reports.recv_bytes(), type=RankReport)
    return None


def step_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def step_decoder() -> msgspec.msgpack.Decoder[SchedulerOutput | None]:
    return msgspec.msgpack.Decoder(SchedulerOutput | None)


class WorkerRanks:
    """Ranks 1..N-1 of one engine: their processes, their step sockets and their watchdog.

    `on_failure` is called once, on the watchdog's thread, when a worker ends unasked.
    """

    def __init__(
        self,
        config: EngineConfig,
        directory: str,
        on_failure: Callable[[RankFailedError], None],
    ) -> None:
        from pagekeeper_engine.runner.worker import run_worker  # noqa: PLC0415

        size = config.tensor_parallel_size
        self.store = serve_rendezvous(size)
        self._encode = step_encoder().encode
        self._context = zmq.Context()
        self._sockets: list[zmq.Socket[bytes]] = []
        self.processes: list[BaseProcess] = []
        self._reports: list[Connection] = []
        self._stopping = threading.Event()
        self._failed = threading.Event()
        self._failure: RankFailedError | None = None
        self._on_failure = on_failure
        context = multiprocessing.get_context("spawn")
        for rank in range(1, size):
            address = f"ipc://{directory}/tp-steps-{rank}"
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.bind(address)
            self._sockets.append(socket)
            reports, report_sender = context.Pipe(duplex=False)
            spec = WorkerSpec(config, rank, self.store.port, address)
            process = context.Process(
                target=run_worker, args=(spec, report_sender), name=f"tp-rank-{rank}", daemon=True
            )
            process.start()
            report_sender.close()  # the worker holds the only sending end
            self.processes.append(process)
            self._reports.append(reports)
        watch_processes(self.processes, self._on_exit, name="tp-watchdog")

    def send(self, out: SchedulerOutput) -> None:
        data = self._encode(out)
        for socket in self._sockets:
            socket.send(data, copy=False)

    def failure(self, timeout_s: float) -> RankFailedError | None:
        """The first worker that ended unasked, waiting up to `timeout_s` for one (rank 0's
        step fails the moment a peer's connection drops, a moment before the watchdog sees
        the peer's exit)."""
        self._failed.wait(timeout_s)
        return self._failure

    def stop(self, *, graceful: bool = True) -> None:
        """Tell every worker to stop and wait for them, killing any that do not go; with
        `graceful` False (rank 0 failed, the others may be inside a collective) kill them."""
        self._stopping.set()
        data = self._encode(None)
        for socket in self._sockets:
            # A worker that never got to connect (it stopped at start-up) cannot take it, and
            # a PUSH socket without a peer would wait for one forever.
            with contextlib.suppress(zmq.Again):
                socket.send(data, zmq.NOBLOCK)
        for process in self.processes:
            process.join(STOP_TIMEOUT_S if graceful else 0)
            if process.is_alive():
                process.kill()
                process.join()
        for socket in self._sockets:
            socket.close(linger=0)
        self._context.term()
        for reports in self._reports:
            reports.close()

    def _on_exit(self, process: BaseProcess) -> None:
        if self._stopping.is_set() or self._failed.is_set():
            return
        failure = self._describe_exit(self.processes.index(process) + 1)
        if failure is None:
            return
        logger.critical("%s; the engine cannot run without it and exits", failure)
        for other in self.processes:
            if other.is_alive():
                other.kill()
        self._failure = failure
        self._failed.set()
        self._on_failure(failure)

    def _describe_exit(self, rank: int) -> RankFailedError | None:
        """Worker `rank`'s unasked exit as the engine's failure (None: nothing to report)."""
        process = self.processes[rank - 1]
        process.join(1.0)  # reap it: its exit code is unknown until then
        code = process.exitcode
        if code == EXIT_SHARED_REFUSAL:
            return None  # rank 0 refuses the same budget and says why
        how = f"was killed by signal {-code}" if code and code < 0 else f"exited ({code})"
        report = _read_report(self._reports[rank - 1])
        what = f"tensor-parallel rank {rank} (pid {process.pid}) {how}"
        if report is None:
            return RankFailedError(what)
        return RankFailedError(
            f"{what}: {report.reason}", wrote_termination_message=report.wrote_termination_message
        )


def start_tensor_parallel(
    config: EngineConfig, directory: str, on_failure: Callable[[RankFailedError], None]
) -> tuple[ModelRunner, WorkerRanks]:
    """Rank 0's runner with the other ranks started and following it (`on_failure`: see
    `WorkerRanks`). ValueError when the model does not split over the ranks or the host has
    too few GPUs."""
    size = config.tensor_parallel_size
    check_divisible(load_model_config(config.model), size)
    device = torch.device("cpu")
    if config.device == "cuda":
        available = torch.cuda.device_count()
        if available < size:
            raise ValueError(
                f"--tensor-parallel-size {size} needs {size} GPUs; this host shows {available}"
            )
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    workers = WorkerRanks(config, directory, on_failure)
    try:
        group = TensorParallelGroup.initialize(0, size, workers.store, device)
        runner = ModelRunner(config, tp=group, followers=workers)
    except BaseException:
        workers.stop(graceful=False)
        raise
    return runner, workers
