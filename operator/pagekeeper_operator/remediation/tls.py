"""The webhook's TLS: a server context that follows its certificate and key files.

cert-manager renews a certificate by rewriting its Secret, and the kubelet replaces the files
of a mounted Secret volume in place (an atomic swap of the volume's `..data` link), so the
operator must read them again without a restart. Each new connection's handshake compares the
files' bytes with what it last read (two reads of a few KiB, beside the handshake's own
signature). A change builds a fresh `SSLContext` from them, and once that has loaded, this
handshake and every later one switch to it: `sni_callback`, which OpenSSL calls on every
ClientHello, with or without a server name. Connections already open keep the certificate
they began with. A new pair that does not load (a key that does not match, a half-written
file) is logged once as an error, and the last good pair keeps serving.
"""

from __future__ import annotations

import hashlib
import logging
import re
import ssl
from pathlib import Path

logger = logging.getLogger(__name__)
_FIRST_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL
)


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A server context with this pair; OSError (ssl.SSLError among them) if it does not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


def fingerprint(cert_pem: bytes) -> str:
    """SHA-256 of the first certificate's DER (as `openssl x509 -fingerprint -sha256` prints
    it, lower case, no colons), to tell in the log which certificate serves."""
    match = _FIRST_CERTIFICATE.search(cert_pem)
    if match is None:
        return "none"
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(match.group().decode("ascii"))).hexdigest()


class ReloadingServerContext:
    """`context` is what the server listens with; each handshake gets the pair the files hold
    now (`reload_if_changed`), or the last one that loaded. A pair that does not load at start
    raises: that is a bad setting, not a renewal."""

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self._seen: bytes | None = self._read()  # None: the files could not be read
        self.current = server_context(cert_file, key_file)
        self.context = self.current
        self.context.sni_callback = self._on_client_hello

    def _read(self) -> bytes:
        return self.cert_file.read_bytes() + b"\0" + self.key_file.read_bytes()

    def reload_if_changed(self) -> bool:
        """Load the files again if their bytes changed since the last look; whether new
        handshakes now get a new pair."""
        try:
            content = self._read()
        except OSError as error:
            if self._seen is not None:
                logger.error(
                    "webhook TLS: %s or %s unreadable (%s); new connections keep the "
                    "certificate loaded before", self.cert_file, self.key_file, error,
                )  # fmt: skip
            self._seen = None
            return False
        if content == self._seen:
            return False
        # Recorded before the load: files that change meanwhile differ from it, and the next
        # handshake loads them again.
        self._seen = content
        try:
            self.current = server_context(self.cert_file, self.key_file)
        except OSError as error:
            logger.error(
                "webhook TLS: the new certificate %s and key %s do not load (%s); new "
                "connections keep the certificate loaded before",
                self.cert_file, self.key_file, error,
            )  # fmt: skip
            return False
        logger.info(
            "webhook TLS: loaded the new certificate %s (sha256 %s)",
            self.cert_file, fingerprint(content.partition(b"\0")[0]),
        )  # fmt: skip
        return True

    def _on_client_hello(
        self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        self.reload_if_changed()
        if connection.context is not self.current:
            connection.context = self.current
