"""The generated CRD: structural, documented, up to date, with the CEL rules and columns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagekeeper_operator import crdgen
from pagekeeper_operator.api.autoscaling import MIN_MAX_RULE, TARGET_RULE
from pagekeeper_operator.api.gateway import (
    DISTINCT_PORTS_RULE,
    PORT_RULE,
    PREFIX_CACHE_RULE,
    REPLAY_PORT_RULE,
)
from pagekeeper_operator.api.lifecycle import BOUNDS_RULE as AGE_BOUNDS_RULE
from pagekeeper_operator.api.lifecycle import FORMAT_RULE as AGE_FORMAT_RULE
from pagekeeper_operator.api.pod import VOLUME_NAME_SCHEMA
from pagekeeper_operator.api.policy import (
    BATCHED_TOKENS_RULE,
    BUDGETS_RULE,
    KV_CACHE_MEMORY_RULE,
    KV_OFFLOAD_BACKEND_RULE,
    KV_OFFLOAD_PREFIX_RULE,
    KV_OFFLOAD_SIZE_RULE,
    NUM_SEQS_RULE,
    SPLIT_SIZE_RULE,
)
from pagekeeper_operator.api.spec_rules import (
    ADAPTIVE_FLOOR_RULE,
    AUTOSCALING_CANARY_RULE,
    BLOCK_SIZE_RULE,
    CANARY_CAPACITY_RULE,
    CANARY_RULE,
    DRAIN_RULE,
    GPU_RULE,
    OFFLOAD_MEMORY_RULE,
    PYTHONPATH_RULE,
    SWAP_RULE,
    TRIGGER_RULES,
)
from pagekeeper_operator.api.tuning import (
    APPLY_RULE,
    BOUNDS_RULES,
    ITL_RULE,
    SECONDARY_RULES,
    TTFT_RULE,
)


def _schemas(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its dotted path."""
    if not isinstance(node, dict):
        return
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _schemas(sub, f"{path}.{name}")
    if "items" in node:
        yield from _schemas(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _schemas(node["additionalProperties"], f"{path}{{}}")


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return crdgen.build_crd()


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_files_on_disk_are_current() -> None:
    for path in crdgen.OUTPUTS:
        assert path.read_text() == crdgen.render_text(), f"{path} is stale: run crdgen --write"
    assert crdgen.main(["--check"]) == 0


def test_check_reports_a_stale_file_with_a_diff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "crds" / "llmservers.pagekeeper.dev.yaml"
    stale.parent.mkdir()
    stale.write_text(
        crdgen.render_text().replace("shortNames:\n    - llms", "shortNames:\n    - x")
    )
    monkeypatch.setattr(crdgen, "REPO", tmp_path)
    monkeypatch.setattr(crdgen, "OUTPUTS", (stale,))
    assert crdgen.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "-    - x\n" in out and "+    - llms\n" in out
    assert crdgen.main(["--write"]) == 0
    assert crdgen.main(["--check"]) == 0


def test_names_scope_and_subresources(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "llmservers.pagekeeper.dev"
    assert spec["group"] == "pagekeeper.dev" and spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "LLMServer",
        "listKind": "LLMServerList",
        "plural": "llmservers",
        "singular": "llmserver",
        "shortNames": ["llms"],
        "categories": ["pagekeeper"],
    }
    version = spec["versions"][0]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = {c["name"]: (c["type"], c["jsonPath"]) for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Ready": ("integer", ".status.readyReplicas"),
        "Current": ("integer", ".status.replicas"),
        "Desired": ("integer", ".status.desiredReplicas"),
        "Reconciling": ("string", '.status.conditions[?(@.type=="Reconciling")].status'),
        "Stalled": ("string", '.status.conditions[?(@.type=="Stalled")].status'),
        "Runtime": ("string", ".spec.runtime"),
        "GPU-Util": ("number", ".status.effectiveMemoryPolicy.gpuMemoryUtilization"),
        "Fits": ("string", ".status.memoryPlan.state"),
        "Last-Scale": ("string", ".status.autoscaling.lastScaleReason"),
        "Recommendation": ("string", ".status.recommendations[0].field"),
        "Last-Remediation": ("date", ".status.lastRemediation"),
        "Oldest-Pod": ("date", ".status.lifecycle.oldestPodCreatedAt"),
        "Age": ("date", ".metadata.creationTimestamp"),
    }


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    for path, node in _schemas(schema):
        assert "$ref" not in node and "title" not in node and "$defs" not in node, path
        assert node.get("type") != "null", path
        if "anyOf" in node:  # only the int-or-string form the API server allows
            assert node["x-kubernetes-int-or-string"] is True, path
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert node.get("type") in {
                "object",
                "array",
                "string",
                "integer",
                "number",
                "boolean",
            }, path
        if node.get("type") == "object" and "properties" not in node:
            assert (
                "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields") is True
                or path == ".metadata"
            ), path
        assert node.get("additionalProperties") is not True, path


def test_every_field_is_documented(schema: dict[str, Any]) -> None:
    undocumented = [
        path
        for path, node in _schemas(schema)
        if path.startswith((".spec.", ".status."))
        and not path.endswith(("[]", "{}"))
        and not node.get("description")
    ]
    assert undocumented == []


