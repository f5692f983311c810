"""One container of a pod spec, played by `podman run` the way a kubelet would run it.

The chart's operator Deployment and the engine Deployment the operator renders are the
specifications the images must satisfy, so the tests run the images from those specs rather
than from flags of their own: the container's command and args, its environment, its user and
security context, and its volumes (emptyDir as tmpfs, secrets and hostPaths as read-only binds,
the ServiceAccount token where the pod mounts it). A volume, environment source or seccomp
profile this cannot play fails the test, so a new one in a spec is noticed here. Probes,
resources and lifecycle hooks are left to the test. The network is the host's (the local
control plane and the test client are on loopback); ports are whatever the arguments say.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class ServiceAccountToken:
    """What the kubelet projects for `automountServiceAccountToken`: a directory holding
    `token`, `ca.crt` and `namespace`, and the API server's address."""

    directory: Path
    host: str
    port: int


@dataclass(frozen=True)
class PodHost:
    """What the node provides: the pod's name and namespace, the host directories standing in
    for secret volumes (by volume name), and the ServiceAccount token."""

    pod_name: str
    namespace: str
    secrets: Mapping[str, Path] = field(default_factory=dict)
    service_account: ServiceAccountToken | None = None


def run_args(
    pod: Mapping[str, Any],
    container_name: str,
    image: str,
    host: PodHost,
    *,
    read_only_root: bool = True,
) -> list[str]:
    """`podman run` arguments (after `run`) for one container; `read_only_root=False` leaves
    the root filesystem writable, so that `podman diff` shows what the container wrote."""
    container = _container(pod, container_name)
    security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    args = ["--network=host", f"--hostname={host.pod_name}"]
    args += _security(security, read_only_root=read_only_root)
    args += _env(container, host)
    args += _mounts(pod, container, host)
    grace = pod.get("terminationGracePeriodSeconds")
    if grace is not None:
        args.append(f"--stop-timeout={grace}")
    if "command" in container:
        # The command replaces the image's ENTRYPOINT, and without args its CMD too.
        args += [f"--entrypoint={json.dumps(container['command'])}", image]
    else:
        args.append(image)
    return [*args, *container.get("args", [])]


def _container(pod: Mapping[str, Any], name: str) -> dict[str, Any]:
    (container,) = [c for c in pod["containers"] if c["name"] == name]
    return dict(container)


def _security(security: Mapping[str, Any], *, read_only_root: bool) -> list[str]:
    args: list[str] = []
    if "runAsUser" in security:
        group = security.get("runAsGroup", security["runAsUser"])
        args.append(f"--user={security['runAsUser']}:{group}")
    if "fsGroup" in security:
        args.append(f"--group-add={security['fsGroup']}")
    if security.get("readOnlyRootFilesystem") and read_only_root:
        # Only the declared volumes are writable: no tmpfs of podman's own on /run or /tmp.
        args += ["--read-only", "--read-only-tmpfs=false"]
    if security.get("allowPrivilegeEscalation") is False:
        args.append("--security-opt=no-new-privileges")
    if "ALL" in security.get("capabilities", {}).get("drop", []):
        args.append("--cap-drop=all")
    assert security.get("seccompProfile", {"type": "RuntimeDefault"}) == {
        "type": "RuntimeDefault"
    }, f"cannot play seccompProfile {security['seccompProfile']}"
    return args


def _env(container: Mapping[str, Any], host: PodHost) -> list[str]:
    fields = {"metadata.name": host.pod_name, "metadata.namespace": host.namespace}
    args = []
    for var in container.get("env", []):
        if "value" in var:
            value = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"cannot play env {var['name']} from {var['valueFrom']}"
            value = fields[path]
        args.append(f"--env={var['name']}={value}")
    return args


def _mounts(pod: Mapping[str, Any], container: Mapping[str, Any], host: PodHost) -> list[str]:
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    args = []
    for mount in container.get("volumeMounts", []):
        volume, path = volumes[mount["name"]], mount["mountPath"]
        assert "subPath" not in mount, f"cannot play subPath mounts: {mount}"
        mode = "ro" if mount.get("readOnly", False) else "rw"
        if "emptyDir" in volume and path == "/dev/shm":
            size = volume["emptyDir"].get("sizeLimit")
            args.append(f"--shm-size={_bytes(size)}" if size else "--shm-size=64m")
        elif "emptyDir" in volume:
            # A kubelet's emptyDir is an empty, world-writable directory that allows exec.
            args.append(f"--tmpfs={path}:rw,exec,nosuid,nodev,mode=1777")
        elif "secret" in volume:
            args.append(f"--volume={host.secrets[mount['name']]}:{path}:ro")
        elif "hostPath" in volume:
            args.append(f"--volume={volume['hostPath']['path']}:{path}:{mode}")
        else:
            raise AssertionError(f"cannot play volume {volume}")
    if pod.get("automountServiceAccountToken", True):
        token = host.service_account
        assert token is not None, "the pod mounts a ServiceAccount token: give one"
        args += [
            f"--volume={token.directory}:{SERVICE_ACCOUNT_DIR}:ro",
            f"--env=KUBERNETES_SERVICE_HOST={token.host}",
            f"--env=KUBERNETES_SERVICE_PORT={token.port}",
        ]
    return args


def _bytes(quantity: str) -> int:
    """A Kubernetes quantity (binary or decimal suffix, or none) in bytes."""
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in suffixes.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * factor)
    return int(quantity)
