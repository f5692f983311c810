"""The operator -> engine flag contract: what render writes, the engine's parser reads back.

This test imports the engine's config module (argparse only, no torch); the operator package
itself never imports the engine.
"""

from __future__ import annotations

from typing import Any

import pytest

from pagekeeper_engine.config import parse_args
from pagekeeper_engine.flags import DEFAULT_STUCK_TIMEOUT_S, build_parser, parse_bytes
from pagekeeper_engine.kv_events_config import KVEventsConfig
from pagekeeper_operator.render import render_deployment
from pagekeeper_operator.render.engine import policy_flags
from pagekeeper_vllm import launch
from tests.operator.servers import DEFAULT_IMAGES, make_server, merge

SPECS: list[dict[str, Any]] = [
    {},
    {
        "model": {"servedModelName": "qwen3", "dtype": "bfloat16", "loadFormat": "dummy"},
        "shutdownGracePeriodSeconds": 120,
        "memoryPolicy": {
            "gpuMemoryUtilization": 0.95,
            "blockSize": 32,
            "maxNumBatchedTokens": 65536,
            "maxNumSeqs": 512,
            "maxModelLen": 32768,
            "swapSpaceGiB": 2.5,
            "prefixCacheMaxFraction": 0.25,
            "fragmentationBuffer": "512Mi",
        },
    },
    {
        "resources": {"gpus": 0},
        "memoryPolicy": {
            "enableChunkedPrefill": False,
            "enablePrefixCaching": False,
            "maxModelLen": 4096,
            "maxNumBatchedTokens": 4096,
            "maxNumSeqs": 8,
            "blockSize": 8,
            "gpuMemoryUtilization": 0.5,
            "fragmentationBuffer": "1.5Gi",
        },
        "remediation": {"adaptive": {"minGpuMemoryUtilization": 0.5}},
    },
    {"parallelism": {"tensor": 4}},
    {"memoryPolicy": {"kvCacheDtype": "fp8"}},
    {"gateway": {"kvEvents": {"enabled": True, "replayPort": 5558, "topic": "kv@p@m"}}},
]


def _command(spec: dict[str, Any]) -> list[str]:
    """The engine's command line: `pagekeeper-engine serve ...`, or under vllm the `vllm serve
    ...` the launcher runs (what follows its `--`)."""
    deployment = render_deployment(make_server(spec), DEFAULT_IMAGES)
    command: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    if command[:3] == ["python3", "-m", "pagekeeper_vllm.launch"]:
        command = command[command.index("--") + 1 :]
    return command


@pytest.mark.parametrize("spec", SPECS)
def test_engine_parses_rendered_args_into_the_policy(spec: dict[str, Any]) -> None:
    server = make_server(spec)
    policy = server.spec.memory_policy
    command = _command(spec)
    assert command[:2] == ["pagekeeper-engine", "serve"]
    config = parse_args(command[2:])
    assert config.model == server.spec.model.source
    assert config.served_model_name == server.spec.model.served_model_name
    assert config.dtype == server.spec.model.dtype
    assert config.load_format == server.spec.model.load_format
    assert config.device == ("cuda" if server.spec.num_gpus else "cpu")
    assert config.tensor_parallel_size == server.spec.parallelism.tensor
    assert config.kv_cache_dtype == policy.kv_cache_dtype
    assert (config.host, config.port) == ("0.0.0.0", 8000)
    assert config.gpu_memory_utilization == policy.effective_utilization
    assert config.block_size == policy.block_size
    assert config.max_num_batched_tokens == policy.max_num_batched_tokens
    assert config.max_num_seqs == policy.max_num_seqs
    assert config.max_model_len == policy.max_model_len
    assert config.swap_space == policy.swap_space_gib
    assert config.enable_chunked_prefill is policy.enable_chunked_prefill
    assert config.enable_prefix_caching is policy.enable_prefix_caching
    assert config.prefix_cache_max_fraction == policy.prefix_cache_max_fraction
    expected_buffer = (
        policy.fragmentation_buffer
        if policy.fragmentation_buffer == "auto"
        else parse_bytes(policy.fragmentation_buffer)
    )
    assert config.fragmentation_buffer == expected_buffer
    assert config.shutdown_timeout == server.spec.shutdown_grace_period_seconds


