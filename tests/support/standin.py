"""KWOK pods that run what the operator rendered for them: the CPU engine as a pod's stand-in,
started with the container command of the pod's Deployment, and a closed-loop load that sends
every stand-in the same requests.

KWOK pods run nothing. A stand-in keeps every rendered flag (the memory policy above all, so a
canary's stand-in runs the canary's policy) and overrides after them only what a GPU pod has
and a loopback process cannot: the model (the tiny checkpoint, dummy weights), the device and
dtype, the address, and a fixed KV pool (`--num-gpu-blocks-override`, no swap). The engine's
flags are last-wins, so overriding is appending.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from kubernetes import client

from harness.cpu_engine import spawn_argv, wait_engine_ready
from harness.processes import Service, free_port

ENGINE_COMMAND = ("pagekeeper-engine", "serve")


def rendered_command(apps: client.AppsV1Api, namespace: str, deployment: str) -> list[str]:
    """The engine container's command and arguments in a Deployment's pod template."""
    template = apps.read_namespaced_deployment(deployment, namespace).spec.template
    assert template.spec is not None, f"Deployment {namespace}/{deployment} has no pod spec"
    container = template.spec.containers[0]
    return [*(container.command or []), *(container.args or [])]


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value `flag` has in `argv` (its last occurrence), None when absent."""
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]
    return values[-1] if values else None


def standin_argv(
    rendered: Sequence[str], checkpoint: Path, port: int, num_blocks: int
) -> list[str]:
    """The CPU engine's command line for a pod whose engine container runs `rendered`."""
    assert tuple(rendered[:2]) == ENGINE_COMMAND, f"not the engine's command: {rendered[:3]}"
    flags = list(rendered[3:])  # after `pagekeeper-engine serve MODEL`
    return [
        sys.executable, "-m", "pagekeeper_engine.cli", "serve", str(checkpoint), *flags,
        "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
        "--num-gpu-blocks-override", str(num_blocks), "--num-cpu-blocks-override", "0",
        "--swap-space", "0", "--shutdown-timeout", "15",
    ]  # fmt: skip


def start_standin(
    rendered: Sequence[str], checkpoint: Path, workdir: Path, num_blocks: int
) -> Service:
    """A ready stand-in for a pod whose engine container runs `rendered`."""
    port = free_port()
    engine = spawn_argv(standin_argv(rendered, checkpoint, port, num_blocks), port, workdir)
    wait_engine_ready(engine)
    return engine


Prompt = Callable[[random.Random], str]


class ClosedLoop:
    """`num_workers` threads, each sending one completion at a time to `url` and the next as
    soon as it is answered, until stopped: a fixed number of requests in flight, so two engines
    given the same loop see the same load whatever the machine's speed."""

    def __init__(
        self, url: str, model: str, prompt: Prompt, max_tokens: int, num_workers: int
    ) -> None:
        self.url, self.model, self.prompt, self.max_tokens = url, model, prompt, max_tokens
        self.num_done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_workers)
        ]

    def _run(self, worker: int) -> None:
        rng = random.Random(worker)
        while not self._stop.is_set():
            body = {
                "model": self.model,
                "prompt": self.prompt(rng),
                "max_tokens": self.max_tokens,
                "ignore_eos": True,
            }
            request = urllib.request.Request(
                f"{self.url}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    response.read()
                self.num_done += 1
            except (urllib.error.URLError, OSError) as exc:
                self.errors.append(str(exc))  # the test prints them if it fails
                self._stop.wait(0.5)  # an engine stopping: do not spin

    def start(self) -> ClosedLoop:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=130)
