"""What a vLLM pod gets from pagekeeper, on the stock vLLM image (pure).

An init container from the engine image writes pagekeeper's vLLM plugin and launcher, pure
Python with the dist-info whose entry point vLLM's `load_general_plugins()` finds, into an
emptyDir (`python3 -m pagekeeper_vllm.bundle`). The vLLM container mounts it read-only, puts it
first on `PYTHONPATH`, and runs `vllm serve` under the launcher, which passes vLLM's output and
exit code through, reports an out-of-memory death in the termination message, and serves the
plugin's allocator series on the port named `pk-metrics`.
"""

from __future__ import annotations

from typing import Any

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render.meta import METRICS_PORT, METRICS_PORT_NAME

BUNDLE_VOLUME = "pagekeeper-vllm"
BUNDLE_DIR = "/opt/pagekeeper"
INIT_CONTAINER_NAME = "pagekeeper-vllm-plugin"
PYTHONPATH = "PYTHONPATH"


def launcher_command(vllm_command: list[str], launcher_flags: list[str]) -> list[str]:
    """`vllm serve ...` under the launcher (with `launcher_flags` of its own), run by the vLLM
    image's own Python."""
    return [
        "python3",
        "-m",
        "pagekeeper_vllm.launch",
        "--metrics-port",
        str(METRICS_PORT),
        *launcher_flags,
        "--",
        *vllm_command,
    ]


def python_path(server: LLMServer) -> dict[str, Any]:
    """The bundle first, then a PYTHONPATH the user gave (the CRD refuses one from a source)."""
    given = next((e.value for e in server.spec.pod_template.env if e.name == PYTHONPATH), None)
    value = f"{BUNDLE_DIR}:{given}" if given else BUNDLE_DIR
    return {"name": PYTHONPATH, "value": value}


def bundle_mount() -> dict[str, Any]:
    return {"name": BUNDLE_VOLUME, "mountPath": BUNDLE_DIR, "readOnly": True}


def bundle_volume() -> dict[str, Any]:
    return {"name": BUNDLE_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}}


def metrics_port() -> dict[str, Any]:
    return {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"}


def init_container(engine_image: str, security_context: dict[str, Any]) -> dict[str, Any]:
    """Copies the bundle out of the engine image; seconds of work, a few hundred KiB."""
    return {
        "name": INIT_CONTAINER_NAME,
        "image": engine_image,
        "command": ["python3", "-m", "pagekeeper_vllm.bundle", BUNDLE_DIR],
        "volumeMounts": [{"name": BUNDLE_VOLUME, "mountPath": BUNDLE_DIR}],
        "resources": {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            "limits": {"cpu": "500m", "memory": "256Mi"},
        },
        "securityContext": security_context,
    }
