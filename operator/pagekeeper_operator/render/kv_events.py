"""KV cache events on the pods (spec.gateway.kvEvents): the engine flag, the named container
ports a router subscribes to, and the pod's identity in the environment for the topic.

One flag serves both runtimes: `--kv-events-config` with vLLM's JSON fields, which the paged
engine parses the same way (`tests/operator/test_flag_contract.py`, `tests/vllm/`); vLLM also
gets the block hash a router computes. Both sockets bind on every interface of the pod
(`tcp://*:<port>`): routers subscribe to each pod's IP, so the Service, which would hand a
subscriber one pod chosen at random, does not carry the ports.
"""

from __future__ import annotations

import json
from typing import Any

from pagekeeper_operator.api.gateway import KVEventsSpec
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.policy.vllm_compat import has_kv_events_flag

# Container port names are IANA service names, at most 15 characters: the API server refuses
# a pod with a longer one.
EVENTS_PORT_NAME = "kv-events"
REPLAY_PORT_NAME = "kv-replay"
HASH_ALGO = "sha256_cbor"  # vLLM 0.11.0's and 0.33.0's parsers both take it
# What the topic may name: the kubelet expands $(NAME) in the command from these.
POD_FIELD_ENV = {
    "POD_IP": "status.podIP",
    "POD_NAME": "metadata.name",
    "POD_NAMESPACE": "metadata.namespace",
}


def publishes_kv_events(server: LLMServer, policy: MemoryPolicy, image: str) -> bool:
    """Whether the pods of `server` running `policy` on `image` get the flag and its ports.

    Off for a vLLM whose parser was not checked (`vllm_compat`, PolicyHonored names it) and
    for a policy without the prefix cache, whose blocks the events report: the CRD refuses
    that in spec, and `effective` keeps a tuned policy from turning the cache off, so only a
    trial policy of the tuner's reaches it, and its pods start without events rather than not
    at all (the paged engine's parser refuses events without the cache).
    """
    spec = server.spec
    if not spec.gateway.kv_events.enabled or not policy.enable_prefix_caching:
        return False
    return spec.runtime == "pagekeeper" or has_kv_events_flag(image)


def kv_events_config(events: KVEventsSpec) -> str:
    """The flag's JSON: vLLM's KVEventsConfig fields the spec sets; hwm and max_queue_size keep
    vLLM's defaults."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events.port}",
    }
    if events.replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{events.replay_port}"
    config["buffer_steps"] = events.buffer_steps
    config["topic"] = events.topic
    return json.dumps(config, separators=(",", ":"))


def kv_events_flags(events: KVEventsSpec, *, is_pagekeeper: bool) -> list[str]:
    """`--kv-events-config <json>`; for vLLM also `--prefix-caching-hash-algo sha256_cbor`.

    vLLM's default block hash (`sha256` of a pickle) is not one a router in another language
    can compute; sha256_cbor is what llm-d's indexer computes and what the paged engine always
    uses (docs/engine.md), so either runtime's pods publish the same hashes for one prompt.
    """
    flags = ["--kv-events-config", kv_events_config(events)]
    if not is_pagekeeper:
        flags += ["--prefix-caching-hash-algo", HASH_ALGO]
    return flags


def kv_events_ports(events: KVEventsSpec) -> list[dict[str, Any]]:
    """The container ports a subscriber looks up by name on each pod."""
    ports = [{"name": EVENTS_PORT_NAME, "containerPort": events.port, "protocol": "TCP"}]
    if events.replay_port is not None:
        ports.append(
            {"name": REPLAY_PORT_NAME, "containerPort": events.replay_port, "protocol": "TCP"}
        )
    return ports


def pod_field_env() -> list[dict[str, Any]]:
    """POD_IP, POD_NAME and POD_NAMESPACE from the downward API, for $(NAME) in the topic."""
    return [
        {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}
        for name, path in POD_FIELD_ENV.items()
    ]
