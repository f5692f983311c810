"""`LLMServer.spec.gateway`: an InferencePool for the Gateway API Inference Extension."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagekeeper_operator.api.types import MAX_NAME_LENGTH, ApiModel


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
    """How an inference gateway reaches the pods."""

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
