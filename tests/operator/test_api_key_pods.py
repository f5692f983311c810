"""spec.apiKey on both runtimes' rendered pods, run: the official `openai` client is served with
the right key, and gets 401 (`openai.AuthenticationError`) with a wrong key and with none.

For each runtime the Deployment is rendered from an LLMServer with spec.apiKey (the operator's
pure `render_deployment`); its container's environment and command are resolved as the kubelet
resolves them (`pod_env`: the Secret's value into PAGEKEEPER_API_KEY, `$(PAGEKEEPER_API_KEY)`
expanded in the command); and the command runs as a process on this machine:
- `pagekeeper`: the paged engine on the CPU with the tiny checkpoint, every rendered flag kept and
  `standin`'s loopback overrides appended after them;
- `vllm`: the init container's bundle written to a directory that stands for its volume, and the
  launcher run from it as rendered, with `tests/vllm/fake_vllm.py serve` (which checks the key as
  vLLM's own server does) in place of the `vllm` program, given the rendered `vllm serve`
  arguments with the address and port replaced in place.
The container's other variables point into the pod's volumes, here directories of the test's.
A malformed Authorization header gets 401 JSON too, and the probes the pod declares pass
without a key, as the kubelet's carry none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from openai import OpenAI

from harness.cpu_engine import spawn_argv, wait_engine_ready, write_tiny_checkpoint
from harness.processes import free_port, free_ports, stop_process, wait_http_ok
from pagekeeper_operator.render import render_deployment
from tests.operator.servers import DEFAULT_IMAGES, make_server
from tests.support.pod_env import container_argv, container_env
from tests.support.standin import standin_argv
from tests.support.vllm_launcher import FAKE_VLLM

MODEL = "tiny-llama"
# It begins with "-", as token_urlsafe keys may: rendered as its own argument it read as a flag.
KEY = "-pk-7f3a9c2e41b8d05f"
SECRETS = {"chat-openai": {"token": KEY}}
SPEC: dict[str, Any] = {
    "model": {"source": "/models/tiny-llama", "servedModelName": MODEL, "loadFormat": "dummy"},
    "apiKey": {"secretName": "chat-openai", "key": "token"},
    "memoryPolicy": {"maxModelLen": 256},
}
NUM_BLOCKS = 64  # of 16 tokens: room for one request of maxModelLen, and more
START_TIMEOUT_S = 180.0  # imports and a dummy load on a busy 2-core machine
STOP_TIMEOUT_S = 60.0


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


@dataclass
class Pod:
    """One rendered pod's container running as a process: its OpenAI port at `url`, the paths
    of its probes, and the metrics URLs Prometheus would scrape."""

    runtime: str
    proc: subprocess.Popen[bytes]
    url: str
    probe_paths: list[str]
    metrics_urls: list[str]
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def on_host(value: str, volumes: Mapping[str, Path]) -> str:
    """`value` with the container paths in it (alone, or in a `:`-separated list) moved to the
    host directories that stand for their volumes."""

    def move(part: str) -> str:
        for path, host in volumes.items():
            if part == path or part.startswith(f"{path}/"):
                return str(host) + part[len(path) :]
        return part

    return ":".join(move(part) for part in value.split(":"))


def with_value(argv: Sequence[str], flag: str, value: str) -> list[str]:
    """`argv` with the value of `flag`, which it gives once, replaced in place."""
    assert list(argv).count(flag) == 1, f"{flag} given {list(argv).count(flag)} times: {argv}"
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def start_engine_pod(
    pod_spec: dict[str, Any], env: dict[str, str], volumes: Mapping[str, Path], workdir: Path
) -> Pod:
    [container] = pod_spec["containers"]  # its volumes hold nothing the engine reads
    checkpoint = write_tiny_checkpoint(workdir / "model")
    port = free_port()
    argv = standin_argv(container_argv(container, env), checkpoint, port, NUM_BLOCKS)
    engine = spawn_argv(argv, port, workdir / "engine", env)
    wait_engine_ready(engine, timeout=START_TIMEOUT_S)
    paths = [container[p]["httpGet"]["path"] for p in PROBES]
    return Pod("pagekeeper", engine.proc, engine.url, paths, [f"{engine.url}/metrics"], engine.log)


def start_vllm_pod(
    pod_spec: dict[str, Any], env: dict[str, str], volumes: Mapping[str, Path], workdir: Path
) -> Pod:
    [init] = pod_spec["initContainers"]
    [container] = pod_spec["containers"]
    [mount] = init["volumeMounts"]
    # The init container runs the engine image's Python; this checkout's is the same code.
    assert init["command"] == ["python3", "-m", "pagekeeper_vllm.bundle", mount["mountPath"]]
    bundle = volumes[mount["mountPath"]]
    subprocess.run(
        [sys.executable, *init["command"][1:-1], str(bundle)], check=True, capture_output=True
    )
    command = container_argv(container, env)
    separator = command.index("--")
    launcher, vllm = command[:separator], command[separator + 1 :]
    assert launcher[:3] == ["python3", "-m", "pagekeeper_vllm.launch"], launcher
    assert vllm[:2] == ["vllm", "serve"], vllm
    port, metrics_port = free_ports(2)
    launcher_flags = with_value(launcher[3:], "--metrics-port", str(metrics_port))
    vllm_args = with_value(with_value(vllm[2:], "--host", "127.0.0.1"), "--port", str(port))
    argv = [
        sys.executable, "-m", "pagekeeper_vllm.launch", *launcher_flags,
        "--metrics-host", "127.0.0.1", "--termination-log", str(workdir / "termination-log"),
        "--", sys.executable, str(FAKE_VLLM), "serve", *vllm_args,
    ]  # fmt: skip
    log = workdir / "launcher.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            argv, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", timeout=START_TIMEOUT_S, proc=proc)
    except (RuntimeError, TimeoutError) as exc:
        stop(proc)
        raise RuntimeError(f"the vLLM pod did not start: {exc}\n{log.read_text()}") from exc
    paths = [container[p]["httpGet"]["path"] for p in PROBES]
    metrics = [f"{url}/metrics", f"http://127.0.0.1:{metrics_port}/metrics"]
    return Pod("vllm", proc, url, paths, metrics, log)


def stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM, as the kubelet sends it (the engine drains, the launcher forwards it)."""
    return stop_process(proc, timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="module", params=["pagekeeper", "vllm"])
