"""The Helm chart (charts/pagekeeper) against the real control plane: lint, a server-side dry
run of everything it renders, install / upgrade / uninstall, the values schema, and the
operator itself running with the Deployment's own command line under the chart's RBAC."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver
from harness.tools import REPO, tool
from pagekeeper_engine.frontend.metric_names import METRICS
from pagekeeper_operator.api.runtime import RUNTIMES, exports
from pagekeeper_operator.render import render_deployment
from pagekeeper_operator.render.meta import HTTP_PORT, METRICS_PORT
from tests.integration.operator_fixture import wait_ready
from tests.operator.servers import DEFAULT_IMAGES, make_server

CHART = REPO / "charts" / "pagekeeper"
CHART_CRDS = sorted((CHART / "crds").glob("*.yaml"))
# The operator image's entrypoint (Dockerfile target `operator`).
ENTRYPOINT = ["kopf", "run", "--module", "pagekeeper_operator.main"]

# The rules every namespace the operator serves needs (docs/operator.md explains each verb).
NAMESPACED_RULES = [
    {"apiGroups": ["pagekeeper.dev"], "resources": ["llmservers"],
     "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["pagekeeper.dev"], "resources": ["llmservers/status"], "verbs": ["patch"]},
    {"apiGroups": ["pagekeeper.dev"], "resources": ["llmservers/finalizers"], "verbs": ["update"]},
    {"apiGroups": ["apps"], "resources": ["deployments"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["monitoring.coreos.com"], "resources": ["servicemonitors", "prometheusrules"],
     "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
]  # fmt: skip
CRD_RULE = {
    "apiGroups": ["apiextensions.k8s.io"],
    "resources": ["customresourcedefinitions"],
    "verbs": ["get", "list", "watch"],
}
NAMESPACES_RULE = {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}
NODES_RULE = {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}


def _peering_rule(resource: str) -> dict[str, Any]:
    return {"apiGroups": ["kopf.dev"], "resources": [resource], "verbs": ["list", "watch", "patch"]}


def helm(cluster: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [tool("helm"), "--kubeconfig", cluster.kubeconfig, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def chart_crds(cluster: Cluster) -> list[Path]:
    """The chart's CRDs (LLMServer, kopf peering), as `helm install` would put them first."""
    for path in CHART_CRDS:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    for path in CHART_CRDS:
        cluster.wait_established(yaml.safe_load(path.read_text())["metadata"]["name"])
    return CHART_CRDS


@pytest.fixture(scope="module")
def kube_version(cluster: Cluster) -> str:
    """`helm template` renders for this version (the chart requires >= 1.29)."""
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    return str(version["serverVersion"]["gitVersion"])


