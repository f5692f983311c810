"""The webhook's TLS over real handshakes on loopback: a renewed certificate (its Secret's files
swapped as the kubelet does, or overwritten in place) serves the next connection, with no
restart; a pair that does not load keeps the last good one serving, logged once."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pagekeeper_operator.remediation.payload import WebhookMessage
from pagekeeper_operator.remediation.tls import ReloadingServerContext, fingerprint
from pagekeeper_operator.remediation.webhook import make_app
from tests.support.certificates import certificate_authority, server_certificate

LOGGER = "pagekeeper_operator.remediation.tls"


@dataclass(frozen=True)
class Pair:
    """A server certificate and its key, and the CA that signed it."""

    ca_file: Path
    cert: Path
    key: Path

    @property
    def der(self) -> bytes:
        return ssl.PEM_cert_to_DER_cert(self.cert.read_text())


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pair, Pair]:
    """Two pairs from two CAs: the issued certificate and its renewal by another issuer."""
    root = tmp_path_factory.mktemp("pki")
    made = []
    for name in ("first", "second"):
        ca = certificate_authority(root / f"{name}-ca", f"pagekeeper-{name}-ca")
        cert, key = server_certificate(ca, root / f"{name}-server")
        made.append(Pair(ca / "ca.crt", cert, key))
    return made[0], made[1]


class SecretVolume:
    """A mounted Secret as the kubelet writes it: `tls.crt` and `tls.key` link into `..data`,
    a link to the current version's directory, swapped by one rename (or, `in_place`, plain
    files overwritten one after the other)."""

    def __init__(self, root: Path, in_place: bool) -> None:
        self.root, self.in_place = root, in_place
        self.num_versions = 0
        root.mkdir()

    @property
    def cert(self) -> Path:
        return self.root / "tls.crt"

    @property
    def key(self) -> Path:
        return self.root / "tls.key"

    def publish(self, cert: Path, key: Path) -> None:
        if self.in_place:
            self.cert.write_bytes(cert.read_bytes())
            self.key.write_bytes(key.read_bytes())
            return
        self.num_versions += 1
        version = self.root / f"..v{self.num_versions}"
        version.mkdir()
        (version / "tls.crt").write_bytes(cert.read_bytes())
        (version / "tls.key").write_bytes(key.read_bytes())
        (self.root / "..data_tmp").symlink_to(version.name)
        os.replace(self.root / "..data_tmp", self.root / "..data")
        for name in ("tls.crt", "tls.key"):
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")


async def ok(message: WebhookMessage) -> dict[str, Any]:
    return {}


@asynccontextmanager
async def webhook(tls: ReloadingServerContext) -> AsyncIterator[int]:
    """The receiver served over `tls` on a free loopback port (yielded)."""
    runner = web.AppRunner(make_app(lambda: "token", ok), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.context)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@dataclass
class Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @property
    def der(self) -> bytes:
        """The certificate the server presented in this connection's handshake."""
        der = self.writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        assert isinstance(der, bytes)
        return der

    async def healthz(self) -> bytes:
        """The status line of `GET /healthz` on this connection (which it then closes)."""
        self.writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        answer = await self.reader.read()
        self.writer.close()
        return answer.partition(b"\r\n")[0]


async def connect(port: int, ca_file: Path) -> Connection:
    """A TLS connection that trusts `ca_file` alone and checks the name (127.0.0.1)."""
    client = ssl.create_default_context(cafile=str(ca_file))
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    return Connection(reader, writer)


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


