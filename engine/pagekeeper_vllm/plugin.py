"""The vLLM general plugin: exports the CUDA caching allocator of every process that uses a GPU.

vLLM calls `register` (entry point group `vllm.general_plugins`, name `pagekeeper`) in its API
server, in the engine core and in every worker, possibly more than once per process. `register`
only asks torch to call back when this process initializes CUDA (`torch.cuda._lazy_call`), so a
process that never touches a GPU (the API server, any process on a CPU-only machine) runs
nothing at all. In a process that does, a daemon thread reads the allocator of each device the
process allocated on every `PAGEKEEPER_VLLM_REPORT_SECONDS` (5 by default) and writes a report
for the launcher (`reports`); it never runs on vLLM's step path. The largest free block needs an
allocator snapshot, which holds the allocator's lock while it walks the segments: it is sampled
at most once a minute and within 0.5% of the elapsed time (`SnapshotSampler`).

Every failure is logged and leaves vLLM serving: an error inside the callback would otherwise
fail CUDA's initialization, and one inside the thread stops only the reports.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagekeeper_vllm.reports import METRICS_DIR_ENV, ProcessReport, write_report

logger = logging.getLogger("pagekeeper_vllm")

PLUGIN_NAME = "pagekeeper"  # the entry point's name: what VLLM_PLUGINS must list
REPORT_SECONDS_ENV = "PAGEKEEPER_VLLM_REPORT_SECONDS"
DEFAULT_REPORT_SECONDS = 5.0
SNAPSHOT_MAX_OVERHEAD = 0.005
SNAPSHOT_MIN_INTERVAL_S = 60.0
# A failing read is logged the first time and then every this many times.
LOG_EVERY = 100


@dataclass
class _ProcessState:
    """Which process registered and which one exports: a forked child starts over."""

    registered_pid: int | None = None
    exporting_pid: int | None = None


_lock = threading.Lock()
_state = _ProcessState()


def register() -> None:
    """vLLM's entry point. Idempotent per process; never raises."""
    try:
        directory = os.environ.get(METRICS_DIR_ENV, "")
        if not directory:
            logger.debug("%s is unset: the allocator exporter stays off", METRICS_DIR_ENV)
            return
        with _lock:
            if _state.registered_pid == os.getpid():
                return
            _state.registered_pid = os.getpid()
        import torch  # noqa: PLC0415  (vLLM has loaded it already; the API server too)

        torch.cuda._lazy_call(lambda: _on_cuda_init(Path(directory)))  # type: ignore[no-untyped-call]
    except Exception:
        logger.exception("pagekeeper: the allocator exporter could not register; vLLM goes on")


def _on_cuda_init(directory: Path) -> None:
    """Runs in the thread that initializes CUDA, inside torch's lazy init: start and return."""
    try:
        with _lock:
            if _state.exporting_pid == os.getpid():
                return
            _state.exporting_pid = os.getpid()
        interval = float(os.environ.get(REPORT_SECONDS_ENV, "") or DEFAULT_REPORT_SECONDS)
        exporter = AllocatorExporter(directory)
        thread = threading.Thread(
            target=exporter.run, args=(interval,), name="pagekeeper-allocator", daemon=True
        )
        thread.start()
        logger.info(
            "pagekeeper: exporting the CUDA allocator of pid %d to %s every %gs",
            os.getpid(),
            directory,
            interval,
        )
    except Exception:
        logger.exception("pagekeeper: the allocator exporter could not start; vLLM goes on")


def _rank(device: int) -> str:
    distributed: Any = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return str(distributed.get_rank())
    return str(device)


class AllocatorExporter:
    """Reads this process's allocators and writes one report per device it allocated on."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._monitors: dict[int, Any] = {}  # device index -> CudaAllocatorMonitor
        self.num_failures = 0

    def devices_in_use(self) -> list[int]:
        """Devices whose allocator ever reserved memory in this process. Reading the counters
        of a device creates no CUDA context on it."""
        import torch  # noqa: PLC0415

        return [
            index
            for index in range(torch.cuda.device_count())
            if torch.cuda.memory_stats(index).get("reserved_bytes.all.peak", 0) > 0
        ]

    def report_once(self) -> list[ProcessReport]:
        import torch  # noqa: PLC0415

        from pagekeeper_engine.memory.cuda import CudaAllocatorMonitor  # noqa: PLC0415

        reports = []
        for index in self.devices_in_use():
            monitor = self._monitors.get(index)
            if monitor is None:
                monitor = CudaAllocatorMonitor(
                    torch.device("cuda", index), SNAPSHOT_MAX_OVERHEAD, SNAPSHOT_MIN_INTERVAL_S
                )
                self._monitors[index] = monitor
            report = ProcessReport(os.getpid(), index, _rank(index), monitor.read())
            write_report(self.directory, report)
            reports.append(report)
        return reports

    def run(self, interval_s: float) -> None:
        while True:
            try:
                self.report_once()
            except Exception:
                self.num_failures += 1
                if self.num_failures % LOG_EVERY == 1:
                    logger.exception(
                        "pagekeeper: reading the allocator failed (%d times); retrying",
                        self.num_failures,
                    )
            time.sleep(interval_s)
