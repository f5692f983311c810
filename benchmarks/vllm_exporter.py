"""What pagekeeper's vLLM exporter costs: a report in a GPU process, and a launcher scrape.

    python -m benchmarks.vllm_exporter [--processes 1 8] [--repeats 2000] [--json OUT]

Measures, on the current GPU, with a realistic allocator state (many segments live):
- `report`: one `AllocatorExporter.report_once()` (memory_stats + write of the report), the
  daemon thread's work every 5 s; with and without the sampled allocator snapshot;
- `scrape`: the launcher's answer to one Prometheus scrape (read every process's report, render
  the exposition), for 1 and 8 GPU processes.
Results are medians in microseconds (docs/benchmarks-archive.md, "The vLLM exporter").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagekeeper_engine.memory.allocator import AllocatorStats
from pagekeeper_engine.memory.cuda import _snapshot_largest_free
from pagekeeper_vllm.plugin import AllocatorExporter
from pagekeeper_vllm.reports import ProcessReport, read_reports, write_report
from pagekeeper_vllm.series import OOMTally, render_metrics


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    # An allocator with history: 2,000 blocks of mixed sizes, a third freed.
    blocks = [
        torch.empty((i % 37 + 1) * 256 * 1024, dtype=torch.uint8, device=device)
        for i in range(2000)
    ]
    del blocks[::3]
    torch.cuda.synchronize(device)
    num_segments = len(torch.cuda.memory_snapshot())
    results: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "segments": num_segments,
        "reserved_bytes": torch.cuda.memory_reserved(device),
    }
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        exporter = AllocatorExporter(directory)
        exporter.report_once()  # the first report takes the snapshot; later ones reuse it
        results["report_us"] = _median_us(exporter.report_once, args.repeats)
        results["memory_stats_us"] = _median_us(
            lambda: torch.cuda.memory_stats(device), args.repeats
        )
        results["snapshot_us"] = _median_us(lambda: _snapshot_largest_free(device), 50)
        stats = AllocatorStats(8 << 30, 1 << 30, 1 << 29, 3, 0)
        for num in args.processes:
            scrape_dir = directory / f"scrape{num}"
            scrape_dir.mkdir()
            for rank in range(num):
                write_report(scrape_dir, ProcessReport(os.getpid(), rank, str(rank), stats))
            tally = OOMTally()

            def scrape(d: Path = scrape_dir, t: OOMTally = tally) -> str:
                reports = read_reports(d)
                t.update(reports)
                return render_metrics(reports, t, "model")

            results[f"scrape_{num}_processes_us"] = _median_us(scrape, args.repeats)
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    del blocks


if __name__ == "__main__":
    main()
