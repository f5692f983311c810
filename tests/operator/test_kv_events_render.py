"""spec.gateway.kvEvents rendered: `--kv-events-config` and the named ports for either
runtime, the pod's identity for the topic, and nothing on the Service or the InferencePool."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagekeeper_operator.render import ClusterFeatures, render_all, render_deployment
from tests.operator.servers import DEFAULT_IMAGES, make_server
from tests.operator.test_effective import promoted, with_status

EVENTS = {"enabled": True, "replayPort": 5558, "topic": "kv@$(POD_IP)@qwen", "bufferSteps": 500}
FIELD_ENV = [
    {
        "name": "POD_IP",
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}},
    },
    {
        "name": "POD_NAME",
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
    },
    {
        "name": "POD_NAMESPACE",
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}},
    },
]


def _container(spec: dict[str, Any]) -> dict[str, Any]:
    deployment = render_deployment(make_server(spec), DEFAULT_IMAGES)
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _events_config(command: list[str]) -> dict[str, Any] | None:
    if "--kv-events-config" not in command:
        return None
    config: dict[str, Any] = json.loads(command[command.index("--kv-events-config") + 1])
    return config


def test_the_paged_engine_publishes_on_named_ports() -> None:
    container = _container({"gateway": {"kvEvents": EVENTS}})
    command = container["command"]
    flag = command.index("--kv-events-config")
    assert command[flag : flag + 2] == [
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
        '"replay_endpoint":"tcp://*:5558","buffer_steps":500,"topic":"kv@$(POD_IP)@qwen"}',
    ]
    assert command[flag + 2] == "--shutdown-timeout"  # no hash choice: always sha256_cbor
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"},
        {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"},
    ]
    env = container["env"]
    assert env[-3:] == FIELD_ENV


def test_without_a_replay_port_there_is_no_replay_endpoint_or_port() -> None:
    container = _container({"gateway": {"kvEvents": {"enabled": True, "port": 6000}}})
    assert _events_config(container["command"]) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:6000",
        "buffer_steps": 10_000,
        "topic": "",
    }
    assert [p["name"] for p in container["ports"]] == ["http", "kv-events"]


def test_off_renders_the_same_pods_as_before() -> None:
    """A server that never set kvEvents, or set it off, keeps its pods (no flag, port or env)."""
    off = {"gateway": {"kvEvents": {"enabled": False, "port": 6000, "replayPort": 6001}}}
    for runtime in ("pagekeeper", "vllm"):
        plain = render_deployment(make_server({"runtime": runtime}), DEFAULT_IMAGES)
        assert render_deployment(make_server({"runtime": runtime, **off}), DEFAULT_IMAGES) == plain


def test_a_user_variable_of_the_same_name_wins() -> None:
    mine = {"name": "POD_NAME", "value": "fixed"}
    env = _container({"gateway": {"kvEvents": EVENTS}, "podTemplate": {"env": [mine]}})["env"]
    assert [e for e in env if e["name"] == "POD_NAME"] == [mine]


def test_service_and_inference_pool_carry_no_event_port() -> None:
    """Routers subscribe to each pod's IP; a Service port would reach one pod at random."""
    pool = {"inferencePool": {"endpointPickerRef": {"name": "epp"}}}
    spec = {"gateway": {**pool, "kvEvents": EVENTS}}
    features = ClusterFeatures(has_inference_pool=True)
    with_events = render_all(make_server(spec), DEFAULT_IMAGES, features)
    without = render_all(make_server({"gateway": pool}), DEFAULT_IMAGES, features)
    kinds = ("Service", "InferencePool")
    assert [o for o in with_events if o["kind"] in kinds] == [
        o for o in without if o["kind"] in kinds
    ]


@pytest.mark.parametrize(
    ("image", "has_flag"),
    [
        ("vllm/vllm-openai:v0.10.2", False),
        ("vllm/vllm-openai:v0.11.0", True),
        ("vllm/vllm-openai:v0.33.0", True),
        ("vllm/vllm-openai:latest", True),
    ],
)
def test_vllm_gets_the_flag_from_the_oldest_checked_parser(image: str, has_flag: bool) -> None:
    container = _container({"runtime": "vllm", "image": image, "gateway": {"kvEvents": EVENTS}})
    command = container["command"]
    vllm_args = command[command.index("--") + 1 :]
    assert ("--kv-events-config" in vllm_args) is has_flag
    if has_flag:
        flag = vllm_args.index("--kv-events-config")
        assert vllm_args[flag + 2 : flag + 4] == ["--prefix-caching-hash-algo", "sha256_cbor"]
    else:
        assert "--prefix-caching-hash-algo" not in vllm_args
    assert "--kv-events-config" not in command[: command.index("--")]  # not the launcher's
    names = [p["name"] for p in container["ports"]]
    expected = ["kv-events", "kv-replay"] if has_flag else []
    assert names == ["http", "pk-metrics", *expected]
    assert ({"POD_IP", "POD_NAME"} <= {e["name"] for e in container["env"]}) is has_flag


def test_a_tuned_prefix_cache_off_keeps_the_flag() -> None:
    change = {"changes": [promoted("enablePrefixCaching", "false", "true")]}
    on = with_status(make_server({"gateway": {"kvEvents": {"enabled": True}}}), tuning=change)
    command = render_deployment(on, DEFAULT_IMAGES)["spec"]["template"]["spec"]["containers"][0][
        "command"
    ]
    assert "--enable-prefix-caching" in command
    assert _events_config(command) is not None
