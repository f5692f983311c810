"""`LLMServer.spec.podTemplate`: additions to the rendered pods (env, volumes, scheduling)."""

from __future__ import annotations

from pydantic import Field, model_validator

from pagekeeper_operator.api.types import (
    MAX_LIST_ITEMS,
    MAX_NAME_LENGTH,
    STRING_MAP,
    ApiModel,
    FreeForm,
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


class EnvVar(ApiModel):
    """An extra environment variable for the engine container."""

    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, description="Variable name.")
    value: str | None = Field(default=None, max_length=32768, description="Literal value.")
    value_from: FreeForm | None = Field(
        default=None, description="A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, ...)."
    )


class VolumeMount(ApiModel):
    """Where an extra volume appears in the engine container."""

    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, description="Volume name.")
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
    volumes: list[FreeForm] = Field(
        default_factory=list, max_length=MAX_LIST_ITEMS, description="Extra core/v1 Volumes."
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
