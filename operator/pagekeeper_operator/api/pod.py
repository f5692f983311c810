"""`LLMServer.spec.podTemplate`: additions to the rendered pods (env, volumes, scheduling)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field, WithJsonSchema, model_validator

from pagekeeper_operator.api.types import (
    MAX_LIST_ITEMS,
    MAX_NAME_LENGTH,
    STRING_MAP,
    ApiModel,
    FreeForm,
    JsonDict,
    cel,
    validations,
)

# Names the operator sets itself from memoryPolicy.allocator; a user value would fight it.
RESERVED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

ENV_RULE = cel(
    "self.all(e, e.name != 'PYTORCH_CUDA_ALLOC_CONF' && e.name != 'PYTORCH_ALLOC_CONF')",
    "spec.podTemplate.env must not set PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF: use "
    "spec.memoryPolicy.allocator",
)


# The API server's own rules for what the pod template copies from here, so that a spec the
# Deployment would refuse is refused at `kubectl apply`, naming the field (k8s.io/apimachinery
# validation: the environment variable name and DNS-1123 label rules).
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
DNS1123_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_LABEL_LENGTH = 63
VOLUME_NAME_SCHEMA: JsonDict = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_LABEL_LENGTH,
    "pattern": DNS1123_LABEL_PATTERN,
    "description": "Volume name: a DNS-1123 label (lower-case letters, digits and '-').",
}


def _check_volume_name(volume: dict[str, Any]) -> dict[str, Any]:
    name = volume.get("name")
    if not isinstance(name, str) or not (
        len(name) <= MAX_LABEL_LENGTH and re.fullmatch(DNS1123_LABEL_PATTERN, name)
    ):
        raise ValueError(f"volume name {name!r} must be a DNS-1123 label")
    return volume


Volume = Annotated[
    dict[str, Any],
    AfterValidator(_check_volume_name),
    WithJsonSchema(
        {
            "type": "object",
            "required": ["name"],
            "properties": {"name": VOLUME_NAME_SCHEMA},
            "x-kubernetes-preserve-unknown-fields": True,
        }
    ),
]
"""A core/v1 Volume, opaque but for its name, which the API server checks in the pod."""


class EnvVar(ApiModel):
    """An extra environment variable for the engine container."""

    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=ENV_NAME_PATTERN,
        description=(
            "Variable name: letters, digits, '_', '-' and '.', not starting with a digit "
            "(the API server's rule for container env names)."
        ),
    )
    value: str | None = Field(default=None, max_length=32768, description="Literal value.")
    value_from: FreeForm | None = Field(
        default=None, description="A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, ...)."
    )


class VolumeMount(ApiModel):
    """Where an extra volume appears in the engine container."""

    name: str = Field(
        min_length=1,
        max_length=MAX_LABEL_LENGTH,
        pattern=DNS1123_LABEL_PATTERN,
        description="Volume name: a DNS-1123 label (lower-case letters, digits and '-').",
    )
    mount_path: str = Field(min_length=1, max_length=4096, description="Path in the container.")
    read_only: bool = Field(default=False, description="Mount read-only.")
    sub_path: str | None = Field(default=None, max_length=4096, description="Sub-path to mount.")


class PodTemplateOverrides(ApiModel):
    """Additions to the pods the operator renders; the operator's own fields always win."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=STRING_MAP, description="Extra nodeSelector."
    )
    tolerations: list[FreeForm] = Field(
        default_factory=list, max_length=MAX_LIST_ITEMS, description="core/v1 Tolerations."
    )
    affinity: FreeForm | None = Field(default=None, description="A core/v1 Affinity.")
    priority_class_name: str | None = Field(
        default=None, max_length=MAX_NAME_LENGTH, description="PriorityClass of the pods."
    )
    service_account_name: str | None = Field(
        default=None, max_length=MAX_NAME_LENGTH, description="ServiceAccount the pods run as."
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"items": {"type": "string", "maxLength": MAX_NAME_LENGTH}},
        description="Names of Secrets used to pull the image.",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        json_schema_extra=validations(ENV_RULE),
        description="Extra environment variables (not the allocator's: see memoryPolicy).",
    )
    volumes: list[Volume] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description="Extra core/v1 Volumes; each name a DNS-1123 label.",
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=MAX_LIST_ITEMS, description="Mounts of extra volumes."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=STRING_MAP, description="Pod annotations."
    )
    labels: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=STRING_MAP, description="Extra pod labels."
    )

    @model_validator(mode="after")
    def _check_env(self) -> PodTemplateOverrides:
        if any(env.name in RESERVED_ENV for env in self.env):
            raise ValueError(ENV_RULE["message"])
        return self
