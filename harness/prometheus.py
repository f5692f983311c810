"""A real Prometheus for the alert -> roll loop: it scrapes the CPU engine (`cpu_engine`) with
static labels that make its series look like those of one chosen KWOK pod (`namespace`, `pod`,
`llmserver`, as the ServiceMonitor's relabelings set them in a cluster), evaluates the rules the
operator renders for the server, and is reloaded (`--web.enable-lifecycle`) to point the series
at another pod.
"""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from harness.processes import Service, free_port, wait_http_ok
from harness.tools import tool

PodIdentity = tuple[str, str, str]
"""(namespace, pod, LLMServer name) that scraped series are labelled with."""
ENGINE_JOB = "engine"


def engine_scrape(engine: Service, *identities: PodIdentity) -> dict[str, Any]:
    """One scrape job reading the engine once per identity, each with that pod's labels.

    Reloads keep this job and change only its targets: Prometheus marks the series of a
    removed target stale at once, but not those of a removed job, whose alerts would keep
    firing for the query lookback (5 minutes).
    """
    return pod_scrape(engine.port, *identities)


def pod_scrape(port: int, *identities: PodIdentity, job: str = ENGINE_JOB) -> dict[str, Any]:
    """One scrape job reading 127.0.0.1:`port` once per identity, with that pod's labels."""
    return {
        "job_name": job,
        "scrape_interval": "1s",
        "static_configs": [
            {
                "targets": [f"127.0.0.1:{port}"],
                "labels": {"namespace": namespace, "pod": pod, "llmserver": server},
            }
            for namespace, pod, server in identities
        ],
    }


class Prometheus:
    """A real Prometheus on loopback whose scrape targets can be changed with a reload; it
    sends its alerts to `alertmanager` when there is one."""

    def __init__(self, workdir: Path, rule_files: list[Path], alertmanager: Service | None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.rule_files = rule_files
        self.alertmanager = alertmanager
        self.config_path = workdir / "prometheus.yml"
        self.service: Service | None = None

    def _write(self, scrape_configs: list[dict[str, Any]]) -> None:
        prometheus_config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in self.rule_files],
        }
        if self.alertmanager is not None:
            target = self.alertmanager.url.removeprefix("http://")
            prometheus_config["alerting"] = {
                "alertmanagers": [{"static_configs": [{"targets": [target]}]}]
            }
        prometheus_config["scrape_configs"] = scrape_configs
        self.config_path.write_text(yaml.safe_dump(prometheus_config, sort_keys=False))

    def start(self, scrape_configs: list[dict[str, Any]], port: int | None = None) -> Prometheus:
        """Start on `port` (default: a free one) with the data of any earlier start."""
        self._write(scrape_configs)
        port = free_port() if port is None else port
        argv = [
            tool("prometheus"),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ]
        log = self.workdir / "prometheus.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=self.workdir)
        self.service = Service(name="prometheus", proc=proc, port=port, log=log)
        try:
            wait_http_ok(f"{self.service.url}/-/ready", proc=proc)
        except (RuntimeError, TimeoutError) as exc:
            self.service.stop()
            raise RuntimeError(
                f"prometheus did not start: {exc}\n{log.read_text()[-3000:]}"
            ) from exc
        return self

    def reload(self, scrape_configs: list[dict[str, Any]]) -> None:
        """Rewrite the scrape targets and apply them (POST /-/reload answers once applied)."""
        assert self.service is not None, "start() first"
        self._write(scrape_configs)
        request = urllib.request.Request(f"{self.service.url}/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200, f"reload answered {response.status}"

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()

    def restart(self, scrape_configs: list[dict[str, Any]]) -> Prometheus:
        """Start again after `stop()` at the same URL, so what was reading it (the operator,
        prometheus-adapter) reads it again."""
        assert self.service is not None, "start() first"
        return self.start(scrape_configs, self.service.port)
