"""The status write (pure): the merge patch of the status fields the operator owns, so a status
that did not change writes nothing and remediation's fields (`remediationHistory`,
`lastRemediation`, `lastOutOfMemory`) are never written back from an older read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.status import LLMServerStatus

# Status fields `conditions.compute_status` computes; the others belong to remediation.
OWNED_FIELDS = (
    "observedGeneration",
    "conditions",
    "replicas",
    "readyReplicas",
    "updatedReplicas",
    "selector",
    "desiredReplicas",
    "autoscaling",
    "effectiveMemoryPolicy",
    "specMemoryPolicyHash",
    "policyHash",
    "triggers",
    "canary",
    "memoryPlan",
    "recommendations",
    "tuning",
)


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch turning `old` into `new` (None deletes a key); {} when equal."""
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif value != before or key not in old:
            patch[key] = value
    return patch


def status_patch(server: LLMServer, new: LLMServerStatus) -> dict[str, Any]:
    """The merge patch of the operator-owned status fields; {} when nothing changed."""
    before = {k: v for k, v in server.status.to_api().items() if k in OWNED_FIELDS}
    after = {k: v for k, v in new.to_api().items() if k in OWNED_FIELDS}
    return merge_patch(before, after)
