"""The API server refuses a `spec.tuning.secondaryFigures` the objective cannot have, an
unknown figure, or one named twice, and a `spec.tuning.bounds.kvOffloadSize` that is empty, out
of order or leaves out the spec's tier, each naming the field, and stores good ones as written
(the pattern of `test_llmserver_validation`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.cluster import Cluster
from harness.loop import llmserver
from pagekeeper_operator.api.tuning import SECONDARY_RULES
from pagekeeper_operator.api.tuning_bounds import TIER_MIN_RULE, TIER_ORDER_RULE, TIER_RANGE_RULE
from tests.integration import operator_fixture
from tests.integration.operator_fixture import get_server

llmserver_crd = operator_fixture.llmserver_crd

TTFT = {"objective": "ThroughputUnderTTFT", "ttftP99Seconds": 2.0}
ITL = {"objective": "ThroughputUnderITL", "itlP99Seconds": 0.1}
FIELD = "spec.tuning.secondaryFigures"


def _apply(
    cluster: Cluster,
    namespace: str,
    tuning: dict[str, Any],
    name: str = "bad",
    policy: dict[str, Any] | None = None,
) -> Any:
    spec = {"model": {"source": "/models/m"}, "tuning": tuning}
    body = llmserver(name, spec if policy is None else {**spec, "memoryPolicy": policy})
    return cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body), check=False
    )


@pytest.mark.parametrize(
    ("tuning", "rule"),
    [
        ({**TTFT, "secondaryFigures": ["PreemptionsPer1000Requests", "TTFTP99"]},
         SECONDARY_RULES[0]),
        ({**ITL, "secondaryFigures": ["ITLP99"]}, SECONDARY_RULES[1]),
    ],
    ids=["ttft-bound", "itl-bound"],
)  # fmt: skip
def test_a_figure_the_objective_bounds_is_refused_naming_the_field(
    cluster: Cluster, namespace: str, llmserver_crd: Path, tuning: dict[str, Any],
    rule: dict[str, str],
) -> None:  # fmt: skip
    result = _apply(cluster, namespace, tuning)
    assert result.returncode != 0
    assert f"{FIELD}: Invalid value" in result.stderr
    assert rule["message"] in result.stderr


@pytest.mark.parametrize(
    ("figures", "error"),
    [
        (["TTFTP50"], f'{FIELD}[0]: Unsupported value: "TTFTP50"'),
        (["ITLP99", "ITLP99"], f'{FIELD}[1]: Duplicate value: "ITLP99"'),
        (["ITLP99", "TTFTP99", "PreemptionsPer1000Requests", "ITLP99"], f"{FIELD}: Too many"),
    ],
    ids=["unknown", "twice", "too-many"],
)
def test_an_unknown_or_repeated_figure_is_refused_naming_the_field(
    cluster: Cluster, namespace: str, llmserver_crd: Path, figures: list[str], error: str
) -> None:
    result = _apply(cluster, namespace, {"secondaryFigures": figures})
    assert result.returncode != 0
    assert error in result.stderr, result.stderr


def test_a_good_list_is_stored_as_written_and_explained(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    named = {**TTFT, "secondaryFigures": ["ITLP99", "PreemptionsPer1000Requests"]}
    for name, tuning in (("named", named), ("alone", {"secondaryFigures": []}), ("unset", {})):
        ok = _apply(cluster, namespace, tuning, name=name)
        assert ok.returncode == 0, ok.stderr
    stored = {n: get_server(cluster, namespace, n)["spec"]["tuning"] for n in ("named", "alone")}
    assert stored["named"]["secondaryFigures"] == ["ITLP99", "PreemptionsPer1000Requests"]
    assert stored["alone"]["secondaryFigures"] == []
    assert "secondaryFigures" not in get_server(cluster, namespace, "unset")["spec"]["tuning"]
    explain = cluster.kubectl("explain", "llmserver.spec.tuning.secondaryFigures")
    assert "not worse beyond a 5% margin" in " ".join(explain.stdout.split())


TIER = "spec.tuning.bounds.kvOffloadSize"
# Each breaks one rule alone, so the API server accepts it if that rule is dropped.
TIER_CASES = [
    ({"min": "0", "max": "8Gi"}, None, f"{TIER}.min", TIER_MIN_RULE),
    ({"min": "16Gi", "max": "8Gi"}, None, f"{TIER}.min", TIER_ORDER_RULE),
    # Compared as quantities, not as text ("1025Mi" < "1Gi" as text).
    ({"min": "1025Mi", "max": "1Gi"}, None, f"{TIER}.min", TIER_ORDER_RULE),
    ({"min": "4Gi", "max": "16Gi"}, {"kvOffload": {"size": "32Gi"}}, TIER, TIER_RANGE_RULE),
    ({"min": "4Gi", "max": "16Gi"}, {"kvOffload": {"size": "2Gi"}}, TIER, TIER_RANGE_RULE),
]


@pytest.mark.parametrize(
    ("bound", "policy", "field", "rule"),
    TIER_CASES,
    ids=["min-zero", "min-above-max", "min-above-max-units", "tier-above", "tier-below"],
)
def test_a_bad_host_tier_bound_is_refused_naming_the_field(
    cluster: Cluster, namespace: str, llmserver_crd: Path, bound: dict[str, str],
    policy: dict[str, Any] | None, field: str, rule: dict[str, str],
) -> None:  # fmt: skip
    result = _apply(cluster, namespace, {"bounds": {"kvOffloadSize": bound}}, policy=policy)
    assert result.returncode != 0
    assert f"{field}: Invalid value" in result.stderr, result.stderr
    assert rule["message"] in result.stderr


def test_a_good_host_tier_bound_is_stored_as_written(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    # The tier at either end of the bound, in other units than the bound's, and a bound
    # without a tier in spec (the tuner may turn it on inside the bound).
    cases = {
        "at-min": ({"min": "4096Mi", "max": "16Gi"}, {"kvOffload": {"size": "4Gi"}}),
        "at-max": ({"min": "4Gi", "max": "16Gi"}, {"kvOffload": {"size": "16384Mi"}}),
        "no-tier": ({"min": "1Gi", "max": "1Gi"}, None),
    }
    for name, (bound, policy) in cases.items():
        ok = _apply(cluster, namespace, {"bounds": {"kvOffloadSize": bound}}, name, policy)
        assert ok.returncode == 0, ok.stderr
        stored = get_server(cluster, namespace, name)["spec"]["tuning"]["bounds"]
        assert stored["kvOffloadSize"] == bound
