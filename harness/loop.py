"""The alert -> roll loop's moving parts, shared by the e2e test and `make demo`.

The operator runs as a subprocess with its Alertmanager webhook on a loopback port behind a
bearer token file. Prometheus (`prometheus`) evaluates the rules rendered here from the server's
spec (`rules_file`) over the CPU engine's series labelled as one of the server's pods, and
Alertmanager posts to the webhook. The rest reads and waits on the cluster: the server, its pods,
its remediation history and Events, and a watch of every pod change.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from harness.cluster import Cluster, wait_for
from harness.operator_process import CRD_PATH
from harness.processes import free_port, stop_process, wait_http_ok
from harness.tools import REPO
from pagekeeper_operator.alerts.render import render_rules_file
from pagekeeper_operator.api.llmserver import GROUP, PLURAL, VERSION, LLMServer
from pagekeeper_operator.remediation.state import EVICT_INTENT
from pagekeeper_operator.render.meta import SERVER_LABEL

# Status and drift are re-planned this often; 5 is the least the settings accept.
RESYNC_SECONDS = 10


def install_crd(cluster: Cluster, path: Path = CRD_PATH) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    cluster.wait_established(f"{PLURAL}.{GROUP}")


def restrict_namespace(cluster: Cluster, namespace: str) -> None:
    """The operator's pods must pass PodSecurity `restricted`."""
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )


class OperatorProcess:
    """`kopf run -m pagekeeper_operator.main` watching one namespace, webhook on loopback."""

    def __init__(
        self,
        kubeconfig: str,
        namespace: str,
        workdir: Path,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_urlsafe(24)
        self.token_file = workdir / "webhook-token"
        self.token_file.write_text(self.token + "\n")
        self.token_file.chmod(0o600)
        self.port = free_port()
        self.scheme = (
            "https" if (extra_env or {}).get("PAGEKEEPER_WEBHOOK_TLS_CERT_FILE") else "http"
        )
        self.log = workdir / "operator.log"
        env = {
            **os.environ,
            "KUBECONFIG": kubeconfig,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO / "operator"), str(REPO / "memplan"), str(REPO)]
            ),
            "PAGEKEEPER_RESYNC_SECONDS": str(RESYNC_SECONDS),
            "PAGEKEEPER_WEBHOOK_PORT": str(self.port),
            "PAGEKEEPER_WEBHOOK_TOKEN_FILE": str(self.token_file),
            **(extra_env or {}),
        }
        kopf = Path(sys.executable).with_name("kopf")
        argv = [str(kopf), "run", "-m", "pagekeeper_operator.main", "--standalone"]
        with self.log.open("wb") as sink:
            self.proc = subprocess.Popen(
                [*argv, "--namespace", namespace],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )

    @property
    def webhook_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/alertmanager"

    def wait_ready(self, timeout: float = 90) -> None:
        url = f"{self.scheme}://127.0.0.1:{self.port}/healthz"
        try:  # readiness only: the TLS tests check the certificate chain themselves
            wait_http_ok(url, timeout=timeout, proc=self.proc, insecure=self.scheme == "https")
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"operator did not start: {exc}\n{self.log_tail()}") from exc

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        stop_process(self.proc, timeout=30)


def llmserver(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LLMServer",
        "metadata": {"name": name},
        "spec": spec,
    }


def get_server(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    obj = client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name
    )
    assert isinstance(obj, dict), f"LLMServer {namespace}/{name} came back as {type(obj)}"
    return obj


def rules_file(cluster: Cluster, namespace: str, name: str, path: Path) -> Path:
    """The server's alerts as a plain rules file, rendered from its spec as stored."""
    server = LLMServer.from_body(get_server(cluster, namespace, name))
    path.write_text(
        render_rules_file(
            name,
            namespace,
            server.spec.remediation,
            server.spec.runtime,
            has_plugin=server.spec.has_vllm_plugin,
        )
    )
    return path


def server_pods(cluster: Cluster, namespace: str, name: str) -> list[client.V1Pod]:
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(
        namespace, label_selector=f"{SERVER_LABEL}={name}"
    )
    return sorted(pods.items, key=pod_name)


def pod_name(pod: client.V1Pod) -> str:
    assert pod.metadata is not None and pod.metadata.name, "a pod from the API server has a name"
    return pod.metadata.name


def is_pod_terminating(pod: client.V1Pod) -> bool:
    return pod.metadata is not None and pod.metadata.deletion_timestamp is not None


def is_pod_ready(pod: client.V1Pod) -> bool:
    conditions = (pod.status.conditions if pod.status else None) or []
    is_ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    return is_ready and not is_pod_terminating(pod)


