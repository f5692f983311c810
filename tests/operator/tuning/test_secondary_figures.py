"""`spec.tuning.secondaryFigures` in the models: the figures in force under each objective, and
the same refusals the CRD's CEL rules and schema make (an objective's bounded figure, a figure
named twice, an unknown figure)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pagekeeper_operator.api.tuning import SECONDARY_RULES, TuningSpec
from tests.operator.servers import make_server

TTFT = {"objective": "ThroughputUnderTTFT", "ttftP99Seconds": 2.0}
ITL = {"objective": "ThroughputUnderITL", "itlP99Seconds": 0.1}


def errors(tuning: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        make_server({"tuning": tuning})
    return str(info.value)


@pytest.mark.parametrize(
    ("tuning", "figures"),
    [
        ({}, ("PreemptionsPer1000Requests", "TTFTP99", "ITLP99")),
        (TTFT, ("PreemptionsPer1000Requests", "ITLP99")),
        (ITL, ("PreemptionsPer1000Requests", "TTFTP99")),
        ({"secondaryFigures": []}, ()),
        ({"secondaryFigures": ["ITLP99", "TTFTP99"]}, ("ITLP99", "TTFTP99")),
        ({**TTFT, "secondaryFigures": ["PreemptionsPer1000Requests"]},
         ("PreemptionsPer1000Requests",)),
    ],
    ids=["throughput", "ttft-bound", "itl-bound", "throughput-alone", "named", "named-bounded"],
)  # fmt: skip
def test_the_figures_in_force(tuning: dict[str, Any], figures: tuple[str, ...]) -> None:
    spec = make_server({"tuning": tuning}).spec.tuning
    assert spec.secondaries == figures


def test_unset_is_not_written_and_a_named_list_is_written_as_named() -> None:
    assert "secondaryFigures" not in TuningSpec().to_api()
    named = TuningSpec.model_validate({"secondaryFigures": ["TTFTP99"]})
    assert named.to_api()["secondaryFigures"] == ["TTFTP99"]
    assert TuningSpec.model_validate({"secondaryFigures": []}).to_api()["secondaryFigures"] == []


@pytest.mark.parametrize(
    ("tuning", "rule"),
    [
        ({**TTFT, "secondaryFigures": ["PreemptionsPer1000Requests", "TTFTP99"]},
         SECONDARY_RULES[0]),
        ({**ITL, "secondaryFigures": ["ITLP99"]}, SECONDARY_RULES[1]),
    ],
    ids=["ttft", "itl"],
)  # fmt: skip
def test_an_objectives_bounded_figure_is_refused_with_the_crd_message(
    tuning: dict[str, Any], rule: dict[str, str]
) -> None:
    assert rule["message"] in errors(tuning)


def test_the_other_objectives_may_name_that_figure() -> None:
    """Each CEL rule is bound to its own objective: TTFTP99 under the ITL bound is fine."""
    spec = make_server({"tuning": {**ITL, "secondaryFigures": ["TTFTP99"]}}).spec.tuning
    assert spec.secondaries == ("TTFTP99",)


def test_a_figure_named_twice_is_refused() -> None:
    assert "secondaryFigures names a figure twice" in errors({"secondaryFigures": ["ITLP99"] * 2})


def test_an_unknown_figure_is_refused_naming_the_field() -> None:
    message = errors({"secondaryFigures": ["TTFTP50"]})
    assert "spec.tuning.secondaryFigures.0" in message
    assert "'PreemptionsPer1000Requests', 'TTFTP99' or 'ITLP99'" in message
