"""Alertmanager posts to the operator's webhook over HTTPS with a bearer token, trusting a real
certificate chain (a CA and a server certificate it signed, as cert-manager would issue), with
`tls_config.ca_file` as docs/operator.md sets it up; an Alertmanager that trusts another CA
cannot deliver. Both judged by Alertmanager's own notification counters. A certificate renewed
by another CA in the operator's files serves the next connection, with no restart."""

from __future__ import annotations

import json
import socket
import ssl
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from harness.cluster import Cluster, wait_for
from harness.loop import OperatorProcess
from harness.processes import Service, start_alertmanager
from tests.support.certificates import certificate_authority, server_certificate


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


def presented(port: int, ca_file: Path) -> bytes:
    """The certificate the webhook presents to a client that trusts `ca_file` alone."""
    context = ssl.create_default_context(cafile=str(ca_file))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_a_renewed_certificate_serves_new_connections_without_a_restart(
    tls_operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    first = ssl.PEM_cert_to_DER_cert((tmp_path / "server" / "tls.crt").read_text())
    assert presented(tls_operator.port, tmp_path / "ca" / "ca.crt") == first
    renewed_ca = certificate_authority(tmp_path / "renewed-ca", "pagekeeper-renewed-ca")
    cert, key = server_certificate(renewed_ca, tmp_path / "renewed")
    # The operator's files rewritten in place, as a renewal rewrites the mounted Secret's.
    (tmp_path / "server" / "tls.crt").write_bytes(cert.read_bytes())
    (tmp_path / "server" / "tls.key").write_bytes(key.read_bytes())
    renewed = ssl.PEM_cert_to_DER_cert(cert.read_text())
    assert presented(tls_operator.port, renewed_ca / "ca.crt") == renewed
    alertmanager = start_alertmanager(
        tmp_path / "am-renewed", tls_operator.webhook_url, tls_operator.token,
        ca_file=renewed_ca / "ca.crt",
    )  # fmt: skip
    try:
        fire(alertmanager, namespace)
        wait_for(lambda: notifications(alertmanager)[0] >= 1, timeout=60, what="a delivery")
        assert notifications(alertmanager)[1] == 0
    finally:
        alertmanager.stop()
    assert tls_operator.proc.poll() is None  # the same process throughout
    assert "webhook TLS: loaded the new certificate" in tls_operator.log_tail(20000)