def wait_ready_pods(
    cluster: Cluster, namespace: str, name: str, num_pods: int, timeout: float = 120
) -> list[str]:
    """Until exactly `num_pods` pods of the server are Ready and none is terminating."""

    def ready() -> list[str] | None:
        pods = server_pods(cluster, namespace, name)
        if len(pods) == num_pods and all(is_pod_ready(pod) for pod in pods):
            return [pod_name(pod) for pod in pods]
        return None

    names: list[str] = wait_for(ready, timeout=timeout, what=f"{num_pods} Ready pods of {name}")
    return names


def wait_beside_canary(
    cluster: Cluster, namespace: str, name: str, canary: str, num_stable: int, timeout: float = 120
) -> set[str]:
    """Until the server runs exactly `num_stable` pods beside the pod `canary`, all Ready and none
    terminating; their names. With maxSurge 0 the canary takes a stable pod's place, and it can
    be Ready before the ReplicaSet has let that pod go."""

    def settled() -> set[str] | None:
        pods = server_pods(cluster, namespace, name)
        others = {pod_name(pod) for pod in pods} - {canary}
        if len(others) == num_stable and all(is_pod_ready(pod) for pod in pods):
            return others
        return None

    names: set[str] = wait_for(
        settled, timeout=timeout, what=f"{num_stable} stable pod(s) of {name} beside the canary"
    )
    return names


def history(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = (get_server(cluster, namespace, name).get("status") or {}).get(
        "remediationHistory", []
    )
    return entries


def wait_history(
    cluster: Cluster, namespace: str, name: str, timeout: float, **fields: str
) -> dict[str, Any]:
    """Until the server's remediation history holds an entry with these field values; an
    eviction's intent (outcome `evicting`, replaced by its outcome) matches only when asked
    for by its outcome."""

    def found() -> dict[str, Any] | None:
        for entry in history(cluster, namespace, name):
            if entry.get("outcome") == EVICT_INTENT and "outcome" not in fields:
                continue
            if all(entry.get(key) == value for key, value in fields.items()):
                return entry
        return None

    entry: dict[str, Any] = wait_for(found, timeout=timeout, interval=1, what=f"history {fields}")
    return entry


def server_events(cluster: Cluster, namespace: str, name: str) -> list[client.CoreV1Event]:
    events = client.CoreV1Api(cluster.api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.kind=LLMServer,involvedObject.name={name}"
    )
    return list(events.items)


class PodWatch:
    """Every pod change in a namespace, recorded from a watch on a background thread, so a
    pod that comes and goes between two polls is still seen."""

    def __init__(self, kubeconfig: str, namespace: str) -> None:
        self.api = config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig
        )
        self.namespace = namespace
        self.seen: list[tuple[str, client.V1Pod]] = []
        self.error: Exception | None = None
        self._is_stopping = False
        self._watch = watch.Watch()  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)

    def start(self) -> PodWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        core = client.CoreV1Api(self.api)
        try:
            stream = self._watch.stream(  # type: ignore[no-untyped-call]
                core.list_namespaced_pod, self.namespace
            )
            for event in stream:
                self.seen.append((str(event["type"]), event["object"]))
        except (ApiException, ValueError, urllib3.exceptions.HTTPError) as exc:
            if not self._is_stopping:
                self.error = exc  # the test checks it: a broken watch saw nothing

    def stop(self) -> None:
        self._is_stopping = True
        self._watch.stop()  # type: ignore[no-untyped-call]
        self.api.close()

    def wait_seen(
        self, condition: Callable[[PodWatch], object], what: str, timeout: float = 30
    ) -> None:
        """Wait until what the watch saw meets `condition`: a change the API server already
        shows (a pod listed gone, an eviction recorded) reaches the watch's thread a moment
        later. A broken watch fails at once."""
        wait_for(
            lambda: self.error is not None or condition(self),
            timeout=timeout,
            interval=0.1,
            what=f"the pod watch seeing {what}",
        )
        assert self.error is None, f"the pod watch broke: {self.error!r}"

    def versions_of(self, pod: str) -> list[client.V1Pod]:
        return [obj for _, obj in list(self.seen) if pod_name(obj) == pod]

    def disruption_of(self, pod: str) -> tuple[str, str] | None:
        """(reason, message) of the DisruptionTarget condition the API server sets on a pod
        it evicts through the Eviction API; None if no version of the pod carried one."""
        for obj in self.versions_of(pod):
            for condition in (obj.status.conditions if obj.status else None) or []:
                if condition.type == "DisruptionTarget" and condition.status == "True":
                    return condition.reason or "", condition.message or ""
        return None

    def was_deleted(self, pod: str) -> bool:
        return any(
            is_pod_terminating(obj) or kind == "DELETED"
            for kind, obj in list(self.seen)
            if pod_name(obj) == pod
        )
