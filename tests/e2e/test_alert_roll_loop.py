"""The alert -> roll loop with real parts only.

A local control plane runs two LLMServers whose pods sit on KWOK GPU nodes; the operator runs as
a subprocess with its webhook on loopback; one engine runs on the CPU with a tiny KV pool, and a
real Prometheus scrapes it as if it were one of those pods, with the operator's rendered rules
loaded; a real Alertmanager posts to the webhook. Streaming load fills the KV pool, the
saturation alert fires, and the operator must evict exactly that pod through the Eviction API,
leave the other pod of the server alone for the cooldown, and be refused by a user's
PodDisruptionBudget on the second server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from harness.cluster import Cluster, wait_for
from harness.cpu_engine import (
    EngineShape,
    StreamingLoad,
    spawn_engine,
    stop_engine,
    wait_engine_ready,
    write_tiny_checkpoint,
)
from harness.loop import (
    OperatorProcess,
    PodWatch,
    get_server,
    history,
    install_crd,
    llmserver,
    restrict_namespace,
    rules_file,
    server_events,
    server_pods,
    wait_history,
    wait_ready_pods,
)
from harness.processes import prometheus_alerts, start_alertmanager
from harness.prometheus import Prometheus, engine_scrape

SHAPE = EngineShape()
ALERT = "PagekeeperKVCacheSaturated"
REMEDIATION = {
    "cooldownSeconds": 600,
    "hysteresisSeconds": 2,
    "maxUnavailable": 1,
    "drainTimeoutSeconds": 60,
    "triggers": {
        # The tiny pool sits between 0.7 and 1.0 under load and at 0 when idle.
        "kvCacheSaturation": {"threshold": 0.5, "for": "3s"},
        "fragmentation": {"enabled": False},
        "queueBacklog": {"enabled": False},
        "engineStalled": {"enabled": False},
    },
}
# Remediation acts within seconds of an alert; the retry of a deferred one takes up to 15 s.
ACT_TIMEOUT_S = 90


def server_spec(replicas: int) -> dict[str, Any]:
    return {
        "model": {
            "source": "/models/tiny-llama",
            "servedModelName": SHAPE.model_name,
            "loadFormat": "dummy",
        },
        "replicas": replicas,
        "resources": {"gpus": 1},
        "remediation": REMEDIATION,
        "shutdownGracePeriodSeconds": 60,
    }


def user_budget(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "guarded-budget", "namespace": namespace},
        "spec": {
            "maxUnavailable": 0,
            "selector": {"matchLabels": {"pagekeeper.dev/llmserver": "guarded"}},
        },
    }


@contextlib.contextmanager
def logs_on_failure(*logs: Path) -> Iterator[None]:
    """Print the tail of each log when the block fails (pytest shows captured output)."""
    try:
        yield
    except BaseException:
        for log in logs:
            if log.exists():
                print(f"===== {log.name} =====\n{log.read_text(errors='replace')[-6000:]}")
        raise


def read_or_none(read: Any, *args: Any) -> Any:
    try:
        return read(*args)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def disown_budget(cluster: Cluster, namespace: str) -> None:
    """Turn the guarded server's managed budget off; the operator must delete the one it made."""
    policy = client.PolicyV1Api(cluster.api)
    managed = policy.read_namespaced_pod_disruption_budget("guarded", namespace)
    assert managed.spec.max_unavailable == 1
    cluster.kubectl(
        "patch", "llmserver", "guarded", "-n", namespace, "--type", "merge",
        "-p", '{"spec": {"disruptionBudget": {"managed": false}}}',
    )  # fmt: skip
    wait_for(
        lambda: (
            read_or_none(policy.read_namespaced_pod_disruption_budget, "guarded", namespace) is None
        ),
        timeout=60,
        what="the managed PodDisruptionBudget deleted",
    )
    cluster.apply_yaml(user_budget(namespace))

    def counted() -> bool:
        pdb = policy.read_namespaced_pod_disruption_budget("guarded-budget", namespace)
        status = pdb.status
        return bool(status and status.expected_pods == 1 and status.disruptions_allowed == 0)

    wait_for(counted, timeout=60, what="the user's budget to count the guarded pod")


def check_rendered_monitoring(cluster: Cluster, namespace: str, rules: Path) -> None:
    """The rules Prometheus loads are the PrometheusRule the operator applied, and its
    ServiceMonitor gives series the labels those rules select on."""
    custom = client.CustomObjectsApi(cluster.api)
    rule = custom.get_namespaced_custom_object(
        "monitoring.coreos.com", "v1", namespace, "prometheusrules", "loop-memory-alerts"
    )
    assert yaml.safe_load(rules.read_text())["groups"] == rule["spec"]["groups"]
    assert [r["alert"] for r in rule["spec"]["groups"][0]["rules"]] == [
        ALERT,
        "PagekeeperOOMEvents",
        "PagekeeperHostMemoryNearLimit",
        "PagekeeperKVOffloadOverCapacity",
    ]
    monitor = custom.get_namespaced_custom_object(
        "monitoring.coreos.com", "v1", namespace, "servicemonitors", "loop"
    )
    relabelings = monitor["spec"]["endpoints"][0]["relabelings"]
    assert [(r["sourceLabels"], r["targetLabel"]) for r in relabelings] == [
        (["__meta_kubernetes_namespace"], "namespace"),
        (["__meta_kubernetes_pod_name"], "pod"),
        (["__meta_kubernetes_pod_label_pagekeeper_dev_llmserver"], "llmserver"),
    ]


def firing_pods(prometheus: Prometheus) -> set[tuple[str, str]]:
    assert prometheus.service is not None
    return {
        (alert["labels"]["llmserver"], alert["labels"]["pod"])
        for alert in prometheus_alerts(prometheus.service)
        if alert["state"] == "firing" and alert["labels"]["alertname"] == ALERT
    }


