"""Apply mode with real parts: a recommendation runs on a canary and is kept only when it wins.

Two servers in Apply mode on the local control plane (KWOK GPU nodes), the operator as a
subprocess with PAGEKEEPER_PROMETHEUS_URL set, and a real Prometheus scraping plain HTTP
exporters as the servers' pods. Every exporter reports prompts that never share a prefix (so the
tuner recommends turning prefix caching off) and output tokens at its own steady rate. Once the
trial's canary pod exists it is scraped as an exporter 20% faster than the others for one
server (a measured win: promoted, every replica runs it) and 20% slower for the other (a loss:
rolled back, the field held, no second trial within the hold-off).
"""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client

from pagekeeper_operator.resync import RESYNC_DONE
from tests.support.cluster import Cluster, wait_for
from tests.support.loop import (
    OperatorProcess,
    Prometheus,
    get_server,
    install_crd,
    llmserver,
    pod_scrape,
    restrict_namespace,
    server_events,
    server_pods,
    wait_ready_pods,
)

BASE_TOKENS_PER_S = 1000.0
TRIAL_TIMEOUT_S = 240  # the first window's data, the trial's window, a resync or two
SPEC: dict[str, Any] = {
    "model": {"source": "/models/tiny-llama", "servedModelName": "tiny", "loadFormat": "dummy"},
    "replicas": 2,
    "resources": {"gpus": 1},
    "rollout": {"canary": {"enabled": True, "replicas": 1, "analysisSeconds": 3600}},
    "tuning": {"mode": "Apply", "windowSeconds": 60, "holdOffSeconds": 3600},
}


