"""The demo's LLMServers are locked by the key the demo creates (`make demo` and
`make demo-autoscale` provision and run a whole cluster, so no test runs them): each is a valid
LLMServer whose rendered pod, resolved as the kubelet resolves it against the demo's Secret, gets
that key as `--api-key`, the key the demo's engine is started with and its load sends."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from harness.tools import REPO
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render import render_deployment
from tests.operator.servers import DEFAULT_IMAGES
from tests.support.pod_env import container_argv, container_env

KEY = "5c0ffee5" * 6  # as long as the demo's (token_hex(24))


@pytest.fixture(scope="module")
def demo() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "hack"))  # demo.py imports demo_autoscaling beside it
        yield importlib.import_module("demo")


def _server(demo: ModuleType, scene: str) -> dict[str, Any]:
    if scene == "alert-loop":
        return dict(demo.demo_server())
    return dict(demo.demo_autoscaling.demo_server(demo.API_KEY_SECRET))


@pytest.mark.parametrize("scene", ["alert-loop", "autoscaling"])
def test_the_demo_servers_pods_get_the_demo_key(demo: ModuleType, scene: str) -> None:
    body = _server(demo, scene)
    body["metadata"]["namespace"] = demo.NAMESPACE
    deployment = render_deployment(LLMServer.model_validate(body), DEFAULT_IMAGES)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    secret = demo.api_key_secret(KEY)
    env = container_env(container, {secret["metadata"]["name"]: secret["stringData"]})
    argv = container_argv(container, env)
    assert f"--api-key={KEY}" in argv
