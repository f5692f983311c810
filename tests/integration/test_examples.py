"""Every manifest in examples/ is accepted by the real API server, and so is what it renders to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.cluster import Cluster
from harness.tools import REPO
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render import ClusterFeatures, render_all
from pagekeeper_operator.settings import OperatorSettings
from tests.integration import operator_fixture

llmserver_crd = operator_fixture.llmserver_crd

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# What each example is for: a small model, an 8B model on one GPU, a 70B model over four GPUs
# (upstream vLLM, FP8 KV), upstream vLLM, replicas behind an inference gateway, and replicas
# an autoscaler owns. (name, runtime, GPUs per pod)
EXPECTED = {
    "llmserver-autoscaling.yaml": ("qwen3-8b-autoscaled", "pagekeeper", 1),
    "llmserver-small.yaml": ("qwen3-0-6b", "pagekeeper", 1),
    "llmserver-8b.yaml": ("llama-3-1-8b", "pagekeeper", 1),
    "llmserver-70b-tp4.yaml": ("llama-3-1-70b", "vllm", 4),
    "llmserver-vllm.yaml": ("qwen3-8b-vllm", "vllm", 1),
    "llmserver-gateway.yaml": ("qwen3-8b-pool", "pagekeeper", 1),
}


def _dry_run(cluster: Cluster, namespace: str, docs: list[dict[str, Any]]) -> Any:
    """Server-side apply with --dry-run=server; returns the objects as the server would store
    them and kubectl's stderr (admission warnings land there)."""
    result = cluster.kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "-n",
        namespace,
        "-o",
        "json",
        "-f",
        "-",
        input=yaml.safe_dump_all(docs, sort_keys=False),
    )
    out = json.loads(result.stdout)
    items = out["items"] if out.get("kind") == "List" else [out]
    return items, result.stderr


def test_the_examples_are_the_ones_documented() -> None:
    assert [path.name for path in EXAMPLES] == sorted(EXPECTED)


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example_is_accepted_by_the_api_server(
    cluster: Cluster, namespace: str, llmserver_crd: Path, path: Path
) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert len(docs) == 1, f"{path.name} holds one LLMServer"
    doc = docs[0]
    name, runtime, num_gpus = EXPECTED[path.name]

    # The operator's own model takes it as it is (the CRD is generated from that model).
    server = LLMServer.from_body({**doc, "metadata": {**doc["metadata"], "namespace": namespace}})
    assert (server.metadata.name, server.spec.runtime, server.spec.num_gpus) == (
        name,
        runtime,
        num_gpus,
    )

    items, _ = _dry_run(cluster, namespace, docs)
    assert len(items) == 1
    stored = items[0]
    assert stored["kind"] == "LLMServer"
    assert stored["metadata"]["name"] == name
    assert stored["metadata"]["namespace"] == namespace
    # Nothing the example says was pruned by the structural schema.
    for key, value in doc["spec"].items():
        assert _contains(stored["spec"][key], value), f"spec.{key} changed on the server"


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_what_an_example_renders_to_is_accepted(
    cluster: Cluster, namespace: str, llmserver_crd: Path, path: Path
) -> None:
    """The Deployment, Service, PodDisruptionBudget, ServiceMonitor and PrometheusRule (and the
    HorizontalPodAutoscaler of an autoscaled server) the operator would create pass the API
    server's validation and PodSecurity `restricted`."""
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    doc = yaml.safe_load(path.read_text())
    items, _ = _dry_run(cluster, namespace, [doc])
    # The dry run assigns the uid the owner references need.
    server = LLMServer.from_body(items[0])
    images = OperatorSettings().default_images
    rendered = render_all(server, images, ClusterFeatures(True, True))
    autoscaler = ["HorizontalPodAutoscaler"] if server.spec.is_autoscaled else []
    assert [obj["kind"] for obj in rendered] == [
        "Service",
        "PodDisruptionBudget",
        "Deployment",
        *autoscaler,
        "ServiceMonitor",
        "PrometheusRule",
    ]
    children, stderr = _dry_run(cluster, namespace, rendered)
    assert [obj["kind"] for obj in children] == [obj["kind"] for obj in rendered]
    assert "PodSecurity" not in stderr, stderr
    deployment = children[2]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    if server.spec.runtime == "vllm":
        assert command[:3] == ["python3", "-m", "pagekeeper_vllm.launch"]
        command = command[command.index("--") + 1 :]
    program = "pagekeeper-engine" if server.spec.runtime == "pagekeeper" else "vllm"
    assert command[:3] == [program, "serve", server.spec.model.source]
    assert container["image"] == (server.spec.image or images[server.spec.runtime])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(server.spec.num_gpus)


def _contains(have: Any, want: Any) -> bool:
    """Whether `have` holds everything in `want` (the server may add defaults)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            key in have and _contains(have[key], value) for key, value in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(have) == len(want)
            and all(_contains(h, w) for h, w in zip(have, want, strict=True))
        )
    if isinstance(want, float) or isinstance(have, float):
        return isinstance(have, int | float) and float(have) == float(want)
    return bool(have == want)
