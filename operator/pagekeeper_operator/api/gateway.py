"""`LLMServer.spec.gateway`: how routers reach the pods, an InferencePool for the Gateway API
Inference Extension, and KV cache events for KV-aware routers (docs/operator.md, "KV-aware
routers")."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from pagekeeper_operator.api.types import MAX_NAME_LENGTH, ApiModel, cel, validations

# Ports the pod already serves on (render.meta): the OpenAI HTTP port, and under runtime vllm
# the launcher's metrics port. Kept free for either runtime, so a runtime change cannot clash.
RESERVED_PORTS = (8000, 8001)
# The engine runs as a user without capabilities, which may not bind a port below 1024.
MIN_EVENTS_PORT = 1024
DEFAULT_EVENTS_PORT = 5557  # vLLM's default endpoint, tcp://*:5557
DEFAULT_BUFFER_STEPS = 10_000  # vLLM's default
_RESERVED = " && ".join(f"self.{{0}} != {port}" for port in RESERVED_PORTS)
_RESERVED_TEXT = " or ".join(map(str, RESERVED_PORTS))

PORT_RULE = cel(
    _RESERVED.format("port"),
    f"spec.gateway.kvEvents.port must not be {_RESERVED_TEXT} (the pod's HTTP port and, under "
    "runtime vllm, pagekeeper's metrics port)",
    ".port",
)
REPLAY_PORT_RULE = cel(
    f"!has(self.replayPort) || ({_RESERVED.format('replayPort')})",
    f"spec.gateway.kvEvents.replayPort must not be {_RESERVED_TEXT} (the pod's HTTP port and, "
    "under runtime vllm, pagekeeper's metrics port)",
    ".replayPort",
)
DISTINCT_PORTS_RULE = cel(
    "!has(self.replayPort) || self.replayPort != self.port",
    "spec.gateway.kvEvents.replayPort must differ from spec.gateway.kvEvents.port (the replay "
    "socket and the publisher are two sockets)",
    ".replayPort",
)
PREFIX_CACHE_RULE = cel(
    "!self.gateway.kvEvents.enabled || self.memoryPolicy.enablePrefixCaching",
    "spec.gateway.kvEvents.enabled needs spec.memoryPolicy.enablePrefixCaching (the events "
    "report the blocks of the prefix cache; without it there are none to report)",
    ".gateway.kvEvents.enabled",
)


class KVEventsSpec(ApiModel):
    """KV cache events for KV-aware routers, as vLLM publishes them (--kv-events-config)."""

    model_config = ConfigDict(
        json_schema_extra=validations(PORT_RULE, REPLAY_PORT_RULE, DISTINCT_PORTS_RULE)
    )

    enabled: bool = Field(
        default=False,
        description=(
            "Publish the engine's KV cache events (BlockStored, BlockRemoved, AllBlocksCleared: "
            "vLLM's msgpack batches) on a ZMQ PUB socket on every pod, for either runtime "
            "(--kv-events-config), so a KV-aware router (llm-d's precise prefix-cache scorer, "
            "NVIDIA Dynamo's KV router, any ZMQ subscriber) knows which prefixes each pod "
            "holds. Needs spec.memoryPolicy.enablePrefixCaching. Subscribers connect to each "
            "pod's IP on the container port named kv-events; the Service does not carry it."
        ),
    )
    port: int = Field(
        default=DEFAULT_EVENTS_PORT,
        ge=MIN_EVENTS_PORT,
        le=65535,
        description=(
            f"The PUB socket's port on each pod (endpoint tcp://*:<port>), the container port "
            f"named kv-events; {MIN_EVENTS_PORT} to 65535 (the engine may not bind below), not "
            f"{_RESERVED_TEXT}."
        ),
    )
    replay_port: int | None = Field(
        default=None,
        ge=MIN_EVENTS_PORT,
        le=65535,
        description=(
            "Set: a ZMQ ROUTER socket on this port (replay endpoint tcp://*:<port>, the "
            "container port named kv-replay) resends the last bufferSteps batches from "
            "a sequence number, so a subscriber that missed some can catch up. Unset (the "
            "default): no replay socket."
        ),
    )
    topic: str = Field(
        default="",
        max_length=256,
        description=(
            "The first frame of every message; subscribers filter on its prefix. The kubelet "
            "expands $(POD_IP), $(POD_NAME) and $(POD_NAMESPACE) in it, so llm-d's convention "
            "kv@$(POD_IP)@<model> names the pod ($$ writes a literal $). Default: empty."
        ),
    )
    buffer_steps: int = Field(
        default=DEFAULT_BUFFER_STEPS,
        ge=1,
        le=1_000_000,
        description=(
            "Batches (one per engine step that had events) the engine keeps for the replay "
            "socket; the oldest go first."
        ),
    )

    @model_validator(mode="after")
    def _check_ports(self) -> KVEventsSpec:
        if self.port in RESERVED_PORTS:
            raise ValueError(PORT_RULE["message"])
        if self.replay_port in RESERVED_PORTS:
            raise ValueError(REPLAY_PORT_RULE["message"])
        if self.replay_port == self.port:
            raise ValueError(DISTINCT_PORTS_RULE["message"])
        return self


class EndpointPickerRef(ApiModel):
    """The endpoint picker (the Gateway API Inference Extension's EPP) that the gateway asks
    which pod of the pool should take each request."""

    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="Name of the endpoint picker's Service, in the LLMServer's namespace.",
    )
    port: int = Field(
        default=9002,
        ge=1,
        le=65535,
        description="Port of that Service (the picker's ext-proc gRPC port, 9002 by default).",
    )
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description=(
            "What the gateway does when the picker does not answer: FailClose refuses the "
            "request; FailOpen sends it to a pod the gateway picks itself."
        ),
    )


class InferencePoolSpec(ApiModel):
    """An InferencePool (inference.networking.k8s.io/v1) over this server's pods."""

    endpoint_picker_ref: EndpointPickerRef = Field(
        description="The endpoint picker the pool names; you deploy it (one per pool)."
    )


class GatewaySpec(ApiModel):
    """How an inference gateway or a KV-aware router reaches the pods."""

    inference_pool: InferencePoolSpec | None = Field(
        default=None,
        description=(
            "Set: the operator renders an InferencePool of the same name selecting this "
            "server's pods on the serving port, so a Gateway API Inference Extension gateway "
            "routes each request to the pod with the shortest queue and the most free KV cache. "
            "Rendered only where the InferencePool CRD is installed. Unset (the default): none, "
            "and one the operator made is deleted."
        ),
    )
    kv_events: KVEventsSpec = Field(
        default_factory=KVEventsSpec,
        description=(
            "KV cache events for KV-aware routers (vLLM's --kv-events-config, for either "
            "runtime). Off by default."
        ),
    )
