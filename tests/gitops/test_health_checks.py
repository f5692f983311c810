"""The LLMServer health script under Argo CD's own Lua health code, and kstatus (Flux), over
the objects captured from the real control plane (tests/integration/test_gitops_states.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from harness.tools import REPO, tool
from tests.support.gitops import CASES, SCRIPT, STATES, kstatus, lua_health

CHART = REPO / "charts" / "pagekeeper"
HEALTH_KEY = "resource.customizations.health.pagekeeper.dev_LLMServer"


def test_every_state_has_a_case_and_the_documented_verdict() -> None:
    cases = yaml.safe_load((CASES / "health_test.yaml").read_text())["tests"]
    assert {c["inputPath"]: c["healthStatus"]["status"] for c in cases} == {
        f"testdata/{state}.yaml": argo for state, (argo, _) in STATES.items()
    }
    assert sorted(p.stem for p in (CASES / "testdata").glob("*.yaml")) == sorted(STATES)


def test_argo_cd_lua_health_passes_every_case(tmp_path: Path) -> None:
    run = lua_health(CASES / "health_test.yaml", CASES / "testdata", tmp_path)
    assert run.results == {f"testdata/{state}.yaml": "PASS" for state in STATES}, run.output
    assert run.returncode == 0, run.output


def test_argo_cd_lua_health_fails_a_wrong_verdict(tmp_path: Path) -> None:
    """The harness can fail: a Healthy expected of the refused apply is reported as a FAIL."""
    cases = yaml.safe_load((CASES / "health_test.yaml").read_text())
    for case in cases["tests"]:
        if case["inputPath"] == "testdata/apply-refused.yaml":
            case["healthStatus"] = {"status": "Healthy", "message": "2/2 replicas ready"}
    wrong = tmp_path / "health_test.yaml"
    wrong.write_text(yaml.safe_dump(cases))
    run = lua_health(wrong, CASES / "testdata", tmp_path / "run")
    assert run.results["testdata/apply-refused.yaml"] == "FAIL"
    assert run.returncode == 1


def test_kstatus_reads_each_state() -> None:
    verdicts = kstatus(sorted((CASES / "testdata").glob("*.yaml")))
    assert {name.removesuffix(".yaml"): v[0] for name, v in verdicts.items()} == {
        state: status for state, (_, status) in STATES.items()
    }
    # A stalled server fails a Flux wait at once, with the cause, not at its timeout.
    assert verdicts["apply-refused.yaml"][1].startswith(
        "the API server refused the Deployment: spec.template.spec.containers[0].volumeMounts["
    )


def test_the_chart_ships_the_script_as_an_argocd_cm_fragment() -> None:
    def render(*values: str) -> list[dict[str, object]]:
        out = subprocess.run(
            [tool("helm"), "template", "pk", str(CHART), "--kube-version", "1.33.0", *values],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    assert not [d for d in render() if HEALTH_KEY in str(d.get("data", {}))]
    (fragment,) = [
        d
        for d in render("--set", "argocd.healthCheck.enabled=true")
        if HEALTH_KEY in str(d.get("data", {}))
    ]
    assert fragment["kind"] == "ConfigMap"
    assert fragment["metadata"]["namespace"] == "argocd"  # type: ignore[index]
    assert fragment["data"] == {HEALTH_KEY: SCRIPT.read_text().rstrip("\n")}