def test_policy_fields_carry_bounds_defaults_and_nullability(schema: dict[str, Any]) -> None:
    policy = schema["properties"]["spec"]["properties"]["memoryPolicy"]
    props = policy["properties"]
    assert policy["default"] == {
        "blockSize": 16,
        "maxNumBatchedTokens": 8192,
        "maxNumSeqs": 256,
        "swapSpaceGiB": 0.0,
        "enableChunkedPrefill": True,
        "enablePrefixCaching": True,
        "prefixCacheMaxFraction": 0.5,
        "fragmentationBuffer": "auto",
        "kvCacheDtype": "auto",
        "allocator": {"expandableSegments": True},
    }
    util = props["gpuMemoryUtilization"]
    assert (
        util["type"],
        util["nullable"],
        util["minimum"],
        util["exclusiveMinimum"],
        util["maximum"],
    ) == ("number", True, 0.0, True, 0.99)
    # No schema default: kvCacheMemory excludes it, and 0.9 applies when neither is set.
    assert "exclusiveMaximum" not in util and "default" not in util
    assert props["kvCacheMemory"]["x-kubernetes-int-or-string"] is True
    weights = props["weights"]["properties"]
    assert weights["quantization"]["enum"] == ["none", "fp8"]
    assert (weights["cpuOffloadGiB"]["minimum"], weights["cpuOffloadGiB"]["default"]) == (0.0, 0.0)
    assert props["blockSize"]["enum"] == [8, 16, 32]
    assert props["maxModelLen"]["nullable"] is True and "default" not in props["maxModelLen"]
    assert (
        props["fragmentationBuffer"]["pattern"]
        == r"^(auto|[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?)$"
    )
    gc = props["allocator"]["properties"]["garbageCollectionThreshold"]
    assert (
        gc["minimum"],
        gc["exclusiveMinimum"],
        gc["maximum"],
        gc["exclusiveMaximum"],
        gc["nullable"],
    ) == (0.0, True, 1.0, True, True)


def test_cel_rules_sit_where_their_fields_are(schema: dict[str, Any]) -> None:
    spec = schema["properties"]["spec"]
    policy = spec["properties"]["memoryPolicy"]
    allocator = policy["properties"]["allocator"]
    assert spec["x-kubernetes-validations"] == [
        SWAP_RULE,
        KV_OFFLOAD_BACKEND_RULE,
        BLOCK_SIZE_RULE,
        ADAPTIVE_FLOOR_RULE,
        OFFLOAD_MEMORY_RULE,
        DRAIN_RULE,
        GPU_RULE,
        CANARY_RULE,
        CANARY_CAPACITY_RULE,
        AUTOSCALING_CANARY_RULE,
        PYTHONPATH_RULE,
        PREFIX_CACHE_RULE,
        *TRIGGER_RULES,
        *BOUNDS_RULES,
        APPLY_RULE,
    ]
    assert spec["properties"]["tuning"]["x-kubernetes-validations"] == [
        TTFT_RULE,
        ITL_RULE,
        *SECONDARY_RULES,
    ]
    assert policy["x-kubernetes-validations"] == [
        BATCHED_TOKENS_RULE,
        NUM_SEQS_RULE,
        BUDGETS_RULE,
        KV_CACHE_MEMORY_RULE,
        KV_OFFLOAD_PREFIX_RULE,
    ]
    kv_offload = policy["properties"]["kvOffload"]
    assert kv_offload["x-kubernetes-validations"] == [KV_OFFLOAD_SIZE_RULE]
    assert allocator["x-kubernetes-validations"] == [SPLIT_SIZE_RULE]
    autoscaling = spec["properties"]["autoscaling"]
    assert autoscaling["x-kubernetes-validations"] == [MIN_MAX_RULE]
    assert autoscaling["properties"]["targets"]["x-kubernetes-validations"] == [TARGET_RULE]
    lifecycle = spec["properties"]["lifecycle"]
    assert lifecycle["x-kubernetes-validations"] == [AGE_FORMAT_RULE, AGE_BOUNDS_RULE]
    kv_events = spec["properties"]["gateway"]["properties"]["kvEvents"]
    assert kv_events["x-kubernetes-validations"] == [
        PORT_RULE,
        REPLAY_PORT_RULE,
        DISTINCT_PORTS_RULE,
    ]
    env = spec["properties"]["podTemplate"]["properties"]["env"]
    assert env["maxItems"] == 64 and env["items"]["properties"]["name"]["maxLength"] == 253
    rules = [
        (path, rule)
        for path, node in _schemas(schema)
        for rule in node.get("x-kubernetes-validations", [])
    ]
    assert len(rules) == 31 + len(TRIGGER_RULES) + len(BOUNDS_RULES) + len(SECONDARY_RULES)
    for path, rule in rules:
        assert rule["message"].startswith("spec."), (path, rule)
        assert path.startswith(".spec"), "status is the operator's; no CEL there"


def test_free_form_objects_preserve_unknown_fields(schema: dict[str, Any]) -> None:
    pod = schema["properties"]["spec"]["properties"]["podTemplate"]["properties"]
    assert pod["affinity"] == {
        "type": "object",
        "description": "A core/v1 Affinity.",
        "nullable": True,
        "x-kubernetes-preserve-unknown-fields": True,
    }
    # A volume stays opaque but for its name, which the pod's validation would refuse.
    assert pod["volumes"]["items"] == {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "required": ["name"],
        "properties": {
            "name": {
                "type": "string",
                "description": VOLUME_NAME_SCHEMA["description"],
                "minLength": 1,
                "maxLength": 63,
                "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
            }
        },
    }
    preserved = [
        path for path, node in _schemas(schema) if node.get("x-kubernetes-preserve-unknown-fields")
    ]
    assert preserved == [
        ".spec.podTemplate.tolerations[]",
        ".spec.podTemplate.affinity",
        ".spec.podTemplate.env[].valueFrom",
        ".spec.podTemplate.volumes[]",
    ]


def test_generated_text_round_trips(crd: dict[str, Any]) -> None:
    text = crdgen.render_text()
    assert text.startswith("# Generated by `python -m pagekeeper_operator.crdgen --write`")
    assert yaml.safe_load(text) == crd
