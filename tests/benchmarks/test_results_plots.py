"""docs/benchmarks.md's plots: each committed SVG is what its recorded JSON draws, byte for byte."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks import results_plots

RESULTS = results_plots.RESULTS
RECORDS = sorted(RESULTS.glob("*.json"))
PAGE = RESULTS.parent / "benchmarks.md"


def test_every_record_names_its_source_and_command() -> None:
    assert RECORDS, RESULTS
    for path in RECORDS:
        record = json.loads(path.read_text())
        assert {"workload", "source"} <= record.keys(), path
        assert "command" in json.dumps(record), path


@pytest.mark.parametrize("path", RECORDS, ids=[p.stem for p in RECORDS])
def test_each_plot_draws_every_series_from_recorded_rows(path: Path) -> None:
    record: dict[str, Any] = json.loads(path.read_text())
    for plot in record.get("plots", []):
        rows = results_plots.plot_rows(record, plot)
        for series in plot["series"]:
            drawn = [r for r in results_plots.selected(rows, series) if r.get(series["y"])]
            assert drawn, (plot["id"], series["name"])


def test_the_committed_svgs_are_what_the_json_draws() -> None:
    drawn = results_plots.all_plots(RESULTS)
    committed = set(RESULTS.glob("*.svg"))
    assert set(drawn) == committed
    for path, svg in drawn.items():
        assert path.read_text() == svg, f"{path.name}: run `make results`"
    assert results_plots.main(["--check"]) == 0


def test_the_page_shows_every_plot_and_nothing_else() -> None:
    shown = set(re.findall(r"\(results/([\w.-]+\.svg)\)", PAGE.read_text()))
    assert shown == {p.name for p in RESULTS.glob("*.svg")}


def test_a_changed_figure_makes_the_check_fail(tmp_path: Path) -> None:
    source = RESULTS / "operator-scale.json"
    record = json.loads(source.read_text())
    (tmp_path / source.name).write_text(json.dumps(record))
    assert results_plots.main(["--results", str(tmp_path)]) == 0
    assert results_plots.main(["--results", str(tmp_path), "--check"]) == 0
    record["rows"][0]["available_s"] = 5.5
    (tmp_path / source.name).write_text(json.dumps(record))
    assert results_plots.main(["--results", str(tmp_path), "--check"]) == 1
