"""`make demo`: the alert -> roll loop on this machine, narrated, in a few minutes;
`make demo-autoscale` (`--autoscaling`): the autoscaling scene instead (`demo_autoscaling`).

Provisions the local control plane (hack/provision.sh, skipping what is cached), starts a
cluster with fake GPU nodes, installs the chart's CRDs, runs the operator, applies an LLMServer
like examples/llmserver-small.yaml, its OpenAI endpoints locked by an API key from a Secret
(spec.apiKey), starts the engine on the CPU with a tiny dummy model and that key, and scrapes it
with a real Prometheus as if it were one of the server's pods, with the operator's alert rules
loaded and a real Alertmanager posting to the operator's webhook. Streaming load, sending the
key, fills the engine's KV cache until PagekeeperKVCacheSaturated fires; the operator evicts that
pod through the Eviction API and the Deployment replaces it. Everything it started is stopped on
exit, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

import demo_autoscaling  # hack/, beside this script
import kubernetes
import yaml
from prometheus_client.parser import text_string_to_metric_families

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
    restrict_namespace,
    rules_file,
    server_pods,
    wait_ready_pods,
)
from harness.processes import Service, prometheus_alerts, start_alertmanager
from harness.prometheus import Prometheus, engine_scrape
from harness.tools import REPO
from pagekeeper_operator.alerts.render import ALERT_KV_CACHE_SATURATED

CLUSTER_NAME = "pagekeeper-demo"
NAMESPACE = "pagekeeper-demo"
EXAMPLE = REPO / "examples" / "llmserver-small.yaml"
SHAPE = EngineShape(model_name="qwen3-0.6b")
ALERT_TIMEOUT_S = 150
API_KEY_SECRET = "demo-openai"  # spec.apiKey's Secret; its key `api-key` (the default)
STARTED = time.monotonic()


def say(text: str) -> None:
    elapsed = time.monotonic() - STARTED
    print(f"[demo {int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] {text}", flush=True)


def show(title: str, text: str) -> None:
    print(f"\n----- {title} -----\n{text.rstrip()}\n", flush=True)


def run(*argv: str, timeout: float = 1800) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result.stdout


def api_key_secret(key: str) -> dict[str, Any]:
    """The Secret spec.apiKey names, holding `key` under `api-key`."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": API_KEY_SECRET},
        "type": "Opaque",
        "stringData": {"api-key": key},
    }


def create_api_key(cluster: Cluster) -> str:
    """A fresh API key in the namespace's Secret, created before any LLMServer names it (a
    server whose Secret is missing gets no pods until it exists)."""
    key = secrets.token_hex(24)  # hex: a key that begins with "-" would read as a flag
    cluster.apply_yaml(api_key_secret(key), "-n", NAMESPACE)
    say(f"Secret {API_KEY_SECRET} holds the OpenAI endpoints' API key (spec.apiKey names it)")
    return key


def demo_server() -> dict[str, Any]:
    """The small example, made to fit the demo: two replicas, no model volume (the engine pods
    are KWOK's and run nothing), remediation that acts within seconds, not minutes, and the
    OpenAI endpoints locked by the demo's API key."""
    server: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec = server["spec"]
    spec["replicas"] = 2
    spec["apiKey"] = {"secretName": API_KEY_SECRET}
    spec["model"]["loadFormat"] = "dummy"
    spec.pop("podTemplate", None)
    spec["remediation"].update(
        hysteresisSeconds=5,
        cooldownSeconds=600,
        triggers={"kvCacheSaturation": {"threshold": 0.5, "for": "5s"}},
    )
    return server


