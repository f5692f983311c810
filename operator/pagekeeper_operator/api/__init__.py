"""The LLMServer API (pagekeeper.dev/v1alpha1): the pydantic models the CRD is generated from."""

from pagekeeper_operator.api.llmserver import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    LLMServer,
    LLMServerSpec,
)
from pagekeeper_operator.api.policy import AllocatorPolicy, MemoryPolicy
from pagekeeper_operator.api.status import Condition, LLMServerStatus

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "AllocatorPolicy",
    "Condition",
    "LLMServer",
    "LLMServerSpec",
    "LLMServerStatus",
    "MemoryPolicy",
]
