"""The processes of a local control plane (`kwokctl --runtime binary`), for fault tests:
stop and start one component (the API server) on the same port and etcd, as an upgrade or a
crash of that process would, and bring back the others a supervisor would restart.

kwokctl keeps each component's binary, arguments and working directory in the cluster's
`kwok.yaml` and its process id in `pids/<component>.pid`; a component started here is written
back there. `kwokctl delete cluster` does not end a process it did not start, so `close` ends
those this object started: call it before the cluster is deleted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

from harness.cluster import Cluster, wait_for

API_SERVER = "kube-apiserver"
# Components that exit when they cannot reach the API server for longer than their leader
# election's renew deadline (10 s): a kubelet would start them again, and so does `revive`.
LEASE_HOLDERS = ("kube-controller-manager", "kube-scheduler")


@dataclass(frozen=True)
class Component:
    """One process of the control plane as kwokctl started it."""

    name: str
    binary: str
    args: tuple[str, ...]
    workdir: Path


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); kwokctl's components are not our children.
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(")")[-1].split()[0] != "Z"


class ControlPlane:
    """The component processes of the cluster whose kubeconfig is `<dir>/kubeconfig.yaml`."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.dir = Path(cluster.kubeconfig).parent
        config = self.dir / "kwok.yaml"
        assert config.is_file(), f"{cluster.kubeconfig} is not a kwokctl cluster's kubeconfig"
        self.components: dict[str, Component] = {}
        for doc in yaml.safe_load_all(config.read_text()):
            if not doc or doc.get("kind") != "KwokctlConfiguration":
                continue
            for entry in doc.get("components") or []:
                self.components[entry["name"]] = Component(
                    name=entry["name"],
                    binary=entry["binary"],
                    args=tuple(entry.get("args") or ()),
                    workdir=Path(entry.get("workDir") or self.dir),
                )
        assert API_SERVER in self.components, f"no {API_SERVER} in {config}"
        self.started: dict[str, int] = {}  # component -> the process id this object started

    def _pid_file(self, name: str) -> Path:
        return self.dir / "pids" / f"{name}.pid"

    def pid(self, name: str) -> int:
        return int(self._pid_file(name).read_text().strip())

    def is_running(self, name: str) -> bool:
        return _is_alive(self.pid(name))

    def stop(self, name: str, grace: float = 5) -> None:
        """SIGTERM the component, SIGKILL it after `grace` seconds, and wait until its process
        is gone. (The API server's graceful shutdown otherwise holds open watches for up to a
        minute, long past the lease holders' renew deadline.)"""
        pid = self.pid(name)
        if _is_alive(pid):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _is_alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def start(self, name: str) -> None:
        """Start the component again with kwokctl's binary and arguments, detached (its own
        session) and logging where kwokctl's copy did."""
        assert not self.is_running(name), f"{name} is already running"
        component = self.components[name]
        log = self.dir / "logs" / f"{name}.log"
        with log.open("ab") as sink:
            proc = subprocess.Popen(
                [component.binary, *component.args],
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=component.workdir,
                start_new_session=True,
            )
        self._pid_file(name).write_text(f"{proc.pid}\n")
        self.started[name] = proc.pid

    def close(self) -> None:
        """End the processes this object started (the ones kwokctl will not)."""
        for name in list(self.started):
            if self.is_running(name) and self.pid(name) == self.started[name]:
                self.stop(name)
            del self.started[name]

    def log_tail(self, name: str, num_bytes: int = 4000) -> str:
        log = self.dir / "logs" / f"{name}.log"
        return log.read_bytes()[-num_bytes:].decode(errors="replace") if log.is_file() else ""

    def wait_api_ready(self, timeout: float = 180) -> None:
        """Until the API server answers /readyz with `ok` (a restart takes about 8 s, beside
        six busy processes too). A process that exited fails the wait at once, and a timeout
        says what the process logged."""

        def ready() -> bool:
            if not self.is_running(API_SERVER):
                raise AssertionError(
                    f"{API_SERVER} exited while starting; its log ends:\n"
                    + self.log_tail(API_SERVER)
                )
            result = self.cluster.kubectl("get", "--raw", "/readyz", check=False, timeout=30)
            return result.returncode == 0 and result.stdout.strip() == "ok"

        try:
            wait_for(ready, timeout=timeout, interval=1, what="the API server ready")
        except AssertionError as exc:
            if not self.is_running(API_SERVER):
                raise  # the predicate's message has the log
            tail = self.log_tail(API_SERVER)
            raise AssertionError(f"{exc}\n{API_SERVER}'s log ends:\n{tail}") from None

    def restart_api_server(self) -> None:
        """Stop kube-apiserver and start it again on the same port and etcd; then, as a kubelet
        would, start again each lease holder that exited, until every one has renewed its
        lease on the new API server (so none exits later for this outage)."""
        stopped_at = datetime.now(UTC)
        self.stop(API_SERVER)
        self.start(API_SERVER)
        self.wait_api_ready()
        self.wait_leases_renewed(since=stopped_at)

    def revive(self) -> list[str]:
        """Start again each lease holder that exited; the names started."""
        started = []
        for name in LEASE_HOLDERS:
            if name in self.components and not self.is_running(name):
                self.start(name)
                started.append(name)
        return started

    def _lease_renewed_at(self, name: str) -> datetime | None:
        result = self.cluster.kubectl(
            "get", "lease", "-n", "kube-system", name, "-o", "jsonpath={.spec.renewTime}",
            check=False,
        )  # fmt: skip
        text = result.stdout.strip()
        return datetime.fromisoformat(text) if result.returncode == 0 and text else None

    def wait_leases_renewed(self, since: datetime, timeout: float = 180) -> None:
        """Until each lease holder runs and renewed its lease after `since`."""

        def renewed() -> bool:
            self.revive()
            return all(
                (at := self._lease_renewed_at(name)) is not None and at > since
                for name in LEASE_HOLDERS
                if name in self.components
            )

        wait_for(renewed, timeout=timeout, interval=1, what="the control plane's leases renewed")


__all__ = ["API_SERVER", "LEASE_HOLDERS", "Component", "ControlPlane"]