@pytest.mark.parametrize("in_place", [False, True], ids=["swapped", "in-place"])
def test_a_renewed_certificate_serves_the_next_connection(
    pairs: tuple[Pair, Pair], tmp_path: Path, in_place: bool, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = pairs
    volume = SecretVolume(tmp_path / "webhook-tls", in_place)
    volume.publish(first.cert, first.key)
    tls = ReloadingServerContext(volume.cert, volume.key)

    async def scenario() -> None:
        async with webhook(tls) as port:
            before = await connect(port, first.ca_file)
            assert before.der == first.der
            volume.publish(second.cert, second.key)  # cert-manager renewed it, another issuer

            after = await connect(port, second.ca_file)
            assert after.der == second.der
            assert await after.healthz() == b"HTTP/1.1 200 OK"
            # The open connection keeps the certificate it began with and still serves.
            assert await before.healthz() == b"HTTP/1.1 200 OK"
            # A client that trusts only the first issuer no longer gets a chain it trusts.
            with pytest.raises(ssl.SSLCertVerificationError):
                await connect(port, first.ca_file)
            again = await connect(port, second.ca_file)
            assert again.der == second.der
            assert await again.healthz() == b"HTTP/1.1 200 OK"

    with caplog.at_level(logging.INFO, logger=LOGGER):
        run(scenario)
    # Loaded once, on the first handshake after the change; unchanged files are not reloaded.
    assert messages(caplog, logging.INFO) == [
        f"webhook TLS: loaded the new certificate {volume.cert} "
        f"(sha256 {hashlib.sha256(second.der).hexdigest()})"
    ]
    assert messages(caplog, logging.ERROR) == []


def test_a_pair_that_does_not_load_keeps_the_last_good_one_logged_once(
    pairs: tuple[Pair, Pair], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = pairs
    volume = SecretVolume(tmp_path / "webhook-tls", in_place=False)
    volume.publish(first.cert, first.key)
    tls = ReloadingServerContext(volume.cert, volume.key)

    async def scenario() -> None:
        async with webhook(tls) as port:
            volume.publish(second.cert, first.key)  # the new certificate with the old key
            for _ in range(2):
                kept = await connect(port, first.ca_file)
                assert kept.der == first.der
                assert await kept.healthz() == b"HTTP/1.1 200 OK"
            assert len(messages(caplog, logging.ERROR)) == 1
            assert tls.reload_if_changed() is False  # the same bad files: not tried again

            volume.publish(second.cert, second.key)  # the renewal, completed
            renewed = await connect(port, second.ca_file)
            assert renewed.der == second.der
            # Served, and closed: an open connection would hold the server's shutdown for
            # aiohttp's 60 s grace.
            assert await renewed.healthz() == b"HTTP/1.1 200 OK"

    with caplog.at_level(logging.INFO, logger=LOGGER):
        run(scenario)
    (error,) = messages(caplog, logging.ERROR)
    assert error.startswith(
        f"webhook TLS: the new certificate {volume.cert} and key {volume.key} do not load ("
    )
    assert error.endswith("); new connections keep the certificate loaded before")
    assert messages(caplog, logging.INFO) == [
        f"webhook TLS: loaded the new certificate {volume.cert} "
        f"(sha256 {hashlib.sha256(second.der).hexdigest()})"
    ]


def test_unreadable_files_keep_the_last_good_pair_logged_once(
    pairs: tuple[Pair, Pair], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, _ = pairs
    volume = SecretVolume(tmp_path / "webhook-tls", in_place=True)
    volume.publish(first.cert, first.key)
    tls = ReloadingServerContext(volume.cert, volume.key)
    volume.key.unlink()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert [tls.reload_if_changed() for _ in range(2)] == [False, False]
        volume.publish(first.cert, first.key)
        assert tls.reload_if_changed() is True  # read again once readable
    (error,) = messages(caplog, logging.ERROR)
    assert error.startswith(f"webhook TLS: {volume.cert} or {volume.key} unreadable (")


def test_a_pair_that_does_not_load_at_start_is_refused(
    pairs: tuple[Pair, Pair], tmp_path: Path
) -> None:
    first, second = pairs
    with pytest.raises(ssl.SSLError):
        ReloadingServerContext(second.cert, first.key)


def test_fingerprint_is_the_first_certificate_s_sha256(pairs: tuple[Pair, Pair]) -> None:
    first, second = pairs
    chain = first.cert.read_bytes() + second.cert.read_bytes()
    assert fingerprint(chain) == hashlib.sha256(first.der).hexdigest()
    assert fingerprint(b"no certificate here") == "none"
