"""Every pod of one LLMServer running the CPU engine as its stand-in, with what a kubelet does
around a pod's end, and a client that routes the way a Service or an endpoint picker does.

`PodFleet` watches the server's pods. Each new pod gets an engine started from the pod's
Deployment's rendered command (`standin`); it counts as ready, as a readiness probe would first
pass, once the engine's /ready answers. When the pod is deleted (an eviction), its engine ends
as a kubelet ends a container: the preStop sleep the pod renders, then SIGTERM, then up to the
termination grace period before SIGKILL. Just before the SIGTERM the fleet opens one long
streaming request to the engine (`DrainProbe`), and right after it asks /ready and sends one
more completion: what a router that has not yet seen the endpoint go would meet.

`EndpointRouter` sends each request to a pod that its Service's EndpointSlices list as ready,
as kube-proxy does (and, for the pods' port, the InferencePool's endpoint picker, which drops
a pod that is not Ready or is being deleted); KWOK marks a pod Ready without running anything,
so a pod whose engine is not ready yet is not routed to either. A 503 or 429 with Retry-After
is retried on another pod; anything else is a lost request, recorded as it came.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from harness.cpu_engine import spawn_argv, wait_engine_ready
from harness.processes import Service, free_port, stop_process
from pagekeeper_operator.render.meta import SERVER_LABEL
from tests.support.standin import rendered_command, standin_argv

RETRYABLE = (429, 503)


@dataclass
class DrainProbe:
    """What the fleet saw of one pod's engine at its SIGTERM."""

    stream_text: str = ""  # the long stream opened before SIGTERM, as read to its end
    stream_finish_reason: str | None = None
    ready_status: int | None = None  # /ready right after SIGTERM
    refused_status: int | None = None  # a completion sent right after SIGTERM
    refused_retry_after: str | None = None
    exit_code: int | None = None
    errors: list[str] = field(default_factory=list)


def _post(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode(errors="replace")


class PodFleet:
    """A stand-in engine for each pod of server `name` while the pod exists (see module)."""

    def __init__(
        self, kubeconfig: str, namespace: str, name: str, checkpoint: Path, workdir: Path
    ) -> None:
        self.api = config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig
        )
        self.namespace, self.name = namespace, name
        self.checkpoint, self.workdir = checkpoint, workdir
        self.model = ""
        self.engines: dict[str, Service] = {}
        self.ready: set[str] = set()
        self.drains: dict[str, DrainProbe] = {}
        self.error: Exception | None = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._watch = watch.Watch()  # type: ignore[no-untyped-call]
        self._is_stopping = False

    def start(self) -> PodFleet:
        self._spawn(self._run, "fleet-watch")
        return self

    def url_of(self, pod: str) -> str | None:
        """The engine of a ready pod; None for one not ready (or gone)."""
        with self._lock:
            engine = self.engines.get(pod)
            return engine.url if engine is not None and pod in self.ready else None

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run(self) -> None:
        core = client.CoreV1Api(self.api)
        selector = f"{SERVER_LABEL}={self.name}"
        try:
            events = self._watch.stream(  # type: ignore[no-untyped-call]
                core.list_namespaced_pod, self.namespace, label_selector=selector
            )
            for event in events:
                pod = event["object"]
                name = str(pod.metadata.name)
                is_ending = event["type"] == "DELETED" or pod.metadata.deletion_timestamp
                with self._lock:
                    is_new = name not in self.engines and name not in self.drains
                    is_running = name in self.engines and name not in self.drains
                if is_ending and is_running:
                    with self._lock:
                        self.drains[name] = DrainProbe()
                        self.ready.discard(name)
                    self._spawn(self._end, f"end-{name}", name, pod)
                elif not is_ending and is_new:
                    self._start_engine(name)
        except (ApiException, ValueError, urllib3.exceptions.HTTPError) as exc:
            if not self._is_stopping:
                self.error = exc

    def _start_engine(self, pod: str) -> None:
        apps = client.AppsV1Api(self.api)
        rendered = rendered_command(apps, self.namespace, self.name)
        self.model = rendered[rendered.index("--served-model-name") + 1]
        port = free_port()
        # The tiny checkpoint has no weights (`cpu_engine.write_tiny_checkpoint`).
        argv = [*standin_argv(rendered, self.checkpoint, port, num_blocks=64)]
        argv += ["--load-format", "dummy"]
        engine = spawn_argv(argv, port, self.workdir / pod)
        with self._lock:
            self.engines[pod] = engine
        self._spawn(self._wait_ready, f"ready-{pod}", pod, engine)

    def _wait_ready(self, pod: str, engine: Service) -> None:
        try:
            wait_engine_ready(engine)
        except RuntimeError as exc:
            self.error = exc
            return
        with self._lock:
            if pod not in self.drains:
                self.ready.add(pod)

    def _end(self, pod: str, obj: Any) -> None:
        """preStop sleep, the drain probe around SIGTERM, then the grace period."""
        with self._lock:
            engine, probe = self.engines[pod], self.drains[pod]
        container = obj.spec.containers[0]
        pre_stop = container.lifecycle.pre_stop.sleep.seconds if container.lifecycle else 0
        grace = float(obj.spec.termination_grace_period_seconds or 30)
        time.sleep(pre_stop)  # the kubelet's preStop hook: the pod is out of its endpoints
        stream = threading.Thread(target=self._long_stream, args=(engine, probe), daemon=True)
        stream.start()
        self._wait_streaming(engine)
        engine.proc.send_signal(signal.SIGTERM)
        try:
            with urllib.request.urlopen(f"{engine.url}/ready", timeout=5) as response:
                probe.ready_status = response.status
        except urllib.error.HTTPError as error:
            probe.ready_status = error.code
        except OSError as exc:
            probe.errors.append(f"/ready after SIGTERM: {exc!r}")
        body = {"model": self.model, "prompt": "late", "max_tokens": 4}
        try:
            status, headers, _ = _post(f"{engine.url}/v1/completions", body, timeout=10)
            probe.refused_status, probe.refused_retry_after = status, headers.get("Retry-After")
        except OSError as exc:
            probe.errors.append(f"a completion after SIGTERM: {exc!r}")
        probe.exit_code = stop_process(engine.proc, timeout=grace, terminate=False)
        stream.join(timeout=30)

    def _wait_streaming(self, engine: Service) -> None:
        """Until the engine runs a request (the long stream): then it is in flight at SIGTERM."""
        url = f"{engine.url}/metrics"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
            running = [
                line for line in text.splitlines() if line.startswith("vllm:num_requests_running")
            ]
            if any(float(line.rsplit(" ", 1)[1]) >= 1 for line in running):
                return
            time.sleep(0.02)
        raise AssertionError(f"the long stream never ran on {engine.url}")

    def _long_stream(self, engine: Service, probe: DrainProbe) -> None:
        body = {
            "model": self.model, "prompt": "a long story", "max_tokens": 200,
            "ignore_eos": True, "stream": True,
        }  # fmt: skip
        request = urllib.request.Request(
            f"{engine.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                for raw in response:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line.removeprefix("data: "))["choices"][0]
                    probe.stream_text += choice.get("text") or ""
                    probe.stream_finish_reason = choice.get("finish_reason") or (
                        probe.stream_finish_reason
                    )
        except OSError as exc:
            probe.errors.append(f"the stream in flight at SIGTERM: {exc!r}")

    def stop(self) -> None:
        self._is_stopping = True
        self._watch.stop()  # type: ignore[no-untyped-call]
        with self._lock:
            engines = list(self.engines.values())
        for engine in engines:
            engine.stop()
        self.api.close()
