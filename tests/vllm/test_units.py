"""The pure parts of pagekeeper's vLLM support, and the contracts it shares with the operator."""

from __future__ import annotations

import fcntl
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagekeeper_engine.frontend.metric_names import OOM_KINDS
from pagekeeper_engine.memory.allocator import AllocatorStats
from pagekeeper_engine.memory.oom import termination_message
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.runtime import VLLM_PLUGIN_NAME, VLLM_PLUGIN_SERIES
from pagekeeper_operator.policy.adaptive import classify_termination
from pagekeeper_operator.policy.vllm_compat import (
    has_kv_offload_flags,
    image_version,
    policy_verdict,
)
from pagekeeper_operator.rollout.canary import canary_pod
from pagekeeper_vllm import pipes, plugin
from pagekeeper_vllm.launch import exit_code, served_model_name
from pagekeeper_vllm.output import LineSplitter, OutputWatcher, classify_line
from pagekeeper_vllm.pipes import READ_BYTES, ChildPipe
from pagekeeper_vllm.plugin import PLUGIN_NAME
from pagekeeper_vllm.reports import METRICS_DIR_ENV, ProcessReport, read_reports, write_report
from pagekeeper_vllm.series import EXPORTED_SERIES, OOMTally, render_metrics
from tests.vllm.fake_vllm import NO_CACHE, OOM

GiB = 1 << 30
# vLLM's texts for a KV cache too small for one max-model-len sequence, 0.11.0 and 0.33.0.
MAX_SEQ_LEN_0_11 = (
    "ValueError: To serve at least one request with the models's max seq len (32768), (4.00 GiB "
    "KV cache is needed, which is larger than the available KV cache memory (1.50 GiB). Based "
    "on the available memory, the estimated maximum model length is 12288. Try increasing "
    "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
)
MAX_SEQ_LEN_0_33 = (
    "ValueError: To serve at least one request with the model's max seq len (32768), (4.00 GiB "
    "KV cache is needed, which is larger than the available KV cache memory (1.50 GiB). Based "
    "on the available memory, the estimated maximum model length is 12288. Try increasing "
    "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing "
    "`max_model_len` when initializing the engine. See https://docs.vllm.ai/en/latest/"
    "configuration/conserving_memory/ for more details."
)


def test_the_plugin_exports_what_the_operator_expects() -> None:
    assert set(EXPORTED_SERIES) == set(VLLM_PLUGIN_SERIES)
    assert PLUGIN_NAME == VLLM_PLUGIN_NAME


@pytest.mark.parametrize("text", [MAX_SEQ_LEN_0_11, MAX_SEQ_LEN_0_33])
def test_the_max_seq_len_error_of_either_vllm(text: str) -> None:
    assert classify_line(text) == (
        "vLLM: the KV cache cannot hold one sequence of max-model-len 32768 (4.00 GiB needed, "
        "1.50 GiB available; about 12288 tokens would fit)"
    )


def test_what_is_not_a_memory_error() -> None:
    assert classify_line("INFO 11-24 [core.py:1] CUDA graphs captured in 12 s") is None
    # vLLM's hint around an OOM names it without torch's text: the torch line carries it.
    assert classify_line("CUDA out of memory occurred when warming up sampler") is None
    assert classify_line(NO_CACHE) is not None and classify_line(OOM) is not None


def test_the_watcher_numbers_errors_and_decides_their_phase() -> None:
    watcher = OutputWatcher()
    startup = watcher.feed_line(OOM)
    assert startup is not None and watcher.phase_of(startup) == "startup"
    watcher.feed_line("INFO:     Application startup complete.")
    later = watcher.feed_line("(EngineCore_DP0 pid=1) " + OOM)
    kv = watcher.feed_line(NO_CACHE)
    assert later is not None and kv is not None
    # Once ready, a CUDA OOM is a run-time one; the KV-cache errors never are.
    assert (watcher.phase_of(later), watcher.phase_of(kv)) == ("runtime", "startup")
    assert [e.line_number for e in watcher.events] == [1, 3, 4]
    assert watcher.first_after(1) == later and watcher.first_after(4) is None


