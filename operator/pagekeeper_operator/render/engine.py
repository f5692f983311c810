"""The engine's command line and environment: the operator's half of the flag contract.

Flags are named as `pagekeeper_engine.flags.build_parser()` names them (vLLM's names), so
`tests/operator/test_flag_contract.py` can parse what this renders with the engine's own parser.
Every policy value is written out, defaults included, so a pod's command says what it runs.
"""

from __future__ import annotations

from typing import Any

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.policy.effective import allocator_conf
from pagekeeper_operator.policy.vllm_compat import has_kv_offload_flags
from pagekeeper_operator.render.kv_events import (
    kv_events_flags,
    pod_field_env,
    publishes_kv_events,
)
from pagekeeper_operator.render.meta import HTTP_PORT
from pagekeeper_operator.render.vllm import PYTHONPATH, python_path

ALLOC_CONF_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
API_KEY_ENV = "PAGEKEEPER_API_KEY"  # from spec.apiKey's Secret; --api-key reads it
CACHE_DIR = "/cache"
TMP_DIR = "/tmp"


def _number(value: float) -> str:
    # 4.0 -> "4", 0.9 -> "0.9": the shortest text that parses back to the same float.
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _switch(name: str, is_on: bool) -> str:
    return f"--{name}" if is_on else f"--no-{name}"


def policy_flags(
    policy: MemoryPolicy, *, is_pagekeeper: bool, has_kv_offload: bool = True
) -> list[str]:
    """The memoryPolicy rows of the contract table, as flags; `has_kv_offload`: whether the
    runtime's parser has the host KV tier's flags (a vLLM before 0.11.1 does not)."""
    kv_bytes = policy.kv_cache_memory_bytes
    if kv_bytes is not None:
        flags = ["--kv-cache-memory-bytes", str(kv_bytes)]
    else:
        utilization = policy.effective_utilization
        assert utilization is not None, "without a KV byte budget the utilization applies"
        flags = ["--gpu-memory-utilization", _number(utilization)]
    flags += [
        "--block-size",
        str(policy.block_size),
        "--max-num-batched-tokens",
        str(policy.max_num_batched_tokens),
        "--max-num-seqs",
        str(policy.max_num_seqs),
    ]
    if policy.max_model_len is not None:
        flags += ["--max-model-len", str(policy.max_model_len)]
    flags += [
        _switch("enable-chunked-prefill", policy.enable_chunked_prefill),
        _switch("enable-prefix-caching", policy.enable_prefix_caching),
    ]
    if policy.kv_cache_dtype != "auto":  # absent at auto, so existing servers keep their pods
        flags += ["--kv-cache-dtype", policy.kv_cache_dtype]
    weights = policy.weight_policy  # absent when unset, as above
    if weights.quantization != "none":
        flags += ["--quantization", weights.quantization]
    if weights.cpu_offload_gib > 0:
        flags += ["--cpu-offload-gb", _number(weights.cpu_offload_gib)]
    tier = policy.kv_offload  # absent when unset, as above
    if tier is not None and has_kv_offload:
        flags += [
            "--kv-offloading-size",
            tier.size_gib_text,
            "--kv-offloading-backend",
            tier.backend,
        ]
    if is_pagekeeper:
        # vLLM has no equivalent of these three (its V1 engine does not swap KV blocks).
        flags += [
            "--swap-space",
            _number(policy.swap_space_gib),
            "--prefix-cache-max-fraction",
            _number(policy.prefix_cache_max_fraction),
            "--fragmentation-buffer",
            policy.fragmentation_buffer,
        ]
    return flags


def engine_command(server: LLMServer, policy: MemoryPolicy, image: str) -> list[str]:
    """The container command: `pagekeeper-engine serve MODEL ...` or `vllm serve MODEL ...`
    (for the vLLM version `image` names: `vllm_compat`)."""
    spec = server.spec
    is_pagekeeper = spec.runtime == "pagekeeper"
    program = "pagekeeper-engine" if is_pagekeeper else "vllm"
    command = [program, "serve", spec.model.source]
    if spec.model.served_model_name is not None:
        command += ["--served-model-name", spec.model.served_model_name]
    command += [
        "--host",
        "0.0.0.0",
        "--port",
        str(HTTP_PORT),
        "--dtype",
        spec.model.dtype,
        "--load-format",
        spec.model.load_format,
    ]
    if is_pagekeeper:
        command += ["--device", "cuda" if spec.num_gpus > 0 else "cpu"]
    if spec.parallelism.tensor > 1:  # absent at 1, so servers without it keep their pods
        command += ["--tensor-parallel-size", str(spec.parallelism.tensor)]
        if not spec.parallelism.custom_all_reduce:
            command.append("--disable-custom-all-reduce")
    has_kv_offload = is_pagekeeper or has_kv_offload_flags(image)
    command += policy_flags(policy, is_pagekeeper=is_pagekeeper, has_kv_offload=has_kv_offload)
    if publishes_kv_events(server, policy, image):  # absent when off, as above
        command += kv_events_flags(spec.gateway.kv_events, is_pagekeeper=is_pagekeeper)
    if is_pagekeeper:
        command += ["--shutdown-timeout", str(spec.shutdown_grace_period_seconds)]
        command += stuck_timeout_flags(server)
    if spec.api_key is not None:
        # The kubelet expands $(NAME) from the container's env. One argument: a key that begins
        # with "-" (token_urlsafe makes those) would read as a flag after a separate --api-key.
        command.append(f"--api-key=$({API_KEY_ENV})")
    return command


def stuck_timeout_flags(server: LLMServer) -> list[str]:
    """`--stuck-timeout`, for the paged engine or the vLLM launcher; none where unset, so a
    server that never set it keeps its pods."""
    seconds = server.spec.stuck_timeout_seconds
    return [] if seconds is None else ["--stuck-timeout", str(seconds)]


def engine_env(
    server: LLMServer, policy: MemoryPolicy, *, has_kv_events: bool = False
) -> list[dict[str, Any]]:
    """Allocator settings, writable cache locations, the pod's identity where it publishes KV
    events (`has_kv_events`: the topic may name it), then the user's extra variables.

    A user variable replaces one of ours of the same name (the CRD forbids the allocator
    ones); the list must hold each name once, since server-side apply keys it by name.
    """
    conf = allocator_conf(policy.allocator)
    ours: dict[str, dict[str, Any]] = {
        name: {"name": name, "value": conf} for name in ALLOC_CONF_ENV
    }
    # The root filesystem is read-only: every cache goes to the writable emptyDir.
    for name, value in (
        ("HOME", CACHE_DIR),
        ("XDG_CACHE_HOME", CACHE_DIR),
        ("HF_HOME", f"{CACHE_DIR}/huggingface"),
        ("TRITON_CACHE_DIR", f"{CACHE_DIR}/triton"),
        ("TORCHINDUCTOR_CACHE_DIR", f"{CACHE_DIR}/inductor"),
        ("TMPDIR", TMP_DIR),
    ):
        ours[name] = {"name": name, "value": value}
    if has_kv_events:
        ours.update((var["name"], var) for var in pod_field_env())
    api_key = server.spec.api_key
    if api_key is not None:
        source = {"secretKeyRef": {"name": api_key.secret_name, "key": api_key.key}}
        ours[API_KEY_ENV] = {"name": API_KEY_ENV, "valueFrom": source}
    for extra in server.spec.pod_template.env:
        ours[extra.name] = extra.to_api()
    if server.spec.runtime == "vllm":
        ours[PYTHONPATH] = python_path(server)
    return list(ours.values())
