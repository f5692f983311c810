"""A Git-driven install on the real control plane: the chart rendered to manifests (CRDs first)
applied with `kubectl apply --server-side` as Argo CD and Flux do, a CRD upgrade applied the
same way, a pruned LLMServer leaving nothing behind, and no drift after the operator reconciled:
a server-side dry-run apply of every example reports no change (Argo CD's server-side diff)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver
from harness.operator_process import CRD_PATH, OperatorProcess
from harness.tools import REPO, tool
from tests.integration import operator_fixture
from tests.integration.operator_fixture import get_server, wait_ready

llmserver_crd = operator_fixture.llmserver_crd
operator = operator_fixture.operator

CHART = REPO / "charts" / "pagekeeper"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
MANAGER = "gitops"  # the field manager a GitOps controller applies as
ENV_PATTERN = "^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# What an LLMServer owns, by kind: none may survive its prune.
OWNED = "deployments,replicasets,pods,services,poddisruptionbudgets,horizontalpodautoscalers"


def server_side_apply(
    cluster: Cluster, namespace: str, text: str, *extra: str, manager: str = MANAGER
) -> str:
    result = cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", f"--field-manager={manager}",
        "-n", namespace, *extra, "-f", "-", input=text,
    )  # fmt: skip
    return result.stdout


def rendered(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    """`helm template --include-crds`, what a GitOps repository would hold."""
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]
    proc = subprocess.run(
        [
            tool("helm"), "template", namespace, str(CHART), "--include-crds",
            "--namespace", namespace, "--kube-version", version["gitVersion"],
        ],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def _older(crd: dict[str, Any]) -> dict[str, Any]:
    """The LLMServer CRD as before the env-name rule and the Reconciling/Stalled columns."""
    old = json.loads(json.dumps(crd))
    version = old["spec"]["versions"][0]
    columns = version["additionalPrinterColumns"]
    version["additionalPrinterColumns"] = [
        c for c in columns if c["name"] not in {"Reconciling", "Stalled"}
    ]
    pod = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["podTemplate"]
    del pod["properties"]["env"]["items"]["properties"]["name"]["pattern"]
    return old


def _env_refused(cluster: Cluster, namespace: str) -> bool:
    spec = {"model": {"source": "/models/m"}, "podTemplate": {"env": [{"name": "A=B"}]}}
    result = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-n", namespace, "-f", "-",
        input=yaml.safe_dump(llmserver("env", spec)), check=False,
    )  # fmt: skip
    return result.returncode != 0 and "spec.podTemplate.env[0].name" in result.stderr


def test_rendered_manifests_install_and_upgrade_the_crd_server_side(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    docs = rendered(cluster, namespace)
    kinds = [d["kind"] for d in docs]
    num_crds = kinds.count("CustomResourceDefinition")
    assert num_crds == 3 and kinds[:num_crds] == ["CustomResourceDefinition"] * num_crds
    (crd,) = [d for d in docs if d["metadata"]["name"] == "llmservers.pagekeeper.dev"]
    assert crd["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"] == "-1"

    # An older CRD, then the rendered one over it: the upgrade a GitOps sync applies. The older
    # one goes in under the manager of the session's CRD, so the fields it lacks are removed.
    server_side_apply(cluster, namespace, yaml.safe_dump(_older(crd)), manager="kubectl")
    cluster.wait_established(crd["metadata"]["name"])
    assert not _env_refused(cluster, namespace)
    cluster_scoped = [d for d in docs if d["kind"].startswith("Cluster")]
    try:
        server_side_apply(cluster, namespace, yaml.safe_dump_all(docs))
        cluster.wait_established(crd["metadata"]["name"])
        assert _env_refused(cluster, namespace)
        stored = json.loads(
            cluster.kubectl("get", "crd", crd["metadata"]["name"], "-o", "json").stdout
        )
        columns = [c["name"] for c in stored["spec"]["versions"][0]["additionalPrinterColumns"]]
        assert {"Reconciling", "Stalled"} <= set(columns)
        # The operator's Deployment from the rendered manifests becomes available (KWOK nodes).
        apps = client.AppsV1Api(cluster.api)
        (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
        wait_for(
            lambda: (
                (
                    apps.read_namespaced_deployment(
                        deployment["metadata"]["name"], namespace
                    ).status.available_replicas
                )
                == 1
            ),
            timeout=120,
            what="the operator Deployment available",
        )
        # A second sync of the same manifests would change nothing.
        diff = cluster.kubectl(
            "diff", "--server-side", "--force-conflicts", f"--field-manager={MANAGER}",
            "-n", namespace, "-f", "-", input=yaml.safe_dump_all(docs), check=False,
        )  # fmt: skip
        assert diff.returncode == 0, diff.stdout + diff.stderr
    finally:
        for doc in cluster_scoped:
            cluster.kubectl(
                "delete", doc["kind"].lower(), doc["metadata"]["name"], "--ignore-not-found",
                "--wait=false",
            )  # fmt: skip
        # Leave the session's CRD as the repository has it.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))


def test_a_pruned_llmserver_leaves_no_orphans(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    spec = {
        "model": {"source": "/models/qwen3-0.6b"},
        "replicas": 2,
        "resources": {"gpus": 1, "requests": {"cpu": "100m", "memory": "1Gi"}},
    }
    server_side_apply(cluster, namespace, yaml.safe_dump(llmserver("pruned", spec)))
    wait_ready(cluster, namespace, "pruned", 2)
    selector = "pagekeeper.dev/llmserver=pruned"

    def owned() -> list[str]:
        out = cluster.kubectl("get", OWNED, "-n", namespace, "-l", selector, "-o", "name")
        return out.stdout.split()

    before = owned()
    assert {name.split("/")[0] for name in before} >= {
        "deployment.apps",
        "replicaset.apps",
        "pod",
        "service",
        "poddisruptionbudget.policy",
    }
    # What a prune does: delete the object Git no longer has (foreground, as Argo CD's default).
    cluster.kubectl(
        "delete", "llmserver", "pruned", "-n", namespace, "--cascade=foreground", "--timeout=120s"
    )
    wait_for(lambda: owned() == [], timeout=120, what="no object of the pruned LLMServer left")


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_no_drift_after_the_operator_reconciled(
    cluster: Cluster, namespace: str, operator: OperatorProcess, path: Path
) -> None:
    text = path.read_text()
    name = yaml.safe_load(text)["metadata"]["name"]
    server_side_apply(cluster, namespace, text)

    def reconciled() -> dict[str, Any] | None:
        obj = get_server(cluster, namespace, name)
        status = obj.get("status", {})
        is_current = status.get("observedGeneration") == obj["metadata"]["generation"]
        return obj if is_current and status.get("conditions") else None

    before = wait_for(reconciled, timeout=120, what=f"{name} reconciled, status written")
    diff = cluster.kubectl(
        "diff", "--server-side", "--force-conflicts", f"--field-manager={MANAGER}",
        "-n", namespace, "-f", "-", input=text, check=False,
    )  # fmt: skip
    assert diff.returncode == 0, diff.stdout + diff.stderr
    after = get_server(cluster, namespace, name)
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"] == before["spec"]
