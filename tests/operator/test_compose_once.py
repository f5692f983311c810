"""One reconcile composes the effective policy once: render, the memory plan and status read
that one `EffectivePolicy`, so the walk from spec.memoryPolicy to the rendered flag has one
place to change. The tuner composes the layer it decides on for its own step."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pagekeeper_operator
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.controllers.reconcile import reconcile
from pagekeeper_operator.policy import effective
from pagekeeper_operator.policy.effective import EffectivePolicy
from tests.operator.servers import DEFAULT_IMAGES, server_body
from tests.operator.test_reconcile_fit import MemoryKube

NOW = "2026-11-29T01:00:00Z"
RECONCILE = "pagekeeper_operator.controllers.reconcile.reconcile"
TUNE = "pagekeeper_operator.tuning.tuner.tune"
FIT_CHECK = "pagekeeper_operator.tuning.tuner._unfit"  # the memory plan on the tuner's candidates
SPEC: dict[str, Any] = {"memoryPolicy": {"gpuMemoryUtilization": 0.85}}


@pytest.fixture
def callers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Each caller of `effective.compose` (module.function), in call order."""
    calls: list[str] = []
    compose = effective.compose

    def counted(server: LLMServer) -> EffectivePolicy:
        frame = sys._getframe(1)
        calls.append(f"{frame.f_globals['__name__']}.{frame.f_code.co_name}")
        return compose(server)

    monkeypatch.setattr(effective, "compose", counted)
    yield calls


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _utilizations(kube: MemoryKube) -> dict[str, str]:
    """Deployment name -> the --gpu-memory-utilization its engine container runs with."""
    return {
        key[2]: _flag(manifest["spec"]["template"]["spec"]["containers"][0]["command"],
                      "--gpu-memory-utilization")
        for key, manifest in kube.objects.items()
        if key[1] == "Deployment"
    }  # fmt: skip


def test_a_reconcile_composes_once_and_renders_the_spec_value(callers: list[str]) -> None:
    kube = MemoryKube([])
    server = LLMServer.from_body(server_body({**SPEC, "tuning": {"mode": "Off"}}))
    result = reconcile(kube, server, DEFAULT_IMAGES, now=NOW)  # type: ignore[arg-type]
    assert callers == [RECONCILE]
    assert _utilizations(kube) == {"qwen": "0.85"}
    assert result.status_patch["effectiveMemoryPolicy"]["gpuMemoryUtilization"] == 0.85


def test_the_tuner_composes_its_own_step_once(callers: list[str]) -> None:
    """Recommend mode (the default) without Prometheus: the tuner's step composes the layer
    it recommends on; render, plan and status still share the reconcile's one composition."""
    kube = MemoryKube([])
    reconcile(kube, LLMServer.from_body(server_body(SPEC)), DEFAULT_IMAGES, now=NOW)  # type: ignore[arg-type]
    assert callers == [TUNE, RECONCILE]
    assert _utilizations(kube) == {"qwen": "0.85"}


def test_a_trial_renders_its_candidate_from_the_same_composition(callers: list[str]) -> None:
    """Under a trial the one composition carries the candidate too: the canary Deployment
    runs the trial's value, status records the policy without it."""
    spec = {
        **SPEC,
        "replicas": 2,
        "rollout": {"canary": {"enabled": True, "replicas": 1}},
        "tuning": {"mode": "Apply", "windowSeconds": 600},
    }
    kube = MemoryKube([])
    first = reconcile(kube, LLMServer.from_body(server_body(spec)), DEFAULT_IMAGES, now=NOW)  # type: ignore[arg-type]
    trial = {
        "field": "gpuMemoryUtilization", "current": "0.85", "proposed": "0.9",
        "rule": "r", "startedAt": NOW,
    }  # fmt: skip
    status = {**first.status_patch, "tuning": {**first.status_patch["tuning"], "trial": trial}}
    trying = LLMServer.from_body(server_body(spec, status=status))
    callers.clear()
    result = reconcile(kube, trying, DEFAULT_IMAGES, now="2026-11-29T01:01:00Z")  # type: ignore[arg-type]
    assert callers == [TUNE, FIT_CHECK, RECONCILE]  # the trial's candidate planned once
    assert _utilizations(kube) == {"qwen": "0.85", "qwen-canary": "0.9"}
    assert "effectiveMemoryPolicy" not in result.status_patch  # still the spec's 0.85


def test_every_caller_reaches_compose_through_the_module() -> None:
    """A name imported from `effective` would escape the count above."""
    root = Path(pagekeeper_operator.__file__).parent
    imported = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").endswith("effective")
        and any(alias.name in ("compose", "effective_memory_policy") for alias in node.names)
    ]
    assert imported == []
