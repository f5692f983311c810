"""Alertmanager posts to the operator's webhook over HTTPS with a bearer token, trusting a real
certificate chain (a CA and a server certificate it signed, as cert-manager would issue), with
`tls_config.ca_file` as docs/operator.md sets it up; an Alertmanager that trusts another CA
cannot deliver. Both judged by Alertmanager's own notification counters."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.support.cluster import Cluster, wait_for
from tests.support.loop import OperatorProcess
from tests.support.processes import Service, start_alertmanager


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def certificate_authority(directory: Path, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
        "-keyout", "ca.key", "-out", "ca.crt", cwd=directory,
    )  # fmt: skip
    return directory


def server_certificate(ca: Path, directory: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1 that `ca` signed."""
    directory.mkdir(parents=True, exist_ok=True)
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=pagekeeper-operator",
        "-keyout", "tls.key", "-out", "tls.csr", cwd=directory,
    )  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509", "-req", "-in", "tls.csr", "-CA", str(ca / "ca.crt"), "-CAkey", str(ca / "ca.key"),
        "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "tls.crt", cwd=directory,
    )  # fmt: skip
    return directory / "tls.crt", directory / "tls.key"


def notifications(alertmanager: Service) -> tuple[float, float]:
    """(sent, failed) webhook notifications, from Alertmanager's /metrics."""
    with urllib.request.urlopen(f"{alertmanager.url}/metrics", timeout=5) as response:
        text = response.read().decode()
    sent = failed = 0.0
    for line in text.splitlines():
        if 'integration="webhook"' not in line or line.startswith("#"):
            continue
        if line.startswith("alertmanager_notifications_total"):
            sent += float(line.rsplit(" ", 1)[1])
        elif line.startswith("alertmanager_notifications_failed_total"):
            failed += float(line.rsplit(" ", 1)[1])
    return sent, failed


def fire(alertmanager: Service, namespace: str) -> None:
    now = datetime.now(UTC)
    alert = {
        "labels": {
            "alertname": "PagekeeperKVCacheSaturated", "namespace": namespace,
            "pod": "nobody-0", "llmserver": "nobody",
        },
        "startsAt": now.isoformat(),
        "endsAt": (now + timedelta(minutes=5)).isoformat(),
    }  # fmt: skip
    request = urllib.request.Request(
        f"{alertmanager.url}/api/v2/alerts",
        data=json.dumps([alert]).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200


@pytest.fixture
def tls_operator(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    ca = certificate_authority(tmp_path / "ca", "pagekeeper-test-ca")
    cert, key = server_certificate(ca, tmp_path / "server")
    env = {
        "PAGEKEEPER_WEBHOOK_TLS_CERT_FILE": str(cert),
        "PAGEKEEPER_WEBHOOK_TLS_KEY_FILE": str(key),
    }
    operator = OperatorProcess(str(cluster.kubeconfig), namespace, tmp_path / "operator", env)
    try:
        operator.wait_ready()
        yield operator
    finally:
        operator.stop()


def test_alertmanager_delivers_over_tls_with_the_token_and_only_to_a_trusted_chain(
    tls_operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    assert tls_operator.webhook_url.startswith("https://")
    trusted = start_alertmanager(
        tmp_path / "am-trusted", tls_operator.webhook_url, tls_operator.token,
        ca_file=tmp_path / "ca" / "ca.crt",
    )  # fmt: skip
    stranger = certificate_authority(tmp_path / "other-ca", "someone-else")
    untrusting = start_alertmanager(
        tmp_path / "am-untrusting", tls_operator.webhook_url, tls_operator.token,
        ca_file=stranger / "ca.crt",
    )  # fmt: skip
    try:
        fire(trusted, namespace)
        fire(untrusting, namespace)
        wait_for(lambda: notifications(trusted)[0] >= 1, timeout=60, what="a delivery")
        wait_for(lambda: notifications(untrusting)[1] >= 1, timeout=60, what="a refused chain")
        assert notifications(trusted)[1] == 0  # delivered: TLS and the bearer token accepted
        assert notifications(untrusting)[0] >= notifications(untrusting)[1] >= 1
        assert "could not handle" not in tls_operator.log_tail(20000)
    finally:
        trusted.stop()
        untrusting.stop()
