"""pagekeeper's plugin and rendered pods against real vLLM (0.11.0 and the newest tested).

Each vLLM runs in its own environment from PyPI (`hack/provision.sh vllm`), with the bundle on
PYTHONPATH exactly as the init container leaves it in the pod; no GPU is needed to load plugins
or parse flags, so the exporter must stay silent here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagekeeper_operator.api.runtime import vllm_loads_plugin
from pagekeeper_operator.policy.vllm_compat import has_kv_offload_flags
from pagekeeper_operator.render import render_deployment
from pagekeeper_vllm.plugin import PLUGIN_NAME
from tests.operator.servers import DEFAULT_IMAGES, make_server
from tests.support.pod_env import container_argv, container_env
from tests.vllm.conftest import HERE, clean_env, run_probe, vllm_python


def _plugins(version: str, bundle: Path, tmp_path: Path, **env: str) -> dict[str, Any]:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    result = run_probe(
        version,
        "probe_plugins.py",
        [],
        clean_env(PYTHONPATH=str(bundle), PAGEKEEPER_VLLM_METRICS_DIR=str(metrics), **env),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def test_vllms_own_loader_finds_and_runs_the_plugin(
    vllm_version: str, bundle: Path, tmp_path: Path
) -> None:
    report = _plugins(vllm_version, bundle, tmp_path)
    assert PLUGIN_NAME in report["discovered"]
    assert report["loaded"] is True
    # A CPU-only machine: CUDA never initializes, so the exporter never starts or writes.
    assert report["cuda_initialized"] is False and report["cuda_error"]
    assert report["exporting"] is False
    assert report["written"] == []
    assert report["engine_args"] == "EngineArgs"


# VLLM_PLUGINS values: the plugin named alone, among others, not named, empty, and named with
# a stray space (vLLM splits on commas and matches names exactly).
FILTER_VALUES = [
    "pagekeeper",
    "lora_filesystem_resolver,pagekeeper",
    "lora_filesystem_resolver",
    "",
    " pagekeeper",
]


def test_vllm_plugins_filters_as_the_operator_predicts(vllm_version: str, bundle: Path) -> None:
    """VLLM_PLUGINS as vLLM's own loader reads it, each value in turn in one process, and
    `vllm_loads_plugin` (PluginLoaded) agreeing; unset, every plugin loads."""
    values: list[str | None] = [None, *FILTER_VALUES]
    result = run_probe(
        vllm_version,
        "probe_plugin_filter.py",
        [json.dumps(values)],
        clean_env(PYTHONPATH=str(bundle)),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    loaded: dict[str, list[str]] = json.loads(result.stdout.strip().splitlines()[-1])
    assert PLUGIN_NAME in loaded["null"]
    for value in FILTER_VALUES:
        named = PLUGIN_NAME in loaded[json.dumps(value)]
        assert named is vllm_loads_plugin(value), value
        assert named is (value in {"pagekeeper", "lora_filesystem_resolver,pagekeeper"}), value


SPECS: list[dict[str, Any]] = [
    {"runtime": "vllm"},
    {
        "runtime": "vllm",
        "model": {"servedModelName": "qwen3", "dtype": "bfloat16", "loadFormat": "dummy"},
        "parallelism": {"tensor": 2, "customAllReduce": False},
        "memoryPolicy": {
            "gpuMemoryUtilization": 0.85,
            "blockSize": 32,
            "maxNumBatchedTokens": 16384,
            "maxNumSeqs": 64,
            "maxModelLen": 8192,
            "enableChunkedPrefill": False,
            "enablePrefixCaching": False,
            "kvCacheDtype": "fp8",
        },
        "podTemplate": {"env": [{"name": "PYTHONPATH", "value": "/srv/extra"}]},
        "apiKey": {"secretName": "chat-openai"},
    },
    {
        "runtime": "vllm",
        "parallelism": {"tensor": 2},
        "memoryPolicy": {"kvOffload": {"size": "1536Mi"}},
    },
    {"runtime": "vllm", "memoryPolicy": {"kvOffload": {"size": "32Gi", "backend": "lmcache"}}},
    {
        "runtime": "vllm",
        "memoryPolicy": {
            "kvCacheMemory": "20Gi",
            "weights": {"quantization": "fp8", "cpuOffloadGiB": 2.5},
        },
    },
    {
        "runtime": "vllm",
        "model": {"servedModelName": "qwen3"},
        "gateway": {
            "kvEvents": {
                "enabled": True,
                "port": 6100,
                "replayPort": 6101,
                "topic": "kv@$(POD_IP)@qwen3",
                "bufferSteps": 500,
            }
        },
    },
]
API_KEY = "sk-4b1d9e"
SECRETS = {"chat-openai": {"api-key": API_KEY}}  # the key spec.apiKey names by default
POD_IP = "10.42.0.7"
POD_FIELDS = {"status.podIP": POD_IP, "metadata.name": "qwen-0", "metadata.namespace": "ml"}


def _pod(spec: dict[str, Any], version: str) -> tuple[Any, dict[str, Any]]:
    """The pod rendered for the image of vLLM `version` (what it gets depends on the version:
    `vllm_compat`)."""
    server = make_server({**spec, "image": f"vllm/vllm-openai:v{version}"})
    pod: dict[str, Any] = render_deployment(server, DEFAULT_IMAGES)["spec"]["template"]["spec"]
    return server, pod


@pytest.mark.parametrize("spec", SPECS)
def test_the_rendered_pod_runs_vllms_parser_under_the_launcher(
    vllm_version: str, tmp_path: Path, spec: dict[str, Any]
) -> None:
    """The pod as rendered: the init container's command writes the bundle into the volume; the
    vLLM container's command, env and mount run the launcher, whose child parses the rendered
    `vllm serve` flags with vLLM's own parser (a probe in place of the `vllm` program), after the
    kubelet's expansion (spec.apiKey's `$(PAGEKEEPER_API_KEY)` from its Secret)."""
    server, pod = _pod(spec, vllm_version)
    [init] = pod["initContainers"]
    [container] = pod["containers"]
    volume = tmp_path / "pagekeeper-vllm"
    mount_path = init["volumeMounts"][0]["mountPath"]
    # The init container runs the engine image's Python; this checkout's is the same code.
    init_command = [sys.executable, *init["command"][1:-1], str(volume)]
    assert init["command"][-1] == mount_path
    subprocess.run(init_command, check=True, capture_output=True, env={**os.environ})
    env = container_env(container, SECRETS, POD_FIELDS)
    python_path = env["PYTHONPATH"].replace(mount_path, str(volume))
    command = container_argv(container, env)
    separator = command.index("--")
    launcher = [str(vllm_python(vllm_version)), *command[1:separator]]
    vllm_args = command[separator + 1 :]
    assert vllm_args[:2] == ["vllm", "serve"]
    child = [str(vllm_python(vllm_version)), str(HERE / "probe_parser.py"), *vllm_args[2:]]
    result = subprocess.run(
        [
            *launcher,
            "--metrics-port",
            "0",
            "--termination-log",
            str(tmp_path / "log"),
            "--",
            *child,
        ],
        env=clean_env(PYTHONPATH=python_path),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    policy = server.spec.memory_policy
    weights = policy.weight_policy
    # The host KV tier's flags: in the command where the version's parser has them, and read
    # back as the spec's bytes over 2**30 with its backend.
    tier, has_tier_flags = policy.kv_offload, has_kv_offload_flags(server.spec.image or "")
    assert ("kv_offloading_size" in parsed) is has_tier_flags
    assert ("--kv-offloading-size" in vllm_args) is (has_tier_flags and tier is not None)
    if has_tier_flags:
        size, backend = parsed.pop("kv_offloading_size"), parsed.pop("kv_offloading_backend")
        if tier is None:
            assert size is None
        else:
            assert (size * 2**30, backend) == (tier.size_bytes, tier.backend)
    # KV events: vLLM's own KVEventsConfig from the rendered JSON, after the kubelet put the
    # pod's IP in the topic; hwm and max_queue_size are vLLM's defaults.
    events = server.spec.gateway.kv_events
    assert parsed.pop("kv_events_config") == (
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events.port}",
            "replay_endpoint": f"tcp://*:{events.replay_port}",
            "buffer_steps": events.buffer_steps,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": f"kv@{POD_IP}@qwen3",
        }
        if events.enabled
        else None
    )
    # The block hash a router computes (`render.kv_events.HASH_ALGO`); vLLM's own otherwise.
    assert parsed.pop("prefix_caching_hash_algo") == ("sha256_cbor" if events.enabled else "sha256")
    if policy.kv_cache_memory_bytes is not None:
        # No utilization is rendered under a KV byte budget: vLLM keeps its own default (0.9 in
        # 0.11.0, 0.92 in 0.33.0), which it does not use then.
        assert "--gpu-memory-utilization" not in vllm_args
        parsed.pop("gpu_memory_utilization")
    assert parsed == {
        "model_tag": server.spec.model.source,
        "served_model_name": (
            [server.spec.model.served_model_name] if server.spec.model.served_model_name else None
        ),
        "host": "0.0.0.0",
        "port": 8000,
        "dtype": server.spec.model.dtype,
        "load_format": server.spec.model.load_format,
        **(
            {}
            if policy.kv_cache_memory_bytes is not None
            else {"gpu_memory_utilization": policy.effective_utilization}
        ),
        "kv_cache_memory_bytes": policy.kv_cache_memory_bytes,
        "quantization": None if weights.quantization == "none" else weights.quantization,
        "cpu_offload_gb": weights.cpu_offload_gib,
        "block_size": policy.block_size,
        "max_num_batched_tokens": policy.max_num_batched_tokens,
        "max_num_seqs": policy.max_num_seqs,
        "max_model_len": policy.max_model_len,
        "enable_chunked_prefill": policy.enable_chunked_prefill,
        "enable_prefix_caching": policy.enable_prefix_caching,
        "kv_cache_dtype": policy.kv_cache_dtype,
        "tensor_parallel_size": server.spec.parallelism.tensor,
        "disable_custom_all_reduce": not server.spec.parallelism.custom_all_reduce,
        # vLLM takes one or more keys (`--api-key A B`); the pod gives one
        "api_key": [API_KEY] if server.spec.api_key is not None else None,
    }
    assert not (tmp_path / "log").exists()  # a clean exit writes no termination message


def test_the_tier_flags_are_refused_before_0_11_1_and_parsed_after(vllm_version: str) -> None:
    """Why the operator leaves them out for 0.11.0 (`vllm_compat.KV_OFFLOAD_FROM`): its parser
    refuses them, and the pod would not start."""
    flags = ["--kv-offloading-size", "1.5", "--kv-offloading-backend", "native"]
    result = run_probe(vllm_version, "probe_parser.py", ["/models/m", *flags], clean_env())
    if has_kv_offload_flags(f"vllm/vllm-openai:v{vllm_version}"):
        assert result.returncode == 0, result.stderr[-4000:]
        parsed = json.loads(result.stdout.strip().splitlines()[-1])
        assert (parsed["kv_offloading_size"], parsed["kv_offloading_backend"]) == (1.5, "native")
    else:
        assert result.returncode != 0
        assert "unrecognized arguments: --kv-offloading-size 1.5" in result.stderr
