"""The plugin's exporter on a real GPU: what it exports is what torch's allocator says.

vLLM is not installed here; the exporter is, exactly as vLLM's plugin loader runs it: `register`
before CUDA initializes, the callback at initialization, the daemon thread's reports, and the
launcher's exposition read back with Prometheus's parser.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pagekeeper_vllm import plugin
from pagekeeper_vllm.reports import METRICS_DIR_ENV, read_reports
from pagekeeper_vllm.series import OOMTally, render_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MiB = 1 << 20


def _samples(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("rank") == "0"
    }


def test_exported_series_agree_with_memory_stats_after_fragmenting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugin, "_state", plugin._ProcessState())  # as in a new process
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(plugin.REPORT_SECONDS_ENV, "0.2")
    plugin.register()
    plugin.register()  # vLLM may call it again: nothing more happens
    device = torch.device("cuda", 0)
    # Fragment the large pool: 3 MiB blocks share 20 MiB segments; free every other one.
    blocks = [torch.empty(3 * MiB, dtype=torch.uint8, device=device) for _ in range(48)]
    del blocks[::2]
    torch.cuda.synchronize(device)

    report_file = tmp_path / f"{os.getpid()}-0.json"
    deadline = time.monotonic() + 60
    while not report_file.is_file():  # the daemon thread's first report
        assert time.monotonic() < deadline, "the exporter thread never reported"
        time.sleep(0.05)
    assert plugin._state.exporting_pid == os.getpid()

    # The same reading the thread takes, now that nothing allocates, then torch's own figures.
    exporter = plugin.AllocatorExporter(tmp_path)
    [report] = exporter.report_once()
    stats = torch.cuda.memory_stats(device)
    samples = _samples(render_metrics(read_reports(tmp_path), OOMTally(), "m"))
    reserved = stats["reserved_bytes.all.current"]
    allocated = stats["allocated_bytes.all.current"]
    assert samples["pagekeeper_allocator_reserved_bytes"] == reserved
    assert samples["pagekeeper_allocator_allocated_bytes"] == allocated
    assert samples["pagekeeper_allocator_fragmentation_bytes"] == reserved - allocated
    assert samples["pagekeeper_allocator_alloc_retries_total"] == stats["num_alloc_retries"]
    # 24 freed 3 MiB blocks leave holes; the largest free block is at least one of them.
    assert reserved - allocated >= 24 * 3 * MiB
    largest = samples["pagekeeper_allocator_largest_free_segment_bytes"]
    assert 3 * MiB <= largest <= reserved - allocated
    assert report.rank == "0" and report.device == 0
    del blocks
