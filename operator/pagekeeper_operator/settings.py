"""Operator settings, read once from the environment (the chart sets them).

PAGEKEEPER_NAMESPACES (default: empty, the whole cluster)
    Comma-separated namespaces to watch; globs allowed (`team-*`). Read by
    `python -m pagekeeper_operator.main`; with `kopf run` pass `--namespace` or `-A` instead.
PAGEKEEPER_PEERING (default: pagekeeper)
    kopf peering object shared by the operator's replicas, so only one acts at a time;
    `standalone` turns peering off (a single replica, or tests).
PAGEKEEPER_PRIORITY (default: 0)
    This replica's peering priority; the live replica with the highest one acts.
PAGEKEEPER_FINALIZER (default: pagekeeper.dev/finalizer)
    Finalizer kopf sets only while a handler must run on deletion. The reconciliation needs
    none (children go by owner references), so deleting never waits for the operator.
PAGEKEEPER_LOG_FORMAT (default: full)
    plain, full or json.
PAGEKEEPER_LOG_LEVEL (default: info)
    debug, info or warning.
PAGEKEEPER_WEBHOOK_PORT (default: 8443)
    Port of the Alertmanager webhook receiver (remediation): `POST /alertmanager`,
    `GET /healthz`, on every address of the pod.
PAGEKEEPER_WEBHOOK_TOKEN_FILE (no default)
    File holding the bearer token Alertmanager must send (`Authorization: Bearer ...`); the
    chart mounts it from a Secret. Read on every request, so a rotated Secret applies without
    a restart. Unset: the receiver does not start (logged as a warning); an empty file: the
    operator refuses to start.
PAGEKEEPER_WEBHOOK_TLS_CERT_FILE, PAGEKEEPER_WEBHOOK_TLS_KEY_FILE (default: unset)
    PEM certificate chain and private key: set both to serve the receiver over HTTPS, or
    neither for plain HTTP (inside the cluster network, behind the bearer token); one without
    the other is refused. Read again when they change (a renewed Secret applies to new
    connections without a restart); a new pair that does not load is logged and the last
    good one keeps serving.
PAGEKEEPER_ENGINE_IMAGE (default: ghcr.io/pagekeeper-dev/pagekeeper-engine:0.1.0)
    Image for runtime pagekeeper when spec.image is unset, and of the init container that
    brings pagekeeper's plugin and launcher into every vLLM pod (docs/vllm.md).
PAGEKEEPER_VLLM_IMAGE (default: docker.io/vllm/vllm-openai:v0.11.0)
    Image for runtime vllm when spec.image is unset.
PAGEKEEPER_METRICS_PORT (default: unset, no metrics endpoint)
    Port of the operator's own Prometheus /metrics (`pagekeeper_remediations_total`).
PAGEKEEPER_RESYNC_SECONDS (default: 60)
    How often each LLMServer is re-planned (drift repair, a policy stepped down in status);
    a re-plan with nothing to change writes nothing.
PAGEKEEPER_PROMETHEUS_URL (default: unset)
    The Prometheus that scrapes the engine pods (http or https URL, e.g.
    http://prometheus-operated.monitoring.svc:9090). Under spec.autoscaling the operator reads
    each pod's requests in flight from it to keep their pod-deletion costs current, and KEDA's
    ScaledObject triggers query it. Unset: no deletion costs, and a HorizontalPodAutoscaler
    even where KEDA is installed.
PAGEKEEPER_DELETION_COST_SECONDS (default: 15)
    How often those pod-deletion costs are brought up to date (a pod is patched only when its
    cost changed); 1 to 3600.
PAGEKEEPER_CANARY_NO_DATA_SECONDS (default: 600)
    With PAGEKEEPER_PROMETHEUS_URL set, a canary whose ready pods that Prometheus has no data
    for (unreachable, or not scraping them) holds: it is never promoted unwatched, and after
    this many seconds without data it is taken back (`failedSignal: noData`); 1 to 604800.

This module is the only reader of these variables; the rest of the operator takes an
`OperatorSettings`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

LogFormat = Literal["plain", "full", "json"]
LogLevel = Literal["debug", "info", "warning"]
_LOG_FORMATS: tuple[LogFormat, ...] = ("plain", "full", "json")
_LOG_LEVELS: tuple[LogLevel, ...] = ("debug", "info", "warning")
T = TypeVar("T", bound=str)


class SettingsError(ValueError):
    """An environment variable has a value the operator cannot use; names the variable."""


@dataclass(frozen=True)
class OperatorSettings:
    """How this operator process runs; see the module docstring for each variable."""

    namespaces: tuple[str, ...] = ()
    peering_name: str = "pagekeeper"
    is_standalone: bool = False
    priority: int = 0
    finalizer: str = "pagekeeper.dev/finalizer"
    log_format: LogFormat = "full"
    log_level: LogLevel = "info"
    webhook_port: int = 8443
    webhook_token_file: Path | None = None
    webhook_tls_cert_file: Path | None = None
    webhook_tls_key_file: Path | None = None
    metrics_port: int | None = None
    default_images: Mapping[str, str] = field(
        default_factory=lambda: {
            "pagekeeper": "ghcr.io/pagekeeper-dev/pagekeeper-engine:0.1.0",
            "vllm": "docker.io/vllm/vllm-openai:v0.11.0",
        }
    )
    resync_seconds: float = 60.0
    prometheus_url: str | None = None
    deletion_cost_seconds: float = 15.0
    canary_no_data_seconds: int = 600

    @property
    def is_clusterwide(self) -> bool:
        return not self.namespaces


def _int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError as exc:
        raise SettingsError(f"{name}={text!r} is not an integer") from exc
    if not lo <= value <= hi:
        raise SettingsError(f"{name}={value} is outside [{lo}, {hi}]")
    return value


def _choice(env: Mapping[str, str], name: str, choices: tuple[T, ...], default: T) -> T:
    text = env.get(name, "").strip().lower() or default
    for choice in choices:
        if choice == text:
            return choice
    raise SettingsError(f"{name}={text!r} must be one of {', '.join(choices)}")


def _path(env: Mapping[str, str], name: str) -> Path | None:
    text = env.get(name, "").strip()
    return Path(text) if text else None


def load_settings(env: Mapping[str, str] | None = None) -> OperatorSettings:
    """Settings from `env` (default: the process environment), validated."""
    env = os.environ if env is None else env
    defaults = OperatorSettings()
    namespaces = tuple(
        ns.strip() for ns in env.get("PAGEKEEPER_NAMESPACES", "").split(",") if ns.strip()
    )
    peering = env.get("PAGEKEEPER_PEERING", "").strip() or defaults.peering_name
    images = dict(defaults.default_images)
    images["pagekeeper"] = env.get("PAGEKEEPER_ENGINE_IMAGE", "").strip() or images["pagekeeper"]
    images["vllm"] = env.get("PAGEKEEPER_VLLM_IMAGE", "").strip() or images["vllm"]
    cert = _path(env, "PAGEKEEPER_WEBHOOK_TLS_CERT_FILE")
    key = _path(env, "PAGEKEEPER_WEBHOOK_TLS_KEY_FILE")
    if (cert is None) != (key is None):
        raise SettingsError(
            "set both PAGEKEEPER_WEBHOOK_TLS_CERT_FILE and PAGEKEEPER_WEBHOOK_TLS_KEY_FILE, "
            "or neither"
        )
    prometheus_url = env.get("PAGEKEEPER_PROMETHEUS_URL", "").strip() or None
    if prometheus_url is not None and not prometheus_url.startswith(("http://", "https://")):
        raise SettingsError(f"PAGEKEEPER_PROMETHEUS_URL={prometheus_url!r} is not an http(s) URL")
    return OperatorSettings(
        namespaces=namespaces,
        peering_name=peering,
        is_standalone=peering == "standalone",
        priority=_int(env, "PAGEKEEPER_PRIORITY", 0, -(2**31), 2**31 - 1),
        finalizer=env.get("PAGEKEEPER_FINALIZER", "").strip() or defaults.finalizer,
        log_format=_choice(env, "PAGEKEEPER_LOG_FORMAT", _LOG_FORMATS, defaults.log_format),
        log_level=_choice(env, "PAGEKEEPER_LOG_LEVEL", _LOG_LEVELS, defaults.log_level),
        webhook_port=_int(env, "PAGEKEEPER_WEBHOOK_PORT", defaults.webhook_port, 1, 65535),
        webhook_token_file=_path(env, "PAGEKEEPER_WEBHOOK_TOKEN_FILE"),
        webhook_tls_cert_file=cert,
        webhook_tls_key_file=key,
        metrics_port=(
            _int(env, "PAGEKEEPER_METRICS_PORT", 0, 1, 65535)
            if env.get("PAGEKEEPER_METRICS_PORT", "").strip()
            else None
        ),
        default_images=images,
        resync_seconds=float(_int(env, "PAGEKEEPER_RESYNC_SECONDS", 60, 5, 86400)),
        prometheus_url=prometheus_url,
        deletion_cost_seconds=float(_int(env, "PAGEKEEPER_DELETION_COST_SECONDS", 15, 1, 3600)),
        canary_no_data_seconds=_int(
            env, "PAGEKEEPER_CANARY_NO_DATA_SECONDS", defaults.canary_no_data_seconds, 1, 604800
        ),
    )
