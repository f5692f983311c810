"""The operator's only Kubernetes I/O: one API client, one request path, for reconciliation
(reads, server-side applies, deletes, status patches, CRD checks), remediation (pods,
evictions, Events, status written under optimistic concurrency) and scale-down (pod-deletion
costs).

Every write of a child object is a server-side apply under one field manager (and, once, the
replicas handed to an autoscaler under a second: `autoscaling`). `force=True` is safe because we
apply only the fields we render: it takes back a field we own that someone else changed, and
never touches fields we do not set. Objects travel as the API's JSON (dicts); the
calls block, so async callers run them in a worker thread.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.adapters.plan import ObjectKey, key_of
from pagekeeper_operator.api.llmserver import API_VERSION, KIND, PLURAL
from pagekeeper_operator.render import ClusterFeatures
from pagekeeper_operator.render.autoscaler import (
    HPA_API_VERSION,
    HPA_KIND,
    SCALED_OBJECT_API_VERSION,
    SCALED_OBJECT_KIND,
)
from pagekeeper_operator.render.gateway import INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND

FIELD_MANAGER = "pagekeeper-operator"
SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"
PROMETHEUS_RULE_CRD = "prometheusrules.monitoring.coreos.com"
INFERENCE_POOL_CRD = "inferencepools.inference.networking.k8s.io"
SCALED_OBJECT_CRD = "scaledobjects.keda.sh"
# A missing CRD may be installed later (the Prometheus Operator or the inference gateway after
# us): look again this often.
CRD_RECHECK_SECONDS = 300.0
# Status writes race other writers (kopf, another replica): read again this many times.
MAX_CONFLICT_RETRIES = 5
MEMO_KEY = "kube"

_PLURALS = {
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("v1", "Service"): "services",
    ("v1", "Secret"): "secrets",  # read only, for spec.apiKey (`api_key`)
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules",
    (INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND): "inferencepools",
    (HPA_API_VERSION, HPA_KIND): "horizontalpodautoscalers",
    (SCALED_OBJECT_API_VERSION, SCALED_OBJECT_KIND): "scaledobjects",
    (API_VERSION, KIND): PLURAL,
}
StatusChange = Callable[[dict[str, Any]], dict[str, Any] | None]
"""Given the LLMServer as read, the status merge patch to write (None: write nothing)."""
logger = logging.getLogger(__name__)


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    """REST path of a namespaced object (or its collection when `name` is None)."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{_PLURALS[(api_version, kind)]}"
    return path if name is None else f"{path}/{name}"


def api_client(env: Mapping[str, str]) -> ApiClient:
    """A client with a configuration of its own (the library's global default is left alone):
    $KUBECONFIG or ~/.kube/config when present, else the pod's service account."""
    configuration = kubernetes.client.Configuration()
    kubeconfig = env.get("KUBECONFIG", "").strip()
    default = Path("~/.kube/config").expanduser()
    if not kubeconfig and default.exists():
        kubeconfig = str(default)
    if kubeconfig:
        kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=configuration
        )
    else:
        kubernetes.config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration
        )
    return ApiClient(configuration)


def shared_kube(memo: MutableMapping[str, Any], env: Mapping[str, str]) -> Kube:
    """The process's one adapter, kept in kopf's memo and made on first use."""
    kube = memo.get(MEMO_KEY)
    if kube is None:
        kube = memo[MEMO_KEY] = Kube(api_client(env))
    assert isinstance(kube, Kube), f"memo[{MEMO_KEY!r}] is not a Kube"
    return kube