@pytest.fixture
def other_namespace(cluster: Cluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def render(
    cluster: Cluster, kube_version: str, namespace: str, *options: str
) -> list[dict[str, Any]]:
    out = helm(
        cluster, "template", "pk", str(CHART), "-n", namespace, "--kube-version", kube_version,
        *options,
    ).stdout  # fmt: skip
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def container_of(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return dict(containers[0])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def cksum(text: str) -> int:
    """POSIX `cksum` of a string: how each peering replica derives its kopf priority."""
    data = text.encode()
    crc = 0
    for byte in data + len(data).to_bytes(8, "big").lstrip(b"\0"):
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7 if crc & 0x80000000 else crc << 1) & 0xFFFFFFFF
    return crc ^ 0xFFFFFFFF


def test_lint_strict(cluster: Cluster) -> None:
    for options in ([], ["--set", "replicas=3", "--set", "watchNamespaces={a,b}"]):
        result = helm(cluster, "lint", "--strict", str(CHART), *options)
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout, result.stdout


DEFAULT_KINDS = [
    "ServiceAccount", "Secret", "ClusterRole", "ClusterRoleBinding", "Service", "Deployment",
]  # fmt: skip
FULL_OPTIONS = [
    "--is-upgrade", "--set", "replicas=2", "--set", "crds.upgrade=true",
    "--set", "dashboards.enabled=true", "--set", "metrics.enabled=true",
    "--set", "metrics.serviceMonitor.enabled=true", "--set", "adapterRules.enabled=true",
    "--set", "operator.prometheusUrl=http://prometheus-operated.monitoring.svc:9090",
]  # fmt: skip
FULL_KINDS = [
    "ServiceAccount", "Secret", "ConfigMap", "ConfigMap", "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding", "Role", "Role", "RoleBinding", "RoleBinding", "Service", "Deployment",
    "KopfPeering", "KopfPeering", "ServiceMonitor",
]  # fmt: skip


def namespaces_peer(*namespaces: str) -> dict[str, Any]:
    """A NetworkPolicy peer: every pod of these namespaces."""
    expression = {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [*namespaces]}
    return {"namespaceSelector": {"matchExpressions": [expression]}}


ALERTMANAGER_PODS = {"app.kubernetes.io/name": "alertmanager"}


def check_network_policies(
    policies: list[dict[str, Any]],
    namespace: str,
    engine_namespace: str,
    alertmanager_pods: dict[str, str] | None = ALERTMANAGER_PODS,
) -> None:
    """The webhook open to Alertmanager's pods alone (`alertmanager_pods`, both selectors in one
    peer; None: every pod of its namespace) and the metrics to Prometheus; the engines' OpenAI
    port to their own namespace, the clients named and Prometheus, their launcher's metrics port
    to Prometheus; each selecting the pods the operator and the chart render."""
    operator, engines = policies
    assert operator["metadata"]["namespace"] == namespace
    alertmanager = namespaces_peer("monitoring")
    if alertmanager_pods is not None:
        alertmanager["podSelector"] = {"matchLabels": alertmanager_pods}
    assert operator["spec"]["ingress"] == [
        {"from": [alertmanager], "ports": [{"protocol": "TCP", "port": 8443}]},
        {"from": [namespaces_peer("monitoring")], "ports": [{"protocol": "TCP", "port": 9090}]},
    ]
    assert operator["spec"]["policyTypes"] == ["Ingress"]
    assert engines["metadata"]["namespace"] == engine_namespace
    # The paged engine's /metrics is on the OpenAI port: Prometheus is let in there too.
    assert engines["spec"]["ingress"] == [
        {
            "from": [namespaces_peer(engine_namespace, "apps", "monitoring")],
            "ports": [{"protocol": "TCP", "port": HTTP_PORT}],
        },
        {
            "from": [namespaces_peer("monitoring")],
            "ports": [{"protocol": "TCP", "port": METRICS_PORT}],
        },
    ]
    pod_labels = render_deployment(make_server({}), DEFAULT_IMAGES)["spec"]["template"]
    selector = engines["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels["metadata"]["labels"].items()


def dry_run(cluster: Cluster, docs: list[dict[str, Any]]) -> None:
    """A server-side dry run of `docs`: the API server admits each, with no warning."""
    text = yaml.safe_dump_all(docs, sort_keys=False)
    result = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-", input=text
    )  # fmt: skip
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(docs)
    assert all(line.endswith("serverside-applied (server dry run)") for line in lines), lines
    assert "Warning" not in result.stderr, result.stderr


NETWORK_OPTIONS = [
    "--set", "networkPolicy.enabled=true", "--set", "metrics.enabled=true",
    "--set", "networkPolicy.engine.clientNamespaces={apps}",
]  # fmt: skip


@pytest.mark.parametrize("variant", ["default", "peering", "everything", "network"])
def test_template_passes_a_server_side_dry_run(
    cluster: Cluster,
    namespace: str,
    other_namespace: str,
    chart_crds: list[Path],
    kube_version: str,
    variant: str,
) -> None:
    options: list[str] = []
    expected = DEFAULT_KINDS
    if variant == "peering":
        options, expected = ["--set", "replicas=2"], [*DEFAULT_KINDS, "ClusterKopfPeering"]
    if variant == "everything":
        options = [*FULL_OPTIONS, "--set", f"watchNamespaces={{{namespace},{other_namespace}}}"]
        expected = FULL_KINDS
    if variant == "network":
        options = [
            *NETWORK_OPTIONS, "--set", f"networkPolicy.engine.namespaces={{{other_namespace}}}"
        ]  # fmt: skip
        expected = ["NetworkPolicy", "NetworkPolicy", *DEFAULT_KINDS]
    docs = render(cluster, kube_version, namespace, *options)
    assert [doc["kind"] for doc in docs] == expected
    dry_run(cluster, docs)
    if variant == "network":
        check_network_policies(by_kind(docs, "NetworkPolicy"), namespace, other_namespace)
    if variant == "everything":
        # The upgrade-time CRD is the chart's file, kept on uninstall.
        (crd,) = by_kind(docs, "CustomResourceDefinition")
        source = yaml.safe_load((CHART / "crds" / "llmservers.pagekeeper.dev.yaml").read_text())
        assert crd["spec"] == source["spec"]
        assert crd["metadata"]["annotations"] == {
            "argocd.argoproj.io/sync-wave": "-1",  # the CRD's own (docs/gitops.md)
            "helm.sh/resource-policy": "keep",
        }
        rules, dashboard = by_kind(docs, "ConfigMap")
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        board = json.loads(dashboard["data"]["pagekeeper.json"])
        assert board == json.loads((CHART / "dashboards" / "pagekeeper.json").read_text())
        assert rules["metadata"]["name"].endswith("-pagekeeper-adapter-rules")
        adapter_rules = (CHART / "adapter" / "rules.yaml").read_text()
        assert yaml.safe_load(rules["data"]["config.yaml"]) == yaml.safe_load(adapter_rules)
        (deployment,) = by_kind(docs, "Deployment")
        env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"][
            "containers"][0]["env"]}  # fmt: skip
        assert env["PAGEKEEPER_PROMETHEUS_URL"] == "http://prometheus-operated.monitoring.svc:9090"
        assert env["PAGEKEEPER_DELETION_COST_SECONDS"] == "15"
        assert env["PAGEKEEPER_CANARY_NO_DATA_SECONDS"] == "600"


