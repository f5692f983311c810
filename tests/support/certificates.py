"""A real certificate chain made with openssl: a CA, and a server certificate for 127.0.0.1
that it signed (as cert-manager would issue), for the webhook's TLS tests."""

from __future__ import annotations

import subprocess
from pathlib import Path


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