class Kube:
    """The objects of LLMServers, as the API's JSON, over one ApiClient."""

    def __init__(self, api: ApiClient, field_manager: str = FIELD_MANAGER) -> None:
        self.api = api
        self.field_manager = field_manager
        self._crds: dict[str, tuple[bool, float]] = {}

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        request = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*request)
        data = response.read()  # type: ignore[no-untyped-call]
        text = data.decode() if isinstance(data, bytes) else str(data or "")
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(http_resp=response, body=text, data=None)
        decoded: dict[str, Any] = json.loads(text) if text else {}
        return decoded

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", resource_path(api_version, kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list_nodes(self, label_selector: str) -> list[dict[str, Any]]:
        """The cluster's nodes matching `label_selector` (cluster-scoped)."""
        answer = self._request("GET", "/api/v1/nodes", query=[("labelSelector", label_selector)])
        items: list[dict[str, Any]] = answer.get("items") or []
        return items

    def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str
    ) -> list[dict[str, Any]]:
        path = resource_path(api_version, kind, namespace)
        answer = self._request("GET", path, query=[("labelSelector", label_selector)])
        items: list[dict[str, Any]] = answer.get("items") or []
        return items

    def observe(self, namespace: str, keys: Iterable[ObjectKey]) -> dict[ObjectKey, Any]:
        """The current state of each object (None where absent)."""
        return {key: self.get(key[0], key[1], namespace, key[2]) for key in keys}

    def apply(
        self, manifest: Mapping[str, Any], field_manager: str | None = None, force: bool = True
    ) -> dict[str, Any]:
        """Server-side apply of an object we fully render, under our field manager unless
        another is named; without `force` a field another manager set differently is a 409."""
        api_version, kind, name = key_of(manifest)
        namespace = str(manifest["metadata"]["namespace"])
        return self._request(
            "PATCH",
            resource_path(api_version, kind, namespace, name),
            query=[
                ("fieldManager", field_manager or self.field_manager),
                ("force", "true" if force else "false"),
            ],
            body=dict(manifest),
            content_type="application/apply-patch+yaml",
        )

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        """Merge-patch annotations of a pod (the pod-deletion cost); a pod already gone is fine."""
        try:
            self._request(
                "PATCH",
                resource_path("v1", "Pod", namespace, name),
                query=[("fieldManager", self.field_manager)],
                body={"metadata": {"annotations": dict(annotations)}},
                content_type="application/merge-patch+json",
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def delete(self, key: ObjectKey, namespace: str, uid: str) -> None:
        """Delete an object if it is still the one with `uid`; already gone is fine."""
        api_version, kind, name = key
        try:
            self._request(
                "DELETE",
                resource_path(api_version, kind, namespace, name),
                body={"preconditions": {"uid": uid}},
                content_type="application/json",
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def patch_status(
        self,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        resource_version: str | None = None,
    ) -> bool:
        """Merge-patch LLMServer status (the status subresource). With `resource_version`, only
        if the object is still at it: False on a conflict."""
        body: dict[str, Any] = {"status": dict(patch)}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            self._request(
                "PATCH",
                resource_path(API_VERSION, KIND, namespace, name) + "/status",
                query=[("fieldManager", self.field_manager)],
                body=body,
                content_type="application/merge-patch+json",
            )
        except ApiException as exc:
            if exc.status == 409 and resource_version is not None:
                return False
            raise
        return True

    def update_status(
        self, namespace: str, name: str, change: StatusChange
    ) -> dict[str, Any] | None:
        """Read the LLMServer, compute a status patch from it and write it only if nobody wrote
        in between; read again on a conflict. The object the patch was computed from, or None
        when it is gone or `change` wanted nothing written."""
        for _ in range(MAX_CONFLICT_RETRIES):
            body = self.get(API_VERSION, KIND, namespace, name)
            if body is None:
                return None
            patch = change(body)
            if patch is None:
                return None
            version = str(body["metadata"]["resourceVersion"])
            if self.patch_status(namespace, name, patch, resource_version=version):
                return body
        raise RuntimeError(f"status of {namespace}/{name} kept changing; not written")

    def evict(self, namespace: str, pod: str) -> None:
        """Ask the Eviction API (policy/v1) to evict a pod; PodDisruptionBudgets decide."""
        eviction = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": pod, "namespace": namespace},
        }
        path = resource_path("v1", "Pod", namespace, pod) + "/eviction"
        self._request("POST", path, body=eviction, content_type="application/json")

    def create_event(self, event: Mapping[str, Any]) -> None:
        namespace = str(event["metadata"]["namespace"])
        path = resource_path("v1", "Event", namespace)
        self._request("POST", path, body=dict(event), content_type="application/json")

    def has_crd(self, name: str) -> bool:
        """Whether a CRD is installed; answers are cached (a negative one only for a while)."""
        cached = self._crds.get(name)
        if cached is not None and (cached[0] or time.monotonic() < cached[1]):
            return cached[0]
        try:
            self._request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            found = True
        except ApiException as exc:
            if exc.status != 404:
                raise
            found = False
        self._crds[name] = (found, time.monotonic() + CRD_RECHECK_SECONDS)
        logger.info("CRD %s is %s", name, "installed" if found else "absent")
        return found

    def features(self) -> ClusterFeatures:
        return ClusterFeatures(
            has_service_monitor=self.has_crd(SERVICE_MONITOR_CRD),
            has_prometheus_rule=self.has_crd(PROMETHEUS_RULE_CRD),
            has_inference_pool=self.has_crd(INFERENCE_POOL_CRD),
            has_scaled_object=self.has_crd(SCALED_OBJECT_CRD),
        )