# The byte budget and the weight-memory flags.
NEW_FLAGS = {"--kv-cache-memory-bytes", "--quantization", "--cpu-offload-gb"}
_ENGINE_FLAGS = {opt for action in build_parser()._actions for opt in action.option_strings}
BUDGET_SPECS: list[dict[str, Any]] = [
    {"memoryPolicy": {"kvCacheMemory": "20Gi", "weights": {"quantization": "fp8"}}},
    {"memoryPolicy": {"gpuMemoryUtilization": 0.8, "weights": {"cpuOffloadGiB": 8}}},
    {
        "runtime": "vllm",
        "memoryPolicy": {"kvCacheMemory": 1500000000, "weights": {"cpuOffloadGiB": 2.5}},
    },
]


@pytest.mark.parametrize("spec", BUDGET_SPECS)
def test_budget_and_weight_flags_render_as_vllm_names_them(spec: dict[str, Any]) -> None:
    policy = make_server(spec).spec.memory_policy
    flags = policy_flags(policy, is_pagekeeper=True)
    kv_bytes, weights = policy.kv_cache_memory_bytes, policy.weight_policy
    if kv_bytes is not None:
        assert flags[:2] == ["--kv-cache-memory-bytes", str(kv_bytes)]
        assert "--gpu-memory-utilization" not in flags
    if weights.quantization == "fp8":
        assert flags[flags.index("--quantization") + 1] == "fp8"
    if weights.cpu_offload_gib:
        assert float(flags[flags.index("--cpu-offload-gb") + 1]) == weights.cpu_offload_gib
    assert "--quantization" in flags or "--cpu-offload-gb" in flags


def test_vllm_gets_the_same_budget_and_weight_flags() -> None:
    command = _command(BUDGET_SPECS[2])
    assert command[:2] == ["vllm", "serve"]
    assert command[command.index("--kv-cache-memory-bytes") + 1] == "1500000000"
    assert command[command.index("--cpu-offload-gb") + 1] == "2.5"
    assert "--gpu-memory-utilization" not in command and "--quantization" not in command


def test_unset_weights_and_budget_render_no_new_flag() -> None:
    """Servers that set none of them keep their command (and pods) across an upgrade."""
    for runtime in ("pagekeeper", "vllm"):
        assert not NEW_FLAGS & set(_command({"runtime": runtime}))


@pytest.mark.parametrize("spec", BUDGET_SPECS[:2])
def test_engine_parses_the_budget_and_weight_flags(spec: dict[str, Any]) -> None:
    policy = make_server(spec).spec.memory_policy
    config = parse_args(_command(spec)[2:])
    assert getattr(config, "kv_cache_memory_bytes", None) == policy.kv_cache_memory_bytes
    weights = policy.weight_policy
    assert (getattr(config, "quantization", None) or "none") == weights.quantization
    assert float(getattr(config, "cpu_offload_gb", 0.0)) == weights.cpu_offload_gib


def test_the_new_flags_are_the_engines() -> None:
    assert NEW_FLAGS <= _ENGINE_FLAGS, NEW_FLAGS - _ENGINE_FLAGS


def test_every_rendered_flag_is_one_the_engine_defines() -> None:
    known = {opt for action in build_parser()._actions for opt in action.option_strings}
    for spec in SPECS:
        rendered = {arg for arg in _command(spec) if arg.startswith("--")}
        assert rendered <= known, rendered - known


def test_every_contract_row_is_rendered() -> None:
    # docs/memory-policy.md's table of fields: each memoryPolicy field maps to exactly one flag.
    tier = {"maxModelLen": 4096, "kvOffload": {"size": "8Gi"}}
    flags = policy_flags(make_server({"memoryPolicy": tier}).spec.memory_policy, is_pagekeeper=True)
    names = [f for f in flags if f.startswith("--")]
    assert names == [
        "--gpu-memory-utilization",
        "--block-size",
        "--max-num-batched-tokens",
        "--max-num-seqs",
        "--max-model-len",
        "--enable-chunked-prefill",
        "--enable-prefix-caching",
        "--kv-offloading-size",
        "--kv-offloading-backend",
        "--swap-space",
        "--prefix-cache-max-fraction",
        "--fragmentation-buffer",
    ]


def test_vllm_args_are_the_shared_subset() -> None:
    vllm = _command({"runtime": "vllm", "memoryPolicy": {"maxModelLen": 4096}})
    pagekeeper = _command({"memoryPolicy": {"maxModelLen": 4096}})
    vllm_flags = {a for a in vllm if a.startswith("--")}
    pagekeeper_only = {
        "--swap-space",
        "--prefix-cache-max-fraction",
        "--fragmentation-buffer",
        "--shutdown-timeout",
        "--device",
    }
    assert vllm_flags == {a for a in pagekeeper if a.startswith("--")} - pagekeeper_only
    # Same values for the shared flags: the engine's parser reads them identically.
    shared = parse_args(["/m", *list(vllm[3:])])
    assert shared.max_model_len == 4096 and shared.gpu_memory_utilization == 0.9