def test_lines_split_at_newlines_and_carriage_returns() -> None:
    splitter = LineSplitter()
    assert splitter.feed("Loading 1/2\rLoading 2/2\r\nready") == ["Loading 1/2", "Loading 2/2"]
    assert splitter.feed("!\n") == ["ready!"]
    assert splitter.feed("tail") == [] and splitter.flush() == ["tail"]


def test_a_child_pipe_passes_bytes_on_and_lines_out_across_reads() -> None:
    """Bytes reach the sink as written; a line, and a character, cut between two writes comes
    out whole; the last partial line comes out at the end, and nothing blocks between."""
    read_end, write_end = os.pipe()
    sink = io.BytesIO()
    lines: list[str] = []
    try:
        pipe = ChildPipe(os.fdopen(read_end, "rb", buffering=0), sink)
        assert pipe.take(lines.append) and lines == []  # empty: returns at once
        euro = "\u20ac".encode()
        os.write(write_end, b"first\rbar " + euro[:1])
        assert pipe.take(lines.append) and lines == ["first"]
        os.write(write_end, euro[1:] + b"\nlast, unterminated")
        assert pipe.take(lines.append) and lines == ["first", "bar \u20ac"]
        assert pipe.wait_readable(0) is False
    finally:
        os.close(write_end)
    assert pipe.wait_readable(0) is True  # the end closed
    assert pipe.take(lines.append) is False and pipe.is_closed
    assert lines == ["first", "bar \u20ac", "last, unterminated"]
    assert pipe.take(lines.append) is False
    assert sink.getvalue() == b"first\rbar " + euro + b"\nlast, unterminated"


