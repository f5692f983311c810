"""Rank 0's side of tensor parallelism: start the other ranks, hand them each step, stop them.

The engine core runs rank 0 (its runner samples and answers the loop); ranks 1..N-1 are worker
processes (`worker`), one GPU each, started here with `spawn`. They meet through a TCP store on
rank 0's host, then build their shards of the model in lockstep with rank 0: the start-up
profile, the block count and the CUDA graphs all run collectives, so every rank takes the same
steps in the same order. Rank 0 sends each step (`protocol`) before it runs it, so the workers'
forward passes meet its collectives.

A worker that ends unasked ends the engine: the `watchdog` reports it to `on_failure`, the
engine core's process. A step that fails on rank 0 because a worker died names that worker's
reason (`failure`), not its own echo of it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch
import zmq

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.distributed.group import TensorParallelGroup, serve_rendezvous
from pagekeeper_engine.executor.protocol import WorkerSpec, step_encoder
from pagekeeper_engine.executor.watchdog import RankWatchdog
from pagekeeper_engine.executor.worker import run_worker
from pagekeeper_engine.faults import RankFailedError
from pagekeeper_engine.model.hf_config import load_model_config
from pagekeeper_engine.model.shard import check_divisible
from pagekeeper_engine.runner.follower_step import FollowerStep
from pagekeeper_engine.runner.runner import ModelRunner

STOP_TIMEOUT_S = 10.0


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
        size = config.tensor_parallel_size
        self.store = serve_rendezvous(size)
        self._encode = step_encoder().encode
        self._context = zmq.Context()
        self._sockets: list[zmq.Socket[bytes]] = []
        self.processes: list[BaseProcess] = []
        self._reports: list[Connection] = []
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
        self._watchdog = RankWatchdog(self.processes, self._reports, on_failure)

    def send(self, step: FollowerStep) -> None:
        data = self._encode(step)
        for socket in self._sockets:
            socket.send(data, copy=False)

    def failure(self, timeout_s: float) -> RankFailedError | None:
        """The first worker that ended unasked, waiting up to `timeout_s` for one."""
        return self._watchdog.failure(timeout_s)

    def kill(self) -> None:
        """Kill every worker at once, from any thread, unreported (rank 0 ends with them)."""
        self._watchdog.stop()
        for process in self.processes:
            if process.is_alive():
                process.kill()

    def stop(self, *, graceful: bool = True) -> None:
        """Tell every worker to stop and wait for them, killing any that do not go; with
        `graceful` False (rank 0 failed, the others may be inside a collective) kill them."""
        self._watchdog.stop()
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
