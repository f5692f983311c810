"""Operator settings from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagekeeper_operator.settings import SettingsError, load_settings


def test_defaults() -> None:
    settings = load_settings({})
    assert settings.is_clusterwide and settings.namespaces == ()
    assert (settings.peering_name, settings.is_standalone) == ("pagekeeper", False)
    assert settings.finalizer == "pagekeeper.dev/finalizer"
    assert (settings.log_format, settings.log_level, settings.webhook_port) == (
        "full",
        "info",
        8443,
    )
    assert settings.resync_seconds == 60.0
    assert (settings.prometheus_url, settings.deletion_cost_seconds) == (None, 15.0)
    assert settings.canary_no_data_seconds == 600


def test_values_from_env() -> None:
    settings = load_settings(
        {
            "PAGEKEEPER_NAMESPACES": " ml, team-* ,",
            "PAGEKEEPER_PEERING": "standalone",
            "PAGEKEEPER_LOG_FORMAT": "JSON",
            "PAGEKEEPER_WEBHOOK_PORT": "9443",
            "PAGEKEEPER_ENGINE_IMAGE": "reg/engine:2",
            "PAGEKEEPER_RESYNC_SECONDS": "30",
            "PAGEKEEPER_PROMETHEUS_URL": " http://prometheus.monitoring.svc:9090 ",
            "PAGEKEEPER_DELETION_COST_SECONDS": "5",
            "PAGEKEEPER_CANARY_NO_DATA_SECONDS": "120",
        }
    )
    assert settings.prometheus_url == "http://prometheus.monitoring.svc:9090"
    assert settings.deletion_cost_seconds == 5.0
    assert settings.canary_no_data_seconds == 120
    assert settings.namespaces == ("ml", "team-*") and not settings.is_clusterwide
    assert settings.is_standalone and settings.log_format == "json"
    assert settings.webhook_port == 9443 and settings.resync_seconds == 30.0
    assert settings.default_images["pagekeeper"] == "reg/engine:2"
    assert settings.default_images["vllm"] == "docker.io/vllm/vllm-openai:v0.11.0"


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"PAGEKEEPER_WEBHOOK_PORT": "0"}, "PAGEKEEPER_WEBHOOK_PORT"),
        ({"PAGEKEEPER_WEBHOOK_PORT": "http"}, "PAGEKEEPER_WEBHOOK_PORT"),
        ({"PAGEKEEPER_LOG_FORMAT": "xml"}, "PAGEKEEPER_LOG_FORMAT"),
        ({"PAGEKEEPER_RESYNC_SECONDS": "1"}, "PAGEKEEPER_RESYNC_SECONDS"),
        ({"PAGEKEEPER_PROMETHEUS_URL": "prometheus:9090"}, "PAGEKEEPER_PROMETHEUS_URL"),
        ({"PAGEKEEPER_DELETION_COST_SECONDS": "0"}, "PAGEKEEPER_DELETION_COST_SECONDS"),
        ({"PAGEKEEPER_CANARY_NO_DATA_SECONDS": "0"}, "PAGEKEEPER_CANARY_NO_DATA_SECONDS"),
        ({"PAGEKEEPER_WEBHOOK_TLS_CERT_FILE": "/tls/crt"}, "PAGEKEEPER_WEBHOOK_TLS_KEY_FILE"),
        ({"PAGEKEEPER_WEBHOOK_TLS_KEY_FILE": "/tls/key"}, "PAGEKEEPER_WEBHOOK_TLS_CERT_FILE"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], name: str) -> None:
    with pytest.raises(SettingsError, match=name):
        load_settings(env)


def test_webhook_files() -> None:
    assert load_settings({}).webhook_token_file is None
    settings = load_settings(
        {
            "PAGEKEEPER_WEBHOOK_TOKEN_FILE": "/secrets/token",
            "PAGEKEEPER_WEBHOOK_TLS_CERT_FILE": "/tls/tls.crt",
            "PAGEKEEPER_WEBHOOK_TLS_KEY_FILE": " /tls/tls.key ",
        }
    )
    assert settings.webhook_token_file == Path("/secrets/token")
    assert (settings.webhook_tls_cert_file, settings.webhook_tls_key_file) == (
        Path("/tls/tls.crt"),
        Path("/tls/tls.key"),
    )
