"""What the built images say about themselves: labels, user, size; and that the names the chart
and the docs use are the ones `make images` tags."""

from __future__ import annotations

import re
import subprocess
import tomllib
from typing import Any

import pytest
import yaml

from harness.tools import REPO
from pagekeeper_operator.settings import OperatorSettings
from tests.images.podman import images_sh, inspect_image, podman

pytestmark = pytest.mark.timeout(3600)  # a cold `images` fixture builds the bases
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
CHART = REPO / "charts" / "pagekeeper"
DEVELOPMENT_DOC = REPO / "docs" / "development.md"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
TARGETS = ("operator", "engine")
DEBIAN_BASE = "localhost/pagekeeper-base:bookworm"


def size_budgets() -> dict[str, int]:
    """docs/development.md's size budgets in bytes, by target (the single place they live)."""
    row = re.compile(r"^\| `pagekeeper-(\w+)` \|.*\| ([\d.]+) (MB|GB) \|$", re.MULTILINE)
    scale = {"MB": 10**6, "GB": 10**9}
    budgets = {
        m[1]: int(float(m[2]) * scale[m[3]]) for m in row.finditer(DEVELOPMENT_DOC.read_text())
    }
    assert set(budgets) == set(TARGETS), f"size budget rows in {DEVELOPMENT_DOC}: {budgets}"
    return budgets


@pytest.mark.parametrize("target", TARGETS)
def test_labels_name_this_version_and_commit(images: dict[str, str], target: str) -> None:
    labels = inspect_image(images[target])["Config"]["Labels"]
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert labels["org.opencontainers.image.title"] == f"pagekeeper-{target}"
    assert labels["org.opencontainers.image.version"] == VERSION
    # The commit, with "-dirty" when the tree had uncommitted changes.
    assert labels["org.opencontainers.image.revision"] in {head, f"{head}-dirty"}
    assert labels["org.opencontainers.image.source"].startswith("https://")


@pytest.mark.parametrize("target", TARGETS)
def test_runs_as_the_charts_numeric_non_root_user(images: dict[str, str], target: str) -> None:
    security = yaml.safe_load((CHART / "values.yaml").read_text())["securityContext"]
    user = inspect_image(images[target])["Config"]["User"]
    assert user == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert re.fullmatch(r"[1-9]\d*:\d+", user), user


@pytest.mark.parametrize("target", TARGETS)
def test_within_the_documented_size_budget(images: dict[str, str], target: str) -> None:
    size = int(inspect_image(images[target])["Size"])
    budget = size_budgets()[target]
    assert size <= budget, f"pagekeeper-{target} is {size / 1e6:.0f} MB, budget {budget / 1e6:.0f}"


@pytest.mark.parametrize("target", TARGETS)
def test_the_build_ca_bundle_stays_out_of_the_image(images: dict[str, str], target: str) -> None:
    """Builds bind the host's CA bundle over the base's for pip; the image keeps the base's
    (the engine's torch base is built on the same Debian base)."""
    cat = ("run", "--rm", "--entrypoint=cat")
    assert podman(*cat, images[target], CA_BUNDLE) == podman(*cat, DEBIAN_BASE, CA_BUNDLE)


def test_chart_and_docs_name_the_tags_make_images_builds() -> None:
    tags = dict(line.split() for line in images_sh("tags").splitlines())
    assert tags == {t: f"pagekeeper-{t}:{VERSION}" for t in TARGETS}
    chart: dict[str, Any] = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    registry, _, name = values["image"]["repository"].rpartition("/")
    assert (f"{name}:{chart['appVersion']}", values["image"]["tag"]) == (tags["operator"], "")
    assert values["operator"]["engineImage"] == f"{registry}/{tags['engine']}"
    assert OperatorSettings().default_images["pagekeeper"] == values["operator"]["engineImage"]
    assert f"make images-push REGISTRY={registry}" in DEVELOPMENT_DOC.read_text()