@pytest.mark.parametrize("runtime", ["pagekeeper", "vllm"])
def test_kv_cache_dtype_reaches_either_runtime(runtime: str) -> None:
    """vLLM spells it --kv-cache-dtype fp8 too; at auto the flag is left out."""
    spec = {"runtime": runtime, "memoryPolicy": {"kvCacheDtype": "fp8", "maxModelLen": 4096}}
    command = _command(spec)
    assert command[command.index("--kv-cache-dtype") + 1] == "fp8"
    assert parse_args(["/m", *command[3:]]).is_fp8_kv_cache
    assert "--kv-cache-dtype" not in _command({"runtime": runtime})


@pytest.mark.parametrize("runtime", ["pagekeeper", "vllm"])
def test_tensor_parallel_size_reaches_either_runtime(runtime: str) -> None:
    """vLLM spells it --tensor-parallel-size too; at 1 the flag is left out, so servers that
    never asked for it keep their pods across an operator upgrade."""
    spec = {"runtime": runtime, "parallelism": {"tensor": 4}, "memoryPolicy": {"maxModelLen": 4096}}
    command = _command(spec)
    index = command.index("--tensor-parallel-size")
    assert command[index + 1] == "4"
    assert parse_args(["/m", *command[3:]]).tensor_parallel_size == 4
    assert "--tensor-parallel-size" not in _command({"runtime": runtime})


@pytest.mark.parametrize("runtime", ["pagekeeper", "vllm"])
def test_custom_all_reduce_off_reaches_either_runtime(runtime: str) -> None:
    """vLLM spells it --disable-custom-all-reduce too; it is rendered only where it changes
    something (tensor > 1 and turned off), so servers that never asked keep their pods."""
    off = {"tensor": 2, "customAllReduce": False}
    command = _command({"runtime": runtime, "parallelism": off})
    assert command.count("--disable-custom-all-reduce") == 1
    assert parse_args(["/m", *command[3:]]).disable_custom_all_reduce
    for parallelism in ({"tensor": 2}, {"tensor": 1, "customAllReduce": False}):
        command = _command({"runtime": runtime, "parallelism": parallelism})
        assert "--disable-custom-all-reduce" not in command
        assert not parse_args(["/m", *command[3:]]).disable_custom_all_reduce


@pytest.mark.parametrize("runtime", ["pagekeeper", "vllm"])
def test_the_api_key_comes_from_its_secret_into_either_runtime(runtime: str) -> None:
    spec = {"runtime": runtime, "apiKey": {"secretName": "chat-openai", "key": "token"}}
    deployment = render_deployment(make_server(spec), DEFAULT_IMAGES)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["PAGEKEEPER_API_KEY"] == {
        "name": "PAGEKEEPER_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "chat-openai", "key": "token"}},
    }
    command = _command(spec)
    # One argument, so a key that begins with "-" is not read as a flag once expanded.
    assert [c for c in command if c.startswith("--api-key")] == ["--api-key=$(PAGEKEEPER_API_KEY)"]
    if runtime == "pagekeeper":  # the kubelet expands it before the engine parses it
        expanded = [c.replace("$(PAGEKEEPER_API_KEY)", "-dash-first") for c in command[2:]]
        assert parse_args(expanded).api_key == "-dash-first"
    plain = render_deployment(make_server({"runtime": runtime}), DEFAULT_IMAGES)
    plain_container = plain["spec"]["template"]["spec"]["containers"][0]
    assert not any(c.startswith("--api-key") for c in plain_container["command"])
    assert "PAGEKEEPER_API_KEY" not in {e["name"] for e in plain_container["env"]}


@pytest.mark.parametrize("seconds", [None, 0, 240])
def test_the_stuck_timeout_reaches_the_paged_engine_and_the_vllm_launcher(
    seconds: int | None,
) -> None:
    spec: dict[str, Any] = {} if seconds is None else {"stuckTimeoutSeconds": seconds}
    expected = DEFAULT_STUCK_TIMEOUT_S if seconds is None else float(seconds)
    command = _command(spec)
    assert ("--stuck-timeout" in command) is (seconds is not None)  # unset: pods unchanged
    assert parse_args(command[2:]).stuck_timeout == expected

    deployment = render_deployment(make_server({**spec, "runtime": "vllm"}), DEFAULT_IMAGES)
    launcher = deployment["spec"]["template"]["spec"]["containers"][0]["command"][3:]
    args = launch.build_parser().parse_args(launcher)
    assert args.stuck_timeout == (launch.DEFAULT_STUCK_TIMEOUT_S if seconds is None else expected)
    assert args.command[1:3] == ["vllm", "serve"]


