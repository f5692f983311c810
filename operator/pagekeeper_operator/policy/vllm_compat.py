"""What a vLLM pod honours of its LLMServer (pure): the policy fields its vLLM version ignores,
and whether pagekeeper's plugin loads. Both become conditions under runtime vllm.

- PolicyHonored: False (IgnoredByRuntime) when the image's vLLM version is known to ignore a
  field the spec sets (spec.gateway.kvEvents among them), or predates the version whose parser
  pagekeeper checked a field's flag against (`FLAG_FIELDS`: its parser may refuse the flag, and
  the pod would not start);
  Unknown (RuntimeVersionUnknown) when such a field is set and the image tag names no
  version; True otherwise.
- PluginLoaded: False (ExcludedByVLLMPlugins) when the container's VLLM_PLUGINS leaves out
  pagekeeper's plugin, so the allocator and OOM series (and their alerts) are missing; Unknown
  when VLLM_PLUGINS comes from a Secret or ConfigMap; True otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.runtime import VLLM_PLUGIN_NAME, VLLM_PLUGINS_ENV
from pagekeeper_operator.api.status import ConditionStatus

Version = tuple[int, int, int]
Verdict = tuple[str, ConditionStatus, str, str]  # (type, status, reason, message)

POLICY_HONORED = "PolicyHonored"
PLUGIN_LOADED = "PluginLoaded"
_TAG_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-+.].*)?$")


@dataclass(frozen=True)
class IgnoredField:
    """A policy setting that vLLM before `honored_from` accepts on its command line and drops."""

    field: str
    is_set: Callable[[MemoryPolicy], bool]
    honored_from: Version
    why: str
    effect: str = "ignores"  # what a version before `honored_from` does with it


# vLLM's parser has --kv-offloading-size and --kv-offloading-backend from 0.11.1 (its
# arg_utils.py; 0.11.0's parser refuses them, 0.33.0's takes them: tests/vllm/test_real_vllm.py).
# Before it the flags are left out of the command, so the pod starts without the tier.
KV_OFFLOAD_FROM: Version = (0, 11, 1)
IGNORED_FIELDS: tuple[IgnoredField, ...] = (
    IgnoredField(
        "spec.memoryPolicy.enableChunkedPrefill: false",
        lambda policy: not policy.enable_chunked_prefill,
        (0, 11, 1),
        "its V1 engine turns chunked prefill back on for generative models",
    ),
    IgnoredField(
        "spec.memoryPolicy.kvOffload",
        lambda policy: policy.kv_offload is not None,
        KV_OFFLOAD_FROM,
        "its parser has no --kv-offloading-size, so the operator leaves the flags out and the "
        "pods run without a host KV tier",
    ),
)


# The flags of byte budgets and weight memory: vLLM 0.11.0's and 0.33.0's parsers accept them
# (tests/vllm/test_real_vllm.py), and no older parser is checked.
CHECKED_FROM: Version = (0, 11, 0)
FLAG_FIELDS: tuple[IgnoredField, ...] = (
    IgnoredField(
        "spec.memoryPolicy.kvCacheMemory",
        lambda policy: policy.kv_cache_memory is not None,
        CHECKED_FROM,
        "pagekeeper checks --kv-cache-memory-bytes against vLLM 0.11.0 and later only",
        "may refuse",
    ),
    IgnoredField(
        "spec.memoryPolicy.weights.quantization: fp8",
        lambda policy: policy.weight_policy.quantization == "fp8",
        CHECKED_FROM,
        "pagekeeper checks --quantization fp8 against vLLM 0.11.0 and later only",
        "may refuse",
    ),
    IgnoredField(
        "spec.memoryPolicy.weights.cpuOffloadGiB",
        lambda policy: policy.weight_policy.cpu_offload_gib > 0,
        CHECKED_FROM,
        "pagekeeper checks --cpu-offload-gb against vLLM 0.11.0 and later only",
        "may refuse",
    ),
)


# --kv-events-config: vLLM 0.11.0's and 0.33.0's parsers take it and its JSON fields
# (tests/vllm/test_real_vllm.py); no older parser is checked, so before 0.11.0 the operator leaves
# the flag and its ports out and the pods start without events.
KV_EVENTS_FROM: Version = CHECKED_FROM
KV_EVENTS_FIELD = IgnoredField(
    "spec.gateway.kvEvents",
    lambda policy: True,  # set or not is the spec's, outside the policy: `policy_verdict`
    KV_EVENTS_FROM,
    "pagekeeper checks --kv-events-config against vLLM 0.11.0 and later only, so the operator "
    "leaves it out and the pods publish no KV events",
)


def image_version(image: str) -> Version | None:
    """The version an image's tag names (`vllm/vllm-openai:v0.11.0` -> (0, 11, 0)); None for a
    digest, `latest` or any other tag."""
    if "@" in image:
        return None
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return None
    match = _TAG_VERSION.match(tag)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def has_kv_offload_flags(image: str) -> bool:
    """Whether the vLLM of `image` parses --kv-offloading-size and --kv-offloading-backend:
    from 0.11.1, and assumed where the tag names no version (the newest have them)."""
    version = image_version(image)
    return version is None or version >= KV_OFFLOAD_FROM


def has_kv_events_flag(image: str) -> bool:
    """Whether the operator renders --kv-events-config for the vLLM of `image`: from
    `KV_EVENTS_FROM`, and where the tag names no version (the newest have it)."""
    version = image_version(image)
    return version is None or version >= KV_EVENTS_FROM


def _text(version: Version) -> str:
    return ".".join(map(str, version))


def policy_verdict(policy: MemoryPolicy, image: str, *, has_kv_events: bool = False) -> Verdict:
    """PolicyHonored for a vLLM pod of `image` running `policy`, with spec.gateway.kvEvents
    enabled where `has_kv_events`."""
    version = image_version(image)
    ignored, unknown = [], []
    entries = (*IGNORED_FIELDS, *FLAG_FIELDS, *((KV_EVENTS_FIELD,) if has_kv_events else ()))
    for entry in entries:
        if not entry.is_set(policy):
            continue
        if version is None:
            unknown.append(entry)
        elif version < entry.honored_from:
            ignored.append(
                f"vLLM {_text(version)} {entry.effect} {entry.field} ({entry.why}); vLLM "
                f"{_text(entry.honored_from)} and later honour it"
            )
    if ignored:
        return POLICY_HONORED, "False", "IgnoredByRuntime", "; ".join(ignored)
    if unknown:
        fields = ", ".join(e.field for e in unknown)
        return (
            POLICY_HONORED,
            "Unknown",
            "RuntimeVersionUnknown",
            f"the tag of {image} names no vLLM version, and versions before "
            f"{_text(min(e.honored_from for e in unknown))} ignore {fields}",
        )
    return POLICY_HONORED, "True", "AllFieldsHonored", f"{image} honours every memoryPolicy field"


def plugin_verdict(server: LLMServer) -> Verdict:
    """PluginLoaded, from the VLLM_PLUGINS of spec.podTemplate.env."""
    is_set, value = server.spec.vllm_plugins
    if not is_set:
        return PLUGIN_LOADED, "True", "Loaded", "vLLM loads every installed plugin"
    if value is None:
        return (
            PLUGIN_LOADED,
            "Unknown",
            "VLLMPluginsFromSource",
            f"{VLLM_PLUGINS_ENV} comes from a Secret or ConfigMap: include "
            f"{VLLM_PLUGIN_NAME!r} in it to keep the allocator series and their alerts",
        )
    if server.spec.has_vllm_plugin:
        return PLUGIN_LOADED, "True", "Loaded", f"{VLLM_PLUGINS_ENV}={value} includes it"
    return (
        PLUGIN_LOADED,
        "False",
        "ExcludedByVLLMPlugins",
        f"{VLLM_PLUGINS_ENV}={value!r} leaves out {VLLM_PLUGIN_NAME!r}: vLLM's processes export "
        "no allocator or OOM series, so the fragmentation and oomEvents alerts are not rendered; "
        f"add {VLLM_PLUGIN_NAME} to the comma-separated list",
    )