@pytest.mark.e2e
def test_memory_alert_evicts_the_pod_at_fault_and_nothing_else(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    with contextlib.ExitStack() as stack:
        # The engine's imports and load take longest: start it first, wait for it last.
        engine = spawn_engine(write_tiny_checkpoint(tmp_path / "model"), tmp_path / "engine", SHAPE)
        stack.callback(stop_engine, engine)
        operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator")
        stack.callback(operator.stop)
        stack.enter_context(logs_on_failure(operator.log, engine.log))
        operator.wait_ready()

        cluster.apply_yaml(
            [llmserver("loop", server_spec(2)), llmserver("guarded", server_spec(1))],
            "-n",
            namespace,
        )
        first, second = wait_ready_pods(cluster, namespace, "loop", 2)
        (guarded,) = wait_ready_pods(cluster, namespace, "guarded", 1)
        disown_budget(cluster, namespace)
        loop_rules = rules_file(cluster, namespace, "loop", tmp_path / "loop-rules.yml")
        guarded_rules = rules_file(cluster, namespace, "guarded", tmp_path / "guarded-rules.yml")
        check_rendered_monitoring(cluster, namespace, loop_rules)
        uid_of = {
            pod.metadata.name: pod.metadata.uid for pod in server_pods(cluster, namespace, "loop")
        }

        wait_engine_ready(engine)
        alertmanager = start_alertmanager(
            tmp_path / "alertmanager", operator.webhook_url, operator.token
        )
        stack.callback(alertmanager.stop)
        prometheus = Prometheus(tmp_path / "prometheus", [loop_rules, guarded_rules], alertmanager)
        stack.callback(prometheus.stop)
        prometheus.start([engine_scrape(engine, (namespace, first, "loop"))])
        stack.enter_context(logs_on_failure(prometheus.config_path, alertmanager.log))
        pods = PodWatch(cluster.kubeconfig, namespace).start()
        stack.callback(pods.stop)
        load = StreamingLoad(engine.url, SHAPE.model_name).start()
        stack.callback(load.stop)

        # 1. The alert names the first pod: it alone is evicted, through the Eviction API.
        evicted = wait_history(
            cluster, namespace, "loop", ACT_TIMEOUT_S, pod=first, action="evict", outcome="evicted"
        )
        assert evicted["alert"] == ALERT
        assert evicted["message"] == f"{ALERT}: evicted {namespace}/{first}"
        # 2. Now the series say they come from the other pod of the same server, and from the
        # guarded server's pod.
        prometheus.reload(
            [engine_scrape(engine, (namespace, second, "loop"), (namespace, guarded, "guarded"))]
        )
        replaced = wait_ready_pods(cluster, namespace, "loop", 2)
        assert first not in replaced and second in replaced
        pods.wait_seen(lambda w: w.disruption_of(first), f"{first}'s eviction")
        reason, _ = pods.disruption_of(first) or ("", "")
        assert reason == "EvictionByEvictionAPI"

        # 3. The second pod's alert is deferred for the cooldown; the guarded pod's eviction is
        # refused by the user's budget (429), recorded, and not forced.
        deferred = wait_history(
            cluster, namespace, "loop", ACT_TIMEOUT_S, pod=second, action="skip"
        )
        blocked = wait_history(
            cluster, namespace, "guarded", ACT_TIMEOUT_S, pod=guarded, action="evict"
        )
        # Still firing for both: the cooldown and the budget are what hold them back. The
        # first pod's alert resolved when the reload made its series stale.
        wait_for(
            lambda: firing_pods(prometheus) == {("loop", second), ("guarded", guarded)},
            timeout=30,
            what="alerts firing for the second and the guarded pod only",
        )
        load.stop()
        assert load.num_completed > 0, load.last_error

    assert deferred["outcome"] == "skipped"
    assert deferred["message"].startswith(f"{ALERT}: cooldown: cooldown until ")
    assert blocked["outcome"] == "pdb-blocked"
    assert blocked["message"] == (
        f"{ALERT}: eviction of {namespace}/{guarded} refused (429): Too Many Requests; "
        "a PodDisruptionBudget forbids it"
    )
    assert pods.error is None
    assert not pods.was_deleted(second) and not pods.was_deleted(guarded)
    still = {pod.metadata.name: pod for pod in server_pods(cluster, namespace, "loop")}
    assert still[second].metadata.uid == uid_of[second]
    assert [pod.metadata.name for pod in server_pods(cluster, namespace, "guarded")] == [guarded]

    loop_status = get_server(cluster, namespace, "loop")["status"]
    assert [(e["pod"], e["action"], e["outcome"]) for e in history(cluster, namespace, "loop")] == [
        (first, "evict", "evicted"),
        (second, "skip", "skipped"),
    ]
    assert loop_status["lastRemediation"] == evicted["time"]
    # One record a firing: a busy machine can let the guarded pod's alert resolve and fire
    # again (a new firing, its own refusal on record), never two records for one firing.
    guarded_history = history(cluster, namespace, "guarded")
    firings = [e["alertStartsAt"] for e in guarded_history]
    assert len(set(firings)) == len(firings), guarded_history
    assert {(e["pod"], e["action"], e["outcome"]) for e in guarded_history} == {
        (guarded, "evict", "pdb-blocked")
    }
    loop_events = {(e.reason, e.message) for e in server_events(cluster, namespace, "loop")}
    assert ("PodEvicted", evicted["message"]) in loop_events
    assert ("RemediationDeferred", deferred["message"]) in loop_events
    guarded_events = [(e.type, e.reason) for e in server_events(cluster, namespace, "guarded")]
    assert guarded_events == [("Warning", "EvictionBlocked")] * len(firings)
