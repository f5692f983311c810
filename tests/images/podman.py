"""podman on the project's image storage (`hack/images.sh podman ...`), and the images it holds."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.tools import REPO, tool

IMAGES_SH = REPO / "hack" / "images.sh"
# A cold build makes the Debian base and installs PyPI's torch: minutes on two cores.
BUILD_TIMEOUT_S = 3600


def require_tools() -> None:
    """buildah, podman, runc and mmdebstrap, or a failure under CI (`make tools` installs them)."""
    for name in ("buildah", "podman", "runc", "mmdebstrap"):
        tool(name)


def images_sh(*args: str, timeout: float = 120, check: bool = True) -> str:
    result = subprocess.run(
        ["bash", str(IMAGES_SH), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"hack/images.sh {' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}"
        )
    return result.stdout


def podman(*args: str, timeout: float = 120, check: bool = True) -> str:
    return images_sh("podman", *args, timeout=timeout, check=check)


def build_test_images(log: Path) -> dict[str, str]:
    """Build both targets on the Debian bases (warm: seconds); image id by target."""
    with log.open("w") as sink:
        result = subprocess.run(
            ["bash", str(IMAGES_SH), "build", "debian"],
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    if result.returncode != 0:
        raise AssertionError(f"hack/images.sh build debian failed:\n{log.read_text()[-6000:]}")
    ids = dict(line.split() for line in result.stdout.splitlines())
    assert set(ids) == {"operator", "engine"}, result.stdout
    return ids


def inspect_image(image: str) -> dict[str, Any]:
    (info,) = json.loads(podman("image", "inspect", image))
    return dict(info)


@dataclass
class Container:
    """A detached container; removed by `remove`."""

    name: str

    def inspect(self) -> dict[str, Any]:
        (info,) = json.loads(podman("container", "inspect", self.name))
        return dict(info)

    def is_running(self) -> bool:
        return bool(self.inspect()["State"]["Running"])

    def process_ids(self) -> tuple[int, int]:
        """Real user and group ids of the container's first process, read on the host."""
        pid = self.inspect()["State"]["Pid"]
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        fields = {line.split(":")[0]: line.split()[1] for line in status if ":" in line}
        return int(fields["Uid"]), int(fields["Gid"])

    def logs(self) -> str:
        result = subprocess.run(
            ["bash", str(IMAGES_SH), "podman", "logs", self.name],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return result.stdout + result.stderr

    def signal(self, name: str) -> None:
        podman("kill", f"--signal={name}", self.name)

    def wait_exit(self, timeout: float = 120) -> int:
        """Until the container exits; its exit code."""
        return int(podman("wait", self.name, timeout=timeout).strip())

    def changes(self) -> set[str]:
        """`podman diff`: what the container changed in its root filesystem, as "KIND path"."""
        diff = json.loads(podman("diff", "--format=json", self.name) or "{}")
        return {
            f"{kind} {path}"
            for kind in ("added", "changed", "deleted")
            for path in diff.get(kind) or []
        }

    def remove(self) -> None:
        podman("rm", "--force", "--time=5", self.name, check=False)


def run_detached(name: str, run_args: list[str]) -> Container:
    podman("rm", "--force", name, check=False)
    podman("run", "--detach", f"--name={name}", *run_args)
    return Container(name)