def pod(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    runtime: str = request.param
    workdir = tmp_path_factory.mktemp(runtime)
    deployment = render_deployment(make_server({**SPEC, "runtime": runtime}), DEFAULT_IMAGES)
    pod_spec = deployment["spec"]["template"]["spec"]
    [container] = pod_spec["containers"]
    env = container_env(container, SECRETS)
    assert env["PAGEKEEPER_API_KEY"] == KEY
    assert KEY not in str(deployment)  # the key is in the Secret, never in the pod spec
    # The container's volumes, here directories of the test's.
    volumes = {m["mountPath"]: workdir / m["name"] for m in container["volumeMounts"]}
    for path in volumes.values():
        path.mkdir(exist_ok=True)
    env = {name: on_host(value, volumes) for name, value in env.items()}
    start = start_engine_pod if runtime == "pagekeeper" else start_vllm_pod
    running = start(pod_spec, env, volumes, workdir)
    yield running
    assert stop(running.proc) == 0, running.log_tail()


def client(pod: Pod, key: str) -> OpenAI:
    return OpenAI(base_url=f"{pod.url}/v1", api_key=key, max_retries=0, timeout=60)


# The client is not built without a key; a request may omit its header, and then sends none.
NO_KEY = {"Authorization": openai.Omit()}


def test_the_right_key_is_served(pod: Pod) -> None:
    out = client(pod, KEY).completions.create(
        model=MODEL, prompt="hello", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 3, pod.log_tail()
    assert [m.id for m in client(pod, KEY).models.list().data] == [MODEL]


@pytest.mark.parametrize("key", ["sk-wrong", KEY[:-1], None], ids=["wrong", "prefix", "none"])
def test_a_wrong_key_or_none_is_401(pod: Pod, key: str | None) -> None:
    openai_client, headers = client(pod, key or "unsent"), NO_KEY if key is None else None
    with pytest.raises(openai.AuthenticationError) as caught:
        openai_client.completions.create(
            model=MODEL, prompt="hello", max_tokens=2, extra_headers=headers
        )
    assert caught.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai_client.models.list(extra_headers=headers)
    if pod.runtime == "pagekeeper":  # the engine says which: vLLM answers "Unauthorized" alone
        message = caught.value.response.json()["error"]["message"]
        assert message.startswith("missing API key" if key is None else "wrong API key"), message


@pytest.mark.parametrize(
    "authorization",
    [KEY, f"Basic {KEY}", "Bearer", "Bearer ", f"Bearer{KEY}", f"Token {KEY}"],
)
def test_a_malformed_authorization_header_is_401_json(pod: Pod, authorization: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    answer = requests.post(
        f"{pod.url}/v1/completions",
        json=body,
        headers={"Authorization": authorization},
        timeout=30,
    )
    assert answer.status_code == 401
    assert answer.headers["Content-Type"].startswith("application/json")
    assert "error" in answer.json()


def test_the_scheme_is_read_in_any_case(pod: Pod) -> None:
    """RFC 9110: auth schemes are case-insensitive; both runtimes take `bearer KEY`."""
    answer = requests.get(
        f"{pod.url}/v1/models", headers={"Authorization": f"bearer {KEY}"}, timeout=30
    )
    assert answer.status_code == 200
    assert [m["id"] for m in answer.json()["data"]] == [MODEL]


def test_the_probes_the_pod_declares_pass_without_a_key(pod: Pod) -> None:
    expected = ["/health", "/ready" if pod.runtime == "pagekeeper" else "/health", "/health"]
    assert pod.probe_paths == expected
    for url in [*(f"{pod.url}{path}" for path in pod.probe_paths), *pod.metrics_urls]:
        assert requests.get(url, timeout=30).status_code == 200, url
