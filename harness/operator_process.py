"""The operator as a subprocess (`kopf run -m pagekeeper_operator.main`) on the local control
plane: stopped and started again at will, each start's log in its own file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from harness.cluster import Cluster, wait_for
from harness.tools import REPO

CRD_PATH = REPO / "crds" / "llmservers.pagekeeper.dev.yaml"
RESYNC_SECONDS = 5


class OperatorProcess:
    """One operator process watching one namespace; its log is kept in a file."""

    def __init__(
        self,
        cluster: Cluster,
        namespace: str,
        log_dir: Path,
        resync_seconds: float = RESYNC_SECONDS,
        extra_env: Mapping[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.cluster = cluster
        self.resync_seconds = resync_seconds
        self.extra_env = dict(extra_env or {})
        self.extra_args = extra_args  # kopf run's own options (`--debug`)
        self.namespace = namespace
        self.log_dir = log_dir
        self.num_starts = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = log_dir / "operator-0.log"

    def start(self) -> None:
        assert self.process is None, "already running"
        self.num_starts += 1
        self.log_path = self.log_dir / f"operator-{self.num_starts}.log"
        env = {
            **os.environ,
            "KUBECONFIG": self.cluster.kubeconfig,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO / "operator"), str(REPO / "memplan"), str(REPO)]
            ),
            "PAGEKEEPER_RESYNC_SECONDS": str(int(self.resync_seconds)),
            **self.extra_env,
        }
        kopf = Path(sys.executable).with_name("kopf")
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    str(kopf),
                    "run",
                    "-m",
                    "pagekeeper_operator.main",
                    "--standalone",
                    *self.extra_args,
                    "--namespace",
                    self.namespace,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 60) -> None:
        def seen() -> bool:
            assert self.process is None or self.process.poll() is None, (
                f"operator exited:\n{self.log()[-4000:]}"
            )
            return text in self.log()

        wait_for(seen, timeout=timeout, what=f"operator log line {text!r}")
