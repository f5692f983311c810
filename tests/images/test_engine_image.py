"""The engine image on the CPU, run as the Deployment the operator renders for it.

A tiny Llama with real safetensors weights, written by the test and mounted read-only where the
LLMServer's volume puts it; the container runs with the pod's command, environment, user and
emptyDirs, on a read-only root filesystem. The official `openai` client gets a completion and a
stream equal to transformers' greedy output; SIGTERM during the stream drains: the stream ends
whole and the container exits 0. With the root filesystem left writable, `podman diff` shows
that nothing was written outside the pod's volumes.
"""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from transformers import PreTrainedModel

from harness.cluster import wait_for
from harness.processes import free_port
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render import render_deployment
from tests.engine.server.checkpoint import decode, encode, greedy_reference, write_checkpoint
from tests.images.pod import PodHost, run_args
from tests.images.podman import Container, run_detached

pytestmark = pytest.mark.timeout(3600)  # a cold `images` fixture builds the bases
MODEL_DIR = "/models/tiny"
MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 512
NO_EOS: dict[str, Any] = {"ignore_eos": True}  # a random model may say EOS at any point
STREAM_TOKENS = 400  # long enough to be running when SIGTERM arrives
START_TIMEOUT_S = 180.0  # imports and the model load on a busy 2-core machine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    path = tmp_path_factory.mktemp("tiny-llama")
    model = write_checkpoint(path, max_positions=MAX_MODEL_LEN)
    # The pod's user owns nothing here: a model volume is readable by all.
    path.chmod(0o755)
    for file in path.iterdir():
        file.chmod(0o644)
    return path, model


def engine_pod(checkpoint: Path, port: int) -> dict[str, Any]:
    """The pod template of the Deployment rendered for a CPU LLMServer serving `checkpoint`."""
    server = LLMServer.model_validate(
        {
            "apiVersion": "pagekeeper.dev/v1alpha1",
            "kind": "LLMServer",
            "metadata": {"name": "tiny", "namespace": "images", "uid": "uid-1", "generation": 1},
            "spec": {
                "model": {
                    "source": MODEL_DIR,
                    "servedModelName": MODEL_NAME,
                    "dtype": "float32",
                    "loadFormat": "safetensors",
                },
                "resources": {"gpus": 0},
                "memoryPolicy": {
                    "blockSize": 8,
                    "maxModelLen": MAX_MODEL_LEN,
                    "maxNumSeqs": 4,
                    "swapSpaceGiB": 0,
                },
                "shutdownGracePeriodSeconds": 30,
                "podTemplate": {
                    # One core for the engine leaves the other to the test.
                    "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
                    "volumes": [{"name": "model", "hostPath": {"path": str(checkpoint)}}],
                    "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}],
                },
            },
        }
    )
    pod: dict[str, Any] = render_deployment(server, {"pagekeeper": "unused", "vllm": "unused"})[
        "spec"
    ]["template"]["spec"]
    # The host's network: the port is one free here.
    command = pod["containers"][0]["command"]
    command[command.index("--port") + 1] = str(port)
    return pod


def is_ready(container: Container, url: str) -> bool:
    assert container.is_running(), f"engine exited:\n{container.logs()[-4000:]}"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(params=["read-only", "writable"])
def root_fs(request: pytest.FixtureRequest) -> str:
    """The container's root filesystem: read-only as in the pod, or writable for `podman diff`."""
    return str(request.param)


@pytest.fixture
def started(
    images: dict[str, str], checkpoint: tuple[Path, PreTrainedModel], root_fs: str
) -> Iterator[tuple[Container, dict[str, Any], int]]:
    """The engine container, ready, with its pod spec and port."""
    port = free_port()
    pod = engine_pod(checkpoint[0], port)
    host = PodHost(pod_name=f"tiny-{uuid.uuid4().hex[:6]}", namespace="images")
    container = run_detached(
        f"pk-engine-{host.pod_name}",
        run_args(pod, "engine", images["engine"], host, read_only_root=root_fs == "read-only"),
    )
    try:
        url = f"http://127.0.0.1:{port}/ready"
        wait_for(lambda: is_ready(container, url), timeout=START_TIMEOUT_S, what="engine /ready")
        yield container, pod, port
    finally:
        container.remove()


def noop_changes(images: dict[str, str], pod: dict[str, Any]) -> set[str]:
    """What the runtime itself changes in a container of this pod (its mount points)."""
    container = dict(pod["containers"][0], command=["true"])
    noop = run_detached(
        f"pk-engine-noop-{uuid.uuid4().hex[:6]}",
        run_args(
            {**pod, "containers": [container]},
            "engine",
            images["engine"],
            PodHost(pod_name="noop", namespace="images"),
            read_only_root=False,
        ),
    )
    try:
        assert noop.wait_exit() == 0, noop.logs()
        return noop.changes()
    finally:
        noop.remove()


def test_engine_image_serves_and_drains(
    images: dict[str, str],
    checkpoint: tuple[Path, PreTrainedModel],
    started: tuple[Container, dict[str, Any], int],
    root_fs: str,
) -> None:
    container, pod, port = started
    security = pod["containers"][0]["securityContext"]
    assert container.process_ids() == (security["runAsUser"], security["runAsGroup"])
    model = checkpoint[1]
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

    expected, _ = greedy_reference(model, encode("hello"), 8)
    out = client.completions.create(
        model=MODEL_NAME, prompt="hello", max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    assert (out.choices[0].text, out.choices[0].finish_reason) == (decode(expected), "length")

    expected, _ = greedy_reference(model, encode("drain me"), STREAM_TOKENS)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="drain me",
        max_tokens=STREAM_TOKENS,
        temperature=0,
        stream=True,
        extra_body=NO_EOS,
    )
    chunks = iter(stream)
    texts = [next(chunks).choices[0].text]
    container.signal("TERM")
    finish = None
    for chunk in chunks:
        texts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert ("".join(texts), finish) == (decode(expected), "length")
    assert container.wait_exit() == 0, container.logs()[-4000:]

    if root_fs == "read-only":
        assert "Read-only file system" not in container.logs()
    else:
        assert container.changes() == noop_changes(images, pod)
