"""The file contract between the plugin (one writer per GPU process) and the launcher (reader).

Each process that drives a CUDA device writes one small JSON file per device into the directory
the launcher names in `PAGEKEEPER_VLLM_METRICS_DIR`, replacing it atomically each interval; the
launcher reads them all when Prometheus scrapes it. A file whose process has ended is dropped
and removed, so a restarted worker never reports twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pagekeeper_engine.memory.allocator import AllocatorStats

logger = logging.getLogger(__name__)

METRICS_DIR_ENV = "PAGEKEEPER_VLLM_METRICS_DIR"
SUFFIX = ".json"


@dataclass(frozen=True)
class ProcessReport:
    """One process's reading of its caching allocator on one device."""

    pid: int
    device: int
    rank: str  # torch.distributed rank where initialized, else the device index
    stats: AllocatorStats

    @property
    def file_name(self) -> str:
        return f"{self.pid}-{self.device}{SUFFIX}"

    def to_json(self) -> str:
        return json.dumps(
            {"pid": self.pid, "device": self.device, "rank": self.rank, **asdict(self.stats)}
        )

    @classmethod
    def from_json(cls, text: str) -> ProcessReport:
        data = json.loads(text)
        stats = AllocatorStats(
            reserved=int(data["reserved"]),
            allocated=int(data["allocated"]),
            largest_free_block=int(data["largest_free_block"]),
            num_alloc_retries=int(data["num_alloc_retries"]),
            num_ooms=int(data["num_ooms"]),
        )
        return cls(int(data["pid"]), int(data["device"]), str(data["rank"]), stats)


def write_report(directory: Path, report: ProcessReport) -> Path:
    """Replace this process's file for the device; readers never see a partial file."""
    path = directory / report.file_name
    partial = directory / f".{report.file_name}.{os.getpid()}.tmp"
    partial.write_text(report.to_json())
    os.replace(partial, path)
    return path


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_reports(directory: Path, alive: Callable[[int], bool] = is_alive) -> list[ProcessReport]:
    """Every live process's reports, by (rank, device); files of ended processes are removed."""
    reports = []
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        try:
            report = ProcessReport.from_json(path.read_text())
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("skipping the unreadable allocator report %s: %s", path, exc)
            continue
        if not alive(report.pid):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        reports.append(report)
    return sorted(reports, key=lambda r: (r.rank, r.device, r.pid))
