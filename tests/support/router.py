"""A client that routes like a Service: each request goes to a pod its EndpointSlices list as
ready (and whose stand-in engine is ready: see `pod_fleet`), round robin; a 503 or 429 with
Retry-After is retried on another pod, and that pod is skipped for the time it asked; anything
else (a reset, a refused connection, another status) is a lost request, kept as it came."""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from tests.support.pod_fleet import RETRYABLE, PodFleet

MAX_ATTEMPTS = 50


@dataclass
class RouterLog:
    """What the client saw, for the test's assertions."""

    served_by: Counter[str] = field(default_factory=Counter)  # completed requests, per pod
    retried: list[tuple[str, int, str | None]] = field(default_factory=list)  # pod, status, RA
    lost: list[str] = field(default_factory=list)


class EndpointRouter:
    """`num_workers` threads, each sending one completion at a time through the Service's
    ready endpoints until stopped (see module)."""

    def __init__(
        self, kubeconfig: str, namespace: str, service: str, fleet: PodFleet, num_workers: int
    ) -> None:
        self.api = config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig
        )
        self.namespace, self.service, self.fleet = namespace, service, fleet
        self.log = RouterLog()
        self.error: Exception | None = None
        self._ready: dict[str, set[str]] = {}  # EndpointSlice -> ready pods it lists
        self._backoff: dict[str, float] = {}  # pod -> monotonic time it may be tried again
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._watch = watch.Watch()  # type: ignore[no-untyped-call]
        self._threads = [threading.Thread(target=self._follow, daemon=True)] + [
            threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(num_workers)
        ]

    def start(self) -> EndpointRouter:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._watch.stop()  # type: ignore[no-untyped-call]
        for thread in self._threads[1:]:
            thread.join(timeout=90)
        self.api.close()

    def routable(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            pods = set().union(*self._ready.values()) if self._ready else set()
            return sorted(p for p in pods if self._backoff.get(p, 0.0) <= now)

    def _follow(self) -> None:
        discovery = client.DiscoveryV1Api(self.api)
        selector = f"kubernetes.io/service-name={self.service}"
        try:
            events = self._watch.stream(  # type: ignore[no-untyped-call]
                discovery.list_namespaced_endpoint_slice, self.namespace, label_selector=selector
            )
            for event in events:
                slice_ = event["object"]
                ready = {
                    e.target_ref.name
                    for e in slice_.endpoints or []
                    if e.target_ref is not None and e.conditions and e.conditions.ready
                }
                with self._lock:
                    if event["type"] == "DELETED":
                        self._ready.pop(slice_.metadata.name, None)
                    else:
                        self._ready[slice_.metadata.name] = ready
        except (ApiException, ValueError, urllib3.exceptions.HTTPError) as exc:
            if not self._stop.is_set():
                self.error = exc

    def _pick(self) -> tuple[str, str] | None:
        candidates = [(p, u) for p in self.routable() if (u := self.fleet.url_of(p)) is not None]
        if not candidates:
            return None
        return candidates[next(self._turn) % len(candidates)]

    def _work(self, worker: int) -> None:
        while not self._stop.is_set():
            body = {
                "model": self.fleet.model, "prompt": f"worker {worker}: hello",
                "max_tokens": 24, "ignore_eos": True,
            }  # fmt: skip
            self._send(json.dumps(body).encode())

    def _send(self, data: bytes) -> None:
        """One request, retried on another pod after a retryable answer, until it completes."""
        for _ in range(MAX_ATTEMPTS):
            picked = self._pick()
            if picked is None:
                # No pod routable (all backing off, or between endpoint updates): as a proxy
                # with no endpoint holds the request, wait for one.
                if self._stop.wait(0.05):
                    return
                continue
            pod, url = picked
            request = urllib.request.Request(
                f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    response.read()
                with self._lock:
                    self.log.served_by[pod] += 1
                return
            except urllib.error.HTTPError as error:
                retry_after = error.headers.get("Retry-After")
                if error.code in RETRYABLE and retry_after is not None:
                    with self._lock:
                        self.log.retried.append((pod, error.code, retry_after))
                        self._backoff[pod] = time.monotonic() + float(retry_after)
                    continue
                detail = error.read().decode(errors="replace")[:300]
                self.log.lost.append(f"{pod}: HTTP {error.code} {retry_after=}: {detail}")
                return
            except OSError as exc:
                self.log.lost.append(f"{pod}: {exc!r}")
                return
        self.log.lost.append(f"no pod completed the request in {MAX_ATTEMPTS} attempts")