@contextlib.contextmanager
def exporter(tokens_per_s: float) -> Iterator[int]:
    """/metrics of an engine that sees only new prompts and writes `tokens_per_s`; its port."""
    start = time.monotonic()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            t = time.monotonic() - start
            labels = 'model_name="tiny"'
            body = (
                "# TYPE vllm:generation_tokens_total counter\n"
                f"vllm:generation_tokens_total{{{labels}}} {t * tokens_per_s}\n"
                "# TYPE vllm:prefix_cache_queries_total counter\n"
                f"vllm:prefix_cache_queries_total{{{labels}}} {t * 2000}\n"
                "# TYPE vllm:prefix_cache_hits_total counter\n"
                f"vllm:prefix_cache_hits_total{{{labels}}} 0\n"
                "# TYPE vllm:request_success_total counter\n"
                f'vllm:request_success_total{{{labels},finished_reason="stop"}} {t * 4}\n'
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def canary_pod(cluster: Cluster, namespace: str, name: str) -> str | None:
    for pod in server_pods(cluster, namespace, name):
        if (pod.metadata.labels or {}).get("pagekeeper.dev/canary") == "true":
            return str(pod.metadata.name)
    return None


def engine_args(apps: client.AppsV1Api, namespace: str, name: str) -> list[str]:
    container = apps.read_namespaced_deployment(name, namespace).spec.template.spec.containers[0]
    return [*(container.command or []), *(container.args or [])]


def tuning(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = get_server(cluster, namespace, name).get("status") or {}
    return status.get("tuning") or {}


def test_a_winning_canary_is_promoted_and_a_losing_one_rolled_back_and_held(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    apps = client.AppsV1Api(cluster.api)
    names = {"wins": 1.2, "loses": 0.8}
    with contextlib.ExitStack() as stack:
        baseline = stack.enter_context(exporter(BASE_TOKENS_PER_S))
        faster = {n: stack.enter_context(exporter(BASE_TOKENS_PER_S * f)) for n, f in names.items()}
        prometheus = Prometheus(tmp_path / "prometheus", [], None)
        stack.callback(prometheus.stop)
        prometheus.start([])
        assert prometheus.service is not None
        operator = OperatorProcess(
            cluster.kubeconfig, namespace, tmp_path / "operator",
            extra_env={"PAGEKEEPER_PROMETHEUS_URL": prometheus.service.url},
        )  # fmt: skip
        stack.callback(operator.stop)
        operator.wait_ready()
        cluster.apply_yaml([llmserver(name, SPEC) for name in names], "-n", namespace)
        pods = {name: wait_ready_pods(cluster, namespace, name, 2) for name in names}
        base_targets = [(namespace, pod, name) for name in names for pod in pods[name]]
        jobs = [pod_scrape(baseline, *base_targets, job="baseline")]
        prometheus.reload(jobs)

        try:
            canaries = {
                name: wait_for(
                    lambda name=name: canary_pod(cluster, namespace, name),
                    timeout=TRIAL_TIMEOUT_S,
                    interval=2,
                    what=f"the canary pod of {name}",
                )
                for name in names
            }
        except AssertionError:
            print(operator.log_tail(8000))
            raise
        for name in names:
            trial = tuning(cluster, namespace, name)["trial"]
            assert (trial["field"], trial["proposed"]) == ("enablePrefixCaching", "false")
        prometheus.reload(
            [*jobs, *(pod_scrape(faster[n], (namespace, canaries[n], n), job=n) for n in names)]
        )

        def decided(name: str) -> dict[str, Any] | None:
            history = tuning(cluster, namespace, name).get("history") or []
            return history[-1] if history else None

        try:
            won = wait_for(lambda: decided("wins"), timeout=TRIAL_TIMEOUT_S, interval=2,
                           what="the trial of wins decided")  # fmt: skip
            lost = wait_for(lambda: decided("loses"), timeout=TRIAL_TIMEOUT_S, interval=2,
                            what="the trial of loses decided")  # fmt: skip
        except AssertionError:
            print(operator.log_tail(8000))
            raise
        assert won["outcome"] == "Promoted", won
        assert lost["outcome"] == "RolledBack", lost
        numbers = {e["name"]: e["value"] for e in won["evidence"]}
        assert numbers["improvement"] > 0.1 and numbers["pValue"] < 0.05
        assert {e["name"]: e["value"] for e in lost["evidence"]}["improvement"] < -0.1

        # The win runs everywhere; the loss left the pods as they were.
        wait_for(
            lambda: "--no-enable-prefix-caching" in engine_args(apps, namespace, "wins"),
            timeout=60, what="every replica of wins running the promoted change",
        )  # fmt: skip
        assert "--enable-prefix-caching" in engine_args(apps, namespace, "loses")
        for name in names:
            wait_for(
                lambda name=name: canary_pod(cluster, namespace, name) is None,
                timeout=90, what=f"the canary of {name} gone",
            )  # fmt: skip
        wins = get_server(cluster, namespace, "wins")
        assert wins["spec"]["memoryPolicy"]["enablePrefixCaching"] is True
        assert wins["status"]["effectiveMemoryPolicy"]["enablePrefixCaching"] is False
        reasons = {e.reason for e in server_events(cluster, namespace, "wins")}
        assert {"TuningTrialStarted", "TuningPromoted"} <= reasons
        assert "TuningRolledBack" in {e.reason for e in server_events(cluster, namespace, "loses")}

        # Within the hold-off the losing change is neither recommended nor tried again.
        held = tuning(cluster, namespace, "loses")
        assert [h["field"] for h in held["holdOffs"]] == ["enablePrefixCaching"]
        rounds = operator.log_tail(10**7).count(RESYNC_DONE)
        wait_for(
            lambda: operator.log_tail(10**7).count(RESYNC_DONE) >= rounds + 3,
            timeout=90, what="three more resync rounds",
        )  # fmt: skip
        again = get_server(cluster, namespace, "loses")["status"]
        assert again["tuning"].get("trial") is None
        assert len(again["tuning"]["history"]) == 1
        assert all(r["field"] != "enablePrefixCaching" for r in again.get("recommendations", []))
