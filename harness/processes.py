"""Real Prometheus and Alertmanager processes on loopback, for the e2e test and the demo; and a
plain exporter of fixed gauges for Prometheus to scrape as a pod."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harness.tools import tool

REPO = Path(__file__).resolve().parents[1]


def engine_pythonpath() -> str:
    """PYTHONPATH for an engine process started from the source tree: the engine, the memory
    plan it imports and the repository root, then whatever the test run was given (a GPU
    machine's carried packages, say)."""
    folders = [str(REPO / "engine"), str(REPO / "memplan"), str(REPO)]
    return os.pathsep.join([*folders, *filter(None, [os.environ.get("PYTHONPATH")])])


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: each socket stays bound until all are chosen (one closed
    before the next is asked for can be handed out again)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def http_get_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def wait_http_ok(
    url: str,
    timeout: float = 60,
    proc: subprocess.Popen[bytes] | None = None,
    insecure: bool = False,
) -> None:
    """Until `url` answers 200; `insecure` accepts any certificate (a self-signed one)."""
    context = ssl._create_unverified_context() if insecure else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer 200 within {timeout}s")


def stop_process(proc: subprocess.Popen[bytes], timeout: float, *, terminate: bool = True) -> int:
    """SIGTERM (with `terminate`; else the caller has signalled already), up to `timeout`
    seconds for the process to end, then SIGKILL; its exit code."""
    if proc.poll() is None:
        if terminate:
            proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@dataclass
class Service:
    """A child process serving HTTP on 127.0.0.1:port, with its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc, timeout=15)


def _spawn(name: str, argv: list[str], workdir: Path, port: int, ready_path: str) -> Service:
    log = workdir / f"{name}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=workdir)
    service = Service(name=name, proc=proc, port=port, log=log)
    try:
        wait_http_ok(f"{service.url}{ready_path}", proc=proc)
    except (RuntimeError, TimeoutError) as exc:
        service.stop()
        raise RuntimeError(f"{name} did not start: {exc}\n{log.read_text()[-3000:]}") from exc
    return service


def start_alertmanager(
    workdir: Path, webhook_url: str, bearer_token: str, ca_file: Path | None = None
) -> Service:
    """Alertmanager that posts every alert (grouped by pod, no delay) to `webhook_url`; with
    `ca_file`, over HTTPS trusting that CA (its `tls_config`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port, cluster_port = free_ports(2)
    config = {
        "route": {
            "receiver": "pagekeeper",
            "group_by": ["namespace", "pod", "alertname"],
            "group_wait": "1s",
            "group_interval": "2s",
            "repeat_interval": "1m",
        },
        "receivers": [
            {
                "name": "pagekeeper",
                "webhook_configs": [
                    {
                        "url": webhook_url,
                        "send_resolved": True,
                        "http_config": {
                            "authorization": {"type": "Bearer", "credentials": bearer_token},
                            **({"tls_config": {"ca_file": str(ca_file)}} if ca_file else {}),
                        },
                    }
                ],
            }
        ],
    }
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump(config))
    argv = [
        tool("prometheus-alertmanager"),  # Debian's name for alertmanager
        f"--config.file={workdir / 'alertmanager.yml'}",
        f"--storage.path={workdir / 'am-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--cluster.listen-address=127.0.0.1:{cluster_port}",
    ]
    return _spawn("alertmanager", argv, workdir, port, "/-/ready")


def start_prometheus(
    workdir: Path,
    scrape_configs: list[dict[str, Any]],
    rule_files: list[Path],
    alertmanager_url: str | None,
    interval: str = "1s",
) -> Service:
    """Prometheus scraping `scrape_configs`, evaluating `rule_files` every `interval`."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": scrape_configs,
        "rule_files": [str(p) for p in rule_files],
    }
    if alertmanager_url is not None:
        target = alertmanager_url.removeprefix("http://")
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [target]}]}]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    argv = [
        tool("prometheus"),
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'prom-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    return _spawn("prometheus", argv, workdir, port, "/-/ready")


def prometheus_alerts(prometheus: Service) -> list[dict[str, Any]]:
    body = http_get_json(f"{prometheus.url}/api/v1/alerts")
    alerts: list[dict[str, Any]] = body["data"]["alerts"]
    return alerts


@contextlib.contextmanager
def exporter(series: dict[str, float]) -> Iterator[tuple[int, dict[str, float]]]:
    """An HTTP server answering /metrics with `series` (gauges; the test may change them)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            lines = [f"{name} {value}" for name, value in series.items()]
            body = ("\n".join(lines) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], series
    finally:
        server.shutdown()
        server.server_close()