def test_a_child_pipe_take_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flooding child: one take makes at most MAX_READS_PER_TAKE reads, the next takes on."""
    monkeypatch.setattr(pipes, "MAX_READS_PER_TAKE", 2)
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 8 * READ_BYTES)
    sink = io.BytesIO()
    try:
        os.write(write_end, b"x" * (5 * READ_BYTES))
        pipe = ChildPipe(os.fdopen(read_end, "rb", buffering=0), sink)
        assert pipe.take(lambda _: None)
        assert len(sink.getvalue()) == 2 * READ_BYTES
        assert pipe.take(lambda _: None)
        assert len(sink.getvalue()) == 4 * READ_BYTES
    finally:
        os.close(write_end)
    assert pipe.take(lambda _: None) is False
    assert len(sink.getvalue()) == 5 * READ_BYTES


def test_exit_codes() -> None:
    event = OutputWatcher().feed_line(OOM)
    assert [exit_code(0, None), exit_code(3, None), exit_code(-15, None)] == [0, 3, 143]
    assert [exit_code(0, event), exit_code(1, event), exit_code(-9, event)] == [1, 1, 137]


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["vllm", "serve", "/m", "--served-model-name", "a", "b"], "a"),
        (["vllm", "serve", "/m", "--served-model-name=qwen"], "qwen"),
        (["vllm", "serve", "Qwen/Qwen3-8B", "--port", "8000"], "Qwen/Qwen3-8B"),
        (["vllm", "serve", "--model", "/m"], "/m"),
        (["python", "-m", "x"], ""),
    ],
)
def test_the_model_name_label_is_vllms(argv: list[str], name: str) -> None:
    assert served_model_name(argv) == name


def _report(pid: int, device: int, rank: str, num_ooms: int = 0) -> ProcessReport:
    stats = AllocatorStats(8 * GiB, 1 * GiB, 6 * GiB, 3, num_ooms)
    return ProcessReport(pid, device, rank, stats)


def test_reports_round_trip_and_ended_processes_are_dropped(tmp_path: Path) -> None:
    write_report(tmp_path, _report(os.getpid(), 0, "0"))
    write_report(tmp_path, _report(2**22 + 7, 1, "1"))  # a pid no process has
    (tmp_path / "garbage.json").write_text("{")
    alive = {os.getpid()}
    assert read_reports(tmp_path, alive.__contains__) == [_report(os.getpid(), 0, "0")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{os.getpid()}-0.json", "garbage.json"]


def test_the_exposition_parses_and_the_oom_counter_never_goes_back() -> None:
    tally = OOMTally()
    reports = [_report(10, 0, "0", num_ooms=1), _report(11, 1, "1")]
    tally.update(reports)
    tally.mark_ready()
    tally.update([_report(10, 0, "0", num_ooms=3)])  # rank 1's process ended meanwhile
    text = render_metrics(reports[:1], tally, "qwen")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    labels = (("model_name", "qwen"), ("rank", "0"))
    assert samples[("pagekeeper_allocator_reserved_bytes", labels)] == 8 * GiB
    assert samples[("pagekeeper_allocator_allocated_bytes", labels)] == 1 * GiB
    assert samples[("pagekeeper_allocator_fragmentation_bytes", labels)] == 7 * GiB
    assert samples[("pagekeeper_allocator_largest_free_segment_bytes", labels)] == 6 * GiB
    assert samples[("pagekeeper_allocator_alloc_retries_total", labels)] == 3
    oom = {k[1][0][1]: v for k, v in samples.items() if k[0] == "pagekeeper_oom_events_total"}
    assert oom == {"startup": 1, "step": 2}
    assert set(oom) <= set(OOM_KINDS)
    # A CPU-only pod: nothing to say, nothing said.
    assert render_metrics([], OOMTally(), "qwen") == ""


def test_the_bundle_imports_alone_and_the_launcher_needs_no_torch(bundle: Path) -> None:
    script = (
        "import sys; import pagekeeper_vllm.launch, pagekeeper_vllm.plugin, "
        "pagekeeper_vllm.bundle; print('torch' in sys.modules)"
    )
    result = subprocess.run(
        # -S: no site-packages, so nothing of this checkout's environment stands in for a
        # module the bundle lacks; the standard library and the bundle alone.
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {str(bundle)!r}); {script}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "False"
    info = next(bundle.glob("pagekeeper_vllm-*.dist-info"))
    assert (info / "entry_points.txt").read_text() == (
        "[vllm.general_plugins]\npagekeeper = pagekeeper_vllm.plugin:register\n"
    )


@pytest.mark.parametrize(
    ("image", "version"),
    [
        ("docker.io/vllm/vllm-openai:v0.11.0", (0, 11, 0)),
        ("vllm/vllm-openai:0.11.1", (0, 11, 1)),
        ("registry:5000/vllm:v0.33.0-cu130", (0, 33, 0)),
        ("vllm/vllm-openai:latest", None),
        ("registry:5000/vllm", None),
        ("vllm/vllm-openai@sha256:" + "0" * 64, None),
    ],
)
def test_image_versions(image: str, version: tuple[int, int, int] | None) -> None:
    assert image_version(image) == version


def test_chunked_prefill_off_is_ignored_before_0_11_1() -> None:
    off = MemoryPolicy(enable_chunked_prefill=False, max_model_len=4096)
    assert policy_verdict(off, "vllm/vllm-openai:v0.11.0")[1:3] == ("False", "IgnoredByRuntime")
    assert policy_verdict(off, "vllm/vllm-openai:v0.11.1")[1:3] == ("True", "AllFieldsHonored")
    assert policy_verdict(off, "vllm/vllm-openai:latest")[1:3] == (
        "Unknown",
        "RuntimeVersionUnknown",
    )
    assert policy_verdict(MemoryPolicy(), "vllm/vllm-openai:v0.11.0")[1] == "True"


def test_the_host_kv_tier_is_honoured_from_0_11_1() -> None:
    """Before 0.11.1 vLLM's parser has no --kv-offloading-size: the flags are left out of the
    command (`has_kv_offload_flags`) and PolicyHonored names the field."""
    policy = MemoryPolicy(kv_offload={"size": "16Gi"})
    old = policy_verdict(policy, "vllm/vllm-openai:v0.11.0")
    assert old == (
        "PolicyHonored",
        "False",
        "IgnoredByRuntime",
        "vLLM 0.11.0 ignores spec.memoryPolicy.kvOffload (its parser has no "
        "--kv-offloading-size, so the operator leaves the flags out and the pods run without a "
        "host KV tier); vLLM 0.11.1 and later honour it",
    )
    assert not has_kv_offload_flags("vllm/vllm-openai:v0.11.0")
    for image in ("vllm/vllm-openai:v0.11.1", "vllm/vllm-openai:v0.33.0"):
        assert policy_verdict(policy, image)[1:3] == ("True", "AllFieldsHonored")
        assert has_kv_offload_flags(image)
    assert policy_verdict(policy, "vllm/vllm-openai:latest")[1:3] == (
        "Unknown",
        "RuntimeVersionUnknown",
    )
    assert has_kv_offload_flags("vllm/vllm-openai:latest")
    assert policy_verdict(MemoryPolicy(), "vllm/vllm-openai:v0.11.0")[1] == "True"


def test_budget_and_weight_flags_are_checked_from_0_11_0() -> None:
    policy = MemoryPolicy(kv_cache_memory="20Gi", weights={"quantization": "fp8"})
    old = policy_verdict(policy, "vllm/vllm-openai:v0.10.2")
    assert old[1:3] == ("False", "IgnoredByRuntime")
    assert old[3].startswith(
        "vLLM 0.10.2 may refuse spec.memoryPolicy.kvCacheMemory (pagekeeper checks "
        "--kv-cache-memory-bytes against vLLM 0.11.0 and later only); vLLM 0.11.0 and later "
        "honour it; vLLM 0.10.2 may refuse spec.memoryPolicy.weights.quantization: fp8"
    )
    for image in ("vllm/vllm-openai:v0.11.0", "vllm/vllm-openai:v0.33.0"):
        assert policy_verdict(policy, image)[1:3] == ("True", "AllFieldsHonored")


def test_the_launchers_message_is_an_oom_to_the_step_down_and_the_canary() -> None:
    """The launcher's termination message, as the operator reads it from a vLLM pod."""
    detail = classify_line(OOM)
    assert detail is not None
    message = termination_message("gpu", "runtime", detail)
    classification = classify_termination("Error", message)
    assert classification is not None and classification.can_step_down
    assert classification.detail == detail and "402.27 MiB reserved" in detail
    terminated = {"reason": "Error", "exitCode": 1, "message": message, "finishedAt": "t1"}
    pod = {
        "metadata": {"name": "vllm-0"},
        "status": {
            "containerStatuses": [{"name": "engine", "lastState": {"terminated": terminated}}]
        },
    }
    assert canary_pod(pod).oom_terminations == 1


def test_the_plugin_never_raises_into_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(plugin, "_state", plugin._ProcessState())  # as in a new process
    # Off without the launcher's directory; registered once per process with it.
    monkeypatch.delenv(METRICS_DIR_ENV, raising=False)
    plugin.register()
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))
    plugin.register()
    plugin.register()
    assert plugin._state.registered_pid == os.getpid()
    # A failure where CUDA initializes is logged, never raised: it would fail vLLM's own init.
    monkeypatch.setenv(plugin.REPORT_SECONDS_ENV, "soon")
    with caplog.at_level("ERROR", logger="pagekeeper_vllm"):
        plugin._on_cuda_init(tmp_path)
    assert "the allocator exporter could not start; vLLM goes on" in caplog.text
    assert list(tmp_path.iterdir()) == []
