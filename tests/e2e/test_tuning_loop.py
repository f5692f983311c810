"""The tuner with real parts only: a workload that never reuses a prefix gets the
prefix-caching recommendation within its window, and a Recommend-mode server gets 0 writes
beyond status (every object the operator owns for it keeps its resourceVersion; the
LLMServer's metadata and spec stay as they were) until a person accepts it by annotation.

The operator runs as a subprocess on the local control plane (KWOK GPU nodes) with
PAGEKEEPER_PROMETHEUS_URL set; one engine runs on the CPU with prefix caching on, and a real
Prometheus scrapes it as the server's pod. A client thread sends prompts of random characters
(no two share a first block) for as long as the test runs, so the window always holds them.
"""

from __future__ import annotations

import contextlib
import json
import random
import string
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.cpu_engine import (
    EngineShape,
    spawn_engine,
    stop_engine,
    wait_engine_ready,
    write_tiny_checkpoint,
)
from harness.loop import (
    OperatorProcess,
    get_server,
    install_crd,
    llmserver,
    restrict_namespace,
    server_events,
    server_pods,
    wait_ready_pods,
)
from harness.prometheus import Prometheus, engine_scrape
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render import ClusterFeatures, render_all

NAME = "tuned"
# A pool that holds several 900-token prompts at once.
SHAPE = EngineShape(num_blocks=512, block_size=16, max_num_seqs=8, max_model_len=1000)
PROMPT_CHARS = 900  # one token per character: 50,000 looked-up tokens take ~56 prompts
SPEC: dict[str, Any] = {
    "model": {"source": "/models/tiny-llama", "servedModelName": SHAPE.model_name,
              "loadFormat": "dummy"},
    "replicas": 1,
    "resources": {"gpus": 1},
    "tuning": {"mode": "Recommend", "windowSeconds": 60},
}  # fmt: skip
WINDOW_TIMEOUT_S = 180  # the load's first window, plus a resync or two
# Each kind `render_all` can make for a server, as kubectl names its resource; a kind whose
# CRD is not installed is neither rendered nor listable.
RENDERED_KINDS = {
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets.policy",
    "Deployment": "deployments.apps",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers.autoscaling",
    "ScaledObject": "scaledobjects.keda.sh",
    "ServiceMonitor": "servicemonitors.monitoring.coreos.com",
    "PrometheusRule": "prometheusrules.monitoring.coreos.com",
    "InferencePool": "inferencepools.inference.networking.k8s.io",
}
IMAGES = {"pagekeeper": "engine:test", "vllm": "vllm:test"}  # names only: keys are compared
# LLMServer metadata the API server moves on a status write (only status may move it).
STATUS_WRITE_METADATA = ("resourceVersion", "managedFields")


class UniquePrompts:
    """Sends completions of fresh random text, one at a time per worker, until stopped."""

    def __init__(self, url: str, model: str, num_workers: int = 4) -> None:
        self.url, self.model = url, model
        self.num_sent = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_workers)
        ]

    def _run(self, worker: int) -> None:
        rng = random.Random(worker)
        letters = string.ascii_lowercase + " "
        while not self._stop.is_set():
            body = {
                "model": self.model,
                "prompt": "".join(rng.choice(letters) for _ in range(PROMPT_CHARS)),
                "max_tokens": 1,
            }
            request = urllib.request.Request(
                f"{self.url}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    response.read()
                self.num_sent += 1
            except (urllib.error.URLError, OSError) as exc:
                self.errors.append(str(exc))

    def __enter__(self) -> UniquePrompts:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)


def owned_versions(
    cluster: Cluster, namespace: str, server: dict[str, Any]
) -> dict[tuple[str, str], str]:
    """(kind, name) -> resourceVersion of every object in the namespace that the LLMServer
    owns, of each kind the operator renders; asserts they are exactly what it renders."""
    uid = server["metadata"]["uid"]
    owned, installed = {}, set()
    for kind, resource in RENDERED_KINDS.items():
        listed = cluster.kubectl("get", resource, "-n", namespace, "-o", "json", check=False)
        if listed.returncode != 0:
            assert "the server doesn't have a resource type" in listed.stderr, listed.stderr
            continue
        installed.add(kind)
        for item in json.loads(listed.stdout)["items"]:
            refs = item["metadata"].get("ownerReferences") or []
            if any(ref["uid"] == uid for ref in refs):
                owned[(kind, item["metadata"]["name"])] = item["metadata"]["resourceVersion"]
    features = ClusterFeatures(
        has_service_monitor="ServiceMonitor" in installed,
        has_prometheus_rule="PrometheusRule" in installed,
        has_inference_pool="InferencePool" in installed,
        has_scaled_object="ScaledObject" in installed,
    )
    rendered = render_all(LLMServer.from_body(server), IMAGES, features)
    assert set(owned) == {(m["kind"], m["metadata"]["name"]) for m in rendered}
    return owned


def wait_settled(cluster: Cluster, namespace: str) -> dict[str, Any]:
    """Until every writer but the tuner is done with the server: kopf recorded the spec it
    handled, status is of this generation with the pod ready, the Deployment's rollout is
    complete and its PodDisruptionBudget counts the pod (so neither controller writes their
    status again). Returns the server."""
    apps, policy = client.AppsV1Api(cluster.api), client.PolicyV1Api(cluster.api)

    def settled() -> dict[str, Any] | None:
        server = get_server(cluster, namespace, NAME)
        meta, status = server["metadata"], server.get("status", {})
        deployment = apps.read_namespaced_deployment(NAME, namespace)
        conditions = {c.type: c for c in deployment.status.conditions or []}
        progressing = conditions.get("Progressing")
        pdb = policy.read_namespaced_pod_disruption_budget(NAME, namespace)
        if (
            "pagekeeper.dev/last-handled-configuration" in (meta.get("annotations") or {})
            and status.get("observedGeneration") == meta["generation"]
            and status.get("readyReplicas") == 1
            and deployment.status.observed_generation == deployment.metadata.generation
            and deployment.status.available_replicas == 1
            and deployment.status.updated_replicas == 1
            and progressing is not None
            and progressing.reason == "NewReplicaSetAvailable"
            and pdb.status.observed_generation == pdb.metadata.generation
            and pdb.status.current_healthy == 1
        ):
            return server
        return None

    server: dict[str, Any] = wait_for(settled, timeout=60, what="the server's objects settled")
    return server