@pytest.mark.parametrize(
    ("labels", "alertmanager_pods"),
    [
        # A map replaces the default (Helm would merge it into a default map), not joins it.
        ({"app": "alertmanager", "team": "sre"}, {"app": "alertmanager", "team": "sre"}),
        ({}, None),  # every pod of Alertmanager's namespaces
    ],
    ids=["labels", "whole-namespace"],
)
def test_the_webhook_policy_admits_the_alertmanager_pods_named(
    cluster: Cluster,
    namespace: str,
    other_namespace: str,
    chart_crds: list[Path],
    kube_version: str,
    labels: dict[str, str],
    alertmanager_pods: dict[str, str] | None,
) -> None:
    docs = render(
        cluster, kube_version, namespace, *NETWORK_OPTIONS,
        "--set", f"networkPolicy.engine.namespaces={{{other_namespace}}}",
        "--set-json", f"networkPolicy.alertmanagerPodLabels={json.dumps(labels)}",
    )  # fmt: skip
    policies = by_kind(docs, "NetworkPolicy")
    check_network_policies(policies, namespace, other_namespace, alertmanager_pods)
    dry_run(cluster, policies)


def test_rbac_cluster_wide_and_per_namespace(
    cluster: Cluster, namespace: str, chart_crds: list[Path], kube_version: str
) -> None:
    docs = render(cluster, kube_version, namespace)
    (role,) = by_kind(docs, "ClusterRole")
    assert role["rules"] == [CRD_RULE, NODES_RULE, *NAMESPACED_RULES]
    assert not by_kind(docs, "Role")
    docs = render(cluster, kube_version, namespace, "--set", "rbac.readApiKeySecrets=false")
    (role,) = by_kind(docs, "ClusterRole")
    assert role["rules"] == [CRD_RULE, NODES_RULE, *NAMESPACED_RULES[:-1]]  # no Secrets at all

    docs = render(cluster, kube_version, namespace, "--set", "replicas=2")
    (role,) = by_kind(docs, "ClusterRole")
    assert role["rules"] == [
        CRD_RULE,
        NODES_RULE,
        _peering_rule("clusterkopfpeerings"),
        *NAMESPACED_RULES,
    ]
    (peering,) = by_kind(docs, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "pk-pagekeeper"

    docs = render(
        cluster, kube_version, namespace, "--set", "replicas=2", "--set", "watchNamespaces={a,b}"
    )
    (role,) = by_kind(docs, "ClusterRole")
    assert role["rules"] == [CRD_RULE, NODES_RULE, NAMESPACES_RULE]
    roles = by_kind(docs, "Role")
    assert [r["metadata"]["namespace"] for r in roles] == ["a", "b"]
    for r in roles:
        assert r["rules"] == [_peering_rule("kopfpeerings"), *NAMESPACED_RULES]
    bindings = by_kind(docs, "RoleBinding")
    assert [b["subjects"] for b in bindings] == [
        [{"kind": "ServiceAccount", "name": "pk-pagekeeper-operator", "namespace": namespace}]
    ] * 2


def test_operator_command_line_per_mode(
    cluster: Cluster, namespace: str, chart_crds: list[Path], kube_version: str
) -> None:
    (deployment,) = by_kind(render(cluster, kube_version, namespace), "Deployment")
    container = container_of(deployment)
    assert "command" not in container  # the image's entrypoint: kopf run --module ...
    assert container["args"] == [
        "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz",
        "--log-format=json",
    ]  # fmt: skip
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}

    docs = render(
        cluster, kube_version, namespace, "--set", "replicas=3", "--set", "watchNamespaces={a,b}",
        "--set", "operator.logLevel=warning", "--set", "operator.logFormat=plain",
    )  # fmt: skip
    (deployment,) = by_kind(docs, "Deployment")
    container = container_of(deployment)
    assert container["command"][:2] == ["/bin/sh", "-c"]
    assert container["args"] == [
        "--namespace=a", "--namespace=b", "--peering=pk-pagekeeper",
        "--liveness=http://0.0.0.0:8080/healthz", "--log-format=plain", "--quiet",
    ]  # fmt: skip
    env = env_of(container)
    assert env["PAGEKEEPER_NAMESPACES"] == "a,b"
    assert env["PAGEKEEPER_PEERING"] == "pk-pagekeeper"
    assert env["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert deployment["spec"]["replicas"] == 3


def test_values_schema_rejects_bad_values(cluster: Cluster, namespace: str) -> None:
    cases = {
        "replicas=-1": "at '/replicas': minimum: got -1, want 1",
        "replica=2": "at '': additional properties 'replica' not allowed",
        "operator.logFormat=xml": "at '/operator/logFormat': value must be one of",
        "watchNamespaces={team-*}": "at '/watchNamespaces/0': 'team-*' does not match pattern",
        "webhook.port=70000": "at '/webhook/port': maximum: got 70,000, want 65,535",
        "networkPolicy.alertmanagerPodLabels.app=1": (
            "at '/networkPolicy/alertmanagerPodLabels/app': got number, want string"
        ),
        "networkPolicy.engine.kvEventsRouter.namespaces={Gateway}": (
            "at '/networkPolicy/engine/kvEventsRouter/namespaces/0': 'Gateway' does not match"
        ),
        "networkPolicy.engine.kvEventsRouter.podLabels.app=1": (
            "at '/networkPolicy/engine/kvEventsRouter/podLabels/app': got number, want string"
        ),
    }
    release = f"bad-{uuid.uuid4().hex[:6]}"
    for value, message in cases.items():
        result = helm(
            cluster, "install", release, str(CHART), "-n", namespace, "--set", value, check=False
        )
        assert result.returncode == 1, result.stdout
        assert "values don't meet the specifications of the schema(s)" in result.stderr
        assert message in result.stderr, result.stderr
    listed = helm(cluster, "list", "-n", namespace, "-a", "-o", "json").stdout
    assert json.loads(listed) == []


def _get(read: Any, *args: Any) -> Any:
    try:
        return read(*args)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _can(cluster: Cluster, user: str, verb: str, resource: str, namespace: str) -> bool:
    """`kubectl auth can-i` for `resource` or `resource/subresource`."""
    resource, _, subresource = resource.partition("/")
    options = [f"--subresource={subresource}"] if subresource else []
    result = cluster.kubectl(
        "auth", "can-i", verb, resource, *options, "-n", namespace, f"--as={user}", check=False
    )
    return result.stdout.strip() == "yes"


def test_install_upgrade_uninstall(
    cluster: Cluster, namespace: str, chart_crds: list[Path]
) -> None:
    apps, core = client.AppsV1Api(cluster.api), client.CoreV1Api(cluster.api)
    rbac, ext = client.RbacAuthorizationV1Api(cluster.api), client.ApiextensionsV1Api(cluster.api)
    # The operator's pod must pass PodSecurity `restricted`.
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )  # fmt: skip
    release = f"r{uuid.uuid4().hex[:6]}"
    name = f"{release}-pagekeeper-operator"
    install = helm(
        cluster, "install", release, str(CHART), "-n", namespace, "--wait", "--timeout", "120s",
        "--set", "operator.resyncSeconds=30",
    )  # fmt: skip
    assert f"Alertmanager webhook: http://{name}.{namespace}.svc:8443/alertmanager" in (
        install.stdout
    )

    deployment = apps.read_namespaced_deployment(name, namespace).to_dict()
    assert deployment["status"]["ready_replicas"] == 1
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == [
        "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz",
        "--log-format=json",
    ]  # fmt: skip
    values = {e["name"]: e["value"] for e in container["env"] if e["value"] is not None}
    assert values == {
        "PAGEKEEPER_PEERING": "standalone",
        "PAGEKEEPER_FINALIZER": "pagekeeper.dev/finalizer",
        "PAGEKEEPER_LOG_FORMAT": "json",
        "PAGEKEEPER_LOG_LEVEL": "info",
        "PAGEKEEPER_RESYNC_SECONDS": "30",
        "PAGEKEEPER_ENGINE_IMAGE": "ghcr.io/pagekeeper-dev/pagekeeper-engine:0.1.0",
        "PAGEKEEPER_VLLM_IMAGE": "docker.io/vllm/vllm-openai:v0.11.0",
        "PAGEKEEPER_WEBHOOK_PORT": "8443",
        "PAGEKEEPER_WEBHOOK_TOKEN_FILE": "/etc/pagekeeper/webhook-token/token",
    }
    security = container["security_context"]
    assert (security["read_only_root_filesystem"], security["allow_privilege_escalation"]) == (
        True,
        False,
    )
    assert core.read_namespaced_service_account(name, namespace) is not None
    role = rbac.read_cluster_role(name)
    assert len(role.rules) == 2 + len(NAMESPACED_RULES)
    binding = rbac.read_cluster_role_binding(name)
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [
        ("ServiceAccount", name, namespace)
    ]
    secret = core.read_namespaced_secret(f"{release}-pagekeeper-webhook", namespace)
    token = base64.b64decode(secret.data["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    service = core.read_namespaced_service(name, namespace)
    assert [(p.name, p.port) for p in service.spec.ports] == [("webhook", 8443)]

    # What the API server's authorizer grants the ServiceAccount, anywhere in the cluster.
    user = f"system:serviceaccount:{namespace}:{name}"
    elsewhere = "kube-system"
    for verb, resource in [
        ("create", "pods/eviction"), ("patch", "llmservers.pagekeeper.dev/status"),
        ("create", "deployments.apps"), ("watch", "pods"), ("create", "events"),
        ("delete", "deployments.apps"), ("list", "nodes"), ("get", "secrets"),
    ]:  # fmt: skip
        assert _can(cluster, user, verb, resource, elsewhere), f"{verb} {resource}"
    for verb, resource in [
        ("delete", "pods"), ("create", "pods"), ("list", "secrets"), ("watch", "secrets"),
        ("delete", "services"),
        ("update", "llmservers.pagekeeper.dev"), ("patch", "nodes"), ("list", "configmaps"),
    ]:  # fmt: skip
        assert not _can(cluster, user, verb, resource, elsewhere), f"{verb} {resource}"

    # An upgrade with a changed value rolls the operator; the token stays.
    generation = deployment["metadata"]["generation"]
    helm(
        cluster, "upgrade", release, str(CHART), "-n", namespace, "--reuse-values", "--wait",
        "--timeout", "120s", "--set", "operator.logLevel=debug",
    )  # fmt: skip
    deployment = apps.read_namespaced_deployment(name, namespace).to_dict()
    assert deployment["metadata"]["generation"] == generation + 1
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-1] == "--debug"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert (env["PAGEKEEPER_LOG_LEVEL"], env["PAGEKEEPER_RESYNC_SECONDS"]) == ("debug", "30")
    secret = core.read_namespaced_secret(f"{release}-pagekeeper-webhook", namespace)
    assert base64.b64decode(secret.data["token"]).decode() == token

    # Opting in to CRD upgrades: the release adopts the LLMServer CRD and keeps it on uninstall.
    helm(
        cluster, "upgrade", release, str(CHART), "-n", namespace, "--reuse-values",
        "--set", "crds.upgrade=true", "--take-ownership",
    )  # fmt: skip
    crd = ext.read_custom_resource_definition("llmservers.pagekeeper.dev")
    assert crd.metadata.annotations["meta.helm.sh/release-name"] == release
    assert crd.metadata.annotations["helm.sh/resource-policy"] == "keep"
    history = json.loads(helm(cluster, "history", release, "-n", namespace, "-o", "json").stdout)
    assert [h["status"] for h in history] == ["superseded", "superseded", "deployed"]

    helm(cluster, "uninstall", release, "-n", namespace, "--wait")
    assert _get(apps.read_namespaced_deployment, name, namespace) is None
    assert _get(core.read_namespaced_service_account, name, namespace) is None
    assert _get(core.read_namespaced_service, name, namespace) is None
    assert _get(core.read_namespaced_secret, f"{release}-pagekeeper-webhook", namespace) is None
    assert _get(rbac.read_cluster_role, name) is None
    assert _get(rbac.read_cluster_role_binding, name) is None
    assert _get(ext.read_custom_resource_definition, "llmservers.pagekeeper.dev") is not None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _http(url: str, body: dict[str, Any] | None = None, token: str | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, ConnectionError):
        return 0


def _service_account_kubeconfig(cluster: Cluster, namespace: str, name: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount, as the pod would."""
    token = cluster.kubectl("create", "token", name, "-n", namespace, "--duration=1h").stdout
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    server = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "cluster", "cluster": server}],
        "users": [{"name": "operator", "user": {"token": token.strip()}}],
        "contexts": [{"name": "operator", "context": {"cluster": "cluster", "user": "operator"}}],
        "current-context": "operator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _alert(namespace: str, pod: str, server: str) -> dict[str, Any]:
    started = (datetime.now(UTC) - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    labels = {
        "alertname": "PagekeeperKVCacheSaturated",
        "namespace": namespace,
        "pod": pod,
        "llmserver": server,
        "severity": "critical",
        "pagekeeper_remediate": "true",
    }
    return {
        "version": "4",
        "groupKey": f'{{}}:{{pod="{pod}"}}',
        "status": "firing",
        "receiver": "pagekeeper",
        "groupLabels": {"pod": pod},
        "commonLabels": labels,
        "alerts": [
            {
                "status": "firing",
                "labels": labels,
                "startsAt": started,
                "endsAt": "0001-01-01T00:00:00Z",
                "fingerprint": uuid.uuid4().hex[:16],
            }
        ],
    }


def test_operator_runs_under_the_charts_rbac(
    cluster: Cluster, namespace: str, chart_crds: list[Path], tmp_path: Path
) -> None:
    """Two replicas watching one namespace. The test runs one replica itself, from the installed
    Deployment's command, args and env, authenticated as the chart's ServiceAccount: it joins
    the peering, reconciles an LLMServer, evicts a pod on an alert and deletes the budget it
    made once the spec brings its own, without a single 403."""
    apps, core = client.AppsV1Api(cluster.api), client.CoreV1Api(cluster.api)
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )  # fmt: skip
    release = f"r{uuid.uuid4().hex[:6]}"
    name = f"{release}-pagekeeper-operator"
    health_port, webhook_port = _free_port(), _free_port()
    helm(
        cluster, "install", release, str(CHART), "-n", namespace, "--set", "replicas=2",
        "--set", f"watchNamespaces={{{namespace}}}", "--set", "operator.resyncSeconds=5",
        "--set", f"operator.healthPort={health_port}", "--set", f"webhook.port={webhook_port}",
        "--set", "operator.logFormat=plain",
    )  # fmt: skip
    try:
        deployment = apps.read_namespaced_deployment(name, namespace)
        container = deployment.spec.template.spec.containers[0]
        command = [*(container.command or ENTRYPOINT), *container.args]
        pod_name = f"{name}-test-0"
        token = base64.b64decode(
            core.read_namespaced_secret(f"{release}-pagekeeper-webhook", namespace).data["token"]
        ).decode()
        token_file = tmp_path / "token"
        token_file.write_text(token)
        env = {e.name: e.value for e in container.env if e.value is not None}
        fields = {e.name: e.value_from.field_ref.field_path for e in container.env if e.value_from}
        assert fields == {"POD_ID": "metadata.name"}
        env |= {
            "POD_ID": pod_name,
            "PAGEKEEPER_WEBHOOK_TOKEN_FILE": str(token_file),
            "KUBECONFIG": str(
                _service_account_kubeconfig(cluster, namespace, name, tmp_path / "kc")
            ),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "memplan")]),
            "HOME": str(tmp_path),
        }
        log_path = tmp_path / "operator.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _exercise_operator(
                cluster, namespace, release, process, log_path, pod_name, token, health_port,
                webhook_port,
            )  # fmt: skip
        finally:
            process.terminate()
            process.wait(timeout=30)
        log_text = log_path.read_text(errors="replace")
        # a 403 status as a word, not the digits of a port such as 40345 in the log
        has_403 = re.search(r"\b403\b", log_text) is not None
        assert "Forbidden" not in log_text and not has_403, log_text[-4000:]
    finally:
        helm(cluster, "uninstall", release, "-n", namespace, check=False)


def _exercise_operator(
    cluster: Cluster,
    namespace: str,
    release: str,
    process: subprocess.Popen[bytes],
    log_path: Path,
    pod_name: str,
    token: str,
    health_port: int,
    webhook_port: int,
) -> None:
    custom, core = client.CustomObjectsApi(cluster.api), client.CoreV1Api(cluster.api)

    def alive(check: Any) -> Any:
        assert process.poll() is None, log_path.read_text(errors="replace")[-4000:]
        return check()

    health = f"http://127.0.0.1:{health_port}/healthz"
    wait_for(lambda: alive(lambda: _http(health) == 200), timeout=60, what="kopf liveness")
    webhook = f"http://127.0.0.1:{webhook_port}"
    assert _http(f"{webhook}/healthz") == 200  # the Deployment's readiness probe

    # This replica's keep-alive, with the priority the Deployment's command derives.
    def peer() -> Any:
        peering = custom.get_namespaced_custom_object(
            "kopf.dev", "v1", namespace, "kopfpeerings", f"{release}-pagekeeper"
        )
        return (peering.get("status") or {}).get(pod_name)

    keepalive = wait_for(lambda: alive(peer), timeout=60, what="peering keep-alive")
    assert keepalive["priority"] == cksum(pod_name)

    spec = {
        "model": {"source": "/models/tiny", "loadFormat": "dummy"},
        "resources": {"gpus": 1, "requests": {"cpu": "1", "memory": "2Gi"}},
        "remediation": {"hysteresisSeconds": 0, "cooldownSeconds": 600},
    }
    cluster.apply_yaml(
        {**llmserver("tiny", spec), "metadata": {"name": "tiny", "namespace": namespace}}
    )
    wait_ready(cluster, namespace, "tiny", 1)
    (pod,) = core.list_namespaced_pod(
        namespace, label_selector="pagekeeper.dev/llmserver=tiny"
    ).items

    alert = _alert(namespace, pod.metadata.name, "tiny")
    assert _http(f"{webhook}/alertmanager", alert) == 401
    assert _http(f"{webhook}/alertmanager", alert, token="wrong") == 401
    assert _http(f"{webhook}/alertmanager", alert, token=token) == 200

    def evicted() -> Any:
        server = custom.get_namespaced_custom_object(
            "pagekeeper.dev", "v1alpha1", namespace, "llmservers", "tiny"
        )
        history = (server.get("status") or {}).get("remediationHistory") or []
        return [(h["pod"], h["action"], h["outcome"]) for h in history if h["action"] == "evict"]

    records = wait_for(lambda: alive(evicted), timeout=90, what="an eviction in the history")
    assert records == [(pod.metadata.name, "evict", "evicted")]
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=tiny")
    assert any(e.source.component == "pagekeeper-operator" for e in events.items)

    # Bringing your own budget: the operator deletes the one it made.
    policy = client.PolicyV1Api(cluster.api)
    assert policy.read_namespaced_pod_disruption_budget("tiny", namespace) is not None
    custom.patch_namespaced_custom_object(
        "pagekeeper.dev", "v1alpha1", namespace, "llmservers", "tiny",
        {"spec": {"disruptionBudget": {"managed": False}}},
    )  # fmt: skip
    budget = policy.read_namespaced_pod_disruption_budget

    wait_for(lambda: alive(lambda: _get(budget, "tiny", namespace) is None), timeout=60,
             what="the operator's PodDisruptionBudget deleted")  # fmt: skip

    # Under spec.autoscaling: the operator makes the HorizontalPodAutoscaler and follows it.
    custom.patch_namespaced_custom_object(
        "pagekeeper.dev", "v1alpha1", namespace, "llmservers", "tiny",
        {"spec": {"autoscaling": {"maxReplicas": 2}}},
    )  # fmt: skip
    autoscaling = client.AutoscalingV2Api(cluster.api).read_namespaced_horizontal_pod_autoscaler
    wait_for(lambda: alive(lambda: _get(autoscaling, "tiny", namespace) is not None), timeout=60,
             what="the operator's HorizontalPodAutoscaler")  # fmt: skip


def test_webhook_variants(
    cluster: Cluster, namespace: str, chart_crds: list[Path], kube_version: str
) -> None:
    docs = render(
        cluster, kube_version, namespace, "--set", "webhook.token.existingSecret=am-token",
        "--set", "webhook.token.key=credentials", "--set", "webhook.tls.secretName=webhook-tls",
    )  # fmt: skip
    assert not by_kind(docs, "Secret")  # the named one is used as it is
    (deployment,) = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = container_of(deployment)
    env = env_of(container)
    assert env["PAGEKEEPER_WEBHOOK_TOKEN_FILE"] == "/etc/pagekeeper/webhook-token/credentials"
    assert env["PAGEKEEPER_WEBHOOK_TLS_CERT_FILE"] == "/etc/pagekeeper/webhook-tls/tls.crt"
    assert env["PAGEKEEPER_WEBHOOK_TLS_KEY_FILE"] == "/etc/pagekeeper/webhook-tls/tls.key"
    volumes = {v["name"]: v.get("secret") for v in pod["volumes"]}
    assert volumes["webhook-token"] == {
        "secretName": "am-token",
        "items": [{"key": "credentials", "path": "credentials"}],
    }
    assert volumes["webhook-tls"] == {"secretName": "webhook-tls"}
    assert container["readinessProbe"]["httpGet"] == {
        "path": "/healthz", "port": "webhook", "scheme": "HTTPS",
    }  # fmt: skip

    docs = render(cluster, kube_version, namespace, "--set", "webhook.enabled=false")
    assert [doc["kind"] for doc in docs] == [
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
    ]  # fmt: skip
    (deployment,) = by_kind(docs, "Deployment")
    container = container_of(deployment)
    assert not [name for name in env_of(container) if name.startswith("PAGEKEEPER_WEBHOOK")]
    assert [p["name"] for p in container["ports"]] == ["health"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_dashboard_reads_only_the_metric_contract() -> None:
    """Every series the dashboard queries is one the engine exports (metric_names.py) or one of
    the operator's (remediations, tuning); every panel the issue asks for is there."""
    board = json.loads((CHART / "dashboards" / "pagekeeper.json").read_text())
    titles = [panel["title"] for panel in board["panels"]]
    assert titles == [
        "KV cache usage",
        "Requests running and waiting",
        "Allocator fragmentation",
        "OOM events",
        "Remediations",
        "Tuning recommendations",
        "Tuning decisions",
    ]
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr)}
    assert used == {
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "pagekeeper_allocator_reserved_bytes",
        "pagekeeper_allocator_allocated_bytes",
        "pagekeeper_oom_events_total",
        "pagekeeper_remediations_total",
        "pagekeeper_tuning_recommendation",
        "pagekeeper_tuning_decisions_total",
    }
    assert used - set(METRICS) == {
        "pagekeeper_remediations_total",
        "pagekeeper_tuning_recommendation",
        "pagekeeper_tuning_decisions_total",
    }
    # Both runtimes export every engine series it reads (vLLM pods through pagekeeper's plugin).
    for runtime in RUNTIMES:
        assert all(exports(runtime, name) for name in used & set(METRICS)), runtime
    assert {v["name"] for v in board["templating"]["list"]} == {
        "datasource",
        "namespace",
        "llmserver",
    }
