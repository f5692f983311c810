"""Rank 0's side of tensor parallelism: start the other ranks, hand them each step, watch them.

The engine core runs rank 0 (its runner samples and answers the loop); ranks 1..N-1 are worker
processes (`runner/worker.py`), one GPU each, started here with `spawn`. They meet through a
TCP store on rank 0's host, then build their shards of the model in lockstep with rank 0: the
start-up profile, the block count and the CUDA graphs all run collectives, so every rank takes
the same steps in the same order.

Each step travels to every worker as MessagePack over its own ZMQ PUSH socket (IPC, no
high-water mark), decoded into `SchedulerOutput` and nothing else; `None` tells a worker to
stop. Rank 0 sends before it runs, so the workers' forward passes meet its collectives.

A rank that dies ends the engine: a watchdog thread waits on the workers' process sentinels
and, unless they were told to stop, logs which rank died and how, stops the others and exits
the process with status 1 within moments (a collective with a dead peer would otherwise wait
forever). A worker that refused the same start-up budget as rank 0 exits with
`EXIT_SHARED_REFUSAL`; rank 0 reports that refusal itself.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import msgspec
import torch
import zmq

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.distributed.group import TensorParallelGroup, serve_rendezvous
from pagekeeper_engine.model.hf_config import load_model_config
from pagekeeper_engine.model.shard import check_divisible
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


def step_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def step_decoder() -> msgspec.msgpack.Decoder[SchedulerOutput | None]:
    return msgspec.msgpack.Decoder(SchedulerOutput | None)


class WorkerRanks:
    """Ranks 1..N-1 of one engine: their processes, their step sockets and their watchdog."""

    def __init__(self, config: EngineConfig, directory: str) -> None:
        from pagekeeper_engine.runner.worker import run_worker  # noqa: PLC0415

        size = config.tensor_parallel_size
        self.store = serve_rendezvous(size)
        self._encode = step_encoder().encode
        self._context = zmq.Context()
        self._sockets: list[zmq.Socket[bytes]] = []
        self.processes: list[BaseProcess] = []
        self._stopping = threading.Event()
        context = multiprocessing.get_context("spawn")
        for rank in range(1, size):
            address = f"ipc://{directory}/tp-steps-{rank}"
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.bind(address)
            self._sockets.append(socket)
            spec = WorkerSpec(config, rank, self.store.port, address)
            process = context.Process(
                target=run_worker, args=(spec,), name=f"tp-rank-{rank}", daemon=True
            )
            process.start()
            self.processes.append(process)
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def send(self, out: SchedulerOutput) -> None:
        data = self._encode(out)
        for socket in self._sockets:
            socket.send(data, copy=False)

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

    def _watch(self) -> None:
        pending = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        while pending:
            for sentinel in wait(list(pending)):
                assert isinstance(sentinel, int)
                rank = pending.pop(sentinel)
                process = self.processes[rank - 1]
                if self._stopping.is_set():
                    continue
                process.join(1.0)  # reap it: its exit code is unknown until then
                code = process.exitcode
                if code == EXIT_SHARED_REFUSAL:
                    continue  # rank 0 refuses the same budget and says why
                how = f"was killed by signal {-code}" if code and code < 0 else f"exited ({code})"
                logger.critical(
                    "tensor-parallel rank %d (pid %s) %s; the engine cannot run without it and "
                    "exits",
                    rank,
                    process.pid,
                    how,
                )
                for other in self.processes:
                    if other.is_alive():
                        other.kill()
                logging.shutdown()
                os._exit(1)


def start_tensor_parallel(config: EngineConfig, directory: str) -> tuple[ModelRunner, WorkerRanks]:
    """Rank 0's runner with the other ranks started and following it. ValueError when the
    model does not split over the ranks or the host has too few GPUs."""
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
    workers = WorkerRanks(config, directory)
    try:
        group = TensorParallelGroup.initialize(0, size, workers.store, device)
        runner = ModelRunner(config, tp=group, followers=workers)
    except BaseException:
        workers.stop(graceful=False)
        raise
    return runner, workers
