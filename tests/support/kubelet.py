"""A stand-in for the kubelet of one KWOK pod: its container as a host process, restarted as a
kubelet restarts it, and each restart reported in the pod's status as a kubelet reports it.

KWOK plays the test cluster's kubelets without running containers. Where a test needs a pod's
container to run (an engine that hangs and must be restarted), `PodKubelet` runs it for one
pod, from what the operator rendered into that pod:
- the startup probe gates the liveness probe (neither counts before the other succeeded once);
- the liveness probe (`httpGet` path, `periodSeconds`, `failureThreshold`, `timeoutSeconds`;
  the named port is the process's own) failing `failureThreshold` times in a row ends the
  process: SIGTERM, then SIGKILL after `terminationGracePeriodSeconds`;
- `restartPolicy: Always`: a process that ended, by itself or by the probe, is started again;
- each end goes into the pod's status: `restartCount`, `lastState.terminated` with the exit
  code (128 + the signal for a killed process), reason `Error` and the termination message (the
  file at the container's terminationMessagePath, which each start gets fresh; with
  `FallbackToLogsOnError`, the log's last 80 lines when that is empty and the exit failed),
  and `state.running` for the new start.
Each start gets a fresh directory (`spawn(directory)`), in which the process must write its
termination message to `termination-log` (`TERMINATION_LOG`), as a container writes
`/dev/termination-log`.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client

from harness.cluster import Cluster
from harness.processes import Service, stop_process

logger = logging.getLogger(__name__)
# The kubelet's bound on a termination message and on its fallback to the log.
MAX_MESSAGE_BYTES = 4096
FALLBACK_LOG_LINES = 80
TERMINATION_LOG = "termination-log"


@dataclass(frozen=True)
class HttpProbe:
    """One `httpGet` probe of a container as the pod spec gives it."""

    path: str
    period_s: float
    failure_threshold: int
    timeout_s: float

    @classmethod
    def from_spec(cls, probe: Any) -> HttpProbe:
        return cls(
            str(probe.http_get.path),
            float(probe.period_seconds or 10),
            int(probe.failure_threshold or 3),
            float(probe.timeout_seconds or 1),
        )

    def passes(self, port: int) -> bool:
        """One probe: a status in [200, 400) within the timeout, as the kubelet counts it."""
        url = f"http://127.0.0.1:{port}{self.path}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                return bool(200 <= response.status < 400)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False


@dataclass(frozen=True)
class Termination:
    """One end of the container, as `lastState.terminated` says it."""

    exit_code: int
    message: str
    started_at: str
    finished_at: str
    by_liveness: bool  # the probe ended it, not the process itself


def _now() -> datetime:
    return datetime.now(UTC)


def _stamp(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def termination_message(path: Path, log: Path, exit_code: int, policy: str) -> str:
    """What the kubelet puts in `terminated.message` (see the module docstring)."""
    text = path.read_text(errors="replace") if path.exists() else ""
    if not text and exit_code != 0 and policy == "FallbackToLogsOnError":
        lines = log.read_text(errors="replace").splitlines()[-FALLBACK_LOG_LINES:]
        text = "\n".join(lines)
    return text.encode()[-MAX_MESSAGE_BYTES:].decode(errors="ignore")


class PodKubelet:
    """Runs the container `container` of the KWOK pod `pod` through `spawn` (which starts the
    process in the directory it is given) until `stop`."""

    def __init__(
        self,
        cluster: Cluster,
        namespace: str,
        pod: str,
        workdir: Path,
        spawn: Callable[[Path], Service],
        container: str = "engine",
    ) -> None:
        self.core = client.CoreV1Api(cluster.api)
        self.namespace, self.pod, self.container = namespace, pod, container
        spec = self.core.read_namespaced_pod(pod, namespace).spec
        assert spec is not None, f"pod {namespace}/{pod} has no spec"
        [self.spec] = [c for c in spec.containers if c.name == container]
        self.startup = HttpProbe.from_spec(self.spec.startup_probe)
        self.liveness = HttpProbe.from_spec(self.spec.liveness_probe)
        self.grace_s = float(spec.termination_grace_period_seconds or 30)
        self.message_policy = str(self.spec.termination_message_policy or "File")
        self.workdir = workdir
        self.spawn = spawn
        self.terminations: list[Termination] = []
        self.service: Service | None = None
        self.error: Exception | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kubelet-{pod}", daemon=True)

    def start(self) -> PodKubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the process (SIGTERM, as a pod deletion would) and stop restarting it."""
        self._stopping.set()
        if self.service is not None and self.service.proc.poll() is None:
            self.service.proc.send_signal(signal.SIGTERM)
        self._thread.join(timeout=self.grace_s + 30)

    @property
    def restart_count(self) -> int:
        return len(self.terminations)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._run_once(len(self.terminations))
        except Exception as exc:  # the test reads it: a stand-in that died restarts nothing
            self.error = exc
            logger.exception("the kubelet stand-in of %s failed", self.pod)
        finally:
            if self.service is not None:
                self._end(self.service.proc)

    def _run_once(self, attempt: int) -> None:
        directory = self.workdir / f"start-{attempt}"
        directory.mkdir(parents=True)
        path = directory / TERMINATION_LOG
        started = _now()
        service = self.service = self.spawn(directory)
        by_liveness = self._supervise(service)
        if self._stopping.is_set():
            return
        exit_code = self._end(service.proc)
        message = termination_message(path, service.log, exit_code, self.message_policy)
        ended = Termination(exit_code, message, _stamp(started), _stamp(_now()), by_liveness)
        self.terminations.append(ended)
        self._report(ended)

    def _supervise(self, service: Service) -> bool:
        """Probe until the process ends (False) or the liveness probe ends it (True)."""
        probe, failures = self.startup, 0
        while not self._exited_within(service.proc, probe.period_s):
            if self._stopping.is_set():
                return False
            if probe.passes(service.port):
                probe, failures = self.liveness, 0  # started: from now on liveness counts
                continue
            failures += 1
            if failures >= probe.failure_threshold:
                return True
        return False

    def _exited_within(self, proc: subprocess.Popen[bytes], seconds: float) -> bool:
        """Whether the process ends within `seconds` (False at once when stopping)."""
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return not self._stopping.is_set()

    def _end(self, proc: subprocess.Popen[bytes]) -> int:
        code = stop_process(proc, timeout=self.grace_s)
        return 128 - code if code < 0 else code  # a signal's end, as a container runtime says it

    def _report(self, ended: Termination) -> None:
        """The pod's status once the container restarted after `ended`."""
        pod = self.core.read_namespaced_pod(self.pod, self.namespace)
        api = client.ApiClient()
        statuses = []
        for status in (pod.status.container_statuses if pod.status else None) or []:
            serialized = api.sanitize_for_serialization(status)  # type: ignore[no-untyped-call]
            entry = {k: v for k, v in serialized.items() if v is not None}
            if status.name == self.container:
                entry |= {
                    "restartCount": self.restart_count,
                    "lastState": {
                        "terminated": {
                            "exitCode": ended.exit_code,
                            "reason": "Error" if ended.exit_code else "Completed",
                            "message": ended.message,
                            "startedAt": ended.started_at,
                            "finishedAt": ended.finished_at,
                        }
                    },
                    "state": {"running": {"startedAt": ended.finished_at}},
                }
            statuses.append(entry)
        self.core.patch_namespaced_pod_status(
            self.pod, self.namespace, {"status": {"containerStatuses": statuses}}
        )