def kv_usage(engine: Service) -> str:
    """The engine's KV cache usage and queue, from its /metrics."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = sample.value
    usage = values.get("vllm:kv_cache_usage_perc", 0.0)
    running = int(values.get("vllm:num_requests_running", 0))
    waiting = int(values.get("vllm:num_requests_waiting", 0))
    return f"KV cache {usage:4.0%}, {running} running, {waiting} waiting"


def alert_state(prometheus: Prometheus, pod: str) -> str:
    assert prometheus.service is not None
    for alert in prometheus_alerts(prometheus.service):
        if alert["labels"].get("pod") == pod and alert["labels"]["alertname"] == (
            ALERT_KV_CACHE_SATURATED
        ):
            return str(alert["state"])
    return "inactive"


def get_pods(cluster: Cluster) -> str:
    return cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide").stdout


def drive_until_evicted(
    cluster: Cluster, engine: Service, prometheus: Prometheus, name: str, pod: str
) -> dict[str, Any]:
    """Report load and alert state every few seconds until the operator evicts `pod`."""
    deadline = time.monotonic() + ALERT_TIMEOUT_S
    last_state = ""
    while time.monotonic() < deadline:
        for entry in history(cluster, NAMESPACE, name):
            if entry["pod"] == pod and entry["action"] == "evict":
                return entry
        state = alert_state(prometheus, pod)
        if state not in (last_state, "inactive"):
            say(f"Prometheus: {ALERT_KV_CACHE_SATURATED} is {state} for pod {pod}")
            last_state = state
        with contextlib.suppress(urllib.error.URLError, ConnectionError):
            say(f"engine: {kv_usage(engine)}; alert {state}")
        time.sleep(3)
    raise TimeoutError(f"no eviction of {pod} within {ALERT_TIMEOUT_S} s")


def ready_code(engine: Service) -> int:
    try:
        with urllib.request.urlopen(f"{engine.url}/ready", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


def drain_engine(engine: Service, load: StreamingLoad, pod: str) -> None:
    """What the evicted pod's engine does on SIGTERM, shown on the CPU engine standing in."""
    say(f"the kubelet sends SIGTERM to the engine of {pod}; the CPU engine stands in for it")
    load.stop_new()
    num_completed, num_in_flight = load.num_completed, load.num_in_flight
    engine.proc.send_signal(signal.SIGTERM)
    while engine.proc.poll() is None:
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            say(f"engine draining: /ready answers {ready_code(engine)}; {kv_usage(engine)}")
        time.sleep(1)
    load.join()
    finished = load.num_completed - num_completed
    say(
        f"engine exited with code {engine.proc.returncode}: {finished} of the {num_in_flight} "
        f"requests in flight at SIGTERM finished, {load.num_failed} failed"
    )