KV_OFFLOAD_FLAGS = {"--kv-offloading-size", "--kv-offloading-backend"}


@pytest.mark.parametrize(
    ("size", "gib"), [("32Gi", "32"), ("1536Mi", "1.5"), ("1G", "0.931322574615478515625")]
)
def test_the_host_tier_reaches_the_engine_in_gib(size: str, gib: str) -> None:
    """The engine reads the size back as the spec's bytes over 2**30, exactly, with the
    swap space beside it (a separate host pool)."""
    spec = {"parallelism": {"tensor": 2}, "memoryPolicy": {"kvOffload": {"size": size}}}
    command = _command(merge(spec, {"memoryPolicy": {"swapSpaceGiB": 4}}))
    assert command[command.index("--kv-offloading-size") + 1] == gib
    assert command[command.index("--kv-offloading-backend") + 1] == "native"
    config = parse_args(command[2:])
    tier = make_server(spec).spec.memory_policy.kv_offload
    assert tier is not None
    assert config.kv_offloading_size * 2**30 == tier.size_bytes
    assert (config.kv_offloading_backend, config.swap_space) == ("native", 4.0)


def test_the_host_tier_flags_are_the_engines() -> None:
    assert KV_OFFLOAD_FLAGS <= _ENGINE_FLAGS, KV_OFFLOAD_FLAGS - _ENGINE_FLAGS
    for action in build_parser()._actions:
        if "--kv-offloading-backend" in action.option_strings:
            # What the CRD allows under runtime pagekeeper (KV_OFFLOAD_BACKEND_RULE).
            assert action.choices is not None and list(action.choices) == ["native"]


@pytest.mark.parametrize("runtime", ["pagekeeper", "vllm"])
def test_no_tier_renders_no_tier_flag(runtime: str) -> None:
    """Servers that never set kvOffload keep their command (and pods) across an upgrade."""
    assert not KV_OFFLOAD_FLAGS & set(_command({"runtime": runtime}))


@pytest.mark.parametrize(
    ("image", "is_rendered"),
    [
        ("vllm/vllm-openai:v0.11.0", False),
        ("vllm/vllm-openai:v0.11.1", True),
        ("vllm/vllm-openai:v0.33.0", True),
        ("vllm/vllm-openai:latest", True),  # a tag with no version: the newest have the flags
    ],
)
def test_vllm_gets_the_tier_flags_where_its_parser_has_them(image: str, is_rendered: bool) -> None:
    """Left out before 0.11.1, whose parser would refuse them (PolicyHonored says so)."""
    tier = {"size": "1536Mi", "backend": "lmcache"}
    command = _command({"runtime": "vllm", "image": image, "memoryPolicy": {"kvOffload": tier}})
    assert command[:2] == ["vllm", "serve"]
    if is_rendered:
        index = command.index("--kv-offloading-size")
        assert command[index : index + 4] == [
            "--kv-offloading-size",
            "1.5",
            "--kv-offloading-backend",
            "lmcache",
        ]
    else:
        assert not KV_OFFLOAD_FLAGS & set(command)


@pytest.mark.parametrize(
    "events",
    [
        {"enabled": True},
        {"enabled": True, "port": 6100, "replayPort": 6101, "topic": "kv@p@m", "bufferSteps": 7},
    ],
)
def test_engine_parses_the_kv_events_config(events: dict[str, Any]) -> None:
    """spec.gateway.kvEvents as the engine's parser reads it: vLLM's fields, vLLM's defaults
    for what the spec leaves out; off, no flag."""
    server = make_server({"gateway": {"kvEvents": events}})
    spec = server.spec.gateway.kv_events
    config = parse_args(_command({"gateway": {"kvEvents": events}})[2:]).kv_events_config
    assert config == KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{spec.port}",
        replay_endpoint=None if spec.replay_port is None else f"tcp://*:{spec.replay_port}",
        buffer_steps=spec.buffer_steps,
        topic=spec.topic,
    )
    assert parse_args(_command({})[2:]).kv_events_config is None
