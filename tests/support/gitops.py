"""The GitOps tools' own health code over LLMServer objects: Argo CD's Lua health test and
kstatus (what Flux's health checks run), both built by hack/provision.sh.

Argo CD runs a health script only from the scripts it embeds at build time, so its test binary
(`go test -c ./util/lua/` of Argo CD's module) embeds `charts/pagekeeper/argocd/health.lua`;
its TestLuaHealthScript walks `../../resource_customizations` from its working directory and
checks each `health_test.yaml` there. `lua_health` lays out such a tree with only our cases.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.tools import BIN, CACHE, REPO, missing
from tests.support.jobs import wait_job

SCRIPT = REPO / "charts" / "pagekeeper" / "argocd" / "health.lua"
GROUP_KIND = Path("pagekeeper.dev") / "LLMServer"
# health_test.yaml and testdata/: Argo CD's test-case layout, as it would be offered upstream.
CASES = REPO / "tests" / "gitops" / "argocd" / GROUP_KIND
ARGOCD_TEST = BIN / "argocd-lua-health.test"
KSTATUS = BIN / "kstatus"
# Each captured state (testdata/<state>.yaml) -> (Argo CD health, kstatus status): the table
# of docs/gitops.md.
STATES: dict[str, tuple[str, str]] = {
    "new": ("Progressing", "InProgress"),
    "rolling-out": ("Progressing", "InProgress"),
    "ready": ("Healthy", "Current"),
    "canary-analyzing": ("Progressing", "InProgress"),
    "canary-rolled-back": ("Degraded", "Failed"),
    "apply-refused": ("Degraded", "Failed"),
    "progress-deadline-exceeded": ("Degraded", "Failed"),
    "scaled-to-zero": ("Suspended", "Current"),
    "deleting": ("Progressing", "Terminating"),
}
_RESULT = re.compile(r"--- (PASS|FAIL): TestLuaHealthScript/pagekeeper\.dev/LLMServer/(\S+)")


def _embedded_scripts() -> list[Path]:
    return sorted(CACHE.glob(f"src/argo-cd-*/resource_customizations/{GROUP_KIND}/health.lua"))


def argocd_lua_test() -> Path:
    """The Argo CD Lua test binary, rebuilt first (incrementally) if it embeds an older script;
    under `make test`, once its background build has ended."""
    wait_job("argocd")
    if not ARGOCD_TEST.is_file():
        missing("Argo CD's Lua health test binary (argocd-lua-health.test)")
    embedded = _embedded_scripts()
    if len(embedded) != 1 or embedded[0].read_bytes() != SCRIPT.read_bytes():
        subprocess.run(["bash", str(REPO / "hack" / "provision.sh"), "argocd"], check=True)
    return ARGOCD_TEST


@dataclass(frozen=True)
class LuaRun:
    """One run of TestLuaHealthScript: each case's verdict and the output to show on failure."""

    results: dict[str, str]
    output: str
    returncode: int


def lua_health(health_test: Path, testdata: Path, work: Path) -> LuaRun:
    """Run Argo CD's TestLuaHealthScript over `health_test` with the objects in `testdata`."""
    binary = argocd_lua_test()
    tree = work / "resource_customizations" / GROUP_KIND
    shutil.copytree(testdata, tree / "testdata")
    shutil.copyfile(health_test, tree / "health_test.yaml")
    shutil.copyfile(SCRIPT, tree / "health.lua")
    cwd = work / "util" / "lua"
    cwd.mkdir(parents=True)
    proc = subprocess.run(
        [str(binary), "-test.run", "^TestLuaHealthScript$", "-test.v", "-test.count=1"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = proc.stdout + proc.stderr
    results = {path: verdict for verdict, path in _RESULT.findall(output)}
    return LuaRun(results=results, output=output, returncode=proc.returncode)


def kstatus(paths: list[Path]) -> dict[str, tuple[str, str]]:
    """kstatus's (status, message) for each object file, by file name."""
    if not KSTATUS.is_file():
        missing("kstatus (hack/kstatus)")
    proc = subprocess.run(
        [str(KSTATUS), *map(str, paths)], capture_output=True, text=True, timeout=60, check=True
    )
    verdicts = [json.loads(line) for line in proc.stdout.splitlines()]
    return {Path(v["file"]).name: (v["status"], v["message"]) for v in verdicts}