def demo(stack: contextlib.ExitStack, workdir: Path, autoscaling: bool = False) -> None:
    say("provisioning the local control plane (hack/provision.sh; cached steps are skipped)")
    run("bash", str(REPO / "hack" / "provision.sh"), "all")

    say(f"starting cluster {CLUSTER_NAME}: etcd, kube-apiserver, controllers, KWOK GPU nodes")
    cluster_sh = str(REPO / "hack" / "cluster.sh")
    stack.callback(say, "cluster deleted")
    stack.callback(run, "bash", cluster_sh, "down", CLUSTER_NAME)
    kubeconfig = run("bash", cluster_sh, "up", CLUSTER_NAME, timeout=300).strip()
    api = kubernetes.config.new_client_from_config(config_file=kubeconfig)
    stack.callback(api.close)
    cluster = Cluster(name=CLUSTER_NAME, kubeconfig=kubeconfig, api=api, owned=True)
    show("kubectl get nodes", cluster.kubectl("get", "nodes").stdout)

    say("installing the chart's CRDs (charts/pagekeeper/crds/)")
    crds = REPO / "charts" / "pagekeeper" / "crds"
    cluster.kubectl("apply", "--server-side", "-f", str(crds))
    install_crd(cluster, crds / "llmservers.pagekeeper.dev.yaml")  # and wait until Established
    cluster.kubectl("create", "namespace", NAMESPACE)
    restrict_namespace(cluster, NAMESPACE)
    api_key = create_api_key(cluster)
    if autoscaling:
        demo_autoscaling.scene(
            stack, workdir, cluster, NAMESPACE, say, show, API_KEY_SECRET, api_key
        )
        return

    # The engine's imports and load take longest: start it now, wait for it later.
    say(
        "starting the engine on the CPU: a tiny Llama with dummy weights, 32 KV blocks of 8, "
        "the API key as its pods get it (--api-key)"
    )
    checkpoint = write_tiny_checkpoint(workdir / "model")
    engine = spawn_engine(checkpoint, workdir / "engine", SHAPE, ["--api-key", api_key])
    stack.callback(say, "engine stopped")
    stack.callback(stop_engine, engine)

    say(f"starting the operator, watching namespace {NAMESPACE}")
    operator = OperatorProcess(kubeconfig, NAMESPACE, workdir / "operator")
    stack.callback(operator.stop)
    operator.wait_ready()
    say(f"operator up; Alertmanager webhook at {operator.webhook_url} (bearer token file)")

    server = demo_server()
    name = server["metadata"]["name"]
    say(
        f"applying LLMServer {name} (examples/llmserver-small.yaml, 2 replicas, KV alert at 50%, "
        f"spec.apiKey from Secret {API_KEY_SECRET})"
    )
    cluster.apply_yaml(server, "-n", NAMESPACE)
    first, second = wait_ready_pods(cluster, NAMESPACE, name, 2)
    wait_for(
        lambda: get_server(cluster, NAMESPACE, name).get("status", {}).get("readyReplicas") == 2,
        timeout=60,
        what=f"LLMServer {name} status with 2 ready replicas",
    )
    say(f"LLMServer {name}: 2 ready replicas on KWOK GPU nodes")
    show("kubectl get pods (before)", get_pods(cluster))

    wait_engine_ready(engine)
    say(f"engine ready at {engine.url}")
    rules = rules_file(cluster, NAMESPACE, name, workdir / "rules.yml")
    show("alert rules rendered by the operator (rules file)", rules.read_text())
    alertmanager = start_alertmanager(
        workdir / "alertmanager", operator.webhook_url, operator.token
    )
    stack.callback(alertmanager.stop)
    say(f"Alertmanager at {alertmanager.url}, posting to the operator's webhook")
    prometheus = Prometheus(workdir / "prometheus", [rules], alertmanager)
    stack.callback(prometheus.stop)
    prometheus.start([engine_scrape(engine, (NAMESPACE, first, name))])
    assert prometheus.service is not None
    say(f"Prometheus at {prometheus.service.url}: the engine's series carry pod={first}")

    pods = PodWatch(kubeconfig, NAMESPACE).start()
    stack.callback(pods.stop)
    say(f"driving load: {8} concurrent streaming completions of 160 tokens each, with the key")
    load = StreamingLoad(engine.url, SHAPE.model_name, api_key=api_key).start()
    stack.callback(load.stop)
    evicted = drive_until_evicted(cluster, engine, prometheus, name, first)
    say(f"operator: {evicted['outcome']} {first} ({evicted['message']})")
    disruption = pods.disruption_of(first)
    if disruption is not None:
        say(f"pod {first}: DisruptionTarget condition, reason {disruption[0]}: draining")
    show("kubectl get pods (right after the eviction)", get_pods(cluster))
    drain_engine(engine, load, first)

    say("waiting for the Deployment to replace the pod")

    def replaced() -> list[str] | None:
        names = [p.metadata.name for p in server_pods(cluster, NAMESPACE, name)]
        return names if first not in names and len(names) == 2 else None

    wait_for(replaced, timeout=90, what=f"{first} replaced")
    after = wait_ready_pods(cluster, NAMESPACE, name, 2)
    say(f"replaced: {first} -> {next(p for p in after if p != second)}; {second} untouched")
    show("kubectl get pods (after)", get_pods(cluster))
    body = get_server(cluster, NAMESPACE, name)
    status_text = yaml.safe_dump(
        {
            "lastRemediation": body["status"].get("lastRemediation"),
            "remediationHistory": body["status"].get("remediationHistory"),
        },
        sort_keys=False,
    )
    show(f"LLMServer {name} status", status_text)
    columns = "TYPE:.type,REASON:.reason,OBJECT:.involvedObject.name,MESSAGE:.message"
    events = cluster.kubectl(
        "get", "events", "-n", NAMESPACE, "--field-selector", "involvedObject.kind=LLMServer",
        "-o", f"custom-columns={columns}",
    )  # fmt: skip
    show("Events of the LLMServer", events.stdout)
    say(f"load: {load.num_completed} requests completed, {load.num_failed} failed")


def main() -> int:
    def stop(signum: int, _: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGINT explicitly too: a shell may start a background job with SIGINT ignored.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    with tempfile.TemporaryDirectory(prefix="pagekeeper-demo-") as tmp:
        try:
            with contextlib.ExitStack() as stack:
                stack.callback(say, "cleaned up")
                try:
                    demo(stack, Path(tmp), autoscaling="--autoscaling" in sys.argv[1:])
                finally:
                    # Each step of the cleanup is bounded; a second Ctrl-C must not cut it short.
                    for signum in (signal.SIGINT, signal.SIGTERM):
                        signal.signal(signum, signal.SIG_IGN)
                    say("cleaning up: load, Prometheus, the adapter, operator, engine, cluster")
        except KeyboardInterrupt:
            say("interrupted; everything it started is stopped")
            return 130
        except (RuntimeError, TimeoutError, AssertionError) as error:
            for log in sorted(Path(tmp).rglob("*.log")):
                show(f"{log.name} (last lines)", log.read_text(errors="replace")[-3000:])
            say(f"failed: {error}")
            return 1
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