def without_status_writes(metadata: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metadata.items() if k not in STATUS_WRITE_METADATA}


def num_writes_logged(operator: OperatorProcess, namespace: str) -> int:
    """The operator's applies and deletions of the server's objects, from its log."""
    log = operator.log.read_text(errors="replace")
    return sum(log.count(f"{namespace}/{NAME}: {verb} ") for verb in ("applied", "deleted"))


def engine_args(apps: client.AppsV1Api, namespace: str) -> list[str]:
    deployment = apps.read_namespaced_deployment(NAME, namespace)
    container = deployment.spec.template.spec.containers[0]
    return [*(container.command or []), *(container.args or [])]


def test_a_server_that_never_reuses_a_prefix_is_told_to_turn_caching_off(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    apps = client.AppsV1Api(cluster.api)
    with contextlib.ExitStack() as stack:
        engine = spawn_engine(write_tiny_checkpoint(tmp_path / "tiny"), tmp_path / "engine", SHAPE)
        stack.callback(stop_engine, engine)
        wait_engine_ready(engine)
        prometheus = Prometheus(tmp_path / "prometheus", [], None)
        stack.callback(prometheus.stop)
        prometheus.start([engine_scrape(engine, (namespace, f"{NAME}-0", NAME))])
        assert prometheus.service is not None
        operator = OperatorProcess(
            cluster.kubeconfig, namespace, tmp_path / "operator",
            extra_env={"PAGEKEEPER_PROMETHEUS_URL": prometheus.service.url},
        )  # fmt: skip
        stack.callback(operator.stop)
        operator.wait_ready()
        cluster.apply_yaml([llmserver(NAME, SPEC)], "-n", namespace)
        wait_ready_pods(cluster, namespace, NAME, 1)
        before = wait_settled(cluster, namespace)
        versions = owned_versions(cluster, namespace, before)
        pods = [(p.metadata.name, p.metadata.uid) for p in server_pods(cluster, namespace, NAME)]
        num_writes = num_writes_logged(operator, namespace)
        assert num_writes >= len(versions)  # each object was applied once at least: it counts
        assert "--enable-prefix-caching" in engine_args(apps, namespace)
        load = stack.enter_context(UniquePrompts(engine.url, SHAPE.model_name))

        def recommended() -> dict[str, Any] | None:
            recs = get_server(cluster, namespace, NAME).get("status", {}).get("recommendations")
            return next((r for r in recs or [] if r["field"] == "enablePrefixCaching"), None)

        try:
            rec = wait_for(
                recommended, timeout=WINDOW_TIMEOUT_S, interval=2, what="a recommendation"
            )
        except AssertionError:
            print(operator.log_tail(8000), load.errors[:3], load.num_sent)
            raise
        assert (rec["current"], rec["proposed"], rec["rule"]) == (
            "true",
            "false",
            "prefix-caching-off",
        )
        evidence = {e["name"]: e["value"] for e in rec["evidence"]}
        assert evidence["prefixHitRate"] < 0.3 and evidence["prefixQueryTokens"] >= 50_000

        # Recommend mode: nothing but status was written, and one Event said so.
        after = get_server(cluster, namespace, NAME)
        assert after["status"]["recommendations"] != before["status"].get("recommendations")
        assert after["spec"] == before["spec"]
        assert without_status_writes(after["metadata"]) == without_status_writes(before["metadata"])
        assert owned_versions(cluster, namespace, after) == versions
        assert [
            (p.metadata.name, p.metadata.uid) for p in server_pods(cluster, namespace, NAME)
        ] == pods
        assert num_writes_logged(operator, namespace) == num_writes
        events = [
            e.message
            for e in server_events(cluster, namespace, NAME)
            if e.reason == "TuningRecommendation" and e.message.startswith("enablePrefixCaching")
        ]
        assert len(events) == 1  # not one per reconcile
        assert events[0].startswith("enablePrefixCaching true -> false (prefix-caching-off")

        # Accepted by annotation: the pods run it, spec still says true.
        cluster.kubectl(
            "annotate", "llmserver", NAME, "-n", namespace,
            "pagekeeper.dev/accept-recommendation=enablePrefixCaching",
        )  # fmt: skip
        wait_for(
            lambda: "--no-enable-prefix-caching" in engine_args(apps, namespace),
            timeout=60,
            what="the Deployment running the accepted change",
        )

        # the reconcile applies the Deployment first and writes status after it
        def recorded() -> dict[str, Any] | None:
            obj = get_server(cluster, namespace, NAME)
            return obj if obj.get("status", {}).get("tuning", {}).get("changes") else None

        status = wait_for(recorded, timeout=60, what="the accepted change in status")
    [change] = status["status"]["tuning"]["changes"]
    assert (change["field"], change["value"], change["source"]) == (
        "enablePrefixCaching",
        "false",
        "Accepted",
    )
    assert status["spec"]["memoryPolicy"]["enablePrefixCaching"] is True
    assert status["status"]["effectiveMemoryPolicy"]["enablePrefixCaching"] is False
